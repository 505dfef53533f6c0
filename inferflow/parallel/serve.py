"""Serve one model on a parallel placement: every rank loads its shard, rank 0 runs the HTTP front and the
scheduler, the others replay rank 0's step plans (inferflow/parallel/replicated.py)::

    torchrun --standalone --nproc-per-node 2 -m inferflow.parallel.serve service.yaml --placement "0&1"

Multi-node: torchrun's ``--nnodes/--node-rank/--master-addr/--master-port``. One model per parallel service
(several engines would interleave their collectives in a different order on each rank).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

import torch.distributed as dist

from ..errors import InferflowError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inferflow.parallel.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="service config file (one model)")
    ap.add_argument("--placement", required=True, help="devices string ('0&1', '0;1') or JSON of the explicit form")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    args = ap.parse_args(argv)
    try:
        import torch

        from ..service.config import load_service_config
        from ..service.served_model import ServedModel, load_model
        from .apply import parallelize
        from .groups import init_groups
        from .placement import Placement
        from .replicated import ReplicatedEngine

        if args.threads:
            torch.set_num_threads(args.threads)
        config = load_service_config(args.config)
        if len(config.models) != 1:
            raise InferflowError(f"placement: a parallel service serves one model, the config names "
                                 f"{len(config.models)}")
        cfg = config.models[0]
        p = Placement.from_config(json.loads(args.placement) if args.placement.lstrip().startswith("{")
                                  else args.placement)
        g = init_groups(p)
        if g.device.type == "cuda":
            cfg.device = str(g.device)
        model = parallelize(load_model(cfg), p, g)
        engine = ReplicatedEngine(model, cfg.engine)
        if g.rank != 0:
            engine.follow()
            return 0
        import uvicorn

        from ..service.app import create_app

        config.host = args.host or config.host
        config.port = args.port if args.port is not None else config.port
        logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
        app = create_app(config, models={cfg.name: ServedModel(cfg, model, engine)})
        print(f"inferflow.parallel.serve: serving {cfg.name} on {g.world} ranks at http://{config.host}:"
              f"{config.port}", file=sys.stderr, flush=True)
        try:
            uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
        finally:
            engine.stop_followers()
    except InferflowError as e:
        print(f"inferflow.parallel.serve: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
