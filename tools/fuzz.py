"""Long fuzz runs of inferflow's file readers (and, with --requests, the HTTP request-body parsers).

    PYTHONPATH=. python tools/fuzz.py --seconds 30                 # every target, 30 s each
    PYTHONPATH=. python tools/fuzz.py gguf pickle --seconds 120 --out /tmp/fuzz-failures
    PYTHONPATH=. python tools/fuzz.py --atheris gguf --seconds 60  # coverage-guided (atheris), one target

Targets and the oracle live in tests/fuzz_targets.py (shared with the in-suite fuzz tests): each input is a
structure-aware mutation of a valid tiny file; it must load, or be refused with an InferflowError naming the file,
within a deadline and without a Python-heap peak out of proportion to its size. Anything else is a failure: the
input is saved under --out (``<target>-<n>.<suffix>`` plus a ``.txt`` with the error) and counted by type.
Per target the report prints inputs tried, inputs/s, outcomes (ok / refused / failures) and the refusals by type.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from fuzz_targets import TARGETS, Target, run_one  # noqa: E402


def fuzz_random(target: Target, seconds: float, out: Path, work: Path, seed: int, alloc_every: int) -> dict:
    rng = random.Random(seed)
    seeds = target.seed_list()
    counts: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    failures = 0
    t0 = time.monotonic()
    n = 0
    corpus = list(enumerate(seeds))  # grows with inputs that loaded: mutants of mutants reach deeper states
    while time.monotonic() - t0 < seconds:
        i, base = rng.choice(corpus)
        data = target.mutate(base, rng)
        res = run_one(target, data, work, i, measure_alloc=alloc_every > 0 and n % alloc_every == 0)
        n += 1
        kinds[res.kind] += 1
        if res.kind == "refused":
            counts[res.detail.split(":", 1)[0]] += 1
        elif res.kind == "ok" and len(corpus) < 200 and data not in seeds:
            corpus.append((i, data))
        else:
            if res.kind == "bug":
                failures += 1
                counts["FAILURE " + res.detail.split(":", 1)[0]] += 1
                out.mkdir(parents=True, exist_ok=True)
                stem = out / f"{target.name}-{failures}"
                stem.with_suffix(target.suffix).write_bytes(target.wrap(data, i) if target.wrap else data)
                stem.with_suffix(".txt").write_text(res.detail + "\n")
                print(f"  FAILURE {target.name}: {res.detail[:200]}", flush=True)
    return {"inputs": n, "seconds": time.monotonic() - t0, "kinds": kinds, "by_type": counts, "failures": failures}


def fuzz_atheris(target: Target, seconds: float, out: Path, work: Path) -> None:
    """Coverage-guided: atheris mutates the seeds (libFuzzer); a failure stops the run with the input saved."""
    import atheris

    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, s in enumerate(target.seed_list()):
        (corpus / f"seed{i}").write_bytes(s)

    def one(data: bytes) -> None:
        res = run_one(target, data, work)
        if res.kind == "bug":
            raise AssertionError(res.detail)

    for s in target.seed_list():  # import what this target uses, then instrument inferflow's code only
        run_one(target, s, work)
    _instrument_inferflow(atheris)
    out.mkdir(parents=True, exist_ok=True)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", f"-artifact_prefix={out}/{target.name}-",
                   "-rss_limit_mb=4096", str(corpus)], one)
    atheris.Fuzz()


def _instrument_inferflow(atheris: Any) -> None:
    """Coverage feedback from inferflow's modules (instrument_all would patch all of torch: minutes)."""
    import types

    done: set[int] = set()

    def patch(fn: Any, mod: str) -> None:
        fn = getattr(fn, "__func__", fn)
        if isinstance(fn, types.FunctionType) and fn.__module__ == mod and id(fn) not in done:
            done.add(id(fn))
            atheris.instrument_func(fn)

    for name, mod in list(sys.modules.items()):
        if not name.startswith("inferflow") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and obj.__module__ == name:
                for attr in vars(obj).values():
                    patch(attr, name)
            else:
                patch(obj, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", help=f"default: all of {', '.join(TARGETS)}")
    ap.add_argument("--seconds", type=float, default=30.0, help="time budget per target")
    ap.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="folder for failing inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alloc-every", type=int, default=10, help="measure the Python heap on every Nth input "
                                                                  "(tracemalloc is slow; 0: never)")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided with atheris (one target per run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.targets or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.atheris:
            if len(names) != 1:
                ap.error("--atheris runs one target")
            fuzz_atheris(TARGETS[names[0]], args.seconds, args.out, Path(tmp))
            return
        total = collections.Counter()
        print(f"{'target':<16}{'inputs':>8}{'/s':>7}{'ok':>7}{'refused':>9}{'FAIL':>6}  refusals by type")
        for name in names:
            r = fuzz_random(TARGETS[name], args.seconds, args.out, Path(tmp), args.seed, args.alloc_every)
            k = r["kinds"]
            kinds = ", ".join(f"{t} {c}" for t, c in r["by_type"].most_common())
            print(f"{name:<16}{r['inputs']:>8}{r['inputs'] / r['seconds']:>7.0f}{k['ok']:>7}{k['refused']:>9}"
                  f"{r['failures']:>6}  {kinds}", flush=True)
            total.update({"inputs": r["inputs"], "failures": r["failures"]})
        print(f"total: {total['inputs']} inputs, {total['failures']} failures"
              + (f" (saved under {args.out})" if total["failures"] else ""))
        sys.exit(1 if total["failures"] else 0)


if __name__ == "__main__":
    main()
