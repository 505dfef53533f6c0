"""Run one generation on a parallel placement, one process per rank (a launch check and a usage example):

    torchrun --standalone --nproc-per-node 2 -m inferflow.parallel MODEL --placement "0&1" --prompt "Hello"
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port 29500 --nproc-per-node 4 \\
        -m inferflow.parallel MODEL --placement "0&1&2&3;4&5&6&7" --prompt "Hello"

Every rank runs the same calls; rank 0 prints the result (as JSON with --json).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from .apply import load_parallel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inferflow.parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--placement", required=True, help="devices string ('0&1;2&3', 'cpu') or JSON of the explicit form")
    ap.add_argument("--prompt", help="text prompt (needs a tokenizer)")
    ap.add_argument("--ids", help="comma-separated prompt token ids")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    placement = json.loads(a.placement) if a.placement.lstrip().startswith("{") else a.placement
    model = load_parallel(a.model, placement, dtype=a.dtype)
    ids = [int(t) for t in a.ids.split(",")] if a.ids else model.tokenizer.encode(a.prompt or "")
    out = model.generate_ids(ids, max_new_tokens=a.max_new_tokens, stop_ids=set() if a.ids else None)
    if model.parallel.rank == 0:
        if a.json:
            print(json.dumps({"ids": out, "world": model.parallel.world}))
        else:
            print(model.tokenizer.decode(out) if model.tokenizer is not None and not a.ids else out)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
