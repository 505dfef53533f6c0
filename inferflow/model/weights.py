"""Filling an assembled network's declared weights from a model file through the spec's name templates.

A template maps an internal name (module path, with ``{i}`` for the layer and ``{j}`` for the
expert) to a source tensor name, optionally transformed: transposed (GPT-2 Conv1D), split out of a
fused tensor, regrouped from a per-head interleaved layout, concatenated, stacked over experts or
permuted (GGUF's interleaved RoPE rows). The longest matching template wins; whatever follows the
matched prefix (``.weight``, ``.q_proj.bias``) is appended to the source name.
"""
from __future__ import annotations

import fnmatch
import json
import re
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from ..errors import WeightError
from ..loaders.source import WeightSource
from ..quant.packed import PackedTensor, cat_rows, dense
from ..spec.expr import resolve
from ..spec.loader import Spec


@lru_cache(maxsize=4096)
def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{[ij]\})", template)
    rx = "".join(f"(?P<{p[1]}>\\d+)" if p in ("{i}", "{j}") else re.escape(p) for p in parts)
    return re.compile(rf"^{rx}(?P<suffix>(\..*)?)$")


def match_template(mapping: dict[str, Any], internal: str) -> tuple[str, dict[str, str], str] | None:
    best = None
    for key in mapping:
        m = _template_regex(key).match(internal)
        if m and (best is None or len(key) > len(best[0])):
            caps = {k: v for k, v in m.groupdict().items() if k in ("i", "j") and v is not None}
            best = (key, caps, m.group("suffix"))
    return best


class _Missing(Exception):
    def __init__(self, name: str):
        self.name = name


class WeightLoader:
    """Resolves and loads source tensors, sharing one tensor between all internal names that read it."""

    def __init__(self, spec: Spec, source: WeightSource, params: dict[str, Any], dtype: torch.dtype,
                 device: torch.device):
        self.spec, self.source, self.params, self.dtype, self.device = spec, source, params, dtype, device
        self.mapping: dict[str, Any] = spec.data.get("weights", {}).get(source.kind, {})
        self.used: set[str] = set()
        self.cache: dict[str, torch.Tensor] = {}

    def _names(self, caps: dict[str, str]) -> dict[str, Any]:
        return {**self.params, **{k: int(v) for k, v in caps.items()}}

    def _fmt(self, name: str, caps: dict[str, str], suffix: str) -> str:
        for k, v in caps.items():
            name = name.replace("{" + k + "}", v)
        return name + suffix

    def _load(self, src: Any, caps: dict[str, str], suffix: str, key: str) -> torch.Tensor:
        names = self._names(caps)
        where = (self.spec.file, f"weights.{self.source.kind}['{key}']")
        if isinstance(src, str):
            src = {"name": src}
        if isinstance(src, list):  # alternatives: the first whose condition holds and whose tensors exist
            last: _Missing | None = None
            for alt in src:
                if isinstance(alt, dict) and not resolve(alt.get("when", True), names, where=where):
                    continue
                try:
                    return self._load(alt, caps, suffix, key)
                except _Missing as e:
                    last = e
            raise last or _Missing(f"(no alternative applies for {key})")
        if "zeros" in src:
            shape = resolve(src["zeros"], names, where=where)
            return torch.zeros(shape if isinstance(shape, list) else [shape], dtype=torch.float32)
        if "cat" in src:
            parts = [self._load(p, caps, suffix, key) for p in src["cat"]]
            t = cat_rows(parts)  # packed (GGUF) parts of one type stay packed
        elif "stack" in src:
            count = resolve(src["count"], names, where=where)
            var = src["stack"]
            parts = [self._load({**{k: v for k, v in src.items() if k not in ("stack", "count")}},
                                {**caps, var: str(j)}, suffix, key) for j in range(count)]
            return torch.stack([dense(p) for p in parts], dim=0)
        else:
            name = self._fmt(src["name"], caps, suffix)
            if name not in self.source:
                raise _Missing(name)
            self.used.add(name)
            t = self.source.get(name)
        # Block-quantized rows are whole blocks, so row-wise transforms (split, regroup, permute along
        # dim 0) run on the raw bytes and the weight stays packed; any other transform gets real values.
        packed = t if isinstance(t, PackedTensor) else None
        if packed is not None:
            t, packed = (packed.data, packed) if _rowwise(src) and packed.dim() == 2 else (packed.dequantize(), None)
        if resolve(src.get("transpose", False), names, where=where) and t.dim() == 2:
            t = t.t()
        if "regroup" in src:  # [groups * sum(sizes), ...] in group-major order -> part-major
            g = resolve(src["regroup"]["groups"], names, where=where)
            sizes = resolve(src["regroup"]["sizes"], names, where=where)
            v = t.reshape(g, sum(sizes), *t.shape[1:])
            t = torch.cat([p.reshape(-1, *t.shape[1:]) for p in torch.split(v, sizes, dim=1)], dim=0)
        if "split" in src:
            sp = src["split"]
            sizes = resolve(sp["sizes"], names, where=where)
            index = resolve(sp["index"], names, where=where)
            dim = sp.get("dim", 0)
            groups = resolve(sp.get("groups", 1), names, where=where)
            if groups > 1:
                v = t.reshape(*t.shape[:dim], groups, sum(sizes), *t.shape[dim + 1:])
                t = torch.split(v, sizes, dim=dim + 1)[index].reshape(*t.shape[:dim], -1, *t.shape[dim + 1:])
            else:
                if sum(sizes) != t.shape[dim]:
                    raise WeightError(self.spec.file, where[1], f"split sizes {sizes} do not add up to dimension "
                                                                f"{dim} of shape {list(t.shape)}")
                t = torch.split(t, sizes, dim=dim)[index]
        if src.get("permute") == "rope_interleaved_to_half":
            heads = resolve(src["heads"], names, where=where)
            t = _unpermute_rope(t, heads)
        if "reshape" in src:
            t = t.reshape(resolve(src["reshape"], names, where=where))
        if "scale" in src:
            t = t.float() * resolve(src["scale"], names, where=where)
        if "offset" in src:
            t = t.float() + resolve(src["offset"], names, where=where)
        return packed.with_rows(t) if packed is not None else t

    def tensor_for(self, internal: str, shape: tuple[int, ...], optional: bool = False) -> torch.Tensor | None:
        """``optional``: a component's auxiliary float32 table that files may lack; None when absent."""
        found = match_template(self.mapping, internal)
        kind = self.source.kind
        if found is None and optional:
            return None
        if found is None:
            raise WeightError(self.spec.file, f"weights.{kind}",
                              f"no tensor-name template covers '{internal}' (shape {list(shape)})")
        key, caps, suffix = found
        src = self.mapping[key]
        cache_key = json.dumps([src, caps, suffix], sort_keys=True, default=str)
        t = self.cache.get(cache_key)
        if t is None:
            try:
                t = self._load(src, caps, suffix, key)
            except _Missing as e:
                if optional:
                    return None
                raise WeightError(self.spec.file, f"weights.{kind}['{key}']",
                                  f"tensor '{e.name}' (for {internal}) not found in {self.source.path}") from None
            except (IndexError, KeyError, RuntimeError, TypeError, ValueError) as e:
                # a transform that does not fit the tensor (split index, reshape, missing 'count', ...)
                raise WeightError(self.spec.file, f"weights.{kind}['{key}']",
                                  f"cannot build {internal} (shape {list(shape)}) from this template: "
                                  f"{type(e).__name__}: {e}") from None
            if tuple(t.shape) != tuple(shape):
                raise WeightError(self.spec.file, f"weights.{kind}['{key}']",
                                  f"shape mismatch for {internal}: the spec expects {list(shape)}, "
                                  f"{self.source.file_of(str(src) if isinstance(src, str) else internal)} gives "
                                  f"{list(t.shape)}")
            if isinstance(t, PackedTensor):
                t = t.to(self.device)
            else:
                keep = torch.float32 if optional else self.dtype
                t = t.to(device=self.device, dtype=keep if t.is_floating_point() else t.dtype)
            self.cache[cache_key] = t
        return t

    def check_unused(self) -> None:
        ignore = self.spec.data.get("weights", {}).get("ignore" if self.source.kind == "hf" else
                                                        f"ignore_{self.source.kind}", [])
        ignore = [ignore] if isinstance(ignore, str) else ignore
        unused = [n for n in self.source.names() if n not in self.used and not any(fnmatch.fnmatchcase(n, p) for p in ignore)]
        if unused:
            shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
            raise WeightError(self.spec.file, f"weights.{self.source.kind}",
                              f"{len(unused)} tensor(s) in {self.source.path} are not used by the spec: {shown} "
                              f"(map them, or list them under weights.ignore)")


