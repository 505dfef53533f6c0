"""Triton picks its interpreter when it is first imported, so a session that imported it earlier cannot run kernel
tests on the CPU in-process. Such a module keeps either its kernel tests (run here) or only ``test_in_subprocess``
(which runs the same file in a fresh interpreter): never both, and never a skipped stand-in."""
import os
import subprocess
import sys
from pathlib import Path


def interpreter_in_process() -> bool:
    """Switch Triton's interpreter on and import Triton; True when that took effect in this process (Triton was not
    imported before)."""
    fresh = "triton" not in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:  # the module's importorskip then says so
        return False
    return fresh and bool(getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "interpret", False))


def run_file_in_subprocess(path: str) -> None:
    """Run the test file ``path`` in a fresh interpreter with Triton's interpreter switched on."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path],
                       env=env, capture_output=True, text=True, timeout=240, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def keep_one_mode(namespace: dict, in_process: bool) -> None:
    for name in [n for n in namespace if n.startswith("test_")]:
        if (name == "test_in_subprocess") == in_process:
            del namespace[name]
