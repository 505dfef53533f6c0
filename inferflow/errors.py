"""inferflow's own error types: every refusal names the file, the key or field, and what was expected."""
from __future__ import annotations


class InferflowError(Exception):
    """Base class of every error inferflow raises on bad input."""


class SpecError(InferflowError):
    """A model spec is malformed or does not fit the weights it is applied to."""

    def __init__(self, file: str | None, key: str | None, problem: str):
        self.file, self.key, self.problem = file, key, problem
        where = ": ".join(p for p in (file, key) if p)
        super().__init__(f"{where}: {problem}" if where else problem)


class WeightError(SpecError):
    """A tensor named by a spec is missing, unused, or of the wrong shape."""


class FormatError(InferflowError):
    """A model file is malformed, truncated or of an unsupported kind."""

    def __init__(self, file: str | None, problem: str):
        self.file, self.problem = file, problem
        super().__init__(f"{file}: {problem}" if file else problem)


class UnsafeFileError(FormatError):
    """A file asked for something that loading must never do (import, call, execute)."""
