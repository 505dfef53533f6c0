"""``inferflow quantize SRC DST --quant q3.5 [--per-tensor ROLE=TYPE ...] [--min-elements N] [--format gguf]``.

Loads SRC (any model file or folder inferflow reads), quantizes it as ``inferflow.load(SRC, quant=...)`` would,
and writes DST: inferflow's quantized folder (default; loads back bit-identically with ``inferflow.load(DST)``)
or, with ``--format gguf``, a GGUF file of llama.cpp block types.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from typing import Any

from ..errors import InferflowError


def parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="inferflow quantize")
    ap.add_argument("source", help="model file or folder to quantize")
    ap.add_argument("dest", help="output folder (inferflow format) or .gguf file (--format gguf)")
    ap.add_argument("--quant", required=True,
                    help="default format: q8 q6 q5 q4 q3.5 q3 q2, or llama.cpp's q8_0 q4_0 q4_1 q5_0 q5_1")
    ap.add_argument("--per-tensor", action="append", default=[], metavar="ROLE=TYPE",
                    help="format for a role (attn_q attn_k attn_v attn_o mlp_gate mlp_up mlp_down head embeddings) "
                         "or an internal-name glob; TYPE 'none' keeps full precision (repeatable)")
    ap.add_argument("--min-elements", type=int, default=0, help="keep smaller tensors in full precision")
    ap.add_argument("--format", choices=("inferflow", "gguf"), default="inferflow")
    ap.add_argument("--spec", help="spec name or file (default: auto-detected)")
    ap.add_argument("--dtype", default="float32", help="dtype of the weights left unquantized (default float32)")
    return ap


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {"default": args.quant}
    for item in args.per_tensor:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InferflowError(f"--per-tensor {item!r}: expected ROLE=TYPE")
        cfg[key.strip()] = value.strip()
    if args.min_elements:
        cfg["min_elements"] = args.min_elements
    return cfg


def summary(tensors: dict) -> str:
    """One line per type: tensor count, weights, bytes, bits per weight (tensors stored once counted once)."""
    from . import ggml
    from .saved import _dedupe

    stored, _ = _dedupe(tensors)
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for name, (t, qtype, shape) in ((n, tensors[n]) for n in stored):
        n = 1
        for s in shape:
            n *= s
        key = ggml.type_name(qtype) if qtype is not None else str(t.dtype).removeprefix("torch.")
        r = rows[key]
        r[0], r[1], r[2] = r[0] + 1, r[1] + n, r[2] + t.numel() * t.element_size()
    lines = [f"{k:10s} {c:5d} tensors {n:12,d} weights {b / 2**20:9.2f} MiB {8 * b / max(n, 1):6.3f} bpw"
             for k, (c, n, b) in sorted(rows.items(), key=lambda kv: -kv[1][1])]
    total_n, total_b = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
    lines.append(f"{'total':10s} {sum(r[0] for r in rows.values()):5d} tensors {total_n:12,d} weights "
                 f"{total_b / 2**20:9.2f} MiB {8 * total_b / max(total_n, 1):6.3f} bpw")
    return "\n".join(lines)


def quantize_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        import inferflow

        from . import gguf_export, saved

        cfg = config_from_args(args)
        t0 = time.time()
        model = inferflow.load(args.source, spec=args.spec, dtype=args.dtype, quant=cfg, quant_kernels="reference")
        t1 = time.time()
        if args.format == "gguf":
            types = gguf_export.write(model, args.dest)
            print(f"wrote {args.dest}: {len(types)} tensors " + ", ".join(f"{k} x{v}" for k, v in
                                                                          Counter(types.values()).items()))
        else:
            saved.save(model, args.dest, cfg)
            print(f"wrote {args.dest}")
        print(summary(saved.collect(model)))
        for name, why in model.quantizer.skipped.items():
            print(f"kept in full precision: {name} ({why})")
        print(f"quantized in {t1 - t0:.1f} s, written in {time.time() - t1:.1f} s", file=sys.stderr)
    except InferflowError as e:
        print(f"inferflow quantize: {e}", file=sys.stderr)
        return 2
    return 0
