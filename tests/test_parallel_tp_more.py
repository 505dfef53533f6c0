"""Tensor parallel (2 gloo ranks) for a MoE with a shared expert, an encoder-decoder with per-head relative
position bias, and a q4 (block-quantized) model: all equal one process."""
from parallel_models import build, run_parallel


def test_tensor_parallel_2_moe_seq2seq_q4(tmp_path):
    kinds = ("moe", "t5", "q4")
    run_parallel(2, {"tensor_parallel": 2}, {k: build(k, tmp_path) for k in kinds})