def _rowwise(src: dict) -> bool:
    """True when every transform of ``src`` only reorders or selects rows (dim 0)."""
    keys = set(src) - {"name", "cat", "when", "permute", "heads", "regroup", "split"}
    return not keys and src.get("split", {}).get("dim", 0) == 0


def _unpermute_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: interleaved RoPE pairs back to HF's rotate-half order."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def load_weights(net: nn.Module, spec: Spec, source: WeightSource, params: dict[str, Any], *, dtype: torch.dtype,
                 device: torch.device, check_unused: bool = True, progress: Any = None, quantizer: Any = None) -> None:
    """Replace every declared (meta) parameter of ``net`` with its tensor from ``source``;
    ``progress(done, total)`` (optional) is called as each tensor is taken; ``quantizer(internal, module, pname,
    t)`` (optional, inferflow/quant/plan.py) may return a weight quantized at load (a PackedTensor)."""
    loader = WeightLoader(spec, source, params, dtype, device)
    total = sum(1 for p in net.parameters() if p.is_meta) if progress is not None else 0
    done = 0
    for mod_name, module in net.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if progress is not None:
                done += 1
                progress(min(done, total), total)
            internal = f"{mod_name}.{pname}" if mod_name else pname
            # ``optional_weights``: components' auxiliary tables a file may lack; absent ones stay None
            t = loader.tensor_for(internal, tuple(param.shape), pname in getattr(module, "optional_weights", ()))
            if t is None:
                module._parameters[pname] = None
                continue
            if quantizer is not None:
                t = quantizer(internal, module, pname, t)
            if isinstance(t, PackedTensor):
                # components that can hold raw blocks (``load_packed``) dequantize on use; others get values
                hold = getattr(module, "load_packed", None)
                if hold is not None and hold(pname, t, dtype):
                    continue
                t = t.dequantize(dtype)
            module._parameters[pname] = nn.Parameter(t, requires_grad=False)
    if check_unused:
        loader.check_unused()
    net.to(device)
