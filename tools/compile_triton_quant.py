"""Compile every autotune config of the SoA quantized-matmul kernels (inferflow/quant/triton_gemv.py) for a GPU
target without a GPU (Triton's ahead-of-time compile + the bundled ptxas), printing registers and spills per config.

    python tools/compile_triton_quant.py [--arch 90]

Exit status 0 when every config compiles, 1 otherwise. Run WITHOUT TRITON_INTERPRET (the interpreter has one config).
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_aot import compile_one, target_from_args  # noqa: E402

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


def sig_k(sig: dict) -> int:
    """Position just after "K" in a signature dict."""
    return list(sig).index("K") + 1


def main() -> int:
    target = target_from_args(__doc__)
    if target is None:
        return 2
    from triton.runtime.jit import JITFunction

    from inferflow.quant import triton_gemv as tg
    from inferflow.quant import triton_q4 as t4
    from inferflow.quant import triton_q4_gemm as t4g

    ok = True
    div16 = [["tt.divisibility", 16]]
    for kname, (kind, qt, st) in KINDS.items():
        for act in ("bf16", "fp32"):
            if kind == 1:  # q8_0: the int8 layout's kernels
                jobs = [(tg.gemv_fma, c, {"MP": mp}) for c in tg.gemv_fma.configs for mp in (1, 2)]
                jobs += [(tg.gemv_dot, c, {"IEEE": act == "fp32"}) for c in tg.gemv_dot.configs]
                jobs += [(tg.dequant, None, {})]
            else:  # 4-bit: the interleaved layout's kernels (EVEN: K a multiple of the tile's columns)
                jobs = [(t4.gemv4, c, {"MP": mp, "EVEN": True}) for c in t4.gemv4.configs for mp in (1, 2)]
                jobs += [(t4g.gemm4, c, {"IEEE": act == "fp32", "EVEN": True}) for c in t4g.gemm4.configs]
                jobs += [(t4g.dequant4, None, {})]
            for kern, cfg, extra in jobs:
                fn = kern
                while not isinstance(fn, JITFunction):  # an Autotuner (and Heuristics) wrap one
                    fn = fn.fn
                if fn.__name__ == "dequant":
                    sig = {"q_ptr": qt, "s_ptr": st, "tab_ptr": "*fp32", "w_ptr": f"*{act}", "N": "i32", "K": "i32"}
                    const = {"KIND": kind, "BLOCK_N": 32, "BLOCK_K": 256}
                    warps, stages = 4, 1
                elif fn.__name__ == "dequant4":
                    sig = {"q_ptr": qt, "s_ptr": st, "tab_ptr": "*fp32", "w_ptr": f"*{act}", "N": "i32", "K": "i32",
                           "KW": "i32"}
                    const = {"KIND": kind, "BLOCK_N": 32, "BG": 2}
                    warps, stages = 4, 1
                else:
                    sig = {"x_ptr": f"*{act}", "q_ptr": qt, "s_ptr": st, "tab_ptr": "*fp32", "b_ptr": f"*{act}",
                           "y_ptr": f"*{act}", "M": "i32", "N": "i32", "K": "i32", "sxm": "i32", "sym": "i32"}
                    if fn.__name__ == "gemv4":  # no M; split-K partials and counters after y
                        del sig["M"]
                        at = list(sig).index("y_ptr") + 1
                        sig = {**{n: sig[n] for n in list(sig)[:at]}, "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                               **{n: sig[n] for n in list(sig)[at:]}}
                    if fn.__name__ in ("gemv4", "gemm4"):  # + KW (words per row) after K; gemm4: + MB
                        sig = {**{n: sig[n] for n in list(sig)[:sig_k(sig)]}, "KW": "i32",
                               **{n: sig[n] for n in list(sig)[sig_k(sig):]}}
                        if fn.__name__ == "gemm4":
                            sig["MB"] = "i32"
                    const = {"HAS_BIAS": True, "KIND": kind, **extra, **cfg.kwargs}
                    warps, stages = cfg.num_warps, cfg.num_stages
                for c in const:
                    sig[c] = "constexpr"
                attrs = {(fn.arg_names.index(n),): div16 for n in sig
                         if sig[n] != "constexpr" and n not in ("M", "MB")}
                desc = f"{kname:5s} {act:4s} {fn.__name__:8s} {str(const):70s} w{warps} s{stages}"
                ok &= compile_one(desc, fn, sig, const, target, attrs, lambda k: resources(k.asm["cubin"]),
                                  num_warps=warps, num_stages=stages)
    print("ALL CONFIGS COMPILE" if ok else "SOME CONFIGS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
