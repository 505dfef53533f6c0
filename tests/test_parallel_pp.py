"""Layer pipeline (2 gloo ranks): logits, KV-cache logits and greedy tokens equal one process."""
from parallel_models import build, run_parallel


def test_pipeline_2(tmp_path):
    kinds = ("llama", "gpt2", "moe", "t5")
    run_parallel(2, {"pipeline_stages": [[0, 0], [1, 1]]}, {k: build(k, tmp_path) for k in kinds})

