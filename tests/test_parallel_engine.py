"""Rank 0 owns the requests, the other rank replays its step plans (ReplicatedEngine): TP=2 and PP=2 greedy
generation equals one process; sampling and an abort keep the ranks in step."""
from parallel_models import build, run_replicated


def test_replicated_engine_tp2(tmp_path):
    run_replicated(2, {"tensor_parallel": 2}, build("llama", tmp_path))


def test_replicated_engine_pp2(tmp_path):
    run_replicated(2, "0;1", build("gpt2", tmp_path))


def test_replicated_engine_embeddings_tp2(tmp_path):
    """Embedding and fill-mask batches (an encoder-only model at TP=2) travel in rank 0's step plans too."""
    from parallel_models import run_replicated_encoder

    run_replicated_encoder(2, {"tensor_parallel": 2}, build("bert", tmp_path))
