"""Sharding while loading (``load_parallel``): weights load as views of the memory-mapped safetensors file and each
of 2 gloo ranks materialises only its own slices (about 1/TP of the model's bytes); logits equal one process."""
from parallel_models import build, run_load


def test_tensor_parallel_shards_while_loading(tmp_path):
    run_load(2, {"tensor_parallel": 2}, build("llama", tmp_path))
