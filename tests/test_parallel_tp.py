"""Tensor parallel (2 gloo ranks): sharded logits, KV-cache logits, greedy tokens (alone and through the engine)
equal one process. GQA with split and with replicated KV heads, fused qkv with learned positions."""
from parallel_models import build, run_parallel


def test_tensor_parallel_2(tmp_path):
    kinds = ("llama", "llama_mqa", "gpt2")
    run_parallel(2, {"tensor_parallel": 2}, {k: build(k, tmp_path) for k in kinds})
