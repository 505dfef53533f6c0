"""tools/bench_parallel.py (the 2-GPU TP/PP benchmark) runs its CPU/gloo check: TP=2 and PP=2 logits and greedy
tokens (alone and through the engine, PP with micro-batches) agree with one process on the tiny shape, and
``--load-check`` compares sharding-while-loading a model folder with a whole load."""
import json
import os
import subprocess
import sys
from pathlib import Path

from parallel_models import build

ROOT = Path(__file__).resolve().parent.parent


def test_bench_parallel_tiny_cpu(tmp_path):
    folder = build("llama", tmp_path)  # --load-check: load_parallel of a real folder against a whole load
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tools" / "bench_parallel.py"), "--tiny", "--device", "cpu", "--reps", "1",
           "--placement", "tp2,pp2mb2",
           "--json-out", str(tmp_path / "r.json"), "--load-check", str(folder)]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["ok"] and set(rep["placements"]) == {"tp2", "pp2mb2"}
    for e in rep["placements"].values():
        assert e["logits_rel_diff"] <= 1e-4 and e["greedy_same"] and e["engine_greedy_same_frac"] == 1.0
        assert e["placement"]["decode_b8"] > 0 and e["base"]["prefill"] > 0
    assert "| tp2 | 2 |" in r.stdout
    assert set(rep["load_check"]) == {"tp2", "pp2mb2"}
    assert all(e["logits_rel_diff"] <= 1e-4 for e in rep["load_check"].values())
