"""Ahead-of-time Triton compiles for a GPU target on a machine without one (tools/compile_triton_*.py): the shared
command line and one compile-and-report step."""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable


def target_from_args(doc: str) -> Any | None:
    """Parse ``--arch`` and return Triton's GPUTarget for it; None (after saying why) under TRITON_INTERPRET, where
    kernels are not compiled."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET")
        return None
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", a.arch, 32)


def compile_one(label: str, fn: Any, sig: dict, const: dict, target: Any, attrs: dict | None = None,
                describe: Callable[[Any], str] = lambda k: f"({len(k.asm['cubin'])} B)", **options: Any) -> bool:
    """Compile ``fn`` for ``target``; print ``label`` with ok (and ``describe(kernel)``) or the failure."""
    import triton
    from triton.compiler import ASTSource

    try:
        src = ASTSource(fn, sig, const, attrs) if attrs else ASTSource(fn=fn, signature=sig, constexprs=const)
        k = triton.compile(src, target=target, options=options or None)
    except Exception as e:  # noqa: BLE001 - report every failing variant
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:300]}")
        return False
    print(f"ok   {label} {describe(k)}")
    return True
