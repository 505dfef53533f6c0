"""Valid tiny inputs for the fuzz targets (tests/fuzz_targets.py), built in memory: only the shipped specs are read
from disk. Mutants of these reach the readers' deep states; random bytes would stop at the magic number."""
from __future__ import annotations

import io
import json
import random
import struct
import zipfile
from pathlib import Path

import torch

SPECS = Path(__file__).resolve().parent.parent / "model_specs"

def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return {"model.a.weight": base, "model.b.weight": torch.arange(5), "model.c.weight": base.t(),
            "model.d.bias": torch.randn(3, generator=g).half(), "model.e": base[1:, 2:4],
            "nested": {"x": torch.tensor([True, False]), "y": 7}}


def torch_seeds(legacy: bool) -> list[bytes]:
    out = []
    for proto in (2, 4):
        buf = io.BytesIO()
        torch.save(_tensors(), buf, _use_new_zipfile_serialization=not legacy, pickle_protocol=proto)
        out.append(buf.getvalue())
    return out


def zip_members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def rezip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, body in members.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            z.writestr(info, body)
    return buf.getvalue()


def pickle_seeds() -> list[bytes]:
    """The data.pkl of each zip seed (the pickle target re-zips a mutated pickle with the seed's storages)."""
    return [next(v for k, v in zip_members(s).items() if k.endswith("data.pkl")) for s in torch_seeds(False)]


def safetensors_seeds() -> list[bytes]:
    from safetensors.torch import save

    t = _tensors()
    return [save({k: v.contiguous() for k, v in t.items() if isinstance(v, torch.Tensor)}, {"format": "pt"}),
            save({"w": torch.ones(2, 2, dtype=torch.bfloat16), "e": torch.zeros(0, 3)})]


def gguf_seeds() -> list[bytes]:
    import gguf
    import numpy as np
    import tempfile

    out = []
    for qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K):
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "s.gguf"
            w = gguf.GGUFWriter(str(p), "llama")
            w.add_block_count(1)
            w.add_embedding_length(32)
            w.add_head_count(2)
            w.add_layer_norm_rms_eps(1e-5)
            w.add_token_list([f"t{i}" for i in range(12)])
            w.add_token_scores([float(i) for i in range(12)])
            w.add_array("general.tags", [1, 2, 3])
            w.add_string("general.name", "seed")
            w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
            w.add_tensor("output_norm.weight", np.ones(32, np.float16))
            rows = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
            if qt == gguf.GGMLQuantizationType.Q8_0:
                w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(rows, qt), raw_dtype=qt)
            else:
                w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 144), np.uint8), raw_dtype=qt)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            out.append(p.read_bytes())
    return out


def llama2c_seeds() -> list[bytes]:
    """v0 (shared and not), v1, v2: dim 8, hidden 16, 1 layer, 2 heads, 1 kv head, vocab 8, seq 4."""
    from inferflow.loaders.llama2c import MAGIC, V1_HEADER, Header, expected_size

    out = []
    for version, shared in ((0, True), (0, False), (1, True), (2, False)):
        h = Header(8, 16, 1, 2, 1, 8, 4, shared=shared, version=version, group_size=4 if version == 2 else 0)
        if version == 0:
            head = struct.pack("<7i", 8, 16, 1, 2, 1, 8 if shared else -8, 4)
        else:
            head = struct.pack("<Ii7iB", MAGIC, version, 8, 16, 1, 2, 1, 8, 4, shared)
            if version == 2:
                head += struct.pack("<i", 4)
            head = head.ljust(V1_HEADER, b"\0")
        body = bytes(random.Random(version).randrange(256) & 0x3F for _ in range(expected_size(h) - len(head)))
        out.append(head + body)
    return out


def yaml_seeds() -> list[bytes]:
    return [(SPECS / n).read_bytes() for n in ("llama.yaml", "gpt2.yaml")]


def ini_seeds() -> list[bytes]:
    return [(SPECS / "smollm3.ini").read_bytes()]


INFERFLOW_NS = {"type": "transformer.llama", "normalization_function": "rms", "activation_function": "silu",
                "position_embedding": "rope", "qk_column_order": 2, "qkv_format": 1, "tensor_name_prefix": "model.",
                "tensor_name_mapping": {"tok.weight": "dec.token_embeddings.weight",
                                        "layers.{i}.attention.wq.weight": "dec.{i}.self_attn.wq.weight"}}


def inferflow_seeds() -> list[bytes]:
    doc = {"config_file": "config.json", "model_files": ["model.safetensors"], "model_file_format": "safetensors",
           "tokenizer_files": [], "tokenization_algorithm": "bpe", "generation_config": "",
           "network_structure": INFERFLOW_NS}
    doc2 = {**doc, "network_structure": {**INFERFLOW_NS, "tensor_name_mapping": {}}, "vocab_size": 96}
    return [("# header comment\n" + json.dumps(doc, indent=2)).encode(), json.dumps(doc2).encode()]


def request_seeds() -> list[bytes]:
    from request_parsing import VALID

    chat = {k: VALID[k] for k in ("model", "messages", "max_tokens", "temperature", "stop", "tools", "n")}
    return [json.dumps(VALID).encode(), json.dumps(chat).encode(),
            json.dumps({"text": "hi", "decoding_alg": "top_p", "random_seed": 3, "max_output_len": 5}).encode(),
            json.dumps({"prompt": [[1, 2], "x"], "logit_bias": {"3": 1.5}, "stream": True,
                        "stream_options": {"include_usage": True}}).encode()]
