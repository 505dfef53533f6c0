"""Micro-batched pipeline (2 gloo stages): an engine step cut into overlapping micro-batches generates the same
greedy tokens as one process; the ``micro_batches`` placement key does it for the replicated (served) engine."""
from inferflow.parallel.micro import split_balanced
from parallel_models import build, run_micro, run_replicated


def test_split_balanced():
    assert split_balanced([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert split_balanced([8, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert split_balanced([1, 1], 5) == [(0, 1), (1, 2)]
    assert split_balanced([3, 3, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_balanced([5], 3) == [(0, 1)]


def test_pipeline_micro_batches_engine(tmp_path):
    run_micro(2, "0;1", {k: build(k, tmp_path) for k in ("llama", "t5")})


def test_replicated_engine_micro_batches(tmp_path):
    run_replicated(2, {"pipeline_parallel": 2, "micro_batches": 2}, build("gpt2", tmp_path))
