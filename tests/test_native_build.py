"""The native kernel build machinery (inferflow/native): compile on first use, cache, share torch's OpenMP."""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from inferflow import native


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_libs", {})
    return tmp_path


def test_builds_caches_and_runs(fresh):
    lib = native.load("selftest")
    assert lib is not None
    built = list((fresh / "native").glob("selftest-*.so"))
    assert len(built) == 1
    lib.inferflow_dot.restype = ctypes.c_float
    lib.inferflow_dot.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    a, b = torch.randn(4099), torch.randn(4099)
    got = lib.inferflow_dot(a.data_ptr(), b.data_ptr(), a.numel(), 2)
    assert got == pytest.approx(float(a.double() @ b.double()), rel=1e-5, abs=1e-4)
    assert native.load("selftest") is lib  # loaded once per process
    mtime = built[0].stat().st_mtime_ns
    native._libs.clear()
    assert native.load("selftest") is not None
    assert built[0].stat().st_mtime_ns == mtime  # the cached build is reused, not recompiled


def test_shares_torchs_openmp_runtime(fresh):
    lib = native.load("selftest")
    assert lib.inferflow_omp_threads(2) == 2
    # the kernels bind to torch's OpenMP runtime (one thread pool), whatever other packages loaded their own
    torch_gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not torch_gomp.exists():
        pytest.skip("this torch build bundles no libgomp.so.1")
    theirs = ctypes.cast(ctypes.CDLL(str(torch_gomp)).omp_get_num_threads, ctypes.c_void_p).value
    lib.inferflow_omp_symbol.restype = ctypes.c_void_p
    assert lib.inferflow_omp_symbol() == theirs


def test_off_or_without_a_compiler_returns_none(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    assert native.load("selftest") is None
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native.load("selftest") is None
