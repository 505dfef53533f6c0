"""Where a run's engine time went, from an ``INFERFLOW_STEP_LOG`` file: steps split into pure decode (by batch
size), mixed (decode rows plus prefill chunks) and pure prefill, with their count, time and tokens.

    INFERFLOW_STEP_LOG=/tmp/steps.jsonl inferflow bench serving ...
    python tools/step_log_summary.py /tmp/steps.jsonl
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


def kind(step: dict) -> str:
    if step["rows"] == 0:
        return "other (embedding / overlap)"
    if step["decode"] == step["rows"] == step["tokens"]:
        return "decode"
    return "prefill" if step["decode"] == 0 else "mixed"


def summarize(steps: list[dict]) -> list[tuple]:
    """(kind, steps, ms, tokens, decode rows) per kind, plus decode split by batch-size bucket."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for s in steps:
        k = kind(s)
        if k == "decode":
            k = f"decode, <= {1 << max(0, (s['rows'] - 1).bit_length())} rows"
        g = groups[k]
        g[0] += 1
        g[1] += s["ms"]
        g[2] += s["tokens"]
        g[3] += s["decode"]
    return sorted(((k, *v) for k, v in groups.items()), key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the JSON-lines file INFERFLOW_STEP_LOG named")
    ap.add_argument("--gap", type=float, default=1.0,
                    help="an idle gap longer than this many seconds starts a new run (warm-up, then each rate)")
    args = ap.parse_args(argv)
    steps = [json.loads(line) for line in open(args.log) if line.strip()]
    if not steps:
        raise SystemExit(f"{args.log}: no steps")
    runs, start = [], 0
    for i in range(1, len(steps) + 1):
        if i == len(steps) or steps[i]["t"] - steps[i - 1]["t"] - steps[i - 1]["ms"] / 1e3 > args.gap:
            runs.append(steps[start:i])
            start = i
    for n, run in enumerate(runs):
        print(f"## run {n + 1} of {len(runs)}")
        report(run)


def report(steps: list[dict]) -> None:
    busy = sum(s["ms"] for s in steps)
    span = (steps[-1]["t"] + steps[-1]["ms"] / 1e3 - steps[0]["t"]) * 1e3
    print(f"{len(steps)} steps over {span:,.0f} ms, {busy:,.0f} ms inside steps ({busy / span:.0%})")
    print(f"{'kind':<32} {'steps':>6} {'ms':>9} {'ms/step':>8} {'tokens':>8} {'decode rows':>11}")
    for k, n, ms, tok, dec in summarize(steps):
        print(f"{k:<32} {n:>6} {ms:>9,.0f} {ms / n:>8.2f} {tok:>8} {dec:>11}")


if __name__ == "__main__":
    main()
