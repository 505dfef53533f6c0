"""The registry of quantized linear formats: inferflow's own (q8 .. q2, q3.5) and llama.cpp's legacy types.

Every format quantizes float32 blocks [n, block_elems] into uint8 blocks [n, block_bytes] and back, vectorised
(no Python loop over blocks). bpw below is the TRUE stored size, scales and zero points included:
8 * block_bytes / block_elems. Blocks are 64 weights (q8, q4, q2: 32): the largest block size dividing the row
lengths of both the default model (576, 1536) and 7B-class models (4096, 11008, 14336); 256-weight k-quant
super-blocks do not divide 576, so scale overhead is cut with a 2-byte header instead (see affine.py).

  name  id    elems bytes bpw    layout (byte offsets)                                 decode
  q8    8     32    34    8.5    0-1 fp16 d, 2-33 int8 q  (= ggml Q8_0 blocks)          d * q; d searched
  q6    4096  64    50    6.25   0 scale code, 1 zero code, 2-33 low-4 plane,          s * (q - z)
                                  34-49 high-2 plane                                    z = zc / 4
  q5    4097  64    42    5.25   0 scale, 1 zero, 2-33 low-4 plane, 34-41 high-1 plane  s * (q - z), z = zc / 8
  q4    4102  32    18    4.5    0 scale code, 1 zero code, 2-17 nibbles               s * (q - z), z = zc / 16
  q3.5  4099  64    28    3.5    21 low bytes of triple codes + 56-bit word            s * LEVELS[q] (codebook.py)
  q3    4100  64    26    3.25   0 scale, 1 zero, 2-17 low-2 plane, 18-25 high-1 plane  s * (q - z), z = zc/16 - 4
  q2    4101  32    10    2.5    0 scale, 1 zero, 2-9 2-bit plane                      s * (q - z), z = zc/32 - 2

Scale code c (q6 .. q2): s = 2 ** ((c - 192) / 12), c = 0 means s = 0. Planes: code j of n sits in byte
``j % (n*b/8)`` of its plane at bit ``b * (j // (n*b/8))`` (bitplanes.py). q4's codes and affine map onto torch's
CPU int4 kernel (group 32; its bf16 scale and zero round s and s * (8 - z)): Linear layers run it through
``_weight_int4pack_mm_for_cpu``. (Id 4098 was an earlier q4 layout, 64-weight blocks with bf16 s and z; retired.)
llama.cpp types keep their ggml ids and layouts (q8_0 8.5, q4_0 4.5, q4_1 5.0, q5_0 5.5, q5_1 6.0 bpw)
and byte-identical gguf-py quantizers (ggml_quantize.py).

Our ids start at 4096, far above ggml's (< 64 today), and are added to :mod:`.ggml`'s tables at import, so a
:class:`~inferflow.quant.packed.PackedTensor` of any format runs through every packed-weight path unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InferflowError
from . import codebook, cpu_kernels, ggml, ggml_quantize, int4pack, triton_kernels
from .affine import CompactAffine
from .packed import PackedTensor
from .search import chunked

BASE_ID = 4096


@dataclass(slots=True, frozen=True)
class Format:
    name: str
    qtype: int                                             # id held by PackedTensor (ggml's own for ggml layouts)
    block_elems: int
    block_bytes: int
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor]    # float32 [n, elems] -> uint8 [n, bytes]
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, bytes] -> float32 [n, elems]
    ggml: bool = False                                     # a llama.cpp type (GGUF-writable)
    summary: str = ""

    @property
    def bpw(self) -> float:
        """True stored bits per weight, scales included."""
        return 8 * self.block_bytes / self.block_elems

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) >= 1 and shape[-1] > 0 and shape[-1] % self.block_elems == 0

    def quantize(self, t: torch.Tensor) -> PackedTensor:
        """A float tensor [..., K] (K a multiple of block_elems) -> PackedTensor of this format."""
        if not self.fits(tuple(t.shape)):
            raise InferflowError(f"{self.name}: rows of {t.shape[-1] if t.dim() else 0} values are not whole "
                                 f"{self.block_elems}-weight blocks")
        blocks = t.detach().reshape(-1, self.block_elems).float()
        data = chunked(self.quantize_blocks, blocks, self.block_bytes, torch.uint8)
        row_bytes = t.shape[-1] // self.block_elems * self.block_bytes
        return PackedTensor(data.reshape(*t.shape[:-1], row_bytes), self.qtype, tuple(t.shape))

    def dequantize(self, p: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return p.dequantize(dtype)


_q6 = CompactAffine(6, 64, zfrac=4, zlo=0, deltas=(-0.5, 0.0, 0.5, 1.0))
_q5 = CompactAffine(5, 64, zfrac=8, zlo=0, deltas=(-0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0))
_q3 = CompactAffine(3, 64, zfrac=16, zlo=4, deltas=tuple(-1.0 + 0.2 * k for k in range(11)))
_q2 = CompactAffine(2, 32, zfrac=32, zlo=2, deltas=tuple(-0.5 + 0.15 * k for k in range(11)))
_q4 = CompactAffine(4, 32, zfrac=16, zlo=0, deltas=tuple(-1.0 + 0.2 * k for k in range(11)))
_ggml_dq = {t: ggml.DEQUANTIZERS[t] for t in (ggml.Q8_0, ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1)}

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("q8", ggml.Q8_0, 32, 34, ggml_quantize.q8_searched, _ggml_dq[ggml.Q8_0],
           summary="Q8_0 blocks, searched fp16 scale"),
    Format("q6", BASE_ID + 0, 64, _q6.block_bytes, _q6.quantize, _q6.dequantize,
           summary="6-bit min+scale, 2-byte header"),
    Format("q5", BASE_ID + 1, 64, _q5.block_bytes, _q5.quantize, _q5.dequantize,
           summary="5-bit min+scale, 2-byte header"),
    Format("q4", BASE_ID + 6, 32, _q4.block_bytes, _q4.quantize, _q4.dequantize,
           summary="4-bit min+scale, 2-byte header, 32-weight blocks"),
    Format("q3.5", BASE_ID + 3, codebook.ELEMS, codebook.BLOCK_BYTES, codebook.quantize, codebook.dequantize,
           summary="10-level codebook, 3 weights per 10-bit code"),
    Format("q3", BASE_ID + 4, 64, _q3.block_bytes, _q3.quantize, _q3.dequantize,
           summary="3-bit min+scale, 2-byte header"),
    Format("q2", BASE_ID + 5, 32, _q2.block_bytes, _q2.quantize, _q2.dequantize,
           summary="2-bit min+scale, 2-byte header"),
    Format("q8_0", ggml.Q8_0, 32, 34, ggml_quantize.q8_0, _ggml_dq[ggml.Q8_0], ggml=True, summary="llama.cpp Q8_0"),
    Format("q4_0", ggml.Q4_0, 32, 18, ggml_quantize.q4_0, _ggml_dq[ggml.Q4_0], ggml=True, summary="llama.cpp Q4_0"),
    Format("q4_1", ggml.Q4_1, 32, 20, ggml_quantize.q4_1, _ggml_dq[ggml.Q4_1], ggml=True, summary="llama.cpp Q4_1"),
    Format("q5_0", ggml.Q5_0, 32, 22, ggml_quantize.q5_0, _ggml_dq[ggml.Q5_0], ggml=True, summary="llama.cpp Q5_0"),
    Format("q5_1", ggml.Q5_1, 32, 24, ggml_quantize.q5_1, _ggml_dq[ggml.Q5_1], ggml=True, summary="llama.cpp Q5_1"),
)}
OURS = ("q8", "q6", "q5", "q4", "q3.5", "q3", "q2")
GGML = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# Other spellings accepted in configs: Inferflow's ini names and common variants
ALIASES = {"q3h": "q3.5", "q3_5": "q3.5", "q35": "q3.5", "q8_b32t2": "q8_0", "q4_b32t1a": "q4_1",
           "q5_b32t1": "q5_1"}
FULL_PRECISION = ("none", "f32", "fp32", "float", "float32", "full")

for _f in FORMATS.values():  # our ids join ggml's tables: every packed-weight path decodes them
    if _f.qtype >= BASE_ID:
        ggml.register_type(_f.qtype, _f.name, _f.block_elems, _f.block_bytes, _f.dequantize_blocks)
# CPU int4-kernel mappings (bf16 scale and zero, codes exact): q4, q3, q2 in one kernel call, q6 and q5 as the
# sum of two (low 4-bit plane + high plane), q3.5 as the sum of three (its levels split: codebook.py).
for _name, _f in (("q4", _q4), ("q3", _q3), ("q2", _q2)):
    int4pack.register(FORMATS[_name].qtype, _f.elems, _f.codes_and_affine)
for _name, _f in (("q6", _q6), ("q5", _q5)):
    int4pack.register_parts(FORMATS[_name].qtype, _f.elems, _f.int4_parts())
int4pack.register_parts(FORMATS["q3.5"].qtype, codebook.ELEMS, codebook.int4_parts())
cpu_kernels.BUFFERED.add(FORMATS["q3.5"].qtype)  # where the int4 kernel is missing or refuses the shape
triton_kernels.register(FORMATS["q4"].qtype, "q4c")  # GPU: Triton dequant-fused matmul (q8 is Q8_0: built in)


def get(name: str) -> Format:
    """The format called ``name`` (case-insensitive; aliases accepted)."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        raise InferflowError(f"unknown quantization format {name!r} (known: {', '.join(FORMATS)}; "
                             f"{', '.join(FULL_PRECISION[:1])} keeps full precision)")
    return FORMATS[key]


def by_qtype(qtype: int) -> Format | None:
    """Our format, else the llama.cpp one, holding blocks of type ``qtype``."""
    found = [f for f in FORMATS.values() if f.qtype == qtype]
    return next((f for f in found if not f.ggml), found[0] if found else None)


def quantize(t: torch.Tensor, fmt: str | Format) -> PackedTensor:
    return (fmt if isinstance(fmt, Format) else get(fmt)).quantize(t)
