"""``python -m inferflow.service [service.yaml]``: the same as ``inferflow-service``."""
import sys

from .cli import service_main

sys.exit(service_main())
