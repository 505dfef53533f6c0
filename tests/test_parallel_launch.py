"""torchrun launch: ``python -m inferflow.parallel`` on 2 gloo ranks (TP=2) generates what one process does."""
import json
import os
import subprocess
import sys
from pathlib import Path

import inferflow
from parallel_models import build

ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_tensor_parallel(tmp_path, one_thread):
    folder = build("llama", tmp_path)
    ids = [5, 17, 42, 8, 3]
    want = inferflow.load(folder, dtype="float32").generate_ids(ids, max_new_tokens=6, stop_ids=set())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "inferflow.parallel", str(folder), "--placement", '{"tensor_parallel": 2}', "--ids",
           ",".join(map(str, ids)), "--max-new-tokens", "6", "--dtype", "float32", "--threads", "1", "--json"]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout  # rank 0 alone prints
    got = json.loads(lines[0])
    assert got == {"ids": want, "world": 2}
