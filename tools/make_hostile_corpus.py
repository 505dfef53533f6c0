"""Build tests/data/hostile/: small model files that try to run code or to make the readers misbehave.

    PYTHONPATH=. python tools/make_hostile_corpus.py [--out tests/data/hostile]

Deterministic (no torch.save, no clocks: zip entries carry a fixed date), so tests/test_hostile_corpus.py can
check that the committed files are exactly what this script writes. MANIFEST.json maps each file to the error
class it must be refused with and a phrase of the expected message.

Every code-running payload aims at the current directory or the environment, so a test that loads the corpus
from an empty directory sees any side effect: it would create ``inferflow_hostile_canary`` (a file), set
``INFERFLOW_HOSTILE_CANARY`` (an environment variable) or import ``inferflow_hostile_canary`` (a module).
Python's own unpickler runs these payloads; inferflow's reader must refuse them without running anything.
"""
from __future__ import annotations

import argparse
import io
import json
import struct
import zipfile
from pathlib import Path
from typing import Callable

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "hostile"
CANARY = "inferflow_hostile_canary"
CMD = f"touch {CANARY}"
CODE = f"open({CANARY!r}, 'w').close()"
ENV = "__import__('os').environ.setdefault('INFERFLOW_HOSTILE_CANARY', '1')"
UNSAFE, FORMAT = "UnsafeFileError", "FormatError"


# ---- pickle opcodes ---------------------------------------------------------------------------------------------
def u(s: str) -> bytes:  # BINUNICODE
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def su(s: str) -> bytes:  # SHORT_BINUNICODE
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def g(mod: str, name: str) -> bytes:  # GLOBAL
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def sg(mod: str, name: str) -> bytes:  # STACK_GLOBAL
    return su(mod) + su(name) + b"\x93"


def call1(fn: bytes, arg: bytes) -> bytes:  # fn(arg) through REDUCE
    return fn + arg + b"\x85R"


P2, P4 = b"\x80\x02", b"\x80\x04"
SYSTEM = call1(g("os", "system"), u(CMD))
EVAL = call1(g("builtins", "eval"), u(ENV))
STORAGE = b"(" + u("storage") + g("torch", "FloatStorage") + u("0") + u("cpu") + b"K\x04tQ"


def tensor(storage: bytes = STORAGE, hooks: bytes = g("collections", "OrderedDict") + b")R") -> bytes:
    """_rebuild_tensor_v2(storage, 0, (4,), (1,), False, hooks)"""
    return g("torch._utils", "_rebuild_tensor_v2") + b"(" + storage + b"K\x00K\x04\x85K\x01\x85\x89" + hooks + b"tR"


def state(*items: tuple[str, bytes]) -> bytes:
    """An OrderedDict state dict {name: value, ...}."""
    return g("collections", "OrderedDict") + b")R(" + b"".join(u(k) + v for k, v in items) + b"u"


