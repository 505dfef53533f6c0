"""Decode steps with the weights and K/V in huge pages vs ordinary pages (inferflow/model/hugepages.py).

    PYTHONPATH=. python tools/bench_hugepages.py [MODEL] [--dtype float32] [--batch 8] [--steps 10] [--rounds 15]
    PYTHONPATH=. python tools/bench_hugepages.py [MODEL] --memory
    PYTHONPATH=. python tools/bench_hugepages.py --faults 128

Two engines on the same model file in one process, one built with ``INFERFLOW_HUGEPAGES=0``, decode ``--batch``
greedy requests; they take turns of ``--steps`` steps (the order alternating each round, as this VM's speed drifts
by tens of percent within seconds). Prints each one's median and best ms per step, and the ratio of the medians.

``--memory``: for each setting, a fresh process loads the model and builds the engine, then prints its resident
memory (/proc/self/smaps_rollup: Rss, file-backed, anonymous, of it in huge pages).

``--faults MIB``: the first touch of each 2 MiB page of a fresh huge-page mapping of MIB MiB, timed (median and max
ms per page, and the total), and ``madvise(MADV_POPULATE_WRITE)`` of another fresh mapping; 4 rounds, each form
first in turn, each mapping freed before the next. A first touch may wait on the kernel compacting memory into a free huge page:
the cost a CPU K/V cache's first writes would pay, which is why its arena is populated when it is made.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import inferflow  # noqa: E402
from inferflow.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
import model_args  # noqa: E402


def faults(mib: int, rounds: int = 4) -> None:
    import torch

    from inferflow.model import hugepages

    n = mib << 20

    def touch() -> str:
        mm, head = hugepages._mapping(n)
        t = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=head)
        ms = []
        for off in range(0, n, hugepages.HUGE):
            t0 = time.perf_counter()
            t[off] = 1
            ms.append((time.perf_counter() - t0) * 1e3)
        del t
        mm.close()
        return (f"first touch of {len(ms)} huge pages: median {statistics.median(ms):.3f} ms, max {max(ms):.2f}, "
                f"total {sum(ms):.1f} ms")

    def populate() -> str:
        mm, head = hugepages._mapping(n)
        t0 = time.perf_counter()
        try:
            mm.madvise(hugepages.MADV_POPULATE_WRITE, head, n)
            return f"MADV_POPULATE_WRITE of {mib} MiB: {(time.perf_counter() - t0) * 1e3:.1f} ms"
        except OSError as e:
            return f"MADV_POPULATE_WRITE not available ({e})"
        finally:
            mm.close()

    for r in range(rounds):  # the first mapping of a process pays the compaction: each form goes first in turn
        order = (populate, touch) if r % 2 == 0 else (touch, populate)
        print(f"round {r + 1}: " + "; ".join(f() for f in order), flush=True)


def main() -> None:
    def options(ap):
        ap.add_argument("--dtype", default="float32")
        ap.add_argument("--batch", type=int, default=8)
        ap.add_argument("--steps", type=int, default=10)
        ap.add_argument("--rounds", type=int, default=15)
        ap.add_argument("--memory", action="store_true", help="resident memory after the engine is built, no timing")
        ap.add_argument("--faults", type=int, default=0, metavar="MIB",
                        help="time first touches of fresh huge pages against MADV_POPULATE_WRITE, no model")

    a = model_args.parse(__doc__, options)
    if a.faults:
        faults(a.faults)
        return
    if a.memory:
        for on in ("0", "1"):
            code = ("import sys, inferflow; from inferflow.engine import Engine, EngineConfig; "
                    f"m = inferflow.load({a.model!r}, dtype={a.dtype!r}); "
                    "e = Engine(m, EngineConfig(max_num_seqs=8, max_model_len=1024)); "
                    "r = dict(l.split(':') for l in open('/proc/self/smaps_rollup') if ':' in l and l[0].isupper()); "
                    "print(', '.join(f'{k} {int(r[k].split()[0]) >> 10} MiB' for k in "
                    "('Rss', 'Pss_File', 'Anonymous', 'AnonHugePages')))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "INFERFLOW_HUGEPAGES": on}).stdout.strip()
            print(f"INFERFLOW_HUGEPAGES={on}: {out}")
        return
    engines = {}
    for on in ("0", "1"):
        os.environ["INFERFLOW_HUGEPAGES"] = on
        eng = Engine(inferflow.load(a.model, dtype=a.dtype), EngineConfig(max_num_seqs=max(8, a.batch),
                                                                          max_model_len=1024))
        for i in range(a.batch):
            eng.add_request(list(range(10 + i, 138 + i)),
                            SamplingParams(temperature=0.0, max_tokens=a.steps * a.rounds + 16, ignore_eos=True))
        for _ in range(3):  # prefill, first decode steps
            eng.step()
        engines["huge pages" if on == "1" else "4 KiB pages"] = eng
    ms: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(a.rounds):
        order = list(engines.items())
        for name, eng in order if r % 2 else order[::-1]:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            ms[name].append((time.perf_counter() - t0) / a.steps * 1e3)
    print(f"{Path(a.model).name}, {a.dtype}, batch {a.batch}, {a.threads} threads, {a.rounds} rounds of {a.steps} steps")
    for name, v in ms.items():
        print(f"  {name:12}: {statistics.median(v):7.2f} ms/step median, {min(v):7.2f} best")
    print(f"  4 KiB / huge (medians): {statistics.median(ms['4 KiB pages']) / statistics.median(ms['huge pages']):.3f}")


if __name__ == "__main__":
    main()
