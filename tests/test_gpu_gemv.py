"""The Triton GEMV for 16-bit weights and 1-4 rows (inferflow/model/gpu_gemv.py) under TRITON_INTERPRET=1 (CPU):
against float64 for every row count, with an N tail, K tails (masked) and exact K (unmasked), split-K, bias; and
its per-shape choice against cuBLAS with the timer injected (chosen once and cached; only a clear win picks
Triton; inside a CUDA-graph capture an unseen shape takes cuBLAS without timing)."""
import pytest
from triton_modes import interpreter_in_process, keep_one_mode, run_file_in_subprocess
import torch

IN_PROCESS = interpreter_in_process()  # before anything here imports Triton
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter", "one_thread")

from inferflow.model import gpu_gemv  # noqa: E402

# the interpreter converts float32 to bfloat16 by truncation (the GPU rounds to nearest): one ulp of the output
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}


def _check(m: int, n: int, k: int, dtype: torch.dtype, cfg: gpu_gemv.Config, bias: bool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = gpu_gemv.gemv(x, w, b, cfg)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    err = (y.double() - ref).abs()
    assert (err <= ULP[dtype] * ref.abs() + 1e-4 * k ** 0.5).all(), (m, cfg, err.max())


def test_in_subprocess():
    """Run this file's tests in a fresh interpreter when Triton was imported earlier in this session."""
    run_file_in_subprocess(__file__)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", gpu_gemv.INTERP_CONFIGS, ids=["plain", "split3", "sum_each"])
def test_matches_float64_with_tails(m, cfg):
    # N = 13: a partial column block; K = 70: a masked K tail (and an uneven split)
    _check(m, 13, 70, torch.bfloat16, cfg, bias=m % 2 == 1, seed=m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # float32: the sums themselves, tightly
def test_dtypes_and_exact_k(dtype):
    for i, cfg in enumerate(gpu_gemv.INTERP_CONFIGS):
        _check(4 - i, 9, 96, dtype, cfg, bias=i != 1, seed=10 + i)  # K = 96: whole tiles, unmasked loads


def test_strided_rows():
    x = torch.randn(3, 80).to(torch.float16)[:, :64]  # rows 80 apart
    w = torch.randn(8, 64).to(torch.float16)
    y = gpu_gemv.gemv(x, w, None, gpu_gemv.INTERP_CONFIGS[0])
    torch.testing.assert_close(y.float(), (x.double() @ w.double().T).float(), atol=1e-2, rtol=2e-3)


@pytest.fixture
def fake_timer(monkeypatch):
    """The timer returns the queued timings (cuBLAS first, then one per candidate) and counts its calls."""
    calls = []

    def timer(fns, w):
        calls.append(len(fns))
        for f in fns:
            f(w)  # every candidate runs (as the real timer does)
        return list(timer.times[: len(fns)])

    timer.times = []
    monkeypatch.setattr(gpu_gemv, "timer", timer)
    monkeypatch.setattr(gpu_gemv, "_choice", {})
    monkeypatch.setattr(gpu_gemv, "ENABLED", True)
    return timer, calls


def test_choice_is_timed_once_and_cached(fake_timer, monkeypatch):
    timer, calls = fake_timer
    cands = gpu_gemv.configs(1)
    timer.times = [10.0] + [9.0, 5.0, 8.0][: len(cands)]
    x, w = torch.randn(1, 40).to(torch.bfloat16), torch.randn(12, 40).to(torch.bfloat16)
    assert gpu_gemv.linear(x, w) is None and calls == []  # outside the warm-up: cuBLAS, nothing timed
    with gpu_gemv.selecting():
        assert gpu_gemv.linear(x, w) is None  # eager calls keep cuBLAS; the choice is made for the capture
    assert calls == [1 + len(cands)]
    assert gpu_gemv._choice[(1, 12, 40, torch.bfloat16, False, x.device)] == cands[1]  # the fastest
    with gpu_gemv.selecting():
        gpu_gemv.linear(x, w)
    assert calls == [1 + len(cands)]  # cached: not timed again
    monkeypatch.setattr(gpu_gemv, "_capturing", lambda device: True)
    y = gpu_gemv.linear(x, w)  # inside a capture: the chosen Triton config
    assert y is not None
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=0.1, rtol=0.02)


class _DictStore:
    """gpu_gemv.STORE in memory and for any device (the real one keeps CUDA devices' choices on disk)."""

    def __init__(self):
        self.d = {}

    def get(self, key, device):
        from inferflow.native import choices

        return self.d.get(repr(tuple(key)), choices.MISSING)

    def put(self, key, device, value):
        self.d[repr(tuple(key))] = value


def test_choice_of_an_earlier_process_is_checked_not_timed(fake_timer, monkeypatch):
    import dataclasses

    timer, calls = fake_timer
    store = _DictStore()
    monkeypatch.setattr(gpu_gemv, "STORE", store)
    cands = gpu_gemv.configs(1)
    timer.times = [10.0] + [9.0, 5.0, 8.0][: len(cands)]
    x, w = torch.randn(1, 40).to(torch.bfloat16), torch.randn(12, 40).to(torch.bfloat16)
    key = (1, 12, 40, torch.bfloat16, False)

    def warm_up():  # a new process: nothing chosen in memory yet
        gpu_gemv._choice.clear()
        with gpu_gemv.selecting():
            gpu_gemv.linear(x, w)
        return gpu_gemv._choice[(*key, x.device)]

    assert warm_up() == cands[1] and len(calls) == 1
    assert store.d[repr(key)] == dataclasses.asdict(cands[1])
    assert warm_up() == cands[1] and len(calls) == 1  # read back, not timed again
    store.d[repr(key)] = {"block_n": 999, "block_k": 1}  # a config this module no longer has: timed again
    assert warm_up() == cands[1] and len(calls) == 2
    real = gpu_gemv.gemv
    monkeypatch.setattr(gpu_gemv, "gemv", lambda x, w, b, c: real(x, w, b, c) * (2 if c == cands[1] else 1))
    assert warm_up() != cands[1] and len(calls) == 3  # wrong on these operands now: checked, then timed again
    store.d[repr(key)] = None  # cuBLAS stored: nothing to check or time
    assert warm_up() is None and len(calls) == 3


def test_near_tie_keeps_cublas(fake_timer):
    timer, calls = fake_timer
    timer.times = [10.0] + [9.9] * len(gpu_gemv.configs(2))  # 1% faster: under MARGIN
    x, w = torch.randn(2, 40).to(torch.float16), torch.randn(12, 40).to(torch.float16)
    with gpu_gemv.selecting():
        assert gpu_gemv.linear(x, w) is None and len(calls) == 1
        assert gpu_gemv.linear(x, w) is None and len(calls) == 1  # the cuBLAS choice is cached too
    assert gpu_gemv._choice[(2, 12, 40, torch.float16, False, x.device)] is None


def test_capture_uses_cached_choice_or_cublas(fake_timer, monkeypatch):
    timer, calls = fake_timer
    monkeypatch.setattr(gpu_gemv, "_capturing", lambda device: True)
    x, w = torch.randn(1, 40).to(torch.bfloat16), torch.randn(12, 40).to(torch.bfloat16)
    assert gpu_gemv.linear(x, w) is None and calls == []  # unseen shape inside a capture: cuBLAS, nothing timed
    gpu_gemv._choice[(1, 12, 40, torch.bfloat16, False, x.device)] = gpu_gemv.INTERP_CONFIGS[0]
    assert gpu_gemv.linear(x, w) is not None and calls == []  # the choice made before the capture


def test_declines_other_inputs(fake_timer, monkeypatch):
    _, calls = fake_timer
    w = torch.randn(12, 40).to(torch.bfloat16)
    assert gpu_gemv.linear(torch.randn(5, 40).to(torch.bfloat16), w) is None  # more rows than MAX_ROWS
    assert gpu_gemv.linear(torch.randn(1, 40), w.float()) is None  # float32
    assert gpu_gemv.linear(torch.randn(1, 40).half(), w) is None  # mixed dtypes
    monkeypatch.setattr(gpu_gemv, "ENABLED", False)  # INFERFLOW_GPU_GEMV=0
    assert gpu_gemv.linear(torch.randn(1, 40).to(torch.bfloat16), w) is None
    assert calls == []


def test_failed_selection_keeps_cublas(fake_timer, monkeypatch):
    def broken(fns, w):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr(gpu_gemv, "timer", broken)
    x, w = torch.randn(1, 40).to(torch.bfloat16), torch.randn(12, 40).to(torch.bfloat16)
    with gpu_gemv.selecting():
        assert gpu_gemv.linear(x, w) is None  # never raises into the forward
    assert gpu_gemv._choice[(1, 12, 40, torch.bfloat16, False, x.device)] is None


def test_wrong_config_is_never_chosen(fake_timer, monkeypatch):
    timer, calls = fake_timer
    bad = gpu_gemv.Config(4, 32)
    real = gpu_gemv.gemv
    monkeypatch.setattr(gpu_gemv, "gemv", lambda x, w, b, c: real(x, w, b, c) * (2 if c == bad else 1))
    monkeypatch.setattr(gpu_gemv, "INTERP_CONFIGS", (bad, gpu_gemv.Config(8, 16)))
    timer.times = [10.0, 5.0]  # cuBLAS, then the one correct candidate
    x, w = torch.randn(1, 40).to(torch.float16), torch.randn(12, 40).to(torch.float16)
    pick, times = gpu_gemv.select(x, w, None)
    assert pick == gpu_gemv.Config(8, 16) and calls == [2] and times == [10.0, float("inf"), 5.0]


keep_one_mode(globals(), IN_PROCESS)