PICKLES: dict[str, tuple[bytes, str, str]] = {  # name -> (pickle, error class, phrase of the message)
    "global_reduce_os_system": (P2 + SYSTEM + b".", UNSAFE, "refusing global os.system"),
    "stack_global_eval": (P4 + call1(sg("builtins", "eval"), u(ENV)) + b".", UNSAFE, "builtins.eval"),
    "inst_exec": (P2 + b"(" + u(CODE) + b"ibuiltins\nexec\n.", UNSAFE, "builtins.exec"),
    "obj_popen": (P2 + b"(" + g("subprocess", "Popen") + b"(" + u("touch") + u(CANARY) + b"lo.", UNSAFE,
                  "subprocess.Popen"),
    "newobj_popen": (P2 + g("subprocess", "Popen") + b"(" + u("touch") + u(CANARY) + b"l\x85\x81.", UNSAFE,
                     "subprocess.Popen"),
    "newobj_ex_exec": (P4 + g("builtins", "exec") + u(CODE) + b"\x85}\x92.", UNSAFE, "builtins.exec"),
    "newobj_ex_allowed_global": (P4 + g("torch._utils", "_rebuild_tensor_v2") + b")}\x92.", UNSAFE, "NEWOBJ_EX"),
    "build_state_os_system": (P2 + g("collections", "OrderedDict") + b")R" + SYSTEM + b"b.", UNSAFE, "os.system"),
    "build_on_tuple": (P2 + call1(g("torch", "Size"), b")") + b"}b.", UNSAFE, "BUILD on tuple"),
    "import_module": (P4 + call1(sg("importlib", "import_module"), u(CANARY)) + b".", UNSAFE, "importlib"),
    "getattr_chain": (P2 + g("builtins", "getattr") + b"(" + call1(g("builtins", "__import__"), u("os"))
                      + u("system") + b"tR" + u(CMD) + b"\x85R.", UNSAFE, "builtins.getattr"),
    "dotted_stack_global": (P4 + sg("torch._utils", "_rebuild_tensor_v2.__globals__") + b".", UNSAFE,
                            "_rebuild_tensor_v2.__globals__"),
    "setattr": (P2 + g("builtins", "setattr") + b"(" + g("os", "environ") + u("x") + u("y") + b"tR.", UNSAFE,
                "builtins.setattr"),
    "memo_smuggled_global": (P2 + g("os", "system") + b"q\x010h\x01" + u(CMD) + b"\x85R.", UNSAFE, "os.system"),
    "persistent_id_with_call": (P2 + b"(" + u("storage") + SYSTEM + u("0") + u("cpu") + b"K\x04tQ.", UNSAFE,
                                "os.system"),
    "persistent_id_text": (P2 + b"Pos.system\n.", FORMAT, "persistent id"),
    "tensor_hooks_os_system": (P2 + state(("w", tensor(hooks=SYSTEM))) + b".", UNSAFE, "os.system"),
    "parameter_eval": (P2 + state(("w", g("torch._utils", "_rebuild_parameter") + b"(" + tensor() + b"\x89"
                                       + EVAL + b"tR")) + b".", UNSAFE, "builtins.eval"),
    "storage_type_os_system": (P2 + state(("w", tensor(b"(" + u("storage") + SYSTEM + u("0") + u("cpu")
                                                        + b"K\x04tQ"))) + b".", UNSAFE, "os.system"),
    "extension_code": (P2 + b"\x82\x01.", UNSAFE, "extension-registry"),
    "torch_load_from_bytes": (P2 + call1(g("torch.storage", "_load_from_bytes"), b"C\x04abcd") + b".", UNSAFE,
                              "torch.storage._load_from_bytes"),
    "numpy_reconstruct": (P2 + g("numpy.core.multiarray", "_reconstruct") + b"(" + g("numpy", "ndarray")
                          + b"K\x00\x85C\x01btR.", UNSAFE, "numpy.core.multiarray._reconstruct"),
    "proto0_eval": (b"c__builtin__\neval\n(V" + ENV.encode() + b"\ntR.", UNSAFE, "__builtin__.eval"),
    "reduce_on_dtype": (P2 + g("torch", "float16") + b")R.", UNSAFE, "REDUCE of torch.float16"),
    "huge_storage_numel": (P2 + state(("w", tensor(b"(" + u("storage") + g("torch", "FloatStorage") + u("0") + u("cpu")
                                                    + b"\x8a\x08" + (1 << 50).to_bytes(8, "little") + b"tQ")))
                           + b".", FORMAT, "more than the file can hold"),
    "view_past_storage": (P2 + state(("w", g("torch._utils", "_rebuild_tensor_v2") + b"(" + STORAGE
                                      + b"K\x02K\x04\x85K\x01\x85\x89)tR")) + b".", FORMAT, "runs past storage"),
    "deep_tuples": (P2 + b")" + b"\x85" * 5000 + b".", FORMAT, "nested deeper"),
}


STORAGE_FIRST = {"tensor_hooks_os_system", "parameter_eval", "huge_storage_numel", "view_past_storage"}


