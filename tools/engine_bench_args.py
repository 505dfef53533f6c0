"""Options shared by the engine benchmarks that run on the embedded default model (bench_prefix_hits.py,
bench_speculative.py): which model, how many torch threads, how many timed rounds."""
from __future__ import annotations

import argparse

import torch

from inferflow.default_model import default_model_path


def parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """An ArgumentParser (described by ``doc``'s first line) with ``--model``, ``--threads`` and ``--rounds``."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", help="default: the embedded default model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def setup(args: argparse.Namespace) -> str:
    """Set the torch thread count; -> the model path (the default model's unless --model)."""
    torch.set_num_threads(args.threads)
    return args.model or str(default_model_path())
