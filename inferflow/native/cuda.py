"""CUDA kernels: ``inferflow/native/<name>.cu`` compiled with ``nvcc`` on first use, for the GPU it runs on, and
loaded with ctypes (the CPU kernels' cache and atomic build, :func:`inferflow.native.cached_build`).

Why not a torch extension: a plain shared library builds in seconds without torch's headers, and its launches go
to the stream torch hands it (CUDA graphs capture them like torch's own). The library links the CUDA runtime
statically; both runtimes use the device's primary context, so pointers and streams are shared.

No ``nvcc`` (``$NVCC``, else ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on PATH), a failed build,
``INFERFLOW_NATIVE=0`` or ``INFERFLOW_CUDA_KERNELS=0``: :func:`load` returns None, once warned where a build failed,
and callers keep their Triton or torch path.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from . import _HERE, cached_build, enabled as native_enabled

ENV = "INFERFLOW_CUDA_KERNELS"
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
_lock = threading.Lock()
_libs: dict[tuple[str, int, int], ctypes.CDLL | None] = {}


def enabled() -> bool:
    """False when ``$INFERFLOW_CUDA_KERNELS`` (or ``$INFERFLOW_NATIVE``) is 0/false/off."""
    off = os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no")
    return native_enabled() and not off


def nvcc() -> str | None:
    """The CUDA compiler to use, or None."""
    explicit = os.environ.get("NVCC")
    if explicit:
        return shutil.which(explicit)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


# sources with instructions of one architecture only: built for its ``sm_XYa`` target (Hopper's wgmma is sm_90a)
ARCH_SPECIFIC = {"q4_wgmma": (9, 0)}


def build_command(compiler: str, src: Path, arch: tuple[int, int], out: str) -> list[str]:
    """nvcc's command line: machine code for exactly this GPU (``sm_XY``: Hopper's own instructions included;
    ``sm_XYa`` for the :data:`ARCH_SPECIFIC` sources)."""
    sm = f"{arch[0]}{arch[1]}" + ("a" if ARCH_SPECIFIC.get(src.stem) == tuple(arch) else "")
    return [compiler, *FLAGS, f"-gencode=arch=compute_{sm},code=sm_{sm}", "-o", out, str(src)]


def load(name: str, device: torch.device) -> ctypes.CDLL | None:
    """The compiled ``inferflow/native/<name>.cu`` for ``device``'s architecture, or None (see the module doc)."""
    if not enabled() or device.type != "cuda" or not torch.cuda.is_available():
        return None
    arch = torch.cuda.get_device_capability(device)
    if name in ARCH_SPECIFIC and ARCH_SPECIFIC[name] != tuple(arch):
        return None
    key = (name, *arch)
    with _lock:
        if key in _libs:
            return _libs[key]
        lib: ctypes.CDLL | None = None
        compiler = nvcc()
        if compiler is not None:
            try:
                version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                         timeout=60).stdout
                src = _HERE / f"{name}.cu"
                path = cached_build(src, lambda out: build_command(compiler, src, arch, out),
                                    repr((FLAGS, arch, compiler, version)))
                lib = ctypes.CDLL(str(path))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"inferflow: CUDA kernels {name!r} unavailable, using Triton instead: {e}",
                              RuntimeWarning, stacklevel=2)
        _libs[key] = lib
        return lib


def bind(lib: ctypes.CDLL, name: str, argtypes: list, configs: int) -> ctypes.CDLL:
    """Type a kernel library's entry points once: ``<name>`` (returns a CUDA error code), ``<name>_error`` (its
    message) and ``<name>_configs`` (the launch configs it was built with, checked against the caller's
    ``configs``)."""
    if getattr(lib, f"_bound_{name}", False):
        return lib
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    err = getattr(lib, f"{name}_error")
    err.argtypes, err.restype = [ctypes.c_int], ctypes.c_char_p
    n = getattr(lib, f"{name}_configs")
    n.restype = ctypes.c_int
    if n() != configs:
        raise RuntimeError(f"{name}.cu has {n()} launch configs, its Python side {configs}")
    setattr(lib, f"_bound_{name}", True)
    return lib


def check(lib: ctypes.CDLL, name: str, code: int) -> None:
    """Raise the launch error ``code`` of ``<name>`` (0: none) with CUDA's message."""
    if code:
        raise RuntimeError(f"{name} launch failed: {getattr(lib, f'{name}_error')(code).decode()}")
