"""Writing a loaded (quantized) model as inferflow's own quantized model folder.

The folder loads back with ``inferflow.load(DST)`` and no other argument, bit-identically:

- ``model.safetensors``: every weight under its *internal* name (``decoder.layers.0.mlp.up_proj.weight``).
  Quantized weights are uint8 tensors [*shape[:-1], row_bytes] of whole blocks; float weights keep their values.
  ``__metadata__["inferflow.quantized"]`` (JSON) names each quantized tensor's block type id, format and logical
  shape, tensors stored once for several names (a head tied to the embedding), the spec document the model was
  built from (so no spec file or config lookup can differ on reload), the source kind and its config.
- GGUF sources: ``metadata.gguf``, the source's metadata (hyper-parameters, tokenizer) without tensors.
- Folder sources: the source's other files (config.json, tokenizer files, sentence-transformers configs).

Reading: :mod:`inferflow.loaders.quantized`.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import InferflowError
from . import ggml

MARKER = "inferflow.quantized"
WEIGHTS = "model.safetensors"
GGUF_METADATA = "metadata.gguf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def collect(model: Any) -> dict[str, tuple[torch.Tensor, int | None, tuple[int, ...]]]:
    """Internal name -> (tensor, block type id or None for float, logical shape) of every weight of the model.

    Packed weights must still be held as blocks: load with ``quant_kernels="reference"`` (the int4 kernel's
    repacking drops them)."""
    out: dict[str, tuple[torch.Tensor, int | None, tuple[int, ...]]] = {}
    for path, module in model.net.named_modules():
        prefix = f"{path}." if path else ""
        kernels = getattr(module, "kernels", None) or {}
        for pname, (qtype, shape) in (getattr(module, "packed", None) or {}).items():
            if kernels.get(pname) == "int4":
                raise InferflowError(f"{prefix}{pname} was repacked for the int4 kernel; load the model with "
                                     f"quant_kernels='reference' to write it")
            out[prefix + pname] = (getattr(module, f"{pname}_blocks"), qtype, tuple(shape))
        for pname, p in module._parameters.items():
            if p is not None:
                out[prefix + pname] = (p.detach(), None, tuple(p.shape))
    return out


def _dedupe(tensors: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each distinct tensor once: (name -> tensor, alias name -> stored name)."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, (t, qtype, shape) in tensors.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), qtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        stored[name] = t.detach().to("cpu").contiguous().clone()
    return stored, aliases


def _copy_gguf_metadata(src_path: str, dst: Path, arch: str) -> None:
    import gguf

    reader = gguf.GGUFReader(src_path)
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or not f.types:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _copy_folder_files(src: Path, dst: Path) -> None:
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_dir() or p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(".index.json") or rel.parts[0].startswith("."):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst / rel)


def save(model: Any, dst: str | Path, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``model`` (loaded with quant_kernels="reference") as a quantized folder; returns the metadata."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    src = model.source
    kind = src.kind if src.kind in ("hf", "gguf") else "hf"  # other kinds expose their config under HF names
    tensors = collect(model)
    stored, aliases = _dedupe(tensors)
    spec = copy.deepcopy(model.spec.data)
    spec.pop("quantization", None)  # already applied: never again on reload
    spec.pop("weights", None)
    info: dict[str, Any] = {
        "version": 1,
        "kind": kind,
        "arch": getattr(src, "arch", None),
        "spec_name": model.spec.name,
        "spec": spec,
        "quantization": config,
        "tensors": {n: {"type": q, "format": ggml.type_name(q), "shape": list(s)}
                    for n, (_, q, s) in tensors.items() if q is not None and n in stored},
        "aliases": aliases,
    }
    folder = getattr(src, "folder", None)
    if folder is not None and Path(folder).resolve() != dst.resolve():
        _copy_folder_files(Path(folder), dst)
    if kind == "gguf":
        _copy_gguf_metadata(getattr(src, "gguf_metadata_path", src.path), dst / GGUF_METADATA, src.arch)
    else:
        info["config"] = src.config
    save_file(stored, str(dst / WEIGHTS), metadata={MARKER: json.dumps(info, default=str)})
    return info
