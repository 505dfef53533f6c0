"""A pickle-opcode interpreter that never imports, calls or executes anything named by the file.

Python's unpickler resolves GLOBAL/STACK_GLOBAL/INST by importing, and REDUCE/NEWOBJ/OBJ/BUILD by
calling what it resolved, so a model file can run arbitrary code. Here every opcode of protocols 0-5
is interpreted by hand: containers and scalars become plain Python values, and a global is only a
lookup in a fixed allow-list (storage types, dtypes, OrderedDict, the tensor rebuilders); anything
else raises UnsafeFileError naming it. Calls are dispatched to our own handlers, never to the
objects the names would import. Malformed input raises FormatError; stack, memo and line sizes are
capped so a hostile stream cannot make us allocate far beyond its own length.
"""
from __future__ import annotations

import codecs
import struct
from typing import Any, Callable

from ..errors import FormatError, UnsafeFileError
from .pickle_globals import Func, describe

MAX_ITEMS = 1 << 22  # stack / memo / mark depth: far above any real checkpoint
MAX_LINE = 1 << 16
MAX_DEPTH = 100  # nesting of tuples/frozensets: hashing deeper ones overflows the C stack


def _clean(name: str) -> str:
    name = "".join(c if c.isprintable() else "?" for c in name)
    return name if len(name) <= 120 else name[:117] + "..."


