"""Writing a loaded model as a GGUF file llama.cpp can load (``inferflow quantize --format gguf``).

Tensor names come from the spec's ``weights.gguf`` templates read backwards: each internal weight takes the first
alternative its template offers that is a plain name, with GGUF's interleaved RoPE row order restored where the
template un-permutes (row permutations apply to block rows unchanged, so quantized q/k stay exact). A template
offering several names (``[output, token_embd]``) is a tie: the weight is not written when an identical tensor
already went out under one of the later names. Quantized weights must be llama.cpp block types (q8_0, q4_0, q4_1,
q5_0, q5_1, or the ggml types a GGUF source already had); float weights are written as F32.

Metadata: a GGUF source's key/values are copied (tokenizer included); for other sources the hyper-parameters
are written under the keys the spec's ``params`` read them from (no tokenizer: llama.cpp then needs one added).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InferflowError
from ..model.weights import match_template
from ..spec.expr import resolve
from . import ggml
from .formats import BASE_ID
from .saved import collect

# general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*) of the most common block type
FILE_TYPES = {ggml.Q4_0: 2, ggml.Q4_1: 3, ggml.Q8_0: 7, ggml.Q5_0: 8, ggml.Q5_1: 9, ggml.Q2_K: 10, ggml.Q3_K: 12,
              ggml.Q4_K: 15, ggml.Q5_K: 17, ggml.Q6_K: 18, ggml.F16: 1, ggml.F32: 0}


def _permute_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp's interleaved pairs (the inverse of weights._unpermute_rope)."""
    rows = t.shape[0]
    return t.reshape(heads, 2, rows // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _targets(mapping: dict, internal: str, names: dict[str, Any], where: str) -> list[tuple[str, int | None]]:
    """(GGUF name, RoPE heads to permute or None) for each plain alternative of ``internal``'s template."""
    found = match_template(mapping, internal)
    if found is None:
        raise InferflowError(f"{where}: no weights.gguf template covers {internal}")
    key, caps, suffix = found
    src = mapping[key]
    names = {**names, **{k: int(v) for k, v in caps.items()}}
    out = []
    for alt in src if isinstance(src, list) else [src]:
        alt = {"name": alt} if isinstance(alt, str) else alt
        if set(alt) - {"name", "permute", "heads", "when"} or not resolve(alt.get("when", True), names):
            continue  # splits, transposes, ...: another alternative (if any) names the tensor plainly
        name = alt["name"]
        for k, v in caps.items():
            name = name.replace("{" + k + "}", v)
        heads = resolve(alt["heads"], names) if alt.get("permute") == "rope_interleaved_to_half" else None
        out.append((name + suffix, heads))
    if not out:
        raise InferflowError(f"{where}: the template for {internal} has no plain GGUF name to write it under")
    return out


def _metadata(writer: Any, model: Any, arch: str) -> None:
    import gguf

    src = model.source
    path = getattr(src, "gguf_metadata_path", src.path if src.kind == "gguf" else None)
    if path is not None:
        reader = gguf.GGUFReader(path)
        skip = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name in skip or not f.types:
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
        return
    writer.add_name(model.spec.name)
    for pname, decl in model.spec.data.get("params", {}).items():
        key = decl.get("gguf") if isinstance(decl, dict) else None
        value = model.params.get(pname)
        if isinstance(key, list):
            key = key[0] if key else None
        if not key or value is None:
            continue
        key = key.replace("{arch}", arch)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)


def write(model: Any, path: str | Path) -> dict[str, str]:
    """Write ``model`` (loaded with quant_kernels="reference") as GGUF; returns GGUF name -> type name."""
    import gguf

    spec = model.spec
    mapping = spec.data.get("weights", {}).get("gguf")
    if not mapping:
        raise InferflowError(f"spec {spec.name!r} has no weights.gguf mapping: cannot name GGUF tensors")
    src = model.source
    archs = spec.data.get("match", {}).get("gguf_architecture", [])
    arch = src.arch if src.kind == "gguf" and src.arch else (archs if isinstance(archs, str) else (archs or [None])[0])
    if not arch:
        raise InferflowError(f"spec {spec.name!r} names no gguf_architecture")
    out: dict[str, tuple[torch.Tensor, int | None, tuple[int, ...]]] = {}
    for internal, (t, qtype, shape) in collect(model).items():
        if qtype is not None and qtype >= BASE_ID:
            raise InferflowError(f"{internal}: {ggml.type_name(qtype)} is inferflow's own format; GGUF files take "
                                 f"llama.cpp types (q8_0, q4_0, q4_1, q5_0, q5_1)")
        targets = _targets(mapping, internal, model.params, f"spec {spec.name!r}")
        name, heads = targets[0]
        if heads is not None:
            t = _permute_rope(t, heads)
        tied = [n for n, _ in targets[1:] if n in out and out[n][1] == qtype and torch.equal(out[n][0], t)]
        if not tied:
            out[name] = (t, qtype, shape)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, model, arch)
    counts = Counter(q for _, q, s in out.values() if q is not None and len(s) == 2)
    main = counts.most_common(1)[0][0] if counts else ggml.F32
    writer.add_file_type(FILE_TYPES.get(main, 0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    types = {}
    for name, (t, qtype, shape) in out.items():
        if qtype is None:
            writer.add_tensor(name, t.float().cpu().numpy())
            types[name] = "F32"
        else:
            data = t.cpu().contiguous().numpy().astype(np.uint8, copy=False)
            writer.add_tensor(name, data.reshape(int(np.prod(shape[:-1])) if len(shape) > 1 else 1, -1),
                              raw_dtype=gguf.GGMLQuantizationType(qtype))
            types[name] = ggml.type_name(qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
