"""Start-up time of the console scripts, source trees side by side (interleaved rounds, medians).

    python tools/bench_startup.py [--trees OLD,NEW] [--what import,llm_inference,service] [--rounds 5]

Each tree is a folder holding ``inferflow/`` (and ``components/``, ``model_specs/``): this checkout by default, or
an older commit unpacked with ``git archive COMMIT inferflow components model_specs service_configs | tar -x -C
DIR``. Every measurement is a fresh process started from an empty folder with ``python -P`` and ``PYTHONPATH=TREE``
(so nothing else on the path shadows the tree):
- ``import``: ``import inferflow.cli`` (what every script, test and user pays first);
- ``llm_inference``: the default job, the shipped query file on the embedded default model, as the console script
  runs it (``llm_inference_main()``), start to exit;
- ``engine`` (not in the default list): timed inside the process, a CPU engine on the default model with the
  default 1 GiB K/V cache made, one 70-token prefill, and the cache's pages all resident;
- ``service``: ``python -m inferflow.service`` on the default model until ``GET /health`` answers 200.
The trees run one after another within each round, so a machine whose speed drifts shifts both alike.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = {
    "import": "import inferflow.cli",
    "llm_inference": "import sys; sys.argv = ['llm_inference']; from inferflow.cli import llm_inference_main; "
                     "sys.exit(llm_inference_main())",
    # timed inside the process (T=...): the default model's CPU engine with EngineConfig's default 1 GiB cache,
    # made and then running one 70-token prefill, the cache's pages all resident at the end
    "engine": "import time, inferflow; from inferflow.default_model import default_model_path; "
              "from inferflow.engine import Engine, EngineConfig, SamplingParams; "
              "from inferflow.model import hugepages; m = inferflow.load(default_model_path()); "
              "t = time.perf_counter(); e = Engine(m, EngineConfig(max_num_seqs=8, max_model_len=2048)); "
              "e.generate([list(range(10, 80))], SamplingParams(max_tokens=1)); "
              "getattr(hugepages, 'settle', lambda: None)(); print(f'T={time.perf_counter() - t}')",
}


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(tree: Path, what: str, cwd: str) -> float:
    """Seconds from the process's start to the end of ``what`` (its exit; for ``service``, the first 200 of
    /health, after which the service is stopped)."""
    t0 = time.perf_counter()
    if what in SNIPPETS:
        r = subprocess.run([sys.executable, "-P", "-c", SNIPPETS[what]], cwd=cwd, env=_env(tree),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode:
            raise SystemExit(f"{tree}: {what} failed:\n{r.stderr[-2000:]}")
        inner = [line[2:] for line in r.stdout.splitlines() if line.startswith("T=")]
        return float(inner[-1]) if inner else time.perf_counter() - t0
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-P", "-m", "inferflow.service", "--port", str(port)], cwd=cwd,
                         env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if p.poll() is not None:
                raise SystemExit(f"{tree}: the service exited with {p.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.02)
    finally:
        p.terminate()
        p.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated source trees; ratios are to the first")
    ap.add_argument("--what", default="import,llm_inference,service")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    for t in trees:
        if not (t / "inferflow" / "__init__.py").is_file():
            raise SystemExit(f"--trees: {t} holds no inferflow/ package")
    whats = args.what.split(",")
    for w in whats:
        if w not in (*SNIPPETS, "service"):
            raise SystemExit(f"--what: unknown {w!r} (import, llm_inference, service, engine)")
    times: dict[tuple[str, Path], list[float]] = {(w, t): [] for w in whats for t in trees}
    with tempfile.TemporaryDirectory() as cwd:
        for w in whats:
            for t in trees:  # page cache and bytecode (__pycache__) of every tree in place first
                run_once(t, w, cwd)
        for r in range(args.rounds):
            for w in whats:
                for t in trees:
                    times[w, t].append(run_once(t, w, cwd))
            print(f"round {r + 1}: " + ", ".join(f"{w} {' / '.join(f'{times[w, t][-1]:.2f}' for t in trees)}"
                                                 for w in whats), flush=True)
    print(f"\n| measurement | {' | '.join(str(t) for t in trees)} | ratio to the first |")
    print(f"|---|{'---:|' * len(trees)}---:|")
    for w in whats:
        med = [statistics.median(times[w, t]) for t in trees]
        span = [f"{statistics.median(times[w, t]):.2f} ({min(times[w, t]):.2f}-{max(times[w, t]):.2f})"
                for t in trees]
        print(f"| {w} s, median (range) | {' | '.join(span)} | "
              f"{' / '.join(f'{m / med[0]:.2f}' for m in med)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
