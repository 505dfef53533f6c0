"""tests/data/hostile/: every file is refused with inferflow's error type and a message naming the file and the
problem, and loading them has no side effect (the pickles' payloads would create a canary file in the current
directory, set a canary environment variable or import a canary module; os.system / subprocess are also replaced
by tripwires while loading). The corpus is exactly what tools/make_hostile_corpus.py writes."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferflow import errors
from inferflow.loaders import open_file
from inferflow.loaders.safetensors import SafetensorsFile

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "hostile"
MANIFEST = json.loads((CORPUS / "MANIFEST.json").read_text())
CANARY, CANARY_ENV = "inferflow_hostile_canary", "INFERFLOW_HOSTILE_CANARY"


def _maker():
    spec = importlib.util.spec_from_file_location("make_hostile_corpus", ROOT / "tools" / "make_hostile_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_completely(path: Path) -> None:
    if path.suffix == ".safetensors":  # open_file would read the whole folder
        f = SafetensorsFile(str(path))
        for name in f.infos:
            f.get(name)
        return
    src = open_file(path)
    for name in src.names():
        src.get(name)


class Tripwire(Exception):
    pass


def _trip(*args, **kwargs):
    raise Tripwire(f"a process or import was attempted: {args!r:.200}")


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """An empty working directory, and the ways to run a program or import a module replaced by tripwires."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CANARY_ENV, raising=False)
    for name in ("system", "popen", "execv", "execve", "execvp", "spawnv", "posix_spawn", "fork"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _trip)
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput"):
        monkeypatch.setattr(subprocess, name, _trip)
    monkeypatch.setattr(importlib, "import_module", _trip)
    return tmp_path


def test_manifest_lists_every_file():
    assert sorted(MANIFEST) == sorted(p.name for p in CORPUS.iterdir() if p.name != "MANIFEST.json")
    assert sum(p.stat().st_size for p in CORPUS.iterdir()) < 500_000


def test_every_hostile_file_refused_without_side_effects(sandbox):
    for warm in ("pickle_global_reduce_os_system.pt", "gguf_unknown_type.gguf", "llama2c_huge_dims.bin"):
        with pytest.raises(errors.InferflowError):  # lazy imports of the readers happen before the snapshot
            load_completely(CORPUS / warm)
    modules = set(sys.modules)
    wrong = []
    for name, (error, phrase) in sorted(MANIFEST.items()):
        try:
            load_completely(CORPUS / name)
            wrong.append(f"{name}: loaded")
            continue
        except errors.InferflowError as e:
            msg = str(e)
            if type(e).__name__ != error or phrase not in msg or name not in msg:
                wrong.append(f"{name}: expected {error} with {phrase!r}, got {type(e).__name__}: {msg[:200]}")
        except Exception as e:  # noqa: BLE001 - a tripwire or any foreign error is a failure
            wrong.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    assert not wrong, "\n".join(wrong)
    assert not list(sandbox.iterdir()), "a payload wrote to the working directory"
    assert CANARY_ENV not in os.environ
    new = {m for m in set(sys.modules) - modules if not m.startswith("inferflow")}
    assert CANARY not in sys.modules and not new, f"modules imported while loading: {sorted(new)[:10]}"


def test_corpus_is_reproducible():
    built = _maker().build()
    on_disk = {p.name: p.read_bytes() for p in CORPUS.iterdir()}
    assert sorted(built) == sorted(on_disk)
    changed = [n for n in built if built[n] != on_disk[n]]
    assert not changed, f"regenerate with: PYTHONPATH=. python tools/make_hostile_corpus.py ({changed[:5]})"


def test_payloads_are_real_for_pythons_unpickler(tmp_path):
    """The same bytes run their code under pickle.load: the corpus tests something."""
    script = ("import pickle, sys, os\nclass U(pickle.Unpickler):\n    def persistent_load(self, pid): return None\n"
              "for p in sys.argv[1:]:\n    try: U(open(p, 'rb')).load()\n    except Exception: pass\n"
              f"print(os.environ.get({CANARY_ENV!r}))\n")
    names = ["global_reduce_os_system", "stack_global_eval", "inst_exec", "getattr_chain", "proto0_eval"]
    env = {k: v for k, v in os.environ.items() if k != CANARY_ENV}
    out = subprocess.run([sys.executable, "-c", script, *[str(CORPUS / f"pickle_{n}.raw.pkl") for n in names]],
                         cwd=tmp_path, env=env, timeout=60, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"  # eval / proto0 eval set the variable
    import time

    for _ in range(50):  # os.system's touch may finish after the interpreter
        if (tmp_path / CANARY).exists():
            break
        time.sleep(0.1)
    assert (tmp_path / CANARY).exists()
