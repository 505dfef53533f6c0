"""One KV layer's storage in one tier (``LayerStore``), the storage dtypes and int8 quantisation.

Storage dtypes: float32/float16/bfloat16 store K/V as is (converted on write and on gather). ``int8`` stores
symmetric per-token-per-head absmax quantised values ``q = round(x / scale)``, ``scale = absmax(x[token, head]) *
(1 / 127)``, plus that float32 scale per token and head, dequantised to the compute dtype on gather. True cost:
8 + 32 / head_dim bits per element (8.25 for D = 128), i.e. ``2 * Hkv * (D + 4)`` bytes per token per layer against
``2 * Hkv * D * 2`` for float16. float32 scales avoid float16's subnormal range for small K/V. int8 holds about twice
the tokens of float16 and decodes about as fast: the decode kernels read the codes in place, each score times its
key's scale and each softmax weight times its value's (CUDA: triton_attention.py, with new rows quantized in the
launch that stores them, triton_kv_write.py; CPU: native/paged_attention.h). Prefill chunks on cached keys still
gather and dequantize.
``fp8`` stores K/V as float8 e4m3 (vLLM's ``kv_cache_dtype="fp8"`` with unit scales): one byte per element, values
rounded to 3 mantissa bits and saturated at +-448 on write, widened to the compute dtype on read. The paged decode
kernels read it in place (CUDA: triton_attention.py; CPU: native/paged_attention.h), so decode attention streams half
the bytes of a 16-bit cache (a quarter of float32's).

``KVLayer`` describes a decoder self-attention layer's K/V (``kv_layers`` finds them in a Model); the paged cache
(kv_cache.py) keeps one ``LayerStore`` per layer and tier.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InferflowError

if TYPE_CHECKING:
    from ..model.hugepages import Arena

STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
                "fp8": torch.float8_e4m3fn}


def storage_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a storage dtype name (an unknown name is an error)."""
    if dtype not in STORE_DTYPES:
        raise InferflowError(f"kv cache: dtype {dtype!r}; expected one of {', '.join(STORE_DTYPES)}")
    return STORE_DTYPES[dtype]


@dataclass(slots=True)
class KVLayer:
    key: int            # the attention module's cache_key (Model numbers them)
    num_kv_heads: int
    head_dim: int


def kv_layers(model: Any) -> list[KVLayer]:
    """The decoder self-attention layers of a ``Model`` (cross-attention keeps its K/V per request)."""
    dec = getattr(model.net, "decoder", None)
    if dec is None:
        return []
    return [KVLayer(m.cache_key, m.hkv, m.d) for m in dec.modules()
            if getattr(m, "uses_kv_cache", False) and not getattr(m, "cross", False)]


@dataclass(slots=True)
class LayerStore:
    """One layer's K/V [blocks, block_size, Hkv, D] (and int8 scales [blocks, block_size, Hkv]) in one tier."""

    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor | None
    vs: torch.Tensor | None

    @classmethod
    def new(cls, layer: KVLayer, nb: int, bs: int, dtype: torch.dtype, device: torch.device, pin: bool,
            arena: "Arena | None" = None) -> "LayerStore":
        """Zeroed stores (``arena``: carved from it, for unpinned CPU memory)."""
        # zeros, not empty: padded gathers read slots they then mask, and 0 * NaN garbage would be NaN
        def z(*shape, dt=dtype):
            if arena is not None:
                return arena.zeros(shape, dt)
            return torch.zeros(shape, dtype=dt, device=device, pin_memory=pin)

        made = [z(*shape, dt=dt) for shape, dt in cls.shapes(layer, nb, bs, dtype)]
        return cls(*made) if len(made) == 4 else cls(*made, None, None)

    @staticmethod
    def shapes(layer: KVLayer, nb: int, bs: int, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of k, v and, for int8 stores, their scales."""
        shape = (nb, bs, layer.num_kv_heads, layer.head_dim)
        scales = [(shape[:3], torch.float32)] * 2 if dtype == torch.int8 else []
        return [(shape, dtype), (shape, dtype), *scales]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.ks, self.vs) if t is not None]

    @property
    def device(self) -> torch.device:
        return self.k.device


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for float8 its bytes (the same storage viewed as uint8): torch's CPU index_copy_ and
    index_select have no float8 kernels, and K/V copies need no arithmetic."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, D] -> int8 values and float32 scales [N, H] (symmetric absmax per token and head)."""
    xf = x.float()
    # a multiply by float32(1 / 127), not a division: what torch computes for "/ 127.0" on CUDA (on the CPU it
    # divides), so the codes and scales are the same on every device and in every kernel that writes them
    scale = xf.abs().amax(dim=-1) * (1.0 / 127.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8), scale