def torch_zip(pkl: bytes, members: dict[str, bytes] | None = None, compress: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, body in {"archive/data.pkl": pkl, "archive/byteorder": b"little", "archive/data/0": b"\0" * 16,
                           **(members or {})}.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compress
            z.writestr(info, body)
    return buf.getvalue()


def corrupt_deflate() -> bytes:
    """A deflated storage whose stream is broken (an invalid block type): zlib raises its own error type."""
    data = bytearray(torch_zip(P2 + state(("w", tensor())) + b".", compress=zipfile.ZIP_DEFLATED))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = z.getinfo("archive/data/0")
    data[info.header_offset + 30 + len(info.filename)] = 0xFF
    return bytes(data)


LEGACY_MAGIC = P2 + b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."
LEGACY_PROTO = P2 + b"M\xe9\x03."
SYS_INFO = P2 + b"}(" + u("protocol_version") + b"M\xe9\x03" + u("little_endian") + b"\x88" + u("type_sizes") \
    + b"}(" + u("short") + b"K\x02" + u("int") + b"K\x04" + u("long") + b"K\x04uu."
KEYS = P2 + b"]" + u("0") + b"a."


def legacy(payload: bytes, sys_info: bytes = SYS_INFO) -> bytes:
    """The pre-1.6 torch.save stream: magic, protocol, sys info, the object, storage keys, storage data."""
    return LEGACY_MAGIC + LEGACY_PROTO + sys_info + payload + KEYS + struct.pack("<q", 4) + b"\0" * 16


# ---- GGUF -----------------------------------------------------------------------------------------------------
def gs(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_str(k: str, v: str) -> bytes:
    return gs(k) + struct.pack("<I", 8) + gs(v)


def kv_u32(k: str, v: int) -> bytes:
    return gs(k) + struct.pack("<II", 4, v)


def tinfo(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return gs(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) \
        + struct.pack("<IQ", qtype, offset)


def gguf(kvs: list[bytes], infos: list[bytes], data: bytes, version: int = 3, n_kv: int | None = None,
         n_tensors: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % 32) + data


ARCH = kv_str("general.architecture", "llama")
A, B = tinfo("a.weight", [32, 2], 0, 0), tinfo("b.weight", [32], 0, 256)
DATA = b"\0" * 384
GGUFS: dict[str, tuple[bytes, str]] = {
    "lying_offset": (gguf([ARCH], [A, tinfo("b.weight", [32], 0, 1 << 40)], DATA), "outside the file"),
    "overlapping_tensors": (gguf([ARCH], [A, tinfo("b.weight", [32], 0, 128)], DATA), "overlap"),
    "unknown_type": (gguf([ARCH], [tinfo("a.weight", [32, 2], 99, 0)], DATA), "unknown ggml type"),
    "huge_array_count": (gguf([ARCH, gs("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 60)], [], b""),
                         "array 'tokenizer.ggml.tokens'"),
    "huge_string_length": (gguf([gs("general.architecture") + struct.pack("<IQ", 8, 1 << 62)], [], b""),
                           "value of 'general.architecture'"),
    "huge_key_length": (gguf([struct.pack("<Q", 1 << 62) + b"general.architecture"], [], b""), "metadata key"),
    "huge_kv_count": (gguf([ARCH], [], b"", n_kv=1 << 60), "cannot fit"),
    "huge_tensor_count": (gguf([ARCH], [], b"", n_tensors=1 << 40), "cannot fit"),
    "huge_dims": (gguf([ARCH], [tinfo("a.weight", [32, 1 << 50], 0, 0)], DATA), "outside the file"),
    "huge_dim_times_zero": (gguf([ARCH], [tinfo("a.weight", [32, 0, 1 << 63], 0, 0)], DATA), "out of range"),
    "too_many_dims": (gguf([ARCH], [tinfo("a.weight", [32, 1, 1, 1, 2], 0, 0)], DATA), "dimensions"),
    "misaligned_offset": (gguf([ARCH], [A, tinfo("b.weight", [32], 0, 260)], DATA), "not a multiple"),
    "partial_block": (gguf([ARCH], [tinfo("a.weight", [33], 8, 0)], DATA), "block size"),
    "bad_alignment": (gguf([ARCH, kv_u32("general.alignment", 24)], [A], DATA), "power of two"),
    "nested_array": (gguf([ARCH, gs("x") + struct.pack("<IIQ", 9, 9, 1)], [], b""), "nested arrays"),
    "duplicate_tensor": (gguf([ARCH], [A, tinfo("a.weight", [32], 0, 256)], DATA), "duplicate tensor"),
    "duplicate_key": (gguf([ARCH, ARCH], [], b""), "duplicate metadata key"),
    "unknown_value_type": (gguf([ARCH, gs("x") + struct.pack("<I", 77)], [], b""), "unknown value type"),
    "big_endian": (gguf([ARCH], [], b"", version=3 << 24), "big-endian"),
    "truncated_header": (gguf([ARCH, kv_str("general.name", "x" * 64)], [], b"")[:60], "truncated"),
    "name_not_utf8": (gguf([ARCH], [tinfo("a\xff", [32], 0, 0)], DATA).replace(b"a\xc3\xbf", b"a\xff\xfe"),
                      "UTF-8"),
}


# ---- safetensors ----------------------------------------------------------------------------------------------
def st(header: dict | bytes, data: bytes = b"\0" * 16, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, sort_keys=True).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def t(dtype: str = "F32", shape: list | None = None, offs: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [2, 2] if shape is None else shape, "data_offsets": offs or [0, 16]}


SAFETENSORS: dict[str, tuple[bytes, str]] = {
    "offset_past_end": (st({"w": t(offs=[0, 1 << 40])}), "outside the data section"),
    "overlapping": (st({"a": t(shape=[2], offs=[0, 8]), "b": t(shape=[2], offs=[4, 12])}), "overlap"),
    "huge_header_length": (st({"w": t()}, length=1 << 62), "header length"),
    "header_length_past_file": (st({"w": t()}, length=4096), "exceeds the file"),
    "not_json": (st(b"{'w': not json at all}"), "not valid JSON"),
    "not_utf8": (st(b'{"w\xff": 1}'), "not valid JSON"),
    "deep_json": (st(b"[" * 20000 + b"]" * 20000), "not valid JSON"),
    "long_integer": (st(b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 16]}}'),
                     "not valid JSON"),
    "dtype_shape_mismatch": (st({"w": t(shape=[3, 3])}), "needs 36 bytes"),
    "unknown_dtype": (st({"w": t(dtype="F128")}), "unsupported dtype"),
    "dtype_not_a_string": (st(b'{"w": {"dtype": ["F32"], "shape": [2, 2], "data_offsets": [0, 16]}}'),
                           "unsupported dtype"),
    "negative_shape": (st({"w": t(shape=[-2, -2])}), "bad shape"),
    "huge_dim_times_zero": (st({"w": t(shape=[1 << 70, 0], offs=[0, 0])}), "bad shape"),
    "negative_offsets": (st({"w": t(offs=[-16, 0])}), "data_offsets"),
    "header_not_object": (st(b"[1, 2, 3]"), "JSON object"),
    "metadata_not_object": (st({"__metadata__": [1], "w": t()}), "__metadata__"),
    "short_file": (b"\x10\0\0", "shorter than"),
}


# ---- llama2.c -------------------------------------------------------------------------------------------------
def l2c_v1(dim: int, hidden: int, layers: int, heads: int, kv: int, vocab: int, seq: int, shared: int = 1,
           version: int = 1, group: int = 0, body: int = 64) -> bytes:
    head = struct.pack("<Ii7iB", 0x616B3432, version, dim, hidden, layers, heads, kv, vocab, seq, shared)
    if version == 2:
        head += struct.pack("<i", group)
    return head.ljust(256, b"\0") + b"\0" * body


LLAMA2C: dict[str, tuple[bytes, str]] = {
    "huge_dims": (l2c_v1(1 << 30, 1 << 30, 1 << 20, 8, 8, 1 << 30, 1 << 30), "implausible"),
    "heads_not_dividing_dim": (l2c_v1(64, 96, 2, 5, 5, 96, 64), "implausible"),
    "zero_heads": (l2c_v1(64, 96, 2, 0, 0, 96, 64), "implausible"),
    "negative_layers": (l2c_v1(64, 96, -2, 4, 2, 96, 64), "implausible"),
    "kv_heads_above_heads": (l2c_v1(64, 96, 2, 4, 8, 96, 64), "implausible"),
    "truncated_weights": (l2c_v1(64, 96, 2, 4, 2, 96, 64), "header needs"),
    "v2_group_zero": (l2c_v1(64, 96, 2, 4, 2, 96, 64, version=2, group=0), "group size"),
    "v2_group_not_dividing": (l2c_v1(64, 96, 2, 4, 2, 96, 64, version=2, group=48), "group size"),
    "unknown_version": (l2c_v1(64, 96, 2, 4, 2, 96, 64, version=9), "unsupported version"),
    "short_v1": (l2c_v1(64, 96, 2, 4, 2, 96, 64)[:100], "unsupported version"),
}


def build() -> dict[str, bytes]:
    """file name -> bytes, including MANIFEST.json (file -> [error class, phrase])."""
    files: dict[str, bytes] = {}
    manifest: dict[str, list[str]] = {}

    def add(name: str, data: bytes, error: str, phrase: str) -> None:
        files[name], manifest[name] = data, [error, phrase]

    for name, (pkl, error, phrase) in PICKLES.items():
        add(f"pickle_{name}.pt", torch_zip(pkl), error, phrase)
        # a bare stream is read as a legacy torch file whose header pickles may not name storages: the tensor
        # payloads stop at their first persistent id, before the code they carry
        raw = (FORMAT, "persistent id outside") if name in STORAGE_FIRST else (error, phrase)
        if not pkl.startswith(b"\x80"):  # protocol 0 has no PROTO opcode: not recognised as a torch file at all
            raw = (FORMAT, "unrecognised model file")
        add(f"pickle_{name}.raw.pkl", pkl, *raw)
        add(f"pickle_{name}.legacy.bin", legacy(pkl), error, phrase)
    add("pickle_in_legacy_sys_info.legacy.bin", legacy(P2 + b"}.", sys_info=P2 + SYSTEM + b"."), UNSAFE, "os.system")
    add("pickle_in_legacy_keys.legacy.bin", LEGACY_MAGIC + LEGACY_PROTO + SYS_INFO + P2 + b"}." + P2 + SYSTEM + b".",
        UNSAFE, "os.system")
    add("pickle_zip_bomb.pt", torch_zip(P2 + b"}" + b"N0" * 400_000 + b".", compress=zipfile.ZIP_DEFLATED), FORMAT,
        "implausible size")
    add("pickle_corrupt_deflate.pt", corrupt_deflate(), FORMAT, "zip member archive/data/0")
    add("pickle_missing_storage_member.pt", torch_zip(P2 + state(("w", tensor())) + b".", {})
        .replace(b"archive/data/0", b"archive/data/9"), FORMAT, "missing or smaller")
    for name, (data, phrase) in GGUFS.items():
        add(f"gguf_{name}.gguf", data, FORMAT, phrase)
    for name, (data, phrase) in SAFETENSORS.items():
        add(f"safetensors_{name}.safetensors", data, FORMAT, phrase)
    for name, (data, phrase) in LLAMA2C.items():
        add(f"llama2c_{name}.bin", data, FORMAT, phrase)
    files["MANIFEST.json"] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    return files


def write(out: Path, files: Callable[[], dict[str, bytes]] = build) -> int:
    out.mkdir(parents=True, exist_ok=True)
    built = files()
    for old in out.iterdir():
        if old.is_file() and old.name not in built:
            old.unlink()
    for name, data in built.items():
        (out / name).write_bytes(data)
    return sum(len(d) for d in built.values())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    total = write(args.out)
    print(f"wrote {len(list(args.out.iterdir()))} files, {total} bytes, to {args.out}")
