"""The files tools/quant_report.py measures besides inferflow's own: the float32 base GGUF (gguf-py) and llama.cpp's
quantizations of it (llama-cpp-python's ``llama_model_quantize``, imported lazily), plus a decoder for IQ4_NL,
the type llama.cpp falls back to for k-quant tensors whose rows are not multiples of 256."""
from __future__ import annotations

from pathlib import Path

import torch

from inferflow.quant import ggml

LCP_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
              "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
              "q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}


def write_f32_gguf(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to float32 (gguf-py), metadata copied field by field."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or not f.types:
            continue
        if k == "general.file_type":
            w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llamacpp_quantize(base: Path, dst: Path, name: str) -> str | None:
    """Quantize ``base`` with llama.cpp's recipe ``name``; None when done, else why not."""
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure means: skip these rows
        return f"llama_cpp not importable ({type(e).__name__}: {e})"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, LCP_FTYPES[name])
    p.nthread = 2
    rc = _quiet(lambda: llama_cpp.llama_model_quantize(str(base).encode(), str(dst).encode(), p),
                dst.with_suffix(".log"))
    return None if rc == 0 and dst.is_file() else f"llama_model_quantize returned {rc}"


def _quiet(fn, log: Path):
    """Run ``fn`` with file descriptor 2 (where llama.cpp prints a line per tensor) sent to ``log``."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            return fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


IQ4_NL = 20
_IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 16 bytes; element j < 16 is the low nibble of byte j, element 16 + j its high nibble
    d = b[:, :2].contiguous().view(torch.float16).float()
    qs = b[:, 2:18]
    idx = torch.cat([qs & 0x0F, qs >> 4], dim=1).long()
    return d * torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32)[idx]


def register_iq4_nl() -> None:
    """llama.cpp's fallback for k-quant tensors whose rows are not multiples of 256 (checked against gguf-py)."""
    if IQ4_NL in ggml.DEQUANTIZERS:
        return
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    # a ggml type (GGML_TYPES names it) that inferflow/quant/ggml.py has no dequantizer for yet: add one here
    assert ggml.GGML_TYPES[IQ4_NL] == ("IQ4_NL", 32, 18)
    ggml.DEQUANTIZERS[IQ4_NL] = _iq4_nl
    ggml.SUPPORTED.add(IQ4_NL)
    blocks = np.random.default_rng(1).integers(0, 256, (8, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16([0.01 * (i + 1) for i in range(8)]).tobytes(), np.uint8).reshape(8, 2)
    want = dequantize(blocks.reshape(-1), GGMLQuantizationType.IQ4_NL).reshape(8, 32)
    got = _iq4_nl(torch.from_numpy(blocks)).numpy()
    assert np.array_equal(want, got), "IQ4_NL dequantizer differs from gguf-py"
