"""Record llama.cpp's greedy continuations of a few chat prompts on the default model, with its top-2 margins.

The file it writes (tests/data/default_model_llamacpp.json) is the reference for a teacher-forcing test:
inferflow reads the same ids and must pick llama.cpp's token wherever llama.cpp was not near a tie.
llama.cpp quantizes activations to 8 bits inside its matmuls, so its logits are not exact math and near-ties
may flip; the margins say where it was sure.

Micro-batches stay below 32 tokens: llama-cpp-python 0.3.16 on an AVX-512/AMX CPU computed wrong logits for
micro-batches of 32 or more tokens (position 0's logits, which cannot depend on later tokens, moved by up to 24
from its own one-token result; below 32 they agree with its one-token results and with exact math within ~2).

    pip install llama-cpp-python   # a C++ build, ~10 min on 2 cores; only this tool needs it
    python tools/llamacpp_reference.py [--out tests/data/default_model_llamacpp.json] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "default_model_llamacpp.json"))
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    import llama_cpp

    import inferflow
    from inferflow.default_model import default_model_path

    path = default_model_path()
    tok = inferflow.load(path).tokenizer  # our tokenizer makes the ids both engines read
    # n_ubatch < 32: see the module docstring
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=16, n_ubatch=16, logits_all=True, n_threads=2,
                          verbose=False)
    eos = llm.token_eos()
    records = []
    for text in PROMPTS:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        llm.reset()
        llm.eval(prompt)
        out, margins = [], []
        for _ in range(args.tokens):
            row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top2 = np.sort(row)[-2:]
            nxt = int(row.argmax())
            out.append(nxt)
            margins.append(round(float(top2[1] - top2[0]), 4))
            if nxt == eos:
                break
            llm.eval([nxt])
        records.append({"text": text, "prompt_ids": prompt, "continuation_ids": out, "margins": margins})
        print(f"{text!r}: {tok.decode(out)!r}")
    Path(args.out).write_text(json.dumps({
        "model": path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "command": "python tools/llamacpp_reference.py --tokens %d" % args.tokens,
        "records": records,
    }, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
