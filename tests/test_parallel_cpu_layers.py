"""``cpu_layers`` inside the paged engine: the first N decoder layers' K/V live in host memory and their attention
runs on the CPU (per layer, next to its compute); greedy tokens equal the engine without the placement. On a
CPU-only machine both parts are the CPU, yet the cache routes those layers through its host-layer path."""
import pytest
import torch

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.parallel import parallelize
from parallel_models import VOCAB, build
from parity import sequences


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_engine_cpu_layers_same_tokens(tmp_path, kind, one_thread):
    folder = build(kind, tmp_path)
    prompts = sequences(VOCAB, seed=3, lengths=(9, 6, 12))
    cfg = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)  # chunked prefill + mixed decode steps
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole = Engine(inferflow.load(folder, dtype="float32"), EngineConfig(**cfg))
    want = [o.outputs[0].token_ids for o in whole.generate(prompts, params)]
    model = parallelize(inferflow.load(folder, dtype="float32"), {"cpu_layers": 1})
    eng = Engine(model, EngineConfig(**cfg))
    first = model.net.decoder.cpu_layers[0]
    key = next(m.cache_key for m in first.modules() if getattr(m, "uses_kv_cache", False)
               and not getattr(m, "cross", False))
    assert model.cpu_kv_keys == {key}
    assert eng.cache.compute_device(key) == torch.device("cpu") and key in eng.cache.host_layers
    assert eng.cache.storage_device(key) == torch.device("cpu")
    assert [o.outputs[0].token_ids for o in eng.generate(prompts, params)] == want