class PickleMachine:
    """Runs one pickle stream (``data[pos:end]``) to its STOP and returns the value and the end offset."""

    def __init__(self, data: Any, where: str, globals_: dict[str, Any],
                 persistent_load: Callable[[Any], Any] | None = None, pos: int = 0, end: int | None = None):
        self.data, self.where, self.globals = data, where, globals_
        self.persistent_load = persistent_load
        self.pos, self.end = pos, len(data) if end is None else end
        self.stack: list[Any] = []
        self.meta: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.depth: dict[int, tuple[Any, int]] = {}  # id -> (object kept alive, nesting depth)

    # ---- reading ----------------------------------------------------------------------------------
    def fail(self, problem: str) -> FormatError:
        return FormatError(self.where, f"pickle at byte {self.pos}: {problem}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(f"truncated (needs {n} more bytes, {self.end - self.pos} left)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return bytes(b)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def line(self) -> str:
        stop = self.data.find(b"\n", self.pos, min(self.end, self.pos + MAX_LINE))
        if stop < 0:
            raise self.fail("unterminated text argument")
        raw = bytes(self.data[self.pos:stop])
        self.pos = stop + 1
        return raw.decode("utf-8")

    # ---- stack ------------------------------------------------------------------------------------
    def push(self, v: Any) -> None:
        if len(self.stack) >= MAX_ITEMS:
            raise self.fail(f"stack exceeds {MAX_ITEMS} items")
        if type(v) in (tuple, frozenset) and id(v) not in self.depth:
            d = 1 + max((self.depth.get(id(x), (None, 0))[1] for x in v if type(x) in (tuple, frozenset)), default=0)
            if d > MAX_DEPTH:
                raise self.fail(f"tuples nested deeper than {MAX_DEPTH}")
            self.depth[id(v)] = (v, d)
        self.stack.append(v)

    def pop(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.meta:
            raise self.fail("no MARK on the stack")
        items, self.stack = self.stack, self.meta.pop()
        return items

    def memo_put(self, idx: int, value: Any) -> None:
        if idx < 0 or (idx not in self.memo and len(self.memo) >= MAX_ITEMS):
            raise self.fail(f"bad memo index {idx} or memo exceeds {MAX_ITEMS} entries")
        self.memo[idx] = value

    def memo_get(self, idx: int) -> None:
        if idx not in self.memo:
            raise self.fail(f"memo index {idx} was never stored")
        self.push(self.memo[idx])

    # ---- globals and calls ------------------------------------------------------------------------
    def find_global(self, module: Any, name: Any) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.fail("global module and name must be strings")
        full = f"{module}.{name}"
        if full not in self.globals:
            raise UnsafeFileError(self.where, f"refusing global {_clean(full)}: only torch tensor/storage rebuilders, "
                                              f"dtypes and plain containers may appear in a model file")
        return self.globals[full]

    def call(self, fn: Any, args: Any, op: str, kwargs: Any = None) -> Any:
        if op in ("NEWOBJ", "NEWOBJ_EX") and isinstance(fn, Func) and fn.name == "collections.OrderedDict":
            return {}  # cls.__new__(OrderedDict, ...) is an empty mapping; items follow via SETITEMS
        if not isinstance(fn, Func) or op in ("NEWOBJ", "NEWOBJ_EX"):
            raise UnsafeFileError(self.where, f"refusing {op} of {_clean(describe(fn))}")
        if not isinstance(args, tuple) or kwargs:
            raise self.fail(f"{op} of {fn.name}: arguments must be a tuple (and no keywords)")
        try:
            return fn.handler(*args)
        except (TypeError, ValueError, OverflowError) as e:
            raise self.fail(f"{op} of {fn.name}: bad arguments ({_clean(str(e))})") from None

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> tuple[Any, int]:
        ops = _OPS
        try:
            while True:
                if self.pos >= self.end:
                    raise self.fail("ended without STOP (truncated file?)")
                code = self.data[self.pos]
                self.pos += 1
                handler = ops.get(code)
                if handler is None:
                    raise self.fail(f"unknown opcode 0x{code:02x}")
                if handler is _stop:
                    return self.pop(), self.pos
                handler(self)
        except (UnicodeDecodeError, struct.error, RecursionError, MemoryError) as e:
            raise self.fail(f"malformed data ({type(e).__name__})") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise self.fail(f"malformed structure ({type(e).__name__}: {_clean(str(e))})") from None


def _stop(m: PickleMachine) -> None:  # handled in run()
    pass


def _proto(m: PickleMachine) -> None:
    if m.take(1)[0] > 5:
        raise m.fail("pickle protocol above 5")


def _frame(m: PickleMachine) -> None:
    if m.unpack("<Q") > m.end - m.pos:
        raise m.fail("frame runs past the end of the data")


def _mark(m: PickleMachine) -> None:
    if len(m.meta) >= MAX_ITEMS:
        raise m.fail("too many nested MARKs")
    m.meta.append(m.stack)
    m.stack = []


def _text_int(m: PickleMachine) -> None:
    s = m.line()
    m.push({"00": False, "01": True}.get(s) if s in ("00", "01") else int(s))


def _text_string(m: PickleMachine) -> None:
    s = m.line().strip()
    if len(s) < 2 or s[0] != s[-1] or s[0] not in "'\"":
        raise m.fail("STRING argument is not quoted")
    m.push(_bytes_to_str(codecs.escape_decode(s[1:-1].encode("latin-1"))[0]))


def _bytes_to_str(b: bytes) -> Any:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b


def _setitems(m: PickleMachine, items: list[Any]) -> None:
    target = m.top()
    if not isinstance(target, dict) or len(items) % 2:
        raise UnsafeFileError(m.where, f"refusing SETITEM(S) on {_clean(describe(target))}")
    for k, v in zip(items[::2], items[1::2]):
        target[k] = v


def _appends(m: PickleMachine, items: list[Any]) -> None:
    target = m.top()
    if not isinstance(target, list):
        raise UnsafeFileError(m.where, f"refusing APPEND(S) on {_clean(describe(target))}")
    target.extend(items)


def _additems(m: PickleMachine) -> None:
    items = m.pop_mark()
    target = m.top()
    if not isinstance(target, set):
        raise UnsafeFileError(m.where, f"refusing ADDITEMS on {_clean(describe(target))}")
    target.update(items)


def _build(m: PickleMachine) -> None:
    state = m.pop()
    target = m.top()
    # OrderedDict state (e.g. a state dict's _metadata) is an attribute we simply drop.
    if not isinstance(target, dict) or not (state is None or isinstance(state, (dict, tuple))):
        raise UnsafeFileError(m.where, f"refusing BUILD on {_clean(describe(target))}")


def _persid(m: PickleMachine, pid: Any) -> None:
    if m.persistent_load is None:
        raise m.fail("persistent id outside a torch file")
    m.push(m.persistent_load(pid))


def _reduce(m: PickleMachine) -> None:
    args = m.pop()
    m.push(m.call(m.pop(), args, "REDUCE"))


def _newobj_ex(m: PickleMachine) -> None:
    kwargs, args = m.pop(), m.pop()
    m.push(m.call(m.pop(), args, "NEWOBJ_EX", kwargs))


def _newobj(m: PickleMachine) -> None:
    args = m.pop()
    m.push(m.call(m.pop(), args, "NEWOBJ"))


def _inst(m: PickleMachine) -> None:
    fn = m.find_global(m.line(), m.line())
    m.push(m.call(fn, tuple(m.pop_mark()), "INST"))


def _obj(m: PickleMachine) -> None:
    items = m.pop_mark()
    if not items:
        raise m.fail("OBJ without a class")
    m.push(m.call(items[0], tuple(items[1:]), "OBJ"))


def _ext(m: PickleMachine, n: int) -> None:
    raise UnsafeFileError(m.where, f"refusing extension-registry code {m.take(n).hex()} (EXT{n})")


def _dict(m: PickleMachine) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise m.fail("DICT with an odd number of items")
    m.push(dict(zip(items[::2], items[1::2])))


def _tuple_n(n: int) -> Callable[[PickleMachine], None]:
    def op(m: PickleMachine) -> None:
        if len(m.stack) < n:
            raise m.fail("stack underflow")
        items = tuple(m.stack[len(m.stack) - n:])
        del m.stack[len(m.stack) - n:]
        m.push(items)
    return op


def _no_buffer(m: PickleMachine) -> None:
    raise m.fail("out-of-band buffers (NEXT_BUFFER) are not supported")


def _string(m: PickleMachine, fmt: str) -> None:
    n = m.unpack(fmt)
    m.push(_bytes_to_str(m.take(n)))


_OPS: dict[int, Callable[[PickleMachine], None]] = {k[0] if isinstance(k, bytes) else ord(k): v for k, v in {
    b".": _stop, b"\x80": _proto, b"\x95": _frame, b"(": _mark,
    b"0": lambda m: m.pop(), b"1": lambda m: m.pop_mark(), b"2": lambda m: m.push(m.top()),
    b"N": lambda m: m.push(None), b"\x88": lambda m: m.push(True), b"\x89": lambda m: m.push(False),
    b"I": _text_int, b"L": lambda m: m.push(int(m.line().rstrip("L"))), b"F": lambda m: m.push(float(m.line())),
    b"J": lambda m: m.push(m.unpack("<i")), b"K": lambda m: m.push(m.take(1)[0]),
    b"M": lambda m: m.push(m.unpack("<H")), b"G": lambda m: m.push(m.unpack(">d")),
    b"\x8a": lambda m: m.push(int.from_bytes(m.take(m.take(1)[0]), "little", signed=True)),
    b"\x8b": lambda m: m.push(int.from_bytes(m.take(m.unpack("<i")), "little", signed=True)),
    b"S": _text_string, b"T": lambda m: _string(m, "<i"), b"U": lambda m: _string(m, "<B"),
    b"V": lambda m: m.push(m.line().encode("latin-1", "surrogatepass").decode("raw-unicode-escape")),
    b"X": lambda m: m.push(m.take(m.unpack("<I")).decode("utf-8", "surrogatepass")),
    b"\x8c": lambda m: m.push(m.take(m.take(1)[0]).decode("utf-8", "surrogatepass")),
    b"\x8d": lambda m: m.push(m.take(m.unpack("<Q")).decode("utf-8", "surrogatepass")),
    b"B": lambda m: m.push(m.take(m.unpack("<I"))), b"C": lambda m: m.push(m.take(m.take(1)[0])),
    b"\x8e": lambda m: m.push(m.take(m.unpack("<Q"))), b"\x96": lambda m: m.push(bytearray(m.take(m.unpack("<Q")))),
    b"\x97": _no_buffer, b"\x98": lambda m: None,
    b")": lambda m: m.push(()), b"]": lambda m: m.push([]), b"}": lambda m: m.push({}),
    b"\x8f": lambda m: m.push(set()), b"t": lambda m: m.push(tuple(m.pop_mark())),
    b"\x85": _tuple_n(1), b"\x86": _tuple_n(2), b"\x87": _tuple_n(3),
    b"l": lambda m: m.push(m.pop_mark()), b"d": _dict, b"\x91": lambda m: m.push(frozenset(m.pop_mark())),
    b"a": lambda m: _appends(m, [m.pop()]), b"e": lambda m: _appends(m, m.pop_mark()),
    b"s": lambda m: _setitems(m, [m.pop(), m.pop()][::-1]), b"u": lambda m: _setitems(m, m.pop_mark()),
    b"\x90": _additems,
    b"p": lambda m: m.memo_put(int(m.line()), m.top()), b"q": lambda m: m.memo_put(m.take(1)[0], m.top()),
    b"r": lambda m: m.memo_put(m.unpack("<I"), m.top()), b"\x94": lambda m: m.memo_put(len(m.memo), m.top()),
    b"g": lambda m: m.memo_get(int(m.line())), b"h": lambda m: m.memo_get(m.take(1)[0]),
    b"j": lambda m: m.memo_get(m.unpack("<I")),
    b"c": lambda m: m.push(m.find_global(m.line(), m.line())),
    b"\x93": lambda m: m.push(m.find_global(*reversed([m.pop(), m.pop()]))),
    b"R": _reduce, b"\x81": _newobj, b"\x92": _newobj_ex, b"i": _inst, b"o": _obj, b"b": _build,
    b"P": lambda m: _persid(m, m.line()), b"Q": lambda m: _persid(m, m.pop()),
    b"\x82": lambda m: _ext(m, 1), b"\x83": lambda m: _ext(m, 2), b"\x84": lambda m: _ext(m, 4),
}.items()}


def load_pickle(data: Any, where: str, globals_: dict[str, Any], persistent_load: Callable[[Any], Any] | None = None,
                pos: int = 0, end: int | None = None) -> tuple[Any, int]:
    """Interpret the pickle at ``data[pos:]``: returns (value, offset just past its STOP)."""
    return PickleMachine(data, where, globals_, persistent_load, pos, end).run()
