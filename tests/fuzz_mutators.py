"""Structure-aware mutators for the fuzz targets (tests/fuzz_targets.py): generic byte damage biased to headers
(interesting integers where counts, lengths and offsets live), pickle opcodes inserted or removed at opcode
boundaries (hostile ones included), JSON/YAML documents edited node by node, YAML alias bombs, INI lines."""
from __future__ import annotations

import json
import random
import struct
from typing import Any

INTERESTING = [0, 1, 2, 7, 8, 31, 32, 63, 64, 127, 128, 255, 256, 4096, 65535, 65536, 0x7FFFFFFF, 0x80000000,
               0xFFFFFFFF, 1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def _int_bytes(rng: random.Random, data: bytes) -> bytes:
    v = rng.choice(INTERESTING + [len(data), len(data) + 1, len(data) - 1, rng.randrange(1 << 16)])
    width = rng.choice((1, 2, 4, 8))
    v &= (1 << (8 * width)) - 1
    return v.to_bytes(width, "little")


def mutate_bytes(data: bytes, rng: random.Random, head: int = 4096) -> bytes:
    """Generic mutations, biased to the first ``head`` bytes (where headers, counts and offsets live)."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 5))):
        n = len(b)
        pos = rng.randrange(min(n, head) if rng.random() < 0.8 else n) if n else 0
        op = rng.randrange(7)
        if op == 0 and n:  # flip bits
            b[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # random byte
            b[pos] = rng.randrange(256)
        elif op == 2:  # interesting integer
            x = _int_bytes(rng, data)
            b[pos:pos + len(x)] = x
        elif op == 3:  # truncate
            del b[rng.randrange(n + 1):]
        elif op == 4 and n:  # delete a span
            del b[pos:pos + rng.randrange(1, 64)]
        elif op == 5 and n:  # duplicate a span elsewhere
            src = rng.randrange(n)
            chunk = b[src:src + rng.randrange(1, 64)]
            b[pos:pos] = chunk
        else:  # insert junk
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    return bytes(b)


def _pickle_snippets() -> list[bytes]:
    def u(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s.encode())) + s.encode()

    return [b"(", b"t", b"l", b"d", b"}", b"]", b")", b"N", b"\x85", b"\x86", b"\x87", b"R", b"b", b"\x81", b"\x92",
            b"o", b"e", b"u", b"s", b"a", b"0", b"1", b"2", b"\x94", b"h\x00", b"h\x05", b"q\x01", b"j\xff\xff\xff\x7f",
            b"K\x07", b"J\xff\xff\xff\xff", b"\x8a\x08" + b"\xff" * 8, b"X\xff\xff\xff\x7f", b"\x8e" + b"\xff" * 8,
            b"\x95" + b"\xff" * 8, b"I99999999999999999999\n", b"L1" + b"0" * 40 + b"L\n", b"F1e999\n",
            b"cos\nsystem\n", b"cbuiltins\neval\n", b"\x8c\x08builtins\x8c\x04exec\x93",
            b"ctorch._utils\n_rebuild_tensor_v2\n", b"ctorch\nFloatStorage\n", b"ccollections\nOrderedDict\n",
            b"(" + u("storage") + b"ctorch\nFloatStorage\n" + u("0") + u("cpu") + b"\x8a\x08" + b"\xff" * 7 + b"\x7ftQ",
            b"P0\n", b"Q", b"\x82\x01", b"\x97", b"\x98", b"\x8f", b"\x90", b"\x91", b"S'abc'\n", b"V\\u12\n",
            b"\x80\x05", b"\x80\x06", b"."]


_SNIPPETS: list[bytes] = []


def mutate_pickle(data: bytes, rng: random.Random) -> bytes:
    """Opcode-aware: delete, duplicate or insert opcodes (hostile ones included) at opcode boundaries."""
    import pickletools

    if not _SNIPPETS:
        _SNIPPETS.extend(_pickle_snippets())
    try:
        cuts = [pos for _, _, pos in pickletools.genops(data)] + [len(data)]
    except Exception:  # noqa: BLE001 - already mutated beyond parsing: fall back to bytes
        return mutate_bytes(data, rng)
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        cuts = [c for c in cuts if c <= len(b)] or [0]
        i = rng.randrange(len(cuts))
        pos = cuts[i]
        op = rng.randrange(4)
        if op == 0 and i + 1 < len(cuts):  # delete one opcode
            del b[pos:cuts[i + 1]]
        elif op == 1 and i + 1 < len(cuts):  # repeat one opcode
            b[pos:pos] = b[pos:cuts[i + 1]] * rng.choice((1, 2, 50))
        elif op == 2:
            b[pos:pos] = rng.choice(_SNIPPETS)
        else:
            return mutate_bytes(bytes(b), rng)
    return bytes(b)


EVIL_VALUES: list[Any] = [None, True, -1, 0, 1 << 62, -(1 << 62), 1 << 64, 1.5, float("inf"), "", "x" * 300, "F32",
                          "Q8_0", [], [1 << 62, 1 << 62], [-1], [[[[]]]], {}, {"a": 1}, [0, 1 << 63], "${1 << 99}",
                          "$nope", "${hidden_size ** 99}", [None]]


def _walk(doc: Any, rng: random.Random, depth: int = 0) -> Any:
    """Replace, delete or add one randomly chosen node of a JSON/YAML document (a dict gets a hostile key, a list
    a duplicated item)."""
    if isinstance(doc, (dict, list)) and doc and depth < 12 and rng.random() < 0.75:
        k = rng.choice(list(doc)) if isinstance(doc, dict) else rng.randrange(len(doc))
        r = rng.random()
        if r < 0.1:
            del doc[k]
        elif r < 0.15 and isinstance(doc, dict):
            doc[rng.choice(["extends", "__metadata__", "zz", k + "x"])] = rng.choice(EVIL_VALUES)
        elif r < 0.15:
            doc.append(doc[k])
        else:
            doc[k] = _walk(doc[k], rng, depth + 1)
        return doc
    return rng.choice(EVIL_VALUES)


def mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    """Edit the JSON header (dtype, shape, offsets, metadata), or lie about its length, or damage bytes."""
    r = rng.random()
    if r < 0.5 and len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        try:
            header = json.loads(data[8:8 + n])
        except ValueError:
            return mutate_bytes(data, rng)
        header = _walk(header, rng)
        raw = json.dumps(header, allow_nan=True).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    if r < 0.6:
        return struct.pack("<Q", rng.choice(INTERESTING)) + data[8:]
    return mutate_bytes(data, rng)


def mutate_json(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.6:
        text = data.decode("utf-8", "replace")
        lines = text.splitlines()
        body = "\n".join(ln for ln in lines if not ln.lstrip().startswith("#"))
        try:
            doc = json.loads(body)
        except ValueError:
            return mutate_bytes(data, rng)
        return json.dumps(_walk(doc, rng)).encode()
    return mutate_bytes(data, rng)


def mutate_yaml(data: bytes, rng: random.Random) -> bytes:
    import yaml

    r = rng.random()
    if r < 0.5:
        try:
            doc = yaml.safe_load(data)
        except yaml.YAMLError:
            return mutate_bytes(data, rng, head=len(data))
        return yaml.safe_dump(_walk(doc, rng), sort_keys=False).encode()
    if r < 0.6:  # alias bombs and deep nesting, the YAML-specific ways to allocate without bytes
        bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{c}: &{c} [{', '.join('*' + p for _ in range(10))}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
        return rng.choice([bomb.encode(), b"x: " + b"[" * 5000 + b"]" * 5000, b"x: &r [*r]\n",
                           data + b"\n" + bomb.encode()])
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    if r < 0.8:
        lines.insert(i, lines[rng.randrange(len(lines))])
    else:
        del lines[i]
    return mutate_bytes(b"\n".join(lines), rng, head=len(data)) if rng.random() < 0.3 else b"\n".join(lines)


def mutate_ini(data: bytes, rng: random.Random) -> bytes:
    lines = data.split(b"\n")
    for _ in range(rng.choice((1, 2, 3))):
        i = rng.randrange(len(lines))
        r = rng.random()
        if r < 0.3 and b"=" in lines[i]:
            k, _, _ = lines[i].partition(b"=")
            v = rng.choice(EVIL_VALUES)
            lines[i] = k + b"= " + json.dumps(v).encode()
        elif r < 0.5:
            lines.insert(i, rng.choice([b"[decoder.layers.steps.99999]", b"[a.0.1.2]", b"x.y.0 = 1", b"[spec]",
                                        b"name.0 = &a [*a]", b"[params.vocab_size]"]))
        elif r < 0.7:
            del lines[i]
        else:
            lines.insert(i, lines[rng.randrange(len(lines))])
    out = b"\n".join(lines)
    return mutate_bytes(out, rng, head=len(out)) if rng.random() < 0.3 else out
