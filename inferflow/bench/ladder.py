"""Precision classes: the same model written as f32 / f16 / q8_0 / q4_0 GGUF files, each run by inferflow in
the matching precision (float32, bfloat16, its Q8_0 / Q4_0 kernels) and by llama.cpp on the very same file.

The f32 file is the source GGUF dequantized (gguf-py); the others are llama.cpp's own quantizations of it
(``llama_model_quantize``), so both systems read identical bytes. The files are cached in a work folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# class -> (inferflow dtype, llama.cpp ftype name, label)
CLASSES = {"f32": ("float32", None, "float32 vs f32"), "f16": ("bfloat16", "LLAMA_FTYPE_MOSTLY_F16", "bf16 vs f16"),
           "q8_0": ("float32", "LLAMA_FTYPE_MOSTLY_Q8_0", "q8 vs q8_0"),
           "q4_0": ("float32", "LLAMA_FTYPE_MOSTLY_Q4_0", "q4 vs q4_0")}
# classes whose HF peer makes sense (HF runs float weights; the quantized classes would compare unlike things)
HF_CLASSES = {"f32": "float32", "f16": "bfloat16"}


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


def llamacpp_quantize(base: Path, dst: Path, ftype: str, threads: int = 2) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, ftype)
    p.nthread = threads
    log = dst.with_suffix(".log")
    fd = os.dup(2)  # llama.cpp prints a line per tensor on fd 2
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(base).encode(), str(dst).encode(), p)
        finally:
            os.dup2(fd, 2)
            os.close(fd)
    if rc != 0 or not dst.is_file():
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}; see {log}")


def class_files(src: Path, folder: Path, classes: list[str]) -> dict[str, Path]:
    """The GGUF of each class (written once into ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / f"{src.stem}.f32.gguf"
    if not base.is_file():
        print(f"writing {base}", file=sys.stderr)
        write_f32_gguf(src, base)
    out = {}
    for c in classes:
        if c not in CLASSES:
            raise ValueError(f"unknown precision class {c!r} (one of {', '.join(CLASSES)})")
        ftype = CLASSES[c][1]
        if ftype is None:
            out[c] = base
            continue
        dst = folder / f"{src.stem}.{c}.gguf"
        if not dst.is_file():
            print(f"writing {dst}", file=sys.stderr)
            llamacpp_quantize(base, dst, ftype)
        out[c] = dst
    return out
