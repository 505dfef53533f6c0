"""``inferflow-service [service.yaml]``: load the configured models and serve them with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import InferflowError


def service_main(argv: list[str] | None = None) -> int:
    """Serve the models of a service config (YAML or Inferflow INI); with no config, the embedded default model."""
    ap = argparse.ArgumentParser(prog="inferflow-service", description=service_main.__doc__)
    ap.add_argument("config", nargs="?", help="service config file (see service_configs/)")
    ap.add_argument("--host", help="override the config's host (default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="override the config's port (default 8080)")
    ap.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    ap.add_argument("--api-key", action="append", default=[],
                    help="require this API key (repeatable; added to the config's api_keys; also read from "
                         "$INFERFLOW_API_KEY, comma-separated)")
    args = ap.parse_args(argv)
    try:
        from .app import create_app
        from .config import load_service_config
        from .progress import LoadBar
        from .serve import run_server

        config = load_service_config(args.config)
        config.host = args.host or config.host
        config.port = args.port if args.port is not None else config.port
        config.log_level = args.log_level or config.log_level
        env_keys = [k.strip() for k in os.environ.get("INFERFLOW_API_KEY", "").split(",") if k.strip()]
        config.api_keys = list(dict.fromkeys([*config.api_keys, *args.api_key, *env_keys]))
        logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
        from ..parallel.launch import launched_world, world_of

        if any(world_of(m) > 1 for m in config.models) or launched_world() > 1:
            # several ranks (torchrun, or spawned here): rank 0 serves, the others follow (docs/placement.md)
            from ..parallel.serve import serve_parallel

            return serve_parallel(config, "inferflow.service", argv)
        models = {}
        from .served_model import ServedModel, load_model

        for cfg in config.models:
            with LoadBar(f"Loading {cfg.name}") as bar:
                models[cfg.name] = ServedModel(cfg, load_model(cfg, progress=bar))
        app = create_app(config, models=models)
        if argv is None:  # the service's own process: the loaded models live as long as it does
            from .. import freeze_heap

            freeze_heap()
        print(f"inferflow-service: serving {', '.join(models)} on http://{config.host}:{config.port} "
              f"(OpenAI routes under /v1, native route POST /)", file=sys.stderr)
        run_server(app, config)  # SIGTERM drains in-flight requests (shutdown_grace), then exits 0
    except InferflowError as e:
        print(f"inferflow-service: {e}", file=sys.stderr)
        return 2
    return 0
