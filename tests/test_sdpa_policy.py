"""The cuDNN policy of inferflow/model/sdpa.py: shapes run without cuDNN (a plan build per new shape) until they
recur; a bounded number of recurring shapes may then use it; the counts stay bounded in a long-running process."""
import pytest
import torch

from inferflow.model import sdpa


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(sdpa, "_counts", {})
    monkeypatch.setattr(sdpa, "_hot", set())
    monkeypatch.setattr(sdpa, "HOT_CALLS", 3)
    monkeypatch.setattr(sdpa, "MAX_HOT", 2)
    monkeypatch.setattr(sdpa, "MAX_TRACKED", 5)


def test_recurring_shapes_get_cudnn_within_the_budget():
    assert [sdpa.allow_cudnn("a") for _ in range(4)] == [False, False, True, True]
    assert [sdpa.allow_cudnn("b") for _ in range(3)] == [False, False, True]
    assert [sdpa.allow_cudnn("c") for _ in range(5)] == [False] * 5  # the budget of 2 hot shapes is spent
    assert sdpa._hot == {"a", "b"} and "a" not in sdpa._counts


def test_counts_stay_bounded():
    for i in range(20):  # a server meeting ever new lengths
        assert not sdpa.allow_cudnn(("len", i))
        assert len(sdpa._counts) <= sdpa.MAX_TRACKED


def test_cpu_calls_are_plain_sdpa():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    torch.testing.assert_close(sdpa.sdpa(q, k, v, is_causal=True),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not sdpa._counts  # nothing counted off CUDA
