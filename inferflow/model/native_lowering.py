"""What the native decode lowering (native_decode.py, native_attention.py) shares: lowered values, the
dtype codes of inferflow/native/step.c, and the exception that keeps a model on its op-by-op path."""
from __future__ import annotations

import torch

ATT_CHUNKS = 8  # paged_attention.h's: key chunks per sequence at most
MAX_ROWS = 16
DT = {torch.float32: 0, torch.bfloat16: 1}
CACHE_DT = {**DT, torch.float8_e4m3fn: 2, torch.int8: 3}  # K/V caches may also hold float8 e4m3 or scaled int8
GEMV_T = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def label(tag: str) -> str:
    """A step's name without its layer set ("L0.mlp.down" -> "mlp.down"): profiles sum over layers."""
    return tag.split(".", 1)[1] if tag[:1] == "L" and "." in tag else tag


class Unsupported(Exception):
    """The model (or one of its steps) has something the native program does not run."""


def name_of(m: torch.nn.Module) -> str:
    """The registered component name of a module (its class name otherwise)."""
    return getattr(m, "component_name", None) or type(m).__name__


class Val:
    """A lowered value: a buffer view [MAX_ROWS, n] (row stride ld elements) of the model's dtype."""

    __slots__ = ("t", "n", "ld")

    def __init__(self, t: torch.Tensor, n: int, ld: int):
        self.t, self.n, self.ld = t, n, ld

    def at(self, col: int) -> int:
        """The address of column ``col`` of row 0."""
        return self.t.data_ptr() + col * self.t.element_size()
