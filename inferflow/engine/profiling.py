"""A torch.profiler trace of a few engine steps, written as a Chrome/Perfetto JSON trace.

The bench tool sets ``engine.profiler`` itself (``inferflow bench --profile DIR``); a service (or any engine)
gets one from the environment: ``INFERFLOW_PROFILE_DIR=DIR`` (and ``INFERFLOW_PROFILE_STEPS``, default 8)
profiles the first steps that run, once. Open the file in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

ENV_DIR, ENV_STEPS = "INFERFLOW_PROFILE_DIR", "INFERFLOW_PROFILE_STEPS"


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
