"""Tensor-parallel / pipeline placements against one device, on a Qwen3-8B-shaped model with random weights built on
each rank's device (no file): logits agreement, greedy agreement, prefill and decode throughput.

    # 2 GPUs (NCCL): TP=2 and PP=2, each next to the one-GPU model on the same rank (interleaved repetitions)
    torchrun --standalone --nproc-per-node 2 tools/bench_parallel.py --placement tp2,pp2 --json-out /tmp/par.json
    torchrun --standalone --nproc-per-node 2 tools/bench_parallel.py --placement pp2mb4   # 4 micro-batches per step
    torchrun --standalone --nproc-per-node 4 tools/bench_parallel.py --placement tp2pp2
    python tools/bench_parallel.py --placement single               # one GPU only (the baseline numbers alone)
    torchrun --standalone --nproc-per-node 2 tools/bench_parallel.py --tiny --device cpu   # a CPU/gloo check

Every rank builds the same seeded weights (per-tensor seeds), keeps a whole copy as the one-device baseline and
shards a second copy for the placement (``inferflow.parallel.parallelize``): one 8B bf16 copy is 16.4 GB, so a rank
holds ~16.4 GB + its shard + two KV caches. Timings alternate baseline and placement ``--reps`` times; the table
shows the median tok/s and the ratio placement / one device. Greedy agreement in bf16: a first difference at a
near-tie (the reference's top-2 logits closer than ``--tie``) is reported as such, not as a failure.
A hang is ended by ``--timeout`` (seconds, whole run; traceback to stderr, exit 1). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 unless set).
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from random_spec_model import SHAPES, build_model  # noqa: E402  (tools/: the script's folder)
# the parts (engine runs, correctness checks), their names re-exported here
from bench_parallel_checks import agreement, load_check  # noqa: E402
from bench_parallel_runs import engine_options, make_engine, parse_placement, speeds  # noqa: E402,F401


def run(a) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but no GPU is visible (use --device cpu with --tiny)")
    device = torch.device("cuda", local) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, a.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=a.timeout))
    shape = SHAPES["tiny" if a.tiny else a.shape]
    vocab = shape["vocab_size"]
    names = a.placement.split(",") if a.placement else (["single"] if world == 1 else
                                                          ["tp2pp2"] if world == 4 else [f"tp{world}", f"pp{world}"])
    from inferflow.parallel import Placement, parallelize
    from inferflow.parallel.groups import init_groups

    checked = load_check(a, names, device, dtype) if a.load_check else None
    if a.only_load_check:
        return {"world": world, "load_check": checked, "placements": {}}
    t0 = time.perf_counter()
    base = build_model(shape, device, dtype, a.seed)
    base_engine = make_engine(base, a)
    report = {"shape": "tiny" if a.tiny else a.shape, "dtype": str(dtype).removeprefix("torch."), "world": world,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "build_seconds": round(time.perf_counter() - t0, 2), "config": vars(a), "placements": {},
              "load_check": checked}
    for name in names:
        cfg = parse_placement(name)
        p = Placement.from_config(cfg)
        if p.world_size != world:
            raise RuntimeError(f"--placement {name} needs {p.world_size} ranks; launched with {world} "
                               f"(torchrun --nproc-per-node {p.world_size})")
        part = None
        if cfg is not None:
            part = build_model(shape, device, dtype, a.seed)
            parallelize(part, p, init_groups(p, device=device))
        entry: dict = {"ranks": world}
        if part is not None:
            entry.update(agreement(base, part, a, vocab))
        eng = make_engine(part, a, pipeline=p.pipeline_parallel > 1) if part is not None else None
        if eng is not None and p.micro_batches > 1:
            from inferflow.parallel.micro import use_micro_batches

            use_micro_batches(eng, p.micro_batches)
        runs: dict[str, list] = {"base": [], "placement": []}
        toks: dict[str, list] = {"base": [], "placement": []}
        for rep in range(a.reps):  # interleaved: the two see the same machine state
            runs["base"].append(speeds(base_engine, a, vocab, device, rep, toks["base"] if rep == 0 else None))
            if eng is not None:
                runs["placement"].append(speeds(eng, a, vocab, device, rep, toks["placement"] if rep == 0 else None))
        if eng is not None:  # the engine's greedy batch (decode_batch sequences) against the one-device engine's
            same = [x == y for x, y in zip(toks["base"], toks["placement"])]
            entry["engine_greedy_same_frac"] = sum(same) / max(len(same), 1)
        for who, rs in runs.items():
            if rs:
                entry[who] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        if device.type == "cuda":
            entry["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        report["placements"][name] = entry
        del part, eng
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"bench_parallel: {name} done", file=sys.stderr, flush=True)
    return report


def table(report: dict) -> str:
    lines = []
    if report.get("load_check"):
        lines += ["| placement (load_parallel of --load-check) | logits rel diff | device peak while loading / whole "
                  "model |", "|---|---|---|"]
        lines += [f"| {n} | {e['logits_rel_diff']:.2e} | {e['shard_load_peak_gib']} / {e['whole_gib']} GiB "
                  f"({e['peak_fraction']:.2f}) |" for n, e in report["load_check"].items()]
    if not report["placements"]:
        return "\n".join(lines)
    keys = next(iter(report["placements"].values()))["base"].keys()
    head = ["placement", "ranks", "logits rel diff", "argmax agree", "greedy", "engine greedy same"]
    head += [f"{k} tok/s (x 1 device)" for k in keys]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, e in report["placements"].items():
        if "placement" not in e:
            row = [name, "1", "-", "-", "-", "-"] + [f"{e['base'][k]:.1f}" for k in keys]
        else:
            greedy = "same" if e["greedy_same"] else (f"differs at {e['greedy_first_diff']}"
                                                      + (" (near-tie)" if e["greedy_near_tie"] else ""))
            row = [name, str(e["ranks"]), f"{e['logits_rel_diff']:.2e}", f"{e['argmax_agree']:.3f}", greedy,
                   f"{e['engine_greedy_same_frac']:.2f}"]
            row += [f"{e['placement'][k]:.1f} ({e['placement'][k] / e['base'][k]:.2f}x)" for k in keys]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", help="comma list of single, tpN, ppN, tpNppM (default by world size)")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (CPU checks)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--tol", type=float, default=None, help="logits relative tolerance (default 5e-2 bf16, 1e-4 f32)")
    ap.add_argument("--tie", type=float, default=0.05, help="a top-2 gap below this many logit stds is a near-tie")
    ap.add_argument("--cuda-graphs", default="off", choices=["off", "on"],
                    help="engine CUDA graphs for the one-device model and TP (never PP); default off (eager)")
    ap.add_argument("--fuse", default="auto", choices=["auto", "on", "off"], help="engine fused projections")
    ap.add_argument("--load-check", metavar="MODEL_DIR", help="also check load_parallel (sharding while loading) "
                    "of this model folder against a whole load on the device")
    ap.add_argument("--only-load-check", action="store_true", help="skip the synthetic model")
    ap.add_argument("--timeout", type=int, default=570, help="seconds for the whole run (under a 10-minute job limit)")
    ap.add_argument("--json-out", help="also write the JSON report here (rank 0)")
    a = ap.parse_args(argv)
    if a.tiny:
        a.prefill_len, a.prefill_batch = min(a.prefill_len, 64), min(a.prefill_batch, 2)
        a.decode_prompt, a.decode_batch = min(a.decode_prompt, 16), min(a.decode_batch, 8)
        a.decode_tokens, a.greedy_tokens, a.reps = min(a.decode_tokens, 8), min(a.greedy_tokens, 16), min(a.reps, 2)
    if a.tol is None:
        a.tol = 1e-4 if (a.dtype == "float32" or a.dtype is None and a.device == "cpu") else 5e-2
    faulthandler.dump_traceback_later(a.timeout, exit=True)  # a hung collective cannot hold the GPUs forever
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4 if a.device == "cpu" else 8)))
    try:
        report = run(a)
    except Exception as e:  # noqa: BLE001 - every rank says why it stopped; torchrun ends the others
        print(f"bench_parallel: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    ok = all(e.get("logits_ok", True) and (e.get("greedy_same", True) or e.get("greedy_near_tie"))
             for e in report["placements"].values()) and \
        all(e["logits_ok"] for e in (report.get("load_check") or {}).values())
    report["ok"] = ok
    if rank == 0:
        print(table(report))
        print(json.dumps(report, default=str))
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(report, indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())