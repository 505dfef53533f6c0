"""A prompts file of random lengths for ``inferflow bench serving --prompts-file`` on a random model folder.

    python tools/ragged_prompts.py /tmp/ragged.txt [--n 256] [--min 32] [--max 700] [--vocab 151936] [--seed 7]

Each line is ``<t{id}>`` words (the vocabulary of tools/random_hf_model.py's tokenizer: one token per word), of a
length drawn uniformly from ``--min`` .. ``--max``: a serving load whose prompts differ in length, as real ones do.
"""
from __future__ import annotations

import argparse
import random


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--min", type=int, default=32)
    ap.add_argument("--max", type=int, default=700)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    r = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.n):
            f.write(" ".join(f"<t{r.randrange(10, a.vocab)}>" for _ in range(r.randrange(a.min, a.max + 1))) + "\n")


if __name__ == "__main__":
    main()
