"""Serve one model on a parallel placement: every rank loads its shard, rank 0 runs the HTTP front and the
scheduler, the others replay rank 0's step plans (inferflow/parallel/replicated.py).

The service does this by itself when a model's ``placement`` needs several ranks (``inferflow-service
service.yaml``: it spawns its ranks on this host, or ``torchrun --nproc-per-node N -m inferflow.service
service.yaml`` starts them). This module is the older spelling with the placement on the command line::

    torchrun --standalone --nproc-per-node 2 -m inferflow.parallel.serve service.yaml --placement "0&1"

Multi-node: torchrun's ``--nnodes/--node-rank/--master-addr/--master-port``. One model per parallel service
(several engines would interleave their collectives in a different order on each rank).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..errors import InferflowError


def serve_parallel(config: Any, module: str = "inferflow.service", argv: list[str] | None = None) -> int:
    """Serve ``config`` (one model, its ``placement`` set) on this rank; ranks are spawned as ``python -m module
    argv`` when no launcher started them. Returns the exit status."""
    from . import launch

    if len(config.models) != 1:
        raise InferflowError(f"placement: a parallel service serves one model, the config names "
                             f"{len(config.models)}")
    cfg = config.models[0]
    launch.spawn_ranks(launch.world_of(cfg), module, list(sys.argv[1:] if argv is None else argv))
    try:
        model, engine = launch.load_replicated(cfg)
        if engine.rank != 0:
            engine.follow()
            return 0
        import uvicorn

        from ..service.app import create_app
        from ..service.served_model import ServedModel

        app = create_app(config, models={cfg.name: ServedModel(cfg, model, engine)})
        print(f"inferflow-service: serving {cfg.name} on {launch.world_of(cfg)} ranks at http://{config.host}:"
              f"{config.port}", file=sys.stderr, flush=True)
        try:
            try:
                from ..service.serve import run_server  # SIGTERM drains in-flight requests, as one process does
            except ImportError:
                run_server = None
            if run_server is not None:
                run_server(app, config)
            else:
                uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
        finally:
            engine.stop_followers()
    finally:
        launch.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inferflow.parallel.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="service config file (one model)")
    ap.add_argument("--placement", help="devices string ('0&1', '0;1') or JSON of the explicit form (default: the "
                                        "model's placement key)")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    try:
        import torch

        from ..service.config import load_service_config
        from .placement import Placement

        if args.threads:
            torch.set_num_threads(args.threads)
        config = load_service_config(args.config)
        if len(config.models) != 1:
            raise InferflowError(f"placement: a parallel service serves one model, the config names "
                                 f"{len(config.models)}")
        if args.placement:
            text = args.placement
            config.models[0].placement = json.loads(text) if text.lstrip().startswith("{") else text
        Placement.from_config(config.models[0].placement)  # a bad placement fails before any rank starts
        config.host = args.host or config.host
        config.port = args.port if args.port is not None else config.port
        logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
        return serve_parallel(config, "inferflow.parallel.serve", argv)
    except InferflowError as e:
        print(f"inferflow.parallel.serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
