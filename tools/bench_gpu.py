"""GPU fast-path benchmark: inferflow's engine against HF transformers' static-cache + torch.compile path, in one run.

    python tools/bench_gpu.py [--out DIR] [--rounds 3] [--budget 420] [--q4] [--tiny]

Model: a Qwen3-8B-shaped decoder (hidden 4096, 36 layers, 32 q / 8 kv heads of 128, intermediate 12288, vocab
151936, q/k norm) with random bf16 weights, built on the GPU by transformers; inferflow loads the same tensors
through an in-memory weight source (no 16 GB file written). Measured, every system interleaved per round, medians:
- decode tok/s at batch 1 and 64 (128-token prompts, 128 new tokens, EOS ignored; tokens after each request's
  first / time after the first token): inferflow's Engine (CUDA graphs, paged Triton attention, fused
  projections) vs HF ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` greedy decode steps;
- prefill tok/s of 2048-token prompts: the Engine (16 prompts, 8192 tokens per step, max_tokens=1) vs HF's
  eager forward of 4 x 2048 tokens (logits of the last position only);
- q4 decode (``--q4``: load-time 4.5-bit quantization, ``--q4-format q4_0`` by default, through the quantization
  helper's Triton kernels) at batch 1 and 64, interleaved with bf16 decode in the same phase (run last: inferflow's
  searched ``q4`` format takes minutes to quantize 8B parameters, seen on the H200: > 5 minutes).
Correctness: last-position logits of 4 prompts (inferflow vs HF: max |diff| / max |ref|, top-1 agreement), greedy
tokens of the decode runs (leading tokens equal to HF's), the Triton decode kernel vs its torch reference on
random bf16 data, and graph replay vs eager steps. ``--tiny`` runs a toy shape (CPU smoke test).
Prints a markdown table and writes ``bench_gpu.json`` (and the table) to ``--out``; ``--doc FILE`` writes the table
with the command, machine, versions and date into FILE's ``bench_gpu`` section (``--from-json`` re-renders it
from a saved ``bench_gpu.json`` without running).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inferflow  # noqa: E402
from inferflow.bench.report import header  # noqa: E402
from inferflow.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from inferflow.loaders.source import WeightSource  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class MemorySource(WeightSource):
    """An HF state dict in memory as a weight source (the same tensors: nothing copied for equal dtypes)."""

    kind = "hf"

    def __init__(self, sd: dict[str, torch.Tensor], config: dict[str, Any], folder: str):
        self.sd, self.config, self.path = sd, config, folder
        self.config_name = os.path.join(folder, "config.json")

    def names(self) -> list[str]:
        return list(self.sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.sd[name]


def load_shared(hf: Any, folder: str, device: str, **kw: Any) -> Any:
    """inferflow.load over the HF model's own tensors (config.json written to ``folder``)."""
    import inferflow.model.model as mm

    hf.config.save_pretrained(folder)
    cfg = json.loads(Path(folder, "config.json").read_text())
    src = MemorySource({k: v for k, v in hf.state_dict().items()}, cfg, folder)
    orig = mm.open_source
    mm.open_source = lambda _: src
    try:
        return inferflow.load(folder, dtype="bfloat16", device=device, **kw)
    finally:
        mm.open_source = orig


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- inferflow ------------------------------------------------------------------------------------------------
def ours_decode(eng: Engine, prompts: list[list[int]], n: int, device: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    g0 = eng.counters.generation_tokens
    handles = [eng.add_request(p, params) for p in prompts]
    t_first = g_first = None
    while eng.has_unfinished():
        eng.step()
        if t_first is None and eng.counters.generation_tokens - g0 >= len(prompts):
            sync(device)
            t_first, g_first = time.perf_counter(), eng.counters.generation_tokens
    sync(device)
    dt = time.perf_counter() - t_first
    return (eng.counters.generation_tokens - g_first) / dt, [h.result().outputs[0].token_ids for h in handles]


def ours_serving(eng: Engine, prompts: list[list[int]], n: int, device: str) -> dict[str, float]:
    """All requests queued at once (an offline serving load); TTFT per request from its arrival, throughput."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync(device)
    g0 = eng.counters.generation_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"serve-{i}")
    first: dict[str, float] = {}
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            rid = getattr(o, "request_id", None)
            if rid is not None and rid not in first and o.outputs and o.outputs[0].token_ids:
                first[rid] = now
    sync(device)
    dt = time.perf_counter() - t0
    ttft = sorted(first.values()) or [float("nan")]
    q = lambda f: ttft[min(len(ttft) - 1, int(f * len(ttft)))] * 1e3  # noqa: E731
    return {"requests": len(prompts), "duration_s": dt, "output_tok_s": (eng.counters.generation_tokens - g0) / dt,
            "total_tok_s": (eng.counters.generation_tokens - g0 + sum(map(len, prompts))) / dt,
            "ttft_ms_median": q(0.5), "ttft_ms_p99": q(0.99), "ttft_ms_min": q(0.0)}


def ours_prefill(eng: Engine, prompts: list[list[int]], device: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    handles = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    sync(device)
    dt = time.perf_counter() - t0
    assert all(h.result().outputs[0].token_ids for h in handles)
    return sum(map(len, prompts)) / dt


# ---- HF -------------------------------------------------------------------------------------------------------
class HFStatic:
    """Greedy decoding with a StaticCache; the one-token step compiled (mode="reduce-overhead": CUDA graphs)."""

    def __init__(self, model: Any, compile_: bool, max_cache_len: int):
        self.model, self.compiled, self.max_cache_len = model, compile_, max_cache_len
        self.caches: dict[int, Any] = {}  # one StaticCache per batch size, reused: no recompiles
        self.step = torch.compile(self._step, mode="reduce-overhead") if compile_ else self._step

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos[None].expand(
            tok.shape[0], 1), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], n: int, device: str) -> tuple[float, list[list[int]]]:
        from transformers import StaticCache

        ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
        b, p = ids.shape
        cache = self.caches.get(b)
        if cache is None:
            try:
                cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            except TypeError:  # older signature
                cache = StaticCache(config=self.model.config, max_batch_size=b, max_cache_len=self.max_cache_len,
                                    device=device, dtype=torch.bfloat16)
            self.caches[b] = cache
        else:
            cache.reset()
        out = self.model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(p, device=device),
                         use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [tok]
        sync(device)
        t0 = time.perf_counter()
        for i in range(n - 1):
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            # clone: a compiled graph's output is overwritten by its next replay
            tok = self.step(tok, torch.tensor([p + i], device=device), cache).clone()
            toks.append(tok)
        sync(device)
        dt = time.perf_counter() - t0
        return b * (n - 1) / dt, torch.cat(toks, 1).tolist()


@torch.inference_mode()
def hf_prefill(model: Any, prompts: list[list[int]], device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    sync(device)
    return ids.numel() / (time.perf_counter() - t0)


# ---- checks ---------------------------------------------------------------------------------------------------
def kernel_check(device: str, small: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Max |diff| of the Triton kernels against torch (``small``: interpreter-sized, for a CPU smoke test)."""
    from inferflow.engine import triton_attention as ta

    if not ta.available(torch.device(device)):
        return {}
    g = torch.Generator(device=device).manual_seed(0)
    B, H, hkv, D, bs, nb = (2, 4, 2, 16, 16, 12) if small else (8, 32, 8, 128, 16, 1200)
    hid, inter = (64, 96) if small else (4096, 12288)
    kc, vc = (torch.randn(nb, bs, hkv, D, device=device, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, D, device=device, generator=g).to(dtype)
    lens = torch.tensor([1, 100] if small else [1, 15, 16, 17, 300, 1000, 1999, 2048], device=device)
    width = 8 if small else 128
    tables = torch.stack([torch.randperm(nb, device=device, generator=g)[:width] for _ in range(B)])
    out = {}
    for name, kw in {"plain": {}, "softcap": {"softcap": 30.0}, "window": {"window": 100}}.items():
        o = ta.paged_decode(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=width * bs, **kw)
        r = ta.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, **kw)
        out[name] = (o.float() - r.float()).abs().max().item()
    # the fused element-wise ops against the torch compositions they replace (bf16: bit-exact expected)
    from inferflow.model import fused_ops
    from inferflow.registry import create

    x = torch.randn(64, 3 * hid, device=device, generator=g).to(dtype)[:, :hid] * 3
    w = torch.randn(hid, device=device, generator=g).to(dtype)
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    out["fused_rmsnorm"] = (fused_ops.rmsnorm(x, w, 1e-6).float() - ref.float()).abs().max().item()
    gu = torch.randn(64, 2 * inter, device=device, generator=g).to(dtype) * 3
    gate, up = gu.split(inter, -1)
    out["fused_silu_mul"] = (fused_ops.silu_mul(gate, up).float() - (torch.nn.functional.silu(gate) * up).float()
                             ).abs().max().item()
    rope = create("rope", {"dim": D, "theta": 1e6})
    from inferflow.model.context import ForwardContext

    ctx = ForwardContext(positions=torch.arange(64, device=device) * 37, q_lens=[64], k_lens=[64], backend=None)
    cos, sin = rope.cos_sin(ctx, dtype)
    q = torch.randn(64, H, D, device=device, generator=g).to(dtype)
    out["fused_rope"] = (fused_ops.rope_half(q, cos, sin).float() - rope._rot(q, cos, sin).float()).abs().max().item()
    # residual add + RMSNorm, q/k norm + RoPE, the one-launch K/V write (None: the kernel declined the inputs)
    from types import SimpleNamespace

    from inferflow.engine import triton_kv_write
    from inferflow.model import fuse_add_norm, fused_qk_rope

    a, b = (torch.randn(64, hid, device=device, generator=g).to(dtype) for _ in range(2))
    sy = fuse_add_norm.add_rmsnorm(a, b, w, 1e-6)
    s = a + b
    h = s.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out["fused_add_rmsnorm"] = None if sy is None else max((sy[0].float() - s.float()).abs().max().item(),
                                                          (sy[1].float() - ref.float()).abs().max().item())
    qkv = torch.randn(64, (H + 2 * hkv) * D, device=device, generator=g).to(dtype) * 3
    qq, kk, vv = qkv.split([H * D, hkv * D, hkv * D], -1)
    norms = [create("rmsnorm", {"dim": D, "eps": 1e-6}) for _ in range(2)]
    for nm in norms:
        nm.weight = torch.nn.Parameter(torch.randn(D, device=device, generator=g).to(dtype), requires_grad=False)
    ctx.position = rope
    attn = SimpleNamespace(use_position=True, q_norm=norms[0], k_norm=norms[1], d=D, h=H, hkv=hkv,
                           qk_norm_per_head=True)
    got = fused_qk_rope.norm_rope(attn, qq, kk, ctx)
    want = (rope._rot(norms[0](qq.reshape(64, H, D)), cos, sin), rope._rot(norms[1](kk.reshape(64, hkv, D)), cos, sin))
    out["fused_qk_norm_rope"] = None if got is None else max((x.float() - y.float()).abs().max().item()
                                                             for x, y in zip(got, want))
    kf, vf = (torch.zeros(nb * bs, hkv, D, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(nb * bs, device=device, generator=g)[:64]
    k3, v3 = kk.view(64, hkv, D), vv.view(64, hkv, D)
    ok = triton_kv_write.write_kv(kf, vf, slots, k3, v3)
    out["fused_kv_write"] = None if not ok else max((kf[slots].float() - k3.float()).abs().max().item(),
                                                    (vf[slots].float() - v3.float()).abs().max().item())
    return out


def graph_gpu_ms(eng: Engine, batches: list[int]) -> dict[int, float]:
    """GPU time of one replay of each bucket's decode graph (the step without the host's work around it)."""
    out = {}
    graphs = eng.runner.graphs
    for b in batches:
        hit = graphs._graphs.get(graphs.bucket(b)) if graphs is not None else None
        if hit is None:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hit[0].replay()
        start.record()
        for _ in range(20):
            hit[0].replay()
        end.record()
        torch.cuda.synchronize()
        out[b] = start.elapsed_time(end) / 20
    return out


def leading_same(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later phases are skipped past it")
    ap.add_argument("--q4", action="store_true")
    ap.add_argument("--q4-format", default="q4_0", help="load-time format of --q4: q4_0 (llama.cpp Q4_0 blocks, "
                    "quick to make) or q4 (inferflow's searched q4: minutes for an 8B model)")
    ap.add_argument("--serving", type=int, default=256, help="requests of the engine serving load (0: skip)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--doc", help="markdown file whose <!-- bench_gpu --> section gets the table (with the command, "
                                  "machine, versions and date)")
    ap.add_argument("--from-json", metavar="FILE", help="write --doc from an earlier run's bench_gpu.json, no run")
    args = ap.parse_args(argv)
    if args.from_json:
        if not args.doc:
            ap.error("--from-json writes --doc: give --doc too")
        write_doc(args.doc, json.loads(Path(args.from_json).read_text()))
        print(f"wrote the {DOC_SECTION} section of {args.doc} from {args.from_json}")
        return 0
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    shape = TINY if args.tiny else QWEN3_8B
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__, "transformers": transformers.__version__,
                           "shape": shape, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                           "header": header(sys.argv[1:] if argv is None else argv, "python tools/bench_gpu.py")}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (outdir / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    def left() -> float:
        return args.budget - (time.perf_counter() - T0)

    torch._dynamo.config.cache_size_limit = max(32, torch._dynamo.config.cache_size_limit)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**shape)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    log("HF model built")
    tmp = tempfile.mkdtemp(prefix="bench-gpu-")
    model = load_shared(hf, tmp, device)
    log("inferflow model loaded")
    V = shape["vocab_size"]
    g = torch.Generator().manual_seed(1)
    rand = lambda n, k: torch.randint(10, V, (n, k), generator=g).tolist()  # noqa: E731

    # correctness: logits of the last position
    cp = rand(4, 64)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor(cp, device=device)).logits[:, -1].float()
    ours = torch.stack([model.logits(p)[-1] for p in cp])
    res["logits"] = {"max_rel_diff": ((ours - ref).abs().max() / ref.abs().max()).item(),
                     "top1_agree": int((ours.argmax(-1) == ref.argmax(-1)).sum()), "of": len(cp)}
    try:
        res["kernel_max_abs_err"] = kernel_check(device)
    except Exception as e:  # noqa: BLE001 - report; the engine falls back to torch attention by itself
        res["kernel_max_abs_err"] = f"{type(e).__name__}: {e}"[:3000]
    log(f"checks {res['logits']} kernel {res['kernel_max_abs_err']}")
    save()

    max_len = max(args.prompt_len + args.new_tokens, args.prefill_len, 768 if args.serving else 0) + 16
    ecfg = dict(max_num_seqs=max(batches), max_model_len=max_len, max_num_batched_tokens=16384,
                enable_prefix_caching=False, kv_cache_memory=4.0 if args.tiny else 24.0)
    eng = Engine(model, EngineConfig(**ecfg))
    def phase(name: str, fn: Any) -> None:
        """Run one part of the benchmark; a failure is recorded and the other parts still run."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            res[f"{name}_error"] = traceback.format_exc()[-3000:]
            log(f"{name} failed: {type(e).__name__}: {e}")
        save()

    def prefill() -> None:
        pp = rand(args.prefill_prompts, args.prefill_len)
        hp = pp[:4]
        ours_prefill(eng, pp[:4], device)
        hf_prefill(hf, hp[:1], device)
        ps: dict[str, list[float]] = {}
        for r in range(args.rounds):
            ps.setdefault("inferflow", []).append(ours_prefill(eng, pp, device))
            ps.setdefault("hf", []).append(hf_prefill(hf, hp, device))
            log(f"prefill round {r + 1}: {ps['inferflow'][-1]:.0f} vs {ps['hf'][-1]:.0f} tok/s")
        res["prefill"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in ps.items()}

    phase("prefill", prefill)

    dprompts = {b: rand(b, args.prompt_len) for b in batches}
    for b in batches:  # warm-up: graphs captured, kernels compiled
        ours_decode(eng, dprompts[b], 4, device)
    log("inferflow warm-up done")

    def serving() -> None:  # through the engine (no HTTP): N requests, 512-token prompts, 256 new tokens
        res["serving"] = ours_serving(eng, rand(args.serving, 512), 256, device)
        log(f"serving {res['serving']}")

    if args.serving and left() > 200:
        phase("serving", serving)


    def q4() -> None:  # load-time 4-bit weights (the quantization helper's Triton kernels), interleaved with bf16
        qm = load_shared(hf, tmp, device, quant=args.q4_format)
        res["q4_format"] = args.q4_format
        res["q4_kernels"] = sorted({str(k) for m in qm.net.modules() for k in (getattr(m, "kernels", None) or {}).values()})
        log(f"q4 model loaded; kernels {res['q4_kernels']}")
        qe = Engine(qm, EngineConfig(**{**ecfg, "kv_cache_memory": min(8.0, ecfg["kv_cache_memory"])}))
        qs: dict[str, list[float]] = {}
        for b in batches:
            ours_decode(qe, dprompts[b], 4, device)
        for r in range(max(1, args.rounds - 1)):
            for b in batches:
                for name, e in ((f"q4 b{b}", qe), (f"bf16 b{b}", eng)):
                    qs.setdefault(name, []).append(ours_decode(e, dprompts[b], args.new_tokens, device)[0])
                    log(f"q4 phase round {r + 1} {name}: {qs[name][-1]:.1f}")
        res["q4_decode"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in qs.items()}


    def graphs_vs_eager() -> None:  # the same greedy tokens (batch 4, 32 tokens), and the speed of each
        eager = Engine(model, EngineConfig(**{**ecfg, "cuda_graphs": False}))
        p4 = dprompts[max(batches)][:4]
        ours_decode(eager, p4, 4, device)
        ta, a = ours_decode(eng, p4, 32, device)
        tc, c = ours_decode(eager, p4, 32, device)
        res["graphs_vs_eager_leading_same"] = [leading_same(x, y) for x, y in zip(a, c)]
        res["batch4_tps_graphs_vs_eager"] = [ta, tc]
        res["batch1_tps_graphs_vs_eager"] = [ours_decode(e, p4[:1], 32, device)[0] for e in (eng, eager)]
        log(f"graphs vs eager {res['graphs_vs_eager_leading_same']} b4 {res['batch4_tps_graphs_vs_eager']} "
            f"b1 {res['batch1_tps_graphs_vs_eager']}")

    if left() > 170:
        phase("graphs_vs_eager", graphs_vs_eager)

    def decode() -> None:
        decode_vs_hf(args, res, eng, hf, dprompts, batches, device, left, log)

    phase("decode", decode)
    if args.q4 and left() > 60:  # last: a slow quantization must not cost the other numbers
        phase("q4", q4)

    text = table(res, batches)
    print("\n" + text)
    (outdir / "bench_gpu.md").write_text(text + "\n")
    save()
    if args.doc:
        write_doc(args.doc, res)
    return 0


DOC_SECTION = "bench_gpu"


def write_doc(path: str, res: dict) -> None:
    """The ``bench_gpu`` section of ``path``: model, command, machine and versions, checks, the table."""
    from inferflow.bench.report import machine_line, write_section

    sh, h = res["shape"], res.get("header")
    lines = [f"### GPU fast path: inferflow vs HF transformers ({res.get('date', '')})", "",
             f"Model: hidden {sh['hidden_size']}, {sh['num_hidden_layers']} layers, {sh['num_attention_heads']} q / "
             f"{sh['num_key_value_heads']} kv heads of {sh.get('head_dim')}, intermediate {sh['intermediate_size']}, "
             f"vocab {sh['vocab_size']}, random bf16 weights shared by both systems (`tools/bench_gpu.py`). "
             f"Device: {res.get('device')}, torch {res.get('torch')}, transformers {res.get('transformers')}.", ""]
    if h:
        lines += [machine_line(h), "", "```bash", h["command"], "```", ""]
    lg = res.get("logits")
    if lg:
        lines += [f"Checks: last-position logits vs HF, max |diff| / max |ref| {lg['max_rel_diff']:.4f}, top-1 "
                  f"{lg['top1_agree']}/{lg['of']}; kernels vs torch (max |diff|): "
                  + (", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in res["kernel_max_abs_err"].items()) or "not run (no Triton device)"
                     if isinstance(res.get("kernel_max_abs_err"), dict) else str(res.get("kernel_max_abs_err"))), ""]
    errors = sorted(k for k in res if k.endswith("_error"))
    if errors:
        lines += [f"Phases that failed (see bench_gpu.json): {', '.join(errors)}.", ""]
    lines.append(table(res, [int(b) for b in str(res["args"]["batches"]).split(",")]))
    write_section(path, "\n".join(lines), DOC_SECTION)


def decode_vs_hf(args: argparse.Namespace, res: dict, eng: Engine, hf: Any, dprompts: dict[int, list[list[int]]],
                 batches: list[int], device: str, left: Any, log: Any) -> None:
    """HF warm-up (torch.compile per batch size), then decode rounds, the two systems interleaved."""
    for b in batches:  # inferflow alone first: kept even if HF's compilation outlasts the run
        res.setdefault("decode_inferflow_before_hf", {})[b] = ours_decode(eng, dprompts[b], args.new_tokens, device)[0]
    log(f"inferflow decode (before HF) {res['decode_inferflow_before_hf']}")
    (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    hf_len = args.prompt_len + args.new_tokens + 8
    hf_static = HFStatic(hf, not args.no_compile and device == "cuda", hf_len)
    for b in batches:  # HF warm-up: torch.compile per batch size
        try:
            hf_static(dprompts[b], 4, device)
        except Exception as e:  # noqa: BLE001 - report, then measure HF uncompiled
            res["hf_compile_error"] = f"{type(e).__name__}: {e}"[:2000]
            log(res["hf_compile_error"])
            hf_static = HFStatic(hf, False, hf_len)
            hf_static(dprompts[b], 4, device)
        log(f"HF warm-up batch {b} done")
    res["hf_compiled"] = hf_static.compiled
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        if r and left() < 30:
            break
        for b in batches:
            for name, fn in ((f"inferflow b{b}", lambda b=b: ours_decode(eng, dprompts[b], args.new_tokens, device)),
                             (f"hf b{b}", lambda b=b: hf_static(dprompts[b], args.new_tokens, device))):
                tps, toks = fn()
                samples.setdefault(name, []).append(tps)
                tokens[name] = toks
                log(f"round {r + 1} {name}: {tps:.1f} tok/s")
    res["decode"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in samples.items()}
    res["greedy_leading_same"] = {b: [leading_same(a, c) for a, c in zip(tokens[f"inferflow b{b}"],
                                                                         tokens[f"hf b{b}"])] for b in batches}
    res["graph_replays"] = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    res["graph_gpu_ms"] = graph_gpu_ms(eng, batches) if device == "cuda" else {}
    log(f"graph GPU ms per step {res['graph_gpu_ms']}")


def table(res: dict, batches: list[int]) -> str:
    hf = "HF StaticCache + torch.compile" if res.get("hf_compiled", True) else "HF StaticCache (NOT compiled)"
    rows = [f"| measurement | inferflow | {hf} (prefill: HF eager) | ratio |", "|---|---:|---:|---:|"]
    d = res.get("decode", {})
    for b in batches:
        if f"inferflow b{b}" in d and f"hf b{b}" in d:
            o, h = d[f"inferflow b{b}"]["tps"], d[f"hf b{b}"]["tps"]
            rows.append(f"| decode tok/s, batch {b} | {o:.1f} | {h:.1f} | {o / h:.2f} |")
    if "prefill" in res:
        o, h = res["prefill"]["inferflow"]["tps"], res["prefill"]["hf"]["tps"]
        rows.append(f"| prefill tok/s, 2048-token prompts | {o:.0f} | {h:.0f} | {o / h:.2f} |")
    if "serving" in res:
        sv = res["serving"]
        rows.append(f"| serving ({sv['requests']} req x 512+256 tok, all queued, {res['args']['batches'].split(',')[-1]} "
                    f"concurrent): output tok/s | {sv['output_tok_s']:.0f} | | |")
        rows.append(f"| serving TTFT median / p99 ms | {sv['ttft_ms_median']:.0f} / {sv['ttft_ms_p99']:.0f} | | |")
    q4 = res.get("q4_decode", {})
    for b in batches:
        if f"q4 b{b}" in q4:
            v, base = q4[f"q4 b{b}"]["tps"], q4[f"bf16 b{b}"]["tps"]
            rows.append(f"| q4 decode tok/s, batch {b} (bf16 in the same phase: {base:.1f}) | {v:.1f} | | "
                        f"{v / base:.2f} x bf16 |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
