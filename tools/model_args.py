"""The command line shared by tools that run one model on the CPU: an optional model path (default: the embedded
default model), ``--threads`` (torch threads, set here) and each tool's own options."""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from inferflow.default_model import model_or_default


def parse(doc: str, options: Callable[[argparse.ArgumentParser], None], name: str = "model") -> argparse.Namespace:
    """Parse ``sys.argv``: positional ``name`` (resolved to the default model when omitted), ``--threads`` (default
    2, applied to torch) and what ``options`` adds; ``doc``'s first line is the description."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(name, nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    options(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    setattr(a, name, model_or_default(getattr(a, name)))
    return a
