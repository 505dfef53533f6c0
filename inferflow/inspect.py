"""``inferflow inspect``: describe a model file or folder from its headers alone (no weights are read)."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from .errors import InferflowError

_FORMATS = {"hf": "safetensors", "gguf": "GGUF", "llama2c": "llama2.c"}


def _format(src: Any) -> str:
    if type(src).__name__ == "PickleSource":  # same "hf" kind as safetensors folders, different file format
        return "torch pickle (.bin/.pt)"
    return _FORMATS.get(src.kind, src.kind)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def tokenizer_kind(src: Any) -> str:
    """What tokenizer ships with the source, from metadata and file names only."""
    if src.kind == "gguf":
        model = src.config.get("tokenizer.ggml.model")
        return f"GGUF metadata (tokenizer.ggml.model={model})" if model else "none"
    base = Path(src.path)
    folder = base if base.is_dir() else base.parent
    if src.kind == "llama2c":
        return "llama2.c tokenizer.bin" if (folder / "tokenizer.bin").is_file() else "none (no tokenizer.bin)"
    tj = folder / "tokenizer.json"
    if tj.is_file():
        try:
            model_type = json.loads(tj.read_text(encoding="utf-8")).get("model", {}).get("type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        return f"tokenizer.json ({model_type or 'unknown model'})"
    if (folder / "tokenizer.model").is_file():
        return "SentencePiece (tokenizer.model)"
    return "none"


def describe(source: str | os.PathLike, spec: Any = None) -> list[str]:
    """Report lines for ``source``: format, architecture, spec, hyper-parameters, tensor types and sizes."""
    from .model.detect import open_source, resolve_spec
    from .spec.params import resolve_params

    src = open_source(source)
    lines = [f"source:        {src.path}", f"format:        {_format(src)}"]
    arch = src.arch if src.kind == "gguf" else src.config.get("model_type")
    archs = src.config.get("architectures") if src.kind != "gguf" else None
    lines.append(f"architecture:  {arch}" + (f" {archs}" if archs else ""))
    try:
        sp = resolve_spec(spec, src)
        lines.append(f"spec:          {sp.name} ({sp.file}) [{sp.architecture}]")
        params = resolve_params(sp, src.kind, src.config, {}, config_name=src.config_name, arch=src.arch)
        lines.append("hyper-parameters:")
        lines += [f"  {k} = {v!r}" for k, v in params.items()]
    except InferflowError as e:
        lines.append(f"spec:          (none) {e}")
    names = src.names()
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # count, bytes, elements
    unknown_bytes = False
    for name in names:
        n_el = 1
        for s in src.shape(name):
            n_el *= s
        t, nb = src.dtype_of(name), src.nbytes(name)
        row = by_type[t]
        row[0] += 1
        row[2] += n_el
        if nb is None:
            unknown_bytes = True
        else:
            row[1] += nb
    total = sum(r[1] for r in by_type.values())
    elements = sum(r[2] for r in by_type.values())
    lines.append(f"tensors:       {len(names)} ({elements:,} parameters)")
    for t, (count, nb, n_el) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        size = "? bytes" if nb == 0 and unknown_bytes else f"{nb} bytes ({_human(nb)})"
        lines.append(f"  {t:10s} {count:5d} tensors  {n_el:>14,} elements  {size}")
    lines.append(f"total bytes:   {total} ({_human(total)})" + (" (some sizes unknown)" if unknown_bytes else ""))
    lines.append(f"tokenizer:     {tokenizer_kind(src)}")
    return lines


def inspect_main(source: str, spec: str | None = None, out: Callable[[str], Any] = print) -> int:
    for line in describe(source, spec):
        out(line)
    return 0
