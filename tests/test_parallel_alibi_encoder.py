"""Tensor parallel and pipeline (2 gloo ranks) for ALiBi attention and an encoder-only MLM model."""
from parallel_models import build, run_parallel


def test_tensor_parallel_2(tmp_path):
    run_parallel(2, {"tensor_parallel": 2}, {k: build(k, tmp_path) for k in ("bloom", "bert")})


def test_pipeline_2(tmp_path):
    run_parallel(2, "0;1", {"bert": build("bert", tmp_path)})
