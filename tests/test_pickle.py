"""Safe PyTorch pickle loading: torch.save zip / legacy files, shards, views, and hostile or broken files."""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import save_file

import inferflow
from inferflow.errors import FormatError, UnsafeFileError
from inferflow.loaders import open_file
from inferflow.loaders.pickle_source import PickleSource
from parity import check_decoder, save, sequences
from service_helpers import tiny_llama_ref

VOCAB = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = tiny_llama_ref(VOCAB, max_position_embeddings=64)
    return ref, save(ref, tmp_path_factory.mktemp("st"))


def _folder(tmp_path, tiny, name="m"):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(tiny[1] / "config.json", d / "config.json")
    return d


def _logits(path):
    return inferflow.load(path, spec="llama").logits(sequences(VOCAB))  # spec given: skip matching every spec


def _state(ref, dtype):
    return {k: v.detach().to(dtype).clone() for k, v in ref.state_dict().items()}


def test_zip_folder_parity(tiny, tmp_path):
    ref, _ = tiny
    d = _folder(tmp_path, tiny)
    torch.save(ref.state_dict(), d / "pytorch_model.bin")
    m = check_decoder(ref, d, VOCAB)
    assert isinstance(m.source, PickleSource) and m.spec.name == "llama"


@pytest.mark.parametrize("how,dtype", [("zip", torch.float32), ("zip", torch.float16), ("zip", torch.bfloat16),
                                       ("legacy", torch.float32), ("legacy", torch.float16), ("legacy", torch.bfloat16),
                                       ("proto4", torch.float16)])
def test_formats_equal_safetensors(tiny, tmp_path, how, dtype):
    ref, st = tiny
    sd = _state(ref, dtype)
    d, s = _folder(tmp_path, tiny, "bin"), _folder(tmp_path, tiny, "st")
    save_file({k: v.contiguous() for k, v in sd.items()}, s / "model.safetensors")
    kw = {"legacy": {"_use_new_zipfile_serialization": False}, "proto4": {"pickle_protocol": 4}}.get(how, {})
    torch.save(sd, d / "pytorch_model.bin", **kw)
    assert torch.equal(_logits(d), _logits(s))


def test_sharded_index(tiny, tmp_path):
    ref, st = tiny
    sd = _state(ref, torch.float32)
    d = _folder(tmp_path, tiny)
    names = sorted(sd)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for zipped, (f, keys) in zip((True, False), shards.items()):  # one zip shard, one legacy shard
        torch.save({k: sd[k] for k in keys}, d / f, _use_new_zipfile_serialization=zipped)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(_logits(d), _logits(st))


