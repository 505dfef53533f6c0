"""A torch.profiler trace of a few engine steps, written as a Chrome/Perfetto JSON trace.

The bench tool sets ``engine.profiler`` itself (``inferflow bench --profile DIR``); a service (or any engine)
gets one from the environment: ``INFERFLOW_PROFILE_DIR=DIR`` (and ``INFERFLOW_PROFILE_STEPS``, default 8)
profiles the first steps that run, once. Open the file in https://ui.perfetto.dev or chrome://tracing.

``INFERFLOW_STEP_LOG=FILE`` appends one JSON line per engine step (its wall time, tokens, scheduled rows and decode
rows), so that a serving run's time can be split between pure-decode, mixed and prefill steps
(``tools/step_log_summary.py``) without the profiler's overhead.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

ENV_DIR, ENV_STEPS, ENV_STEP_LOG = "INFERFLOW_PROFILE_DIR", "INFERFLOW_PROFILE_STEPS", "INFERFLOW_STEP_LOG"


class StepProfiler:
    """Profiles ``steps`` consecutive engine steps; ``tick()`` is called at the start of every step."""

    def __init__(self, folder: str | os.PathLike, steps: int = 8, name: str = "engine"):
        self.folder, self.steps, self.name = Path(folder), max(1, int(steps)), name
        self.seen = 0
        self.prof: torch.profiler.profile | None = None
        self.path: Path | None = None   # the trace, once written

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        folder = os.environ.get(ENV_DIR)
        return cls(folder, int(os.environ.get(ENV_STEPS, "8"))) if folder else None

    @property
    def done(self) -> bool:
        return self.path is not None

    def tick(self) -> None:
        if self.done:
            return
        if self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, with_stack=False)
            self.prof.__enter__()
        elif self.seen >= self.steps:
            self.finish()
            return
        self.seen += 1

    def finish(self) -> Path | None:
        """Stop (if running) and write the trace; returns its path."""
        if self.prof is None or self.done:
            return self.path
        self.prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.name}-{os.getpid()}-{int(time.time())}.trace.json"
        self.prof.export_chrome_trace(str(path))
        self.path = path
        return path


class StepLog:
    """One JSON line per engine step, appended to a file and flushed at exit (or every 256 steps)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.lines: list[str] = []

    @classmethod
    def from_env(cls) -> "StepLog | None":
        path = os.environ.get(ENV_STEP_LOG)
        return cls(path) if path else None

    def record(self, t0: float, seconds: float, tokens: int, rows: int, decode: int) -> None:
        """A step that started at ``t0`` (perf_counter) and computed ``tokens`` for ``rows`` sequences, ``decode`` of
        them one-token decodes."""
        self.lines.append(json.dumps({"t": round(t0, 6), "ms": round(seconds * 1e3, 3), "tokens": tokens,
                                      "rows": rows, "decode": decode}))
        if len(self.lines) >= 256:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with self.path.open("a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines = []
