"""Automatic KV-cache sizing: gpu_memory_utilization on CUDA (torch.cuda.mem_get_info faked, no GPU needed),
1 GiB elsewhere, explicit kv_cache_memory / num_blocks unchanged, and the service config's validation of both."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from inferflow.engine import sizing
from inferflow.engine.config import EngineConfig
from inferflow.errors import InferflowError

GiB = 1 << 30
PARAMS = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 4096}


def _model(device: str) -> SimpleNamespace:
    attn = [SimpleNamespace(uses_kv_cache=True, cross=False, cache_key=k, hkv=2, d=16) for k in range(2)]
    net = SimpleNamespace(decoder=SimpleNamespace(modules=lambda: iter(attn)))
    return SimpleNamespace(net=net, params=dict(PARAMS), dtype=torch.bfloat16, device=torch.device(device))


@pytest.fixture
def fake_gpu(monkeypatch):
    """A 100 GiB GPU with 20 GiB in use (weights + context)."""
    seen = []

    def mem_get_info(device=None):
        seen.append(torch.device(device))
        return 80 * GiB, 100 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return seen


def test_cuda_auto_uses_the_utilization_minus_weights_and_reserve(fake_gpu):
    model, cfg = _model("cuda:1"), EngineConfig()
    assert cfg.kv_cache_memory is None and cfg.gpu_memory_utilization == 0.9
    reserve = sizing.activation_reserve(model, cfg)
    assert GiB < reserve < 2 * GiB  # tiny shapes: the fixed slack dominates
    assert sizing.device_kv_bytes(model, cfg) == 90 * GiB - 20 * GiB - reserve
    assert fake_gpu == [torch.device("cuda:1")]  # the model's own GPU is asked
    half = sizing.device_kv_bytes(model, EngineConfig(gpu_memory_utilization=0.5))
    assert half == 50 * GiB - 20 * GiB - reserve


def test_reserve_grows_with_batched_tokens_and_rows():
    model = _model("cuda")
    small = sizing.activation_reserve(model, EngineConfig(max_num_batched_tokens=1024))
    big = sizing.activation_reserve(model, EngineConfig(max_num_batched_tokens=8192))
    per_token = 2 * (4 * 64 + (4 + 2 * 2) * 16 + 3 * 128)  # bf16 bytes of a token's buffers
    assert big - small == 2 * 7168 * per_token
    rows = sizing.activation_reserve(model, EngineConfig(max_num_seqs=64)) - sizing.activation_reserve(
        model, EngineConfig(max_num_seqs=32))
    assert rows == 32 * 100 * 16  # float32 logits and the sampler's copies per extra sampled row


def test_cuda_blocks_capped_and_logged(fake_gpu, caplog):
    model = _model("cuda")
    per_block = 2 * 2 * 2 * 16 * 2 * 16  # layers * K,V * heads * dim * bf16 bytes * tokens
    with caplog.at_level(logging.INFO, logger="inferflow.engine"):
        cap = EngineConfig(max_num_seqs=4).max_num_seqs * (4096 // 16)
        assert sizing.device_blocks(model, EngineConfig(max_num_seqs=4), per_block, cap) == cap
    assert "KV cache: 1024 blocks" in caplog.text and "capped" in caplog.text
    uncapped = sizing.device_blocks(model, EngineConfig(), per_block, 10 ** 12)
    assert uncapped == sizing.device_kv_bytes(model, EngineConfig()) // per_block


def test_explicit_memory_and_cpu_default_ignore_the_gpu(fake_gpu):
    assert sizing.device_kv_bytes(_model("cuda"), EngineConfig(kv_cache_memory=2)) == 2 * GiB
    assert sizing.device_kv_bytes(_model("cpu"), EngineConfig()) == GiB
    assert fake_gpu == []
    cache = sizing.build_cache(_model("cpu"), EngineConfig(max_num_seqs=1), 64)  # auto on CPU still builds
    assert cache.num_blocks == 4


def test_no_room_is_a_clear_error(fake_gpu):
    with pytest.raises(InferflowError, match="gpu_memory_utilization"):
        sizing.device_kv_bytes(_model("cuda"), EngineConfig(gpu_memory_utilization=0.2))


@pytest.mark.parametrize("kw", [{"kv_cache_memory": 0}, {"kv_cache_memory": "1"}, {"gpu_memory_utilization": 0},
                                {"gpu_memory_utilization": 1.5}, {"gpu_memory_utilization": True}])
def test_validation(kw):
    with pytest.raises(InferflowError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_service_config_accepts_both_keys():
    from inferflow.service.config import ServiceConfigError, config_from_dict

    cfg = config_from_dict({"models": [{"name": "m", "engine": {"gpu_memory_utilization": 0.8,
                                                                 "kv_cache_memory": None}}]})
    eng = cfg.models[0].engine
    assert eng.gpu_memory_utilization == 0.8 and eng.kv_cache_memory is None
    with pytest.raises(ServiceConfigError, match=r"models\[0\]\.engine.*gpu_memory_utilization"):
        config_from_dict({"models": [{"name": "m", "engine": {"gpu_memory_utilization": 2}}]})
