"""The HTTP service: Inferflow's native route and OpenAI-compatible routes over the engine.

    from inferflow.service import create_app, load_service_config
    app = create_app(load_service_config("service_configs/default.yaml"))   # a Starlette app (run with uvicorn)
"""
from __future__ import annotations

from .app import create_app, load_models
from .config import ModelConfig, ServiceConfig, ServiceConfigError, config_from_dict, load_service_config
from .served_model import ServedModel

__all__ = ["create_app", "load_models", "load_service_config", "config_from_dict", "ServiceConfig", "ModelConfig",
           "ServiceConfigError", "ServedModel"]
