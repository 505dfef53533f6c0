"""Guided (constrained) decoding: JSON / JSON-schema / choice constraints enforced token by token."""
from __future__ import annotations

from .constraint import Guide, compile_guided, is_guided, make_guide, pick_guided, prepare, validate
from .schema import SchemaError, compile_schema

__all__ = ["Guide", "SchemaError", "compile_guided", "compile_schema", "is_guided", "make_guide", "pick_guided",
           "prepare", "validate"]
