"""Native CPU kernels: small C files compiled on first use for the machine they run on, loaded with ctypes.

Why C and not a torch op: torch has no integer-dot or block-quantized GEMV for CPUs, and its float GEMV for a few
rows (a decode step) reads weights at about half the memory bandwidth. Each ``inferflow/native/<name>.c`` is
compiled with the system C compiler (``$CC``, else ``cc``) at ``-O3 -march=native -fopenmp`` into a cache
directory (``$INFERFLOW_CACHE_DIR``, else ``~/.cache/inferflow``), keyed by a hash of the source, the flags and
the compiler, so a rebuilt or moved machine compiles again. The library links ``libgomp.so.1`` by soname, so once
torch is imported it shares torch's OpenMP runtime and thread pool (no second pool spinning against the first).

No compiler, a failed build or ``INFERFLOW_NATIVE=0``: :func:`load` returns None, once warned, and every caller
keeps its torch path. CUDA kernels (``<name>.cu``, built with ``nvcc``) load through :mod:`inferflow.native.cuda`,
with the same cache (:func:`cached_build`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch  # noqa: F401 - loaded first: its libgomp is the one the kernels bind to

ENV = "INFERFLOW_NATIVE"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno")
_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """False when ``$INFERFLOW_NATIVE`` is 0/false/off (the torch paths run everywhere)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    root = os.environ.get("INFERFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "inferflow")
    return Path(root) / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def _build(name: str) -> Path:
    src = _HERE / f"{name}.c"
    cc = _compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    return cached_build(src, lambda out: [cc, *FLAGS, "-o", out, str(src), "-lm"], repr((FLAGS, cc, version)))


def cached_build(src: Path, command: Callable[[str], list[str]], ident: str) -> Path:
    """The shared library built from ``src`` by ``command(output_path)``, kept in :func:`cache_dir` under a hash
    of the source, every other kernel source and header next to it (a kernel may include them) and ``ident`` (the
    flags and the compiler's version)."""
    text = src.read_bytes()
    exts = ("*.cu", "*.cuh") if src.suffix == ".cu" else ("*.h", "*.c")
    deps = b"".join(h.read_bytes() for h in sorted(p for ext in exts for p in _HERE.glob(ext)) if h != src)
    key = hashlib.sha256(text + deps + ident.encode()).hexdigest()[:16]
    out = cache_dir() / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # a private temporary name, then an atomic rename: concurrent builders (test workers) never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = command(tmp)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed on {src}:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(name: str) -> ctypes.CDLL | None:
    """The compiled ``inferflow/native/<name>.c`` (built on first use), or None where native kernels are off or
    cannot be built here (a warning says why, once)."""
    if not enabled():
        return None
    with _lock:
        if name in _libs:
            return _libs[name]
        try:
            lib: ctypes.CDLL | None = ctypes.CDLL(str(_build(name)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            warnings.warn(f"inferflow: native kernels {name!r} unavailable, using torch ops instead: {e}",
                          RuntimeWarning, stacklevel=2)
            lib = None
        _libs[name] = lib
        return lib


def threads() -> int:
    """Threads a kernel call should use: torch's intra-op setting, so both share one budget."""
    return torch.get_num_threads()
