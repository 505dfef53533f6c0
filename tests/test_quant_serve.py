"""A q4 model served: quantized by the CLI, served by the OpenAI route, answering with exactly the greedy tokens the
engine gives offline for the same q4 folder (issue 5: "a test serves a q4 model")."""
import httpx
import openai
import pytest
import torch

import inferflow
from inferflow.cli import main
from inferflow.engine import Engine, EngineConfig, SamplingParams
from service_helpers import LiveServer, chat_llama

pytestmark = pytest.mark.usefixtures("one_thread")
MSG = [{"role": "user", "content": "hello world"}]
KEY = "sk-q4"


def test_served_q4_model_answers_with_the_offline_greedy_tokens(tmp_path):
    from inferflow.service import config_from_dict, create_app

    src, dst = chat_llama(tmp_path / "src"), tmp_path / "q4"
    assert main(["quantize", str(src), str(dst), "--quant", "q4"]) == 0
    m = inferflow.load(dst)  # the folder says q4: no other argument
    kernels = {f"{path}.{n}": k for path, mod in m.net.named_modules()
               for n, k in (getattr(mod, "kernels", None) or {}).items()}
    layers = {k for p, k in kernels.items() if ".layers." in f".{p}"}
    assert len(kernels) >= 14 and layers == {"int4"}, kernels  # the layers' q4 weights run the int4 kernel

    cfg = config_from_dict({"api_keys": [KEY], "models": [{"name": "q4", "source": str(dst)}]})
    with LiveServer(create_app(cfg)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = client.chat.completions.create(model="q4", messages=MSG, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        prompt = httpx.post(srv.url + "/tokenize", json={"model": "q4", "messages": MSG},
                            headers={"Authorization": f"Bearer {KEY}"}).json()
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    ids = prompt["tokens"]
    assert len(ids) == prompt["count"] == r.usage.prompt_tokens

    eng = Engine(m, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64))
    offline = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    tokens = offline.outputs[0].token_ids
    assert len(tokens) == 8
    assert r.choices[0].message.content == m.tokenizer.decode(tokens)
    # and the engine agrees with the model's own greedy loop on the same q4 weights
    with torch.inference_mode():
        assert m.generate_ids(ids, max_new_tokens=8, stop_ids=set()) == tokens
