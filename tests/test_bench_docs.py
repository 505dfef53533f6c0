"""tools/bench_docs.py, the one script that regenerates docs/benchmarks.md's generated sections: every section it
knows has its marker in the docs, and every command it would run parses with the flags its tool takes."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_docs  # noqa: E402


def argv_of(cmd: str) -> list[str]:
    return shlex.split(cmd)[2:]  # drop the interpreter and the script (or "-m module")


def test_every_section_has_its_marker_and_a_runnable_tool():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for s in bench_docs.SECTIONS:
        assert f"<!-- {s.name} -->" in text and f"<!-- /{s.name} -->" in text, s.name
        for cmd in bench_docs.commands(s, "docs/benchmarks.md", "/tmp/o"):
            script = shlex.split(cmd)[1]
            assert script == "-m" or (ROOT / script).is_file(), cmd


def test_commands_parse_with_their_tools_flags():
    from inferflow.bench.cli import parse_args

    import bench_engine

    cmds = {s.name: bench_docs.commands(s, "docs/benchmarks.md", "/tmp/o") for s in bench_docs.SECTIONS}
    bench_engine.parse_args(argv_of(cmds["bench_engine"][0]))
    assert parse_args(argv_of(cmds["bench_cpu"][0])).classes
    serving = parse_args(shlex.split(cmds["bench_serving"][1])[4:])  # after "-m inferflow.cli bench"
    assert serving.mode == "serving" and serving.doc == "docs/benchmarks.md"
    helptext = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--help"], capture_output=True,
                              text=True, cwd=ROOT).stdout
    for flag in (a for a in argv_of(cmds["bench_gpu"][0]) if a.startswith("--")):
        assert flag in helptext, flag


def test_dry_run_and_bad_names(capsys):
    assert bench_docs.main(["--dry-run", "--out", "/tmp/o"]) == 0
    out = capsys.readouterr().out
    assert all(f"[{s.name}] $ " in out for s in bench_docs.SECTIONS)
    with pytest.raises(SystemExit):
        bench_docs.main(["--only", "nope"])
