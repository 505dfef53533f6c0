"""4-bit prefill steps of 65-256 tokens on a GPU: the dequant-fused GEMM against decode + cuBLAS, interleaved in one
process by moving ``triton_soa.GEMM_MAX_ROWS`` (prefill steps run eagerly, so each step takes the path it names).

    python3 tools/random_hf_model.py qwen3-8b /tmp/qwen3-8b
    python3 tools/bench_q4_prefill_gpu.py --model /tmp/qwen3-8b [--lens 96,128,256] [--rounds 5] [--quant q4_0]

Each round runs one fresh random prompt of each length per setting (no prefix-cache hits), one token out, and
prints the medians of the prefill times (ms) and their ratio.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import inferflow  # noqa: E402
from bench_short_prefill_gpu import first_token_ms, interleave  # noqa: E402
from inferflow.engine import Engine, EngineConfig  # noqa: E402
from inferflow.quant import triton_soa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--lens", default="96,128,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fused-max", type=int, default=256, help="GEMM_MAX_ROWS of the fused setting")
    ap.add_argument("--decode-above", type=int, default=64, help="GEMM_MAX_ROWS of the decode + cuBLAS setting")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile one prefill of N tokens (torch.profiler): the top ops by host and GPU time")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="then five prefills of N tokens under cProfile: the top Python functions")
    a = ap.parse_args()
    model = inferflow.load(a.model, dtype="bfloat16", device="cuda", quant=None if a.quant == "none" else a.quant)
    eng = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=1024, enable_prefix_caching=False,
                                     kv_cache_memory=4.0))
    g = torch.Generator().manual_seed(0)
    lens = [int(v) for v in a.lens.split(",")]
    settings = {"fused": a.fused_max, "decode+cublas": a.decode_above}

    def run(name: str, n: int) -> float:
        triton_soa.GEMM_MAX_ROWS = settings[name]
        return first_token_ms(eng, torch.randint(10, 32000, (n,), generator=g).tolist(), "cuda")

    times = interleave(list(settings), lens, a.rounds, run)
    for n in lens:
        f, d = (statistics.median(times[(s, n)]) for s in settings)
        print(f"prefill {n} tokens: fused GEMM (to {a.fused_max} rows) {f:.2f} ms, decode + cuBLAS {d:.2f} ms, "
              f"{f / d:.2f}x  (fused {[round(t, 2) for t in times[('fused', n)]]}, decode "
              f"{[round(t, 2) for t in times[('decode+cublas', n)]]})", flush=True)
    if a.cprofile:
        import cProfile
        import pstats

        prompts = [torch.randint(10, 32000, (a.cprofile,), generator=g).tolist() for _ in range(5)]
        pr = cProfile.Profile()
        pr.enable()
        ms = [first_token_ms(eng, p, "cuda") for p in prompts]
        pr.disable()
        print(f"cProfiled prefills of {a.cprofile} tokens: {[round(t, 2) for t in ms]} ms")
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        prompt = torch.randint(10, 32000, (a.profile,), generator=g).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = first_token_ms(eng, prompt, "cuda")
        print(f"profiled prefill of {a.profile} tokens: {ms:.2f} ms")
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
