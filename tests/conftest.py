import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Triton's kernel tests switch its interpreter on when they are imported (Triton reads the switch when a kernel is
# defined); at run time the switch must reach only those tests, or the others would send CPU paths through it.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")


import pytest  # noqa: E402


def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def one_thread():
    """Small kernels (tiny models, per-layer dequantization): on a busy shared CPU, multi-threaded kernels wait on
    each other at every op (seen: 2 s -> 28 s); one thread keeps runtimes small and steady."""
    yield from _threads(1)


@pytest.fixture
def two_threads():
    yield from _threads(2)


def pytest_collection_finish(session):
    if _TRITON_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _TRITON_INTERPRET
    # build the native CPU kernels once, up front (~10 s on a fresh machine): a first-use compile inside a test
    # with a time limit (the fuzzers' alarms) would otherwise be charged to that test
    from inferflow import native

    for src in sorted(Path(native.__file__).parent.glob("*.c")):
        native.load(src.stem)


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run on CPU tensors (its interpreter) for this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def no_native(monkeypatch):
    """Native CPU kernels off ($INFERFLOW_NATIVE=0) for this test: it covers the torch paths that run where the
    kernels cannot be built (quant/cpu_kernels.py falls back to them)."""
    from inferflow.native import float_linear

    monkeypatch.setenv("INFERFLOW_NATIVE", "0")
    float_linear.reset()  # it binds the library once: re-read the switch now and again after the test
    yield
    float_linear.reset()


@pytest.fixture
def torch_ops(monkeypatch):
    """The torch paths of a CPU decode step's attention and RoPE ($INFERFLOW_NATIVE_OPS=0): for tests that look at
    those paths' internal calls (the native ops replace them; tests/test_native_ops.py covers those)."""
    from inferflow.native import cpu_ops

    monkeypatch.setenv("INFERFLOW_NATIVE_OPS", "0")
    cpu_ops.refresh()
    yield
    monkeypatch.delenv("INFERFLOW_NATIVE_OPS")
    cpu_ops.refresh()
