"""Placement config parsing, the CPU/GPU hybrid (cpu_layers, one process) and block-aligned slicing of packed
weights."""
import pytest
import torch

import inferflow
from inferflow.errors import InferflowError
from inferflow.parallel import Placement, parallelize, parse_devices
from inferflow.parallel import packed_split
from inferflow.quant import formats
from parallel_models import VOCAB, build, check_same


def test_devices_syntax():
    assert parse_devices("cpu").cpu and parse_devices("cpu").world_size == 1
    p = parse_devices("0")
    assert (p.tensor_parallel, p.pipeline_parallel, p.devices) == (1, 1, [[0]])
    p = parse_devices("0;1")
    assert (p.tensor_parallel, p.pipeline_parallel, p.devices) == (1, 2, [[0], [1]])
    p = parse_devices("0&1")
    assert (p.tensor_parallel, p.pipeline_parallel) == (2, 1)
    p = parse_devices("0&1;2&3")
    assert (p.tensor_parallel, p.pipeline_parallel, p.world_size) == (2, 2, 4)
    assert [p.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.device_index(r) for r in range(4)] == [0, 1, 2, 3]
    for bad, msg in (("0&1;2", "same number"), ("0;0", "twice"), ("a", "not a GPU id"), ("", "empty")):
        with pytest.raises(InferflowError, match=msg):
            parse_devices(bad)


def test_explicit_form_and_errors():
    p = Placement.from_config({"tensor_parallel": 2, "pipeline_stages": [[0, 15], [16, 31]]})
    assert (p.tensor_parallel, p.pipeline_parallel, p.world_size) == (2, 2, 4)
    assert p.stage_ranges(32) == [(0, 16), (16, 32)]
    assert Placement.from_config({"pipeline_parallel": 3}).stage_ranges(8) == [(0, 3), (3, 6), (6, 8)]
    assert Placement.from_config({"cpu_layers": 3}).cpu_layers == 3
    assert Placement.from_config("0&1").tensor_parallel == 2
    assert Placement.from_config(None).world_size == 1
    for cfg, key in (({"tensor_paralel": 2}, "tensor_paralel"), ({"tensor_parallel": 0}, "tensor_parallel"),
                     ({"cpu_layers": -1}, "cpu_layers"), ({"pipeline_stages": [[0]]}, "pipeline_stages"),
                     ({"devices": "0&1", "tensor_parallel": 4}, "tensor_parallel"),
                     ({"tensor_parallel": 2, "cpu_layers": 1}, "cpu_layers"),
                     ({"host_embeddings": "yes"}, "host_embeddings")):
        with pytest.raises(InferflowError, match=key):
            Placement.from_config(cfg)
    gap = Placement.from_config({"pipeline_stages": [[0, 3], [5, 7]]})
    with pytest.raises(InferflowError, match="contiguous"):
        gap.stage_ranges(8)
    with pytest.raises(InferflowError, match="has 8"):
        Placement.from_config({"pipeline_stages": [[0, 3], [4, 6]]}).stage_ranges(8)


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_cpu_layers(tmp_path, kind, one_thread):
    folder = build(kind, tmp_path)
    whole = inferflow.load(folder, dtype="float32")
    part = parallelize(inferflow.load(folder, dtype="float32"), {"cpu_layers": 1})
    stack = part.net.decoder
    assert len(stack.cpu_layers) == 1 and len(stack.layers) == 1
    check_same(whole, part, kind, 0)
    with pytest.raises(InferflowError, match="cpu_layers"):
        parallelize(inferflow.load(folder, dtype="float32"), {"cpu_layers": 5})


def test_packed_slices_on_block_boundaries():
    w = torch.randn(6, 128)
    t = formats.quantize(w, "q8_0")
    whole = t.dequantize()
    rows = packed_split.take_rows(t, [(0, 2), (4, 6)])
    assert torch.equal(rows.dequantize(), torch.cat([whole[0:2], whole[4:6]]))
    cols = packed_split.take_cols(t, 32, 96)
    assert torch.equal(cols.dequantize(), whole[:, 32:96])
    with pytest.raises(InferflowError, match="multiples of 32"):
        packed_split.take_cols(t, 16, 64, "w")
    assert VOCAB % 2  # the TP tests' vocab takes uneven slices


def test_service_config_placement_key():
    from inferflow.service.config import ServiceConfigError, config_from_dict
    from inferflow.service.ini_config import ini_to_dict

    cfg = config_from_dict({"models": [{"name": "a", "source": "x", "placement": "0&1;2&3"}]})
    assert Placement.from_config(cfg.models[0].placement).world_size == 4
    cfg = config_from_dict({"models": [{"name": "a", "placement": {"tensor_parallel": 2, "cpu_layers": 0}}]})
    assert cfg.models[0].placement == {"tensor_parallel": 2, "cpu_layers": 0}
    assert config_from_dict({"models": [{"name": "a", "placement": 0}]}).models[0].placement == "0"
    with pytest.raises(ServiceConfigError, match=r"models\[0\]\.placement: tensor_parallel"):
        config_from_dict({"models": [{"name": "a", "placement": {"tensor_parallel": 0}}]})
    ini = "[transformer_engine]\nmodels = m\n[model.m]\nmodel_dir = x\ndevices = 0&1\n"
    assert ini_to_dict(ini, "s.ini")["models"][0]["placement"] == "0&1"
