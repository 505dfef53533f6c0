"""TP=2 x PP=2 (4 gloo ranks): tensor-parallel groups inside pipeline stages equal one process."""
from parallel_models import build, run_parallel


def test_hybrid_tp2_pp2(tmp_path):
    run_parallel(4, "0&1;2&3", {k: build(k, tmp_path) for k in ("llama", "t5")})
