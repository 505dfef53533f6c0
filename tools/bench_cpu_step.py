"""CPU decode speed with the native non-GEMV ops (inferflow/native/cpu_ops.py) on vs off, in one process.

    PYTHONPATH=. python tools/bench_cpu_step.py [--model PATH] [--dtypes float32,bfloat16] [--batches 1,8]
        [--tokens 32] [--rounds 5] [--threads 2]

"on" = ``INFERFLOW_NATIVE_OPS=1`` (RMSNorm, SiLU*mul, RoPE, paged decode attention + K/V write, and residual add +
RMSNorm linked by model/fuse_add_norm.py unless --no-fuse-add-norm); "off" = ``=0`` (the torch paths; H1/H2's
native GEMVs run in both arms). For each dtype one model is loaded; each round runs, for every batch size, a
greedy decode through the Engine on and off (alternating which goes first: the machine is shared and noisy),
timing each pure-decode step. Prints decode tok/s from the median step of each, their ratio and the milliseconds
per step saved, and checks that both give the same tokens. ``--clock cpu`` times process CPU time (steadier on a
loaded machine; meaningful with one thread), ``--null-gemv`` leaves GEMVs out. ``--model``: a GGUF or HF folder
(default: the float32 GGUF of tools/bench.py's ladder when it exists, else the embedded default model).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LADDER = Path("/tmp/bench9/ladder/SmolLM2-135M-Instruct.Q4_1.f32.gguf")


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def decode_run(model, batch: int, tokens: int, native: bool, clock=time.perf_counter) -> tuple[list[float], list]:
    """(seconds of each pure-decode step, generated tokens) of ``batch`` greedy requests."""
    from inferflow.engine import Engine, EngineConfig, SamplingParams
    from inferflow.native import cpu_ops

    os.environ["INFERFLOW_NATIVE_OPS"] = "1" if native else "0"
    cpu_ops.refresh()
    link_add_norms(model, native and FUSE_ADD_NORM[0])
    bs = 16
    eng = Engine(model, EngineConfig(block_size=bs, num_blocks=batch * ((40 + tokens) // bs + 2) + 8,
                                     max_num_seqs=batch, max_num_batched_tokens=max(256, 40 * batch)))
    p = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    handles = [eng.add_request([1] + list(range(20 + 7 * i, 50 + 7 * i)), p) for i in range(batch)]
    steps = []
    while eng.has_unfinished():
        t = clock()
        eng.step()
        dt = clock() - t
        if eng.counters.last_step_tokens == batch and all(len(h._request.seqs[0].output_ids) > 1 for h in handles):
            steps.append(dt)
    return steps, [h.result().outputs[0].token_ids for h in handles]


FUSE_ADD_NORM = [True]


def link_add_norms(model, on: bool) -> None:
    """Residual add + next RMSNorm as one native call (model/fuse_add_norm.py; the engine links them on CUDA only
    by default): linked for the native arm, unlinked for the torch arm."""
    from inferflow.model.fuse_add_norm import fuse_add_norms

    for m in model.net.modules():
        m.__dict__.pop("fused_norm", None)
    if on:
        fuse_add_norms(model.net)


def null_gemvs(model) -> None:
    """Every linear layer returns its first output for that row count again (no GEMV): the step time is then the
    non-GEMV rest (norms, RoPE, attention, activations, engine host work), the part the native ops replace."""
    for m in model.net.modules():
        if getattr(m, "component_name", None) == "linear":
            def fwd(x, ctx=None, _orig=m.forward, _memo={}):
                out = _memo.get(x.shape[0])
                if out is None:
                    out = _memo[x.shape[0]] = _orig(x, ctx)
                return out
            m.forward = fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fuse-add-norm", action="store_true", help="on arm: keep residual adds and norms apart")
    ap.add_argument("--null-gemv", action="store_true", help="time everything but the GEMVs (see null_gemvs)")
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="cpu: process CPU time (less sensitive to other processes on a shared machine; with "
                         "1 thread, as OpenMP threads spin)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    FUSE_ADD_NORM[0] = not a.no_fuse_add_norm
    import inferflow
    from inferflow.default_model import default_model_path
    from inferflow.native import cpu_ops

    path = a.model or (str(LADDER) if LADDER.exists() else str(default_model_path()))
    print(f"model {path}, {a.threads} threads, {a.clock} clock, null GEMVs: {a.null_gemv}, "
          f"native ops available: {cpu_ops.enabled()}")
    batches = [int(b) for b in a.batches.split(",")]
    print("| dtype | batch | off tok/s | on tok/s | on/off | ms/step saved | same tokens |\n"
          "|---|---:|---:|---:|---:|---:|---|")
    for dtype in a.dtypes.split(","):
        model = inferflow.load(path, dtype=dtype)
        if a.null_gemv:
            with torch.inference_mode():
                decode_run(model, 2, 2, True)  # the engine fuses q|k|v and gate|up first: patch the fused layers
            null_gemvs(model)
        res: dict[tuple[int, bool], list[float]] = {(b, n): [] for b in batches for n in (False, True)}
        same = {b: True for b in batches}
        with torch.inference_mode():
            for b in batches:
                decode_run(model, b, 4, True), decode_run(model, b, 4, False)  # warm-up (builds, caches)
            for r in range(a.rounds):
                for b in batches:
                    outs = {}
                    for n in ((True, False) if r % 2 == 0 else (False, True)):
                        steps, outs[n] = decode_run(model, b, a.tokens, n, CLOCK[a.clock])
                        res[(b, n)] += steps
                    same[b] &= outs[True] == outs[False]
        for b in batches:  # the median step over all rounds: robust to the bursts of a shared machine
            off, on = statistics.median(res[(b, False)]), statistics.median(res[(b, True)])
            print(f"| {dtype} | {b} | {b / off:.1f} | {b / on:.1f} | {off / on:.2f}x | {(off - on) * 1e3:.2f} "
                  f"| {same[b]} |", flush=True)
        del model
    os.environ.pop("INFERFLOW_NATIVE_OPS", None)
    cpu_ops.refresh()


if __name__ == "__main__":
    main()
