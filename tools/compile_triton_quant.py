"""Compile every autotune config of the SoA quantized-matmul kernels (inferflow/quant/triton_gemv.py) for a GPU
target without a GPU (Triton's ahead-of-time compile + the bundled ptxas), printing registers and spills per config.

    python tools/compile_triton_quant.py [--arch 90]

Exit status 0 when every config compiles, 1 otherwise. Run WITHOUT TRITON_INTERPRET (the interpreter has one config).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = {"q4c": (0, "*i32", "*i16"), "q8_0": (1, "*i8", "*fp16"), "q4_0": (2, "*i32", "*fp16")}


def resources(cubin: bytes) -> str:
    """Registers, spills (LOCAL) and shared memory of a compiled kernel, from the bundled cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", str(f)], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?SHARED:(\d+) LOCAL:(\d+)", out)
    return f"regs {m.group(1)} shared {m.group(2)} local(spill) {m.group(3)}" if m else "(no resource info)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from inferflow.quant import triton_gemv as tg

    target = GPUTarget("cuda", a.arch, 32)
    ok = True
    div16 = [["tt.divisibility", 16]]
    for kname, (kind, qt, st) in KINDS.items():
        for act in ("bf16", "fp32"):
            jobs = [(tg.gemv_fma, c, {"MP": mp}) for c in tg.gemv_fma.configs for mp in (1, 2)]
            jobs += [(tg.gemv_dot, c, {"IEEE": act == "fp32"}) for c in tg.gemv_dot.configs]
            jobs += [(tg.dequant, None, {})]
            for kern, cfg, extra in jobs:
                fn = kern if isinstance(kern, JITFunction) else kern.fn  # an Autotuner wraps one
                if fn.__name__ == "dequant":
                    sig = {"q_ptr": qt, "s_ptr": st, "tab_ptr": "*fp32", "w_ptr": f"*{act}", "N": "i32", "K": "i32"}
                    const = {"KIND": kind, "BLOCK_N": 32, "BLOCK_K": 256}
                    warps, stages = 4, 1
                else:
                    sig = {"x_ptr": f"*{act}", "q_ptr": qt, "s_ptr": st, "tab_ptr": "*fp32", "b_ptr": f"*{act}",
                           "y_ptr": f"*{act}", "M": "i32", "N": "i32", "K": "i32", "sxm": "i32", "sym": "i32"}
                    const = {"HAS_BIAS": True, "KIND": kind, **extra, **cfg.kwargs}
                    warps, stages = cfg.num_warps, cfg.num_stages
                for c in const:
                    sig[c] = "constexpr"
                attrs = {(fn.arg_names.index(n),): div16 for n in sig if sig[n] != "constexpr" and n not in ("M",)}
                desc = f"{kname:5s} {act:4s} {fn.__name__:8s} {str(const):70s} w{warps} s{stages}"
                try:
                    src = ASTSource(fn, sig, const, attrs)
                    k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
                    print(f"ok   {desc} {resources(k.asm['cubin'])}")
                except Exception as e:  # noqa: BLE001 - report every failing config
                    ok = False
                    print(f"FAIL {desc} {type(e).__name__}: {str(e)[:300]}")
    print("ALL CONFIGS COMPILE" if ok else "SOME CONFIGS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