def test_single_file_nested_and_compressed(tiny, tmp_path):
    ref, st = tiny
    d = _folder(tmp_path, tiny)
    raw = tmp_path / "raw.pt"
    torch.save({"model": {"_orig_mod." + k: v for k, v in ref.state_dict().items()}, "step": 7,
                "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}, "loss": torch.tensor(1.5)}, raw)
    with zipfile.ZipFile(raw) as zin, zipfile.ZipFile(d / "model.pt", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with zipfile.ZipFile(d / "model.pt") as z:
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    assert torch.equal(_logits(d / "model.pt"), _logits(st))


@pytest.mark.parametrize("legacy", [False, True])
def test_shared_storage_views_strides(tmp_path, legacy):
    base = torch.randn(6, 5)
    flat = torch.arange(40, dtype=torch.float64)
    sd = {"base": base, "t": base.t(), "block": base[1:, 2:4], "row": base[3], "col": base[:, 1],
          "strided": flat.as_strided((3, 4), (1, 9), 2), "tail": flat[30:], "step": flat[::3],
          "half": torch.randn(4, 4).half()[:, ::2], "long": torch.arange(5), "b": torch.tensor([True, False]),
          "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "param": torch.nn.Parameter(torch.randn(2))}
    torch.save(sd, tmp_path / "v.pt", _use_new_zipfile_serialization=not legacy)
    src = PickleSource(tmp_path / "v.pt")
    for k, v in sd.items():
        t = src.get(k)
        assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (v.dtype, v.shape, v.stride(),
                                                                      v.storage_offset()), k
        assert torch.equal(t, v.detach()), k
    # views of one storage share memory, as they did when saved
    assert src.get("t").untyped_storage().data_ptr() == src.get("base").untyped_storage().data_ptr()
    assert src.get("base").data_ptr() + 4 * 5 * 3 == src.get("row").data_ptr()


# ---- hostile files -------------------------------------------------------------------------------------
def _u(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _su(s):
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _g(mod, name):
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def _system(marker):
    return _g("os", "system") + _u(f"touch '{marker}'") + b"\x85R"


def _payloads(tmp):
    m = lambda n: tmp / f"marker_{n}"  # noqa: E731
    code = lambda n: f"open({str(m(n))!r}, 'w').close()"  # noqa: E731
    (tmp / "ifl_marker_mod.py").write_text(code("import_module") + "\n")
    storage = b"((" + _u("storage") + _g("torch", "FloatStorage") + _u("0") + _u("cpu") + b"K\x04tQ"
    return {
        "global_reduce": b"\x80\x02" + _system(m("global_reduce")) + b".",
        "stack_global_eval": b"\x80\x04" + _su("builtins") + b"\x94" + _su("eval") + b"\x94\x93"
                             + _su(code("stack_global_eval")) + b"\x85R.",
        "inst_exec": b"\x80\x02(" + _u(code("inst_exec")) + b"ibuiltins\nexec\n.",
        "obj_popen": b"\x80\x02(" + _g("subprocess", "Popen") + b"(" + _u("touch") + _u(str(m("obj_popen")))
                     + b"lo.",
        "import_module": b"\x80\x04" + _su("importlib") + _su("import_module") + b"\x93" + _su("ifl_marker_mod")
                         + b"\x85R.",
        "build_state": b"\x80\x02" + _g("collections", "OrderedDict") + b")R" + _system(m("build_state")) + b"b.",
        "newobj_ex": b"\x80\x04" + _g("collections", "OrderedDict") + _g("builtins", "exec") + _u(code("newobj_ex"))
                     + b"\x85R\x85}\x92.",
        "tensor_args": b"\x80\x02" + _g("collections", "OrderedDict") + b")R(" + _u("w")
                       + _g("torch._utils", "_rebuild_tensor_v2") + storage + b"K\x00K\x04\x85K\x01\x85\x89"
                       + _system(m("tensor_args")) + b"tRu.",
    }


def _torch_zip(path, pkl, data=b"\0" * 16):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", data)


def test_hostile_pickles_refused_and_never_run(tiny, tmp_path):
    payloads = _payloads(tmp_path)
    for name, pkl in payloads.items():
        (tmp_path / f"{name}.raw").write_bytes(pkl)
        _torch_zip(tmp_path / f"{name}.pt", pkl)
        d = _folder(tmp_path, tiny, name)
        _torch_zip(d / "pytorch_model.bin", pkl)
        # a bare stream is read as a legacy torch file, whose header pickles may not reference storages
        raw_error = FormatError if name == "tensor_args" else UnsafeFileError
        for attempt, error in ((lambda: open_file(tmp_path / f"{name}.raw"), raw_error),
                               (lambda: open_file(tmp_path / f"{name}.pt"), UnsafeFileError),
                               (lambda: inferflow.load(d), UnsafeFileError)):
            with pytest.raises(error):
                attempt()
    assert "ifl_marker_mod" not in sys.modules
    assert not list(tmp_path.glob("marker_*"))
    # The same bytes are real exploits for Python's own unpickler: each one creates its marker.
    script = ("import pickle, sys\nclass U(pickle.Unpickler):\n    def persistent_load(self, pid): return None\n"
              "for p in sys.argv[1:]:\n    try: U(open(p, 'rb')).load()\n    except Exception: pass\n")
    subprocess.run([sys.executable, "-c", script, *[str(tmp_path / f"{n}.raw") for n in payloads]], cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60, check=True)
    for _ in range(50):
        if all((tmp_path / f"marker_{n}").exists() for n in payloads):
            break
        subprocess.run(["sleep", "0.1"])
    assert sorted(p.name for p in tmp_path.glob("marker_*")) == sorted(f"marker_{n}" for n in payloads)


@pytest.mark.parametrize("pkl,what", [
    (b"\x80\x04" + _g("torch._utils", "_rebuild_tensor_v2") + b")}\x92.", "NEWOBJ_EX"),
    (b"\x80\x02" + _g("torch", "float16") + b")R.", "REDUCE of torch.float16"),
    (b"\x80\x02]}b.", "BUILD on list"),
    (b"\x80\x02" + _g("torch", "FloatStorage") + b"K\x01a.", "APPEND"),
    (b"\x80\x02\x82\x01.", "extension"),
    (b"\x80\x02" + _g("torch", "load") + b".", "global torch.load"),
])
def test_refusals_without_globals(tmp_path, pkl, what):
    _torch_zip(tmp_path / "x.pt", pkl)
    with pytest.raises(UnsafeFileError, match=what):
        open_file(tmp_path / "x.pt")


# ---- malformed files ---------------------------------------------------------------------------------
def _expect_format_error_or_ok(path):
    try:
        src = open_file(path)
        for n in src.names():
            src.get(n)
    except FormatError:
        pass


def test_truncated_and_garbage(tmp_path):
    sd = {"a": torch.randn(8, 4), "b": torch.randn(3).half()}
    for legacy in (False, True):
        torch.save(sd, tmp_path / "ok.pt", _use_new_zipfile_serialization=not legacy)
        data = (tmp_path / "ok.pt").read_bytes()
        for n in list(range(1, 64)) + list(range(64, len(data), 7)):
            (tmp_path / "cut.pt").write_bytes(data[:n])
            with pytest.raises(FormatError):
                open_file(tmp_path / "cut.pt").get("a")
        rng = random.Random(legacy)
        for _ in range(150):
            b = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            (tmp_path / "fuzz.pt").write_bytes(bytes(b))
            _expect_format_error_or_ok(tmp_path / "fuzz.pt")
    (tmp_path / "junk.bin").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(1000)))
    with pytest.raises(FormatError):
        open_file(tmp_path / "junk.bin")


@pytest.mark.parametrize("pkl", [
    b"\x80\x02X\xff\xff\xff\xff.",  # string longer than the file
    b"\x80\x02" + b"\x85" * 10 + b".",  # stack underflow
    b"\x80\x02h\x07.",  # memo never stored
    b"\x80\x02)" + b"\x85" * 200000 + b"K\x01\x86}(\x85\x00\x00u.",  # tuple nesting that would overflow hashing
    b"\x80\x02(" * 10 + b"\x8b\x00\x00\x00\x80.",  # LONG4 past the end
    b"\x80\x02}(]K\x01u.",  # list as dict key
    b"\x80\x02\x95\xff\xff\xff\xff\xff\xff\xff\x7f.",  # frame longer than the file
    b"\x80\x02" + _g("torch._utils", "_rebuild_tensor_v2") + b"((" + _u("storage") + _g("torch", "FloatStorage")
    + _u("0") + _u("cpu") + b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x01tQK\x00K\x01\x85K\x01\x85\x89)tR.",  # huge numel
    b"\x80\x02" + _g("torch._utils", "_rebuild_tensor_v2") + b"((" + _u("storage") + _g("torch", "FloatStorage")
    + _u("0") + _u("cpu") + b"K\x04tQK\x02K\x04\x85K\x01\x85\x89)tR.",  # view past the storage end
])
def test_malformed_pickles(tmp_path, pkl):
    _torch_zip(tmp_path / "x.pt", pkl)
    with pytest.raises(FormatError):
        src = open_file(tmp_path / "x.pt")
        for n in src.names():
            src.get(n)
