"""Compile the fused residual-add + RMSNorm kernel (inferflow/model/fuse_add_norm.py), the q/k norm + RoPE kernel
(inferflow/model/fused_qk_rope.py) and the one-launch K/V cache write (inferflow/engine/triton_kv_write.py) for
a GPU target without a GPU (Triton's ahead-of-time compile), for the activation dtypes and a few sizes.

    python tools/compile_triton_fused.py [--arch 90]

Exit status 0 when every variant compiles. Run WITHOUT TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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

    from inferflow.engine import triton_kv_write as kvw
    from inferflow.model import fuse_add_norm as fan
    from inferflow.model import fused_qk_rope as fqr

    target, ok = GPUTarget("cuda", a.arch, 32), True
    for dt in ("bf16", "fp16", "fp32"):
        for D in (2048, 4096, 5120):
            for in_float, offset in ((False, False), (True, True), (False, True)):
                sig = {**{k: f"*{dt}" for k in "ABWSY"}, "sa": "i32", "sb": "i32", "eps": "fp32", "offset": "fp32",
                       **{k: "constexpr" for k in ("D", "BLOCK", "WEIGHT_IN_FLOAT", "HAS_OFFSET")}}
                const = {"D": D, "BLOCK": triton.next_power_of_2(D), "WEIGHT_IN_FLOAT": in_float, "HAS_OFFSET": offset}
                try:
                    k = triton.compile(ASTSource(fn=fan._add_rmsnorm, signature=sig, constexprs=const), target=target,
                                       options={"num_warps": 4 if D <= 4096 else 8})
                    print(f"{dt} D={D} weight_in_float={in_float} offset={offset}: ok ({len(k.asm['cubin'])} B)")
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print(f"{dt} D={D} weight_in_float={in_float} offset={offset}: FAILED {e}")
    for dt, st in (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp16"), ("fp32", "fp32")):
        for row in (512, 1024, 1536):  # Hkv * D: 4 x 128, 8 x 128, 12 x 128
            sig = {"K": f"*{dt}", "V": f"*{dt}", "KC": f"*{st}", "VC": f"*{st}", "SLOTS": "*i64", "sk": "i32",
                   "sv": "i32", "ROW": "constexpr", "BLOCK": "constexpr"}
            const = {"ROW": row, "BLOCK": min(triton.next_power_of_2(row), 2048)}
            try:
                k = triton.compile(ASTSource(fn=kvw._kv_write, signature=sig, constexprs=const), target=target)
                print(f"kv_write {dt}->{st} row={row}: ok ({len(k.asm['cubin'])} B)")
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"kv_write {dt}->{st} row={row}: FAILED {e}")
    for dt in ("bf16", "fp16", "fp32"):
        for d in (64, 128, 256):
            for in_float, offset in ((False, False), (True, True)):
                sig = {**{k: f"*{dt}" for k in ("QKV", "WQ", "WK", "C", "S", "QO", "KO")}, "sx": "i32", "sc": "i32",
                       "H": "i32", "HKV": "i32", "eps": "fp32", "offset": "fp32",
                       **{k: "constexpr" for k in ("HALF", "WEIGHT_IN_FLOAT", "HAS_OFFSET")}}
                const = {"HALF": d // 2, "WEIGHT_IN_FLOAT": in_float, "HAS_OFFSET": offset}
                try:
                    k = triton.compile(ASTSource(fn=fqr._qk_norm_rope, signature=sig, constexprs=const), target=target)
                    print(f"qk_norm_rope {dt} D={d} weight_in_float={in_float}: ok ({len(k.asm['cubin'])} B)")
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print(f"qk_norm_rope {dt} D={d} weight_in_float={in_float}: FAILED {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
