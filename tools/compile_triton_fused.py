"""Compile the fused residual-add + RMSNorm kernel (inferflow/model/fuse_add_norm.py), the q/k norm + RoPE kernel
(inferflow/model/fused_qk_rope.py), the one-launch K/V cache write (inferflow/engine/triton_kv_write.py) and the
paged decode attention kernels (inferflow/engine/triton_attention.py) for a GPU target without a GPU (Triton's
ahead-of-time compile), for the activation dtypes and a few sizes.

    python tools/compile_triton_fused.py [--arch 90]

Exit status 0 when every variant compiles. Run WITHOUT TRITON_INTERPRET.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from triton_aot import compile_one, target_from_args  # noqa: E402


def main() -> int:
    target = target_from_args(__doc__)
    if target is None:
        return 2
    import triton

    from inferflow.engine import triton_attention as ta
    from inferflow.engine import triton_kv_write as kvw
    from inferflow.model import fuse_add_norm as fan
    from inferflow.model import fused_qk_rope as fqr

    ok = True
    for dt in ("bf16", "fp16", "fp32"):
        for D in (2048, 4096, 5120):
            for in_float, offset in ((False, False), (True, True), (False, True)):
                sig = {**{k: f"*{dt}" for k in "ABWSY"}, "sa": "i32", "sb": "i32", "eps": "fp32", "offset": "fp32",
                       **{k: "constexpr" for k in ("D", "BLOCK", "WEIGHT_IN_FLOAT", "HAS_OFFSET")}}
                const = {"D": D, "BLOCK": triton.next_power_of_2(D), "WEIGHT_IN_FLOAT": in_float, "HAS_OFFSET": offset}
                ok &= compile_one(f"add_rmsnorm {dt} D={D} weight_in_float={in_float} offset={offset}",
                                  fan._add_rmsnorm, sig, const, target, num_warps=4 if D <= 4096 else 8)
    for dt, st in (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp16"), ("fp32", "fp32")):
        for row in (512, 1024, 1536):  # Hkv * D: 4 x 128, 8 x 128, 12 x 128
            sig = {"K": f"*{dt}", "V": f"*{dt}", "KC": f"*{st}", "VC": f"*{st}", "SLOTS": "*i64", "sk": "i32",
                   "sv": "i32", "ROW": "constexpr", "BLOCK": "constexpr"}
            const = {"ROW": row, "BLOCK": min(triton.next_power_of_2(row), 2048)}
            ok &= compile_one(f"kv_write {dt}->{st} row={row}", kvw._kv_write, sig, const, target)
        for hkv, d in ((8, 128), (3, 64)):  # an int8 cache: quantized in the same launch
            sig = {"K": f"*{dt}", "V": f"*{dt}", "KC": "*i8", "VC": "*i8", "KS": "*fp32", "VS": "*fp32",
                   "SLOTS": "*i64", "sk": "i32", "sv": "i32",
                   **{k: "constexpr" for k in ("HKV", "D", "BLOCK_H", "BLOCK_D")}}
            const = {"HKV": hkv, "D": d, "BLOCK_H": triton.next_power_of_2(hkv), "BLOCK_D": d}
            ok &= compile_one(f"kv_write_int8 {dt} Hkv={hkv} D={d}", kvw._kv_write_int8, sig, const, target)
    for dt in ("bf16", "fp16", "fp32"):
        for d in (64, 128, 256):
            for in_float, offset, write, quant in ((False, False, True, False), (True, True, False, False),
                                                   (False, False, True, True)):
                cdt = "i8" if quant else dt
                sig = {**{k: f"*{dt}" for k in ("QKV", "WQ", "WK", "C", "S", "QO", "KO")}, "KC": f"*{cdt}",
                       "VC": f"*{cdt}", "KS": "*fp32", "VS": "*fp32", "sx": "i32", "sc": "i32", "H": "i32",
                       "HKV": "i32", "eps": "fp32", "offset": "fp32", "SLOTS": "*i64",
                       **{k: "constexpr" for k in ("HALF", "WEIGHT_IN_FLOAT", "HAS_OFFSET", "WRITE_KV", "QUANT")}}
                const = {"HALF": d // 2, "WEIGHT_IN_FLOAT": in_float, "HAS_OFFSET": offset, "WRITE_KV": write,
                         "QUANT": quant}
                ok &= compile_one(f"qk_norm_rope {dt} D={d} weight_in_float={in_float} write_kv={write} "
                                  f"int8={quant}", fqr._qk_norm_rope, sig, const, target)
            for heads in (40, 6):  # H + Hkv: 32 + 8, 4 + 2 (padded to 64, 8)
                sig = {**{k: f"*{dt}" for k in ("QKV", "WQ", "WK", "C", "S", "QO", "KO")}, "sx": "i32", "sc": "i32",
                       "H": "i32", "HKV": "i32", "eps": "fp32", "offset": "fp32",
                       **{k: "constexpr" for k in ("HALF", "BLOCK_H", "WEIGHT_IN_FLOAT", "HAS_OFFSET")}}
                const = {"HALF": d // 2, "BLOCK_H": triton.next_power_of_2(heads), "WEIGHT_IN_FLOAT": heads == 6,
                         "HAS_OFFSET": heads == 6}
                ok &= compile_one(f"qk_norm_rope_rows {dt} D={d} heads={heads}", fqr._qk_norm_rope_rows, sig, const,
                                  target)
    for dt in ("bf16", "fp16", "fp32"):
        for d, g, ticket, cap, win, bn, fused, q8 in (
                (128, 4, True, False, False, 32, False, False), (128, 4, False, True, True, 64, False, False),
                (64, 8, True, True, False, 32, False, False), (256, 2, True, False, True, 64, False, False),
                (128, 4, True, False, False, 64, True, False), (128, 4, True, True, True, 32, True, False),
                (64, 8, False, False, False, 64, True, False), (128, 4, True, False, False, 128, False, True),
                (128, 4, True, True, True, 64, False, True)):
            ints = ("scale", "softcap", "window", "min_part", "sq_b", "sq_h", "sk_s", "sk_h", "sv_s", "sv_h", "ss_s",
                    "st_b", "sm_b", "sm_h", "sa_b", "sa_h", "sa_s", "so_b", "so_h", "sc", "eps", "offset", "H", "HKV",
                    "S")
            sig = {**{k: f"*{dt}" for k in ("Q", "Out", "WQ", "WK", "C", "S_")}, "K": "*i8" if q8 else f"*{dt}",
                   "V": "*i8" if q8 else f"*{dt}", "KS": "*fp32", "VS": "*fp32", "Tables": "*i64",
                   "Lens": "*i64", "SLOTS": "*i64", **{k: "*fp32" for k in ("Mo", "Lo", "Ao")}, "Tick": "*i32",
                   **{k: ("fp32" if k in ("scale", "softcap", "eps", "offset") else "i32") for k in ints},
                   **{k: "constexpr" for k in ("G", "BLOCK_G", "D", "BLOCK_D", "BS", "BLOCK_N", "HAS_CAP", "HAS_WIN",
                                               "PREC", "TICKET", "FUSED", "WEIGHT_IN_FLOAT", "HAS_OFFSET",
                                               "HAS_SCALE")}}
            const = {"G": g, "BLOCK_G": 16, "D": d, "BLOCK_D": d, "BS": 16, "BLOCK_N": bn, "HAS_CAP": cap,
                     "HAS_WIN": win, "PREC": "ieee" if dt == "fp32" else "tf32", "TICKET": ticket, "FUSED": fused,
                     "WEIGHT_IN_FLOAT": fused and cap, "HAS_OFFSET": fused and win, "HAS_SCALE": q8}
            ok &= compile_one(f"decode_part {dt} D={d} G={g} BLOCK_N={bn} ticket={ticket} cap={cap} win={win} "
                              f"fused={fused} int8={q8}", ta._decode_part, sig, const, target, num_warps=4)
        sig = {"Lens": "*i64", **{k: "*fp32" for k in ("Mo", "Lo", "Ao")}, "Out": f"*{dt}",
               **{k: "i32" for k in ("window", "min_part", "sm_b", "sm_h", "sa_b", "sa_h", "sa_s", "so_b", "so_h",
                                     "S")},
               **{k: "constexpr" for k in ("G", "BLOCK_G", "D", "BLOCK_D", "HAS_WIN", "BLOCK_N")}}
        const = {"G": 4, "BLOCK_G": 16, "D": 128, "BLOCK_D": 128, "HAS_WIN": False, "BLOCK_N": 64}
        ok &= compile_one(f"decode_merge {dt}", ta._decode_merge, sig, const, target, num_warps=4)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
