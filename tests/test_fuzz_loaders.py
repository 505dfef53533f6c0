"""Fuzzing every model-file and spec reader: structure-aware mutants of valid tiny files (tests/fuzz_targets.py)
either load completely or are refused with an InferflowError naming the file, within a deadline and without a
Python-heap peak out of proportion to the file. Derandomized, a fixed number of examples: the longer search is
tools/fuzz.py. Also regression tests for what fuzzing found."""
from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_targets import TARGETS, run_one

# examples per target: about 2-4 s each on a busy 2-core machine (the specs validate against a JSON Schema)
EXAMPLES = {"pickle": 120, "raw_pickle": 200, "torch_zip": 120, "torch_legacy": 120, "safetensors": 200,
            "gguf": 200, "llama2c": 200, "spec_yaml": 30, "spec_ini": 40, "inferflow_json": 40,
            "request_body": 150}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("name", list(TARGETS))
def test_seeds_load(name, work):
    t = TARGETS[name]
    for i, seed in enumerate(t.seed_list()):
        out = run_one(t, seed, work, i)
        assert out.kind == "ok", out.detail


def _fuzz(name: str):
    @settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rng=st.randoms(use_true_random=False), which=st.integers(0, 7), alloc=st.booleans())
    def test(work, rng, which, alloc):
        t = TARGETS[name]
        seeds = t.seed_list()
        i = which % len(seeds)
        data = t.mutate(seeds[i], rng)
        out = run_one(t, data, work, i, measure_alloc=alloc)
        assert out.kind != "bug", f"{name}: {out.detail}\ninput ({len(data)} bytes): {data[:400]!r}"
    return test


for _name in TARGETS:
    globals()[f"test_fuzz_{_name}"] = _fuzz(_name)


# ---- regressions: what fuzzing found ----------------------------------------------------------------------------
def test_gguf_small_numeric_array_then_more_metadata(tmp_path):
    """A short numeric array (not a tokenizer table) was read without moving past it: the next key was garbage."""
    from gguf_files import gstr, kv_str, raw_gguf
    from inferflow.loaders.gguf import GGUFSource

    arr = gstr("general.tags") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3)
    p = tmp_path / "a.gguf"
    p.write_bytes(raw_gguf([kv_str("general.architecture", "llama"), arr, kv_str("general.name", "x")], [], b""))
    src = GGUFSource(p)
    assert src.config["general.tags"] == [1, 2, 3] and src.config["general.name"] == "x"


def test_gguf_quantized_tensor_with_a_zero_dimension(tmp_path):
    from gguf_files import kv_str, raw_gguf, tensor_info
    from inferflow.loaders.gguf import GGUFSource

    p = tmp_path / "z.gguf"
    p.write_bytes(raw_gguf([kv_str("general.architecture", "llama")], [tensor_info("w", [32, 0], 8, 0)], b""))
    assert tuple(GGUFSource(p).get("w").shape) == (0, 32)


@pytest.mark.parametrize("header,what", [
    (b'{"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "dtype"),
    (b"[" * 50000 + b"]" * 50000, "RecursionError"),
    (b'{"w": {"dtype": "F32", "shape": [' + b"1" * 5000 + b'], "data_offsets": [0, 4]}}', "ValueError"),
])
def test_safetensors_header_values_refused(tmp_path, header, what):
    from inferflow.errors import FormatError
    from inferflow.loaders.safetensors import read_header

    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(FormatError, match=what):
        read_header(str(p))


def test_pickle_dict_holding_itself_under_many_keys(tmp_path):
    """{k0: d, ..., k9: d} with d itself: walking every path to depth 8 was 10**8 steps."""
    t = TARGETS["pickle"]
    pkl = b"\x80\x02}q\x00(" + b"".join(b"X\x02\x00\x00\x00k%d" % i + b"h\x00" for i in range(10)) + b"u."
    assert run_one(t, pkl, tmp_path, deadline=3.0).kind == "ok"


def test_zip_version_and_pickle_bomb_refused(tmp_path):
    from inferflow.errors import FormatError
    from inferflow.loaders import open_file

    data = bytearray(TARGETS["torch_zip"].seed_list()[0])
    cd = data.rfind(b"PK\x01\x02")  # last central-directory entry: claim zip version 7.5 to extract
    data[cd + 6:cd + 8] = struct.pack("<H", 75)
    (tmp_path / "v.pt").write_bytes(bytes(data))
    with pytest.raises(FormatError, match="bad zip archive"):
        open_file(tmp_path / "v.pt")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}" + b"N0" * 2_000_000 + b".")
    (tmp_path / "b.pt").write_bytes(buf.getvalue())
    with pytest.raises(FormatError, match="implausible size"):
        open_file(tmp_path / "b.pt")


@pytest.mark.parametrize("text,what", [
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join('*' + p for _ in range(10))}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
     "expands to more than"),
    ("a: &r [*r]\n", "nested deeper"),
    ("name: x\nwhen: 2001-13-45\n", "invalid YAML"),
    ("name: x\nextends: " + "x" * 300 + "\n", "no spec file found"),  # too long a file name: OSError before
    ("name: x\nextends: \"a\\0b\"\n", "no spec file found"),
])
def test_bad_yaml_refused_quickly(tmp_path, text, what):
    from inferflow.errors import SpecError
    from inferflow.spec.loader import load_spec

    p = tmp_path / "bomb.yaml"
    p.write_text(text)
    with pytest.raises(SpecError, match=what):
        load_spec(p)


def test_llama2c_checkpoint_with_infinite_dim(tmp_path):
    from inferflow.errors import FormatError
    from inferflow.loaders import open_file

    torch.save({"model": {"tok_embeddings.weight": torch.zeros(8, 8)},
                "model_args": {"dim": float("inf"), "n_layers": 1, "n_heads": 2}}, tmp_path / "c.pt")
    with pytest.raises(FormatError, match="model_args"):
        open_file(tmp_path / "c.pt")


@pytest.mark.parametrize("weight_map", [{"w": ["a.safetensors"]}, {"w": "x" * 300 + ".safetensors"},
                                        {"w": "a\0.safetensors"}])
def test_index_with_bad_shard_names_refused(tmp_path, weight_map):
    import json

    from inferflow.errors import FormatError
    from inferflow.loaders import open_folder

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="model.safetensors.index.json"):
        open_folder(tmp_path)
