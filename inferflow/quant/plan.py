"""Quantization configs and load-time quantization.

A config says which format each weight gets::

    "q4"                                                  # every linear and embedding table
    {"default": "q4", "attn_v": "q6", "mlp_down": "q6",   # per role (inferflow/quant/roles.py)
     "head": "q8", "embeddings": "q8",
     "decoder.layers.0.*": "q8",                          # per tensor: internal-name globs (first match wins)
     "min_elements": 1_000_000}                           # smaller tensors stay in full precision

Lookup for one weight: below ``min_elements`` -> full precision; else the first glob that matches its internal
name, else its role (fused projections fall back to their parts' roles), else ``default``. A value of None /
"none" / "f32" keeps full precision. A weight whose row length is not a whole number of the format's blocks also
stays in full precision (recorded in :attr:`LoadQuantizer.skipped`).

Sources: ``inferflow.load(src, quant=...)``, else the spec's ``quantization:`` block; a service config's model
``quantization`` field passes through to ``load``. Weights that arrive block-quantized (GGUF) are dequantized and
quantized again when a config applies to them.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InferflowError
from . import formats
from .packed import PackedTensor
from .roles import ROLES, lookup_order, role_of


def _format(value: Any, where: str) -> formats.Format | None:
    if value is None or str(value).strip().lower() in formats.FULL_PRECISION:
        return None
    try:
        return formats.get(value)
    except InferflowError as e:
        raise InferflowError(f"quantization {where}: {e}") from None


@dataclass(slots=True)
class QuantConfig:
    default: formats.Format | None = None
    roles: dict[str, formats.Format | None] = field(default_factory=dict)
    tensors: dict[str, formats.Format | None] = field(default_factory=dict)  # internal-name globs
    min_elements: int = 0

    @classmethod
    def parse(cls, q: Any) -> "QuantConfig | None":
        """A format name, a dict (see module doc) or a QuantConfig; None / "" -> None (no quantization)."""
        if q is None or isinstance(q, QuantConfig):
            return q
        if isinstance(q, str):
            return cls(default=_format(q, "default")) if q.strip() else None
        if not isinstance(q, dict):
            raise InferflowError(f"quantization: expected a format name or a mapping, got {type(q).__name__}")
        cfg = cls()
        for key, value in q.items():
            if key == "default":
                cfg.default = _format(value, "default")
            elif key == "min_elements":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InferflowError(f"quantization min_elements: expected a non-negative integer, got {value!r}")
                cfg.min_elements = value
            elif key in ROLES:
                cfg.roles[key] = _format(value, key)
            elif any(ch in str(key) for ch in ".*?["):
                cfg.tensors[str(key)] = _format(value, key)
            else:
                raise InferflowError(f"quantization: unknown key {key!r} (use default, min_elements, a role: "
                                     f"{', '.join(ROLES)}, or an internal-name glob such as 'decoder.layers.0.*')")
        return cfg

    def choose(self, name: str, role: str, shape: tuple[int, ...]) -> formats.Format | None:
        """The format for weight ``name`` (internal name) of ``role`` and ``shape``; None: full precision."""
        numel = 1
        for s in shape:
            numel *= s
        if numel < self.min_elements:
            return None
        for pattern, fmt in self.tensors.items():
            if fnmatch.fnmatchcase(name, pattern):
                return fmt
        for r in lookup_order(role):
            if r in self.roles:
                return self.roles[r]
        return self.default

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain mapping (format names), ready for JSON and for :meth:`parse`."""
        name = lambda f: None if f is None else f.name  # noqa: E731
        out: dict[str, Any] = {"default": name(self.default)}
        out.update({k: name(v) for k, v in self.roles.items()})
        out.update({k: name(v) for k, v in self.tensors.items()})
        if self.min_elements:
            out["min_elements"] = self.min_elements
        return out


class LoadQuantizer:
    """Called by the weight loader for every weight: returns it quantized (a PackedTensor) where the config says
    so, else unchanged. Only weights of components that hold packed blocks (``load_packed``) are considered."""

    def __init__(self, config: QuantConfig):
        self.config = config
        self.held: dict[str, str] = {}      # internal name -> format name
        self.skipped: dict[str, str] = {}   # internal name -> why it stayed in full precision
        self._memo: dict[tuple, PackedTensor] = {}

    def __call__(self, internal: str, module: nn.Module, pname: str, t: Any) -> Any:
        if pname != "weight" or getattr(module, "load_packed", None) is None or len(t.shape) != 2:
            return t
        module_path = internal[: -len(".weight")] if internal.endswith(".weight") else internal
        shape = tuple(int(s) for s in t.shape)
        fmt = self.config.choose(internal, role_of(module_path, module), shape)
        if fmt is None:
            return t
        if not fmt.fits(shape):
            self.skipped[internal] = f"rows of {shape[-1]} are not whole {fmt.name} blocks of {fmt.block_elems}"
            return t
        data = t.data if isinstance(t, PackedTensor) else t
        key = (data.data_ptr(), data.dtype, shape, getattr(t, "qtype", None), fmt.name)  # a tied head shares blocks
        packed = self._memo.get(key)
        if packed is None:
            values = t.dequantize(torch.float32) if isinstance(t, PackedTensor) else t.float()
            packed = self._memo[key] = fmt.quantize(values)
        self.held[internal] = fmt.name
        return packed


def held_types(net: nn.Module) -> dict[str, str]:
    """Internal name -> block type name of every weight a module holds packed (quantized here or in the file)."""
    from . import ggml

    out = {}
    for path, module in net.named_modules():
        for pname, (qtype, _shape) in (getattr(module, "packed", None) or {}).items():
            out[f"{path}.{pname}" if path else pname] = ggml.type_name(qtype)
    return out
