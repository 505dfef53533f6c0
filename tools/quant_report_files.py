"""The files tools/quant_report.py measures besides inferflow's own: the float32 base GGUF (gguf-py) and llama.cpp's
quantizations of it (llama-cpp-python's ``llama_model_quantize``, imported lazily). IQ4_NL, the type llama.cpp
falls back to for k-quant tensors whose rows are not multiples of 256, is decoded by inferflow/quant/ggml.py."""
from __future__ import annotations

from pathlib import Path

from inferflow.bench.ladder import write_f32_gguf  # noqa: F401 - shared with `inferflow bench`
from inferflow.quant import ggml

LCP_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
              "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
              "q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}


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


_iq4_nl = ggml._iq4_nl  # re-exported: tests/test_perplexity.py checks it against gguf-py


def register_iq4_nl() -> None:
    """IQ4_NL (llama.cpp's fallback for k-quant tensors whose rows are not multiples of 256) now lives in
    inferflow/quant/ggml.py (tests/test_ggml_dequant.py checks it bit-exact against gguf-py); kept as a no-op check."""
    assert ggml.IQ4_NL in ggml.SUPPORTED
