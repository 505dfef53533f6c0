"""A tqdm-style progress bar on stderr for weight loading (no dependency; silent when stderr is not a terminal
unless forced, so logs and tests are not filled with carriage returns)."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LoadBar:
    """``progress(done, total)`` callback drawing ``desc: 42%|████▏     | 42/100 [00:01<00:01]``."""

    def __init__(self, desc: str, stream: TextIO | None = None, width: int = 24, force: bool = False):
        self.desc, self.stream, self.width = desc, stream or sys.stderr, width
        self.enabled = force or getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.05 and done < total):
            return
        self.last = now
        frac = done / total if total else 1.0
        full = int(frac * self.width)
        bar = "█" * full + " " * (self.width - full)
        elapsed = now - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self.stream.write(f"\r{self.desc}: {frac:4.0%}|{bar}| {done}/{total} [{_clock(elapsed)}<{_clock(eta)}]")
        self.stream.flush()
        self.drawn = True

    def __enter__(self) -> "LoadBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m:02d}:{s:02d}"
