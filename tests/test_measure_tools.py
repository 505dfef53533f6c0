"""Measurement tools on the CPU: ``INFERFLOW_STEP_LOG`` (one JSON line per engine step, profiling.StepLog),
tools/step_log_summary.py (a log split into runs at idle gaps, each run's steps summed by kind), and the variant
order of tools/bench_paged_decode.py."""
import json
import sys
import time
from pathlib import Path

import engine_models
from inferflow.engine import Engine, EngineConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import step_log_summary  # noqa: E402


def test_every_step_is_logged_and_summarized(tmp_path, monkeypatch, capsys):
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("INFERFLOW_STEP_LOG", str(log))
    eng = Engine(engine_models.llama(tmp_path / "m"), EngineConfig(block_size=4, num_blocks=64,
                                                                   max_num_batched_tokens=16, max_num_seqs=4))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eng.generate([[1, 2, 3, 4, 5, 6], list(range(1, 21))], params)  # 20 tokens: chunks of a 16-token budget
    eng.step_log.flush()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(steps) == eng.counters.steps
    assert sum(s["tokens"] for s in steps) == 6 + 20 + 2 * 4  # prompts, then one token per later decode
    assert all(s["ms"] > 0 and 0 <= s["decode"] <= s["rows"] for s in steps)
    kinds = {step_log_summary.kind(s) for s in steps}
    assert {"prefill", "decode"} <= kinds
    # a second run after an idle gap is reported on its own
    time.sleep(0.3)
    eng.generate([[7, 8, 9]], params)
    eng.step_log.flush()
    step_log_summary.main([str(log), "--gap", "0.2"])
    out = capsys.readouterr().out
    assert "## run 1 of 2" in out and "## run 2 of 2" in out and "decode, <= 2 rows" in out


def test_paged_decode_bench_rotates_the_variants_order():
    """tools/bench_paged_decode.py: a later place measured ~11% slower on the same kernel (H200), so each round starts
    one place further on."""
    import bench_paged_decode

    assert bench_paged_decode.rotations(["a", "b", "c"], 3) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert bench_paged_decode.rotations(["old", "new"], 2) == [["old", "new"], ["new", "old"]]
    assert bench_paged_decode.rotations([], 2) == []


def test_startup_bench_times_import_of_a_tree_and_rejects_what_it_cannot(capsys):
    import bench_startup
    import pytest

    root = Path(__file__).resolve().parent.parent
    assert bench_startup.main(["--trees", str(root), "--what", "import", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "round 1: import " in out and "| import s, median (range) |" in out and "| 1.00 |" in out
    with pytest.raises(SystemExit, match="no inferflow/ package"):
        bench_startup.main(["--trees", str(root / "docs")])
    with pytest.raises(SystemExit, match="unknown 'startup'"):
        bench_startup.main(["--trees", str(root), "--what", "startup"])
