"""Regenerate the generated sections of docs/benchmarks.md: one script for every table a tool writes there.

    python tools/bench_docs.py                 # the sections this machine can run: CPU ones, and GPU ones on CUDA
    python tools/bench_docs.py --only bench_gpu,bench_serving --out /tmp/out
    python tools/bench_docs.py --dry-run       # print the commands

Each section sits between ``<!-- name -->`` and ``<!-- /name -->`` in the docs file and is written by its tool's
``--doc`` / ``--write`` option with the command, machine, versions and date of the run; the hand-written analyses
around them keep their own commands. The sections, in run order:
- ``bench_engine``: engine decode vs HF ``generate`` on the CPU (tools/bench_engine.py);
- ``bench_cpu``: the precision ladder against llama.cpp and HF on the CPU (tools/bench.py --classes ...), needing
  the ``bench-peers`` extra;
- ``bench_gpu``: the Qwen3-8B-shaped GPU table against HF's static-cache compiled path (tools/bench_gpu.py);
- ``bench_serving``: 256 streamed requests through an in-process inferflow-service on the GPU, on a random
  Qwen3-8B-shaped folder written first (tools/random_hf_model.py).
A failing section is reported and the others still run; the exit status is the number of failures.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    gpu: bool
    commands: tuple[str, ...]  # run in order from the repository root; {doc}, {out}, {py} filled in


SECTIONS: tuple[Section, ...] = (
    Section("bench_engine", False, ("{py} tools/bench_engine.py --rounds 3 --write {doc}",)),
    Section("bench_cpu", False, (
        "{py} tools/bench.py --classes f32,f16,q8_0,q4_0,file --vs hf --vs llama.cpp --batch 1,8 --prompt-len 128 "
        "--new-tokens 128 --rounds 5 --threads 2 --work-dir {out}/ladder --json {out}/bench_cpu.json --doc {doc}",)),
    Section("bench_gpu", True, (
        "{py} tools/bench_gpu.py --out {out} --rounds 3 --budget 470 --q4 --serving 0 --doc {doc}",)),
    Section("bench_serving", True, (
        "{py} tools/random_hf_model.py qwen3-8b {out}/qwen3-8b",
        "{py} -m inferflow.cli bench serving --model {out}/qwen3-8b --device cuda --dtype bfloat16 --num-prompts 256 "
        "--prompt-len 512 --new-tokens 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 1024 "
        "--request-rate inf,16 --arrival poisson --warmup-requests 256 --json {out}/serving.json --doc {doc}")),
)


def commands(section: Section, doc: str, out: str) -> list[str]:
    """The section's shell commands with the docs file, the output folder and this interpreter filled in."""
    py = shlex.quote(sys.executable)
    return [c.format(doc=shlex.quote(doc), out=shlex.quote(out), py=py) for c in section.commands]


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/inferflow-bench-docs"),
                    help="where the runs keep their JSON, GGUF ladder and model folder")
    ap.add_argument("--only", default="", help="comma-separated section names (default: all this machine can run)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    names = {s.name for s in SECTIONS}
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - names)
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; known: {sorted(names)}")
    text = Path(args.doc).read_text(encoding="utf-8")
    cuda = args.dry_run or has_cuda()
    failed = 0
    for s in SECTIONS:
        if only and s.name not in only:
            continue
        if f"<!-- {s.name} -->" not in text:
            print(f"[{s.name}] {args.doc} has no <!-- {s.name} --> marker: skipped", flush=True)
            failed += 1
            continue
        if s.gpu and not cuda:
            print(f"[{s.name}] needs a CUDA GPU: skipped (run this script on the GPU machine)", flush=True)
            continue
        for cmd in commands(s, args.doc, args.out):
            print(f"[{s.name}] $ {cmd}", flush=True)
            if args.dry_run:
                continue
            Path(args.out).mkdir(parents=True, exist_ok=True)
            rc = subprocess.call(cmd, shell=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
            if rc:
                print(f"[{s.name}] failed (exit {rc}); the other sections still run", flush=True)
                failed += 1
                break
    return failed


if __name__ == "__main__":
    sys.exit(main())
