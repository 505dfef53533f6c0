"""An incremental JSON pushdown automaton over bytes, driven by grammar nodes (schema.py).

A grammar is a sequence of items (``(node, whitespace_before_ok)``): fixed text (Lit) and JSON values. A
configuration is ``(stack, ws)``: a persistent linked stack of small immutable frames ``(frame, parent)`` and
the number of consecutive whitespace bytes just written outside strings. Nothing is ever copied: trying a token
on a state builds new frames and leaves the old ones intact, so every candidate starts from the same state for
free. A state is a tuple of configurations, because ``anyOf`` is nondeterministic until the bytes tell the
branches apart (capped at MAX_CONFIGS; dropping branches only narrows what may be written, so it stays sound).

Soundness rules the frames enforce: strings are valid UTF-8 without raw control characters, escapes are the
JSON ones and \\u never names a surrogate; numbers follow the JSON grammar (integers: no fraction or exponent)
with bounded digit runs (json.loads must not overflow); objects never repeat a key and close only once their
required keys are in; arrays respect minItems / maxItems; whitespace runs are at most MAX_WS bytes, so a model
cannot loop on whitespace forever. A value that may still grow (a number, an enum literal that prefixes another)
ends lazily: a byte it cannot take is handed to its parent. No state is ever a dead end: every transition that
would leave nothing to write (a comma when no key or item may follow) is refused up front.

What it takes to finish a configuration (the token budget) is budget.py's business.
"""
from __future__ import annotations

import json
from typing import Any

from .nodes import Arr, AnyOf, Lit, Node, Num, Obj, Str

MAX_WS = 16                  # consecutive whitespace bytes outside strings
MAX_CONFIGS = 32             # simultaneous anyOf branches kept
INT_DIGITS, FRAC_DIGITS, EXP_DIGITS = 16, 16, 2

SEQ, VAL, OBJ, ARR, STR, NUM, LIT = range(7)                  # frame tags
OPEN, NEXT, KEY, COLON, VALUE, AFTER = range(6)               # object / array phases
MINUS, ZERO, INT, DOT, FRAC, EXP, EXPSIGN, EXPD = range(1, 9)  # number states
ACCEPT = frozenset((ZERO, INT, FRAC, EXPD))
WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
QUOTE, BACKSLASH, COMMA, COLON_B = 0x22, 0x5C, 0x2C, 0x3A
LBRACE, RBRACE, LBRACK, RBRACK = 0x7B, 0x7D, 0x5B, 0x5D
KEY_STR = Str()
EMPTY: frozenset = frozenset()


def _utf8_lead(c: int) -> tuple[int, int, int] | None:
    """(continuation bytes, low, high bound of the next one) for a UTF-8 lead byte; None if it is not one."""
    if 0xC2 <= c <= 0xDF:
        return 1, 0x80, 0xBF
    if c == 0xE0:
        return 2, 0xA0, 0xBF
    if c == 0xED:  # no UTF-16 surrogates
        return 2, 0x80, 0x9F
    if 0xE1 <= c <= 0xEF:
        return 2, 0x80, 0xBF
    if c == 0xF0:
        return 3, 0x90, 0xBF
    if 0xF1 <= c <= 0xF3:
        return 3, 0x80, 0xBF
    if c == 0xF4:
        return 3, 0x80, 0x8F
    return None


def initial(items: tuple[tuple[Node, bool], ...]) -> tuple:
    return ((((SEQ, items, 0), None), 0),)


def feed(configs: tuple, data: bytes) -> tuple:
    """The state after ``data``; () when ``data`` cannot continue any configuration."""
    for c in data:
        out: list = []
        for stack, ws in configs:
            _feed(stack, ws, c, out)
        if not out:
            return ()
        configs = tuple(dict.fromkeys(out))[:MAX_CONFIGS] if len(out) > 1 else (out[0],)
    return configs


def complete(configs: tuple) -> bool:
    """Whether the grammar may end here (EOS allowed)."""
    return any(_complete(stack) for stack, _ in configs)


# ---- transitions --------------------------------------------------------------------------------
def _ws(stack: Any, ws: int, out: list) -> None:
    if ws < MAX_WS:
        out.append((stack, ws + 1))


def _start(node: Node, parent: Any, c: int, out: list) -> None:
    """Begin a value of ``node`` (under ``parent``) with its first byte ``c``."""
    t = type(node)
    if t is AnyOf:
        for alt in node.alts:
            _start(alt, parent, c, out)
    elif t is Obj:
        if c == LBRACE:
            out.append((((OBJ, node, OPEN, EMPTY, None), parent), 0))
    elif t is Arr:
        if c == LBRACK:
            out.append((((ARR, node, OPEN, 0), parent), 0))
    elif t is Str:
        if c == QUOTE:
            out.append((((STR, node, False, 0, 0, 0, 0, 0, None), parent), 0))
    elif t is Num:
        state = MINUS if c == 0x2D else ZERO if c == 0x30 else INT if c in DIGITS else 0
        if state:
            out.append((((NUM, node, state, int(state != MINUS)), parent), 0))
    elif t is Lit:
        _lit(node.options, 0, False, parent, c, out)


def _lit(options: tuple, pos: int, key: bool, parent: Any, c: int, out: list) -> None:
    viable = tuple(o for o in options if len(o) > pos and o[pos] == c)
    if viable:
        pos += 1
        if all(len(o) == pos for o in viable):  # finished, and nothing longer can follow
            s = _done(parent, viable[0] if key else None)
            if s is not None:
                out.append((s, 0))
        else:
            out.append((((LIT, viable, pos, key), parent), 0))
        return
    if any(len(o) == pos for o in options):  # it had ended already: ``c`` belongs to the parent
        s = _done(parent, None)
        if s is not None:
            _feed(s, 0, c, out)


def _done(stack: Any, key: bytes | None = None) -> Any:
    """The parent stack once its child value (or key, quotes included) is finished; None if that is invalid."""
    frame, parent = stack
    tag = frame[0]
    if tag == SEQ:
        return stack
    if tag == OBJ:
        node, phase, seen = frame[1], frame[2], frame[3]
        if phase == KEY:
            name = node.names.get(key)
            if name is None:
                name = json.loads(key)
            if name in seen or node.value(name) is None:
                return None
            return (OBJ, node, COLON, seen, name), parent
        return (OBJ, node, AFTER, seen | {frame[4]}, None), parent
    return (ARR, frame[1], AFTER, frame[3] + 1), parent  # ARR in phase VALUE


def _more_keys(node: Obj, seen: frozenset) -> bool:
    return node.additional is not None or any(k not in seen and v is not None for k, v in node.props.items())


def _feed(stack: Any, ws: int, c: int, out: list) -> None:
    frame, parent = stack
    tag = frame[0]
    if tag == STR:
        _string(frame, parent, c, out)
    elif tag == NUM:
        _number(frame, parent, c, out)
    elif tag == LIT:
        _lit(frame[1], frame[2], frame[3], parent, c, out)
    elif tag == SEQ:
        items, idx = frame[1], frame[2]
        if idx < len(items):
            node, ws_ok = items[idx]
            if ws_ok and c in WS:
                _ws(stack, ws, out)
            else:
                _start(node, ((SEQ, items, idx + 1), parent), c, out)
    elif tag == VAL:
        if c in WS:
            _ws(stack, ws, out)
        else:
            _start(frame[1], parent, c, out)
    elif c in WS:
        _ws(stack, ws, out)
    elif tag == OBJ:
        _object(frame, parent, c, out)
    else:
        _array(frame, parent, c, out)


def _object(frame: tuple, parent: Any, c: int, out: list) -> None:
    _, node, phase, seen, cur = frame
    if phase in (OPEN, NEXT):
        if c == QUOTE:
            below = (OBJ, node, KEY, seen, None), parent
            if node.additional is None:
                opts = tuple(node.keys[k] for k, v in node.props.items() if k not in seen and v is not None)
                if opts:
                    out.append((((LIT, opts, 1, True), below), 0))
            else:
                out.append((((STR, KEY_STR, True, 0, 0, 0, 0, 0, b""), below), 0))
        elif c == RBRACE and phase == OPEN and node.required <= seen:
            out.append((_done(parent), 0))
    elif phase == COLON:
        if c == COLON_B:
            out.append((((VAL, node.value(cur)), ((OBJ, node, VALUE, seen, cur), parent)), 0))
    elif phase == AFTER:
        if c == COMMA and _more_keys(node, seen):
            out.append((((OBJ, node, NEXT, seen, None), parent), 0))
        elif c == RBRACE and node.required <= seen:
            out.append((_done(parent), 0))


def _array(frame: tuple, parent: Any, c: int, out: list) -> None:
    _, node, phase, count = frame
    if phase == AFTER:
        if c == COMMA and (node.max_items is None or count < node.max_items):
            out.append((((ARR, node, NEXT, count), parent), 0))
        elif c == RBRACK and count >= node.min_items:
            out.append((_done(parent), 0))
    elif phase == OPEN and c == RBRACK:
        if node.min_items == 0:
            out.append((_done(parent), 0))
    elif node.max_items != 0:  # OPEN or NEXT: an item starts
        _start(node.items, ((ARR, node, VALUE, count), parent), c, out)


def _string(frame: tuple, parent: Any, c: int, out: list) -> None:
    _, node, key, esc, need, lo, hi, n, acc = frame
    if acc is not None:
        acc += bytes((c,))
    if need:
        if lo <= c <= hi:
            out.append((((STR, node, key, 0, need - 1, 0x80, 0xBF, n, acc), parent), 0))
        return
    if esc:
        if esc == 1:
            nxt = 0 if c in ESCAPES else 2 if c == 0x75 else -1
        elif c not in HEX:
            return
        elif esc == 2:
            nxt = 4 if c in b"dD" else 3
        elif esc == 4:
            nxt = 5 if c in b"01234567" else -1  # \uD8xx..\uDFxx are surrogates
        else:
            nxt = 5 if esc == 3 else 6 if esc == 5 else 0
        if nxt >= 0:
            out.append((((STR, node, key, nxt, 0, 0, 0, n + (nxt == 0), acc), parent), 0))
        return
    if c == QUOTE:
        if n >= node.min_chars:
            s = _done(parent, b'"' + acc if key else None)
            if s is not None:
                out.append((s, 0))
        return
    if c < 0x20 or (node.max_chars is not None and n >= node.max_chars):
        return
    if c == BACKSLASH:
        out.append((((STR, node, key, 1, 0, 0, 0, n, acc), parent), 0))
    elif c < 0x80:
        out.append((((STR, node, key, 0, 0, 0, 0, n + 1, acc), parent), 0))
    else:
        lead = _utf8_lead(c)
        if lead is not None:
            out.append((((STR, node, key, 0, lead[0], lead[1], lead[2], n + 1, acc), parent), 0))


def _number(frame: tuple, parent: Any, c: int, out: list) -> None:
    _, node, state, digits = frame
    nxt, run = 0, 1
    if c in DIGITS:
        if state == MINUS:
            nxt = ZERO if c == 0x30 else INT
        elif state in (INT, FRAC, EXPD):
            limit = INT_DIGITS if state == INT else FRAC_DIGITS if state == FRAC else EXP_DIGITS
            nxt, run = (state, digits + 1) if digits < limit else (0, 0)
            if not nxt:
                return
        elif state in (DOT, EXP, EXPSIGN):
            nxt = FRAC if state == DOT else EXPD
        elif state == ZERO:
            return  # no leading zeros
    elif c == 0x2E and state in (ZERO, INT) and not node.integer:
        nxt = DOT
    elif c in b"eE" and state in (ZERO, INT, FRAC) and not node.integer:
        nxt = EXP
    elif c in b"+-" and state == EXP:
        nxt = EXPSIGN
    if nxt:
        out.append((((NUM, node, nxt, run), parent), 0))
    elif state in ACCEPT:  # the number ended before ``c``
        s = _done(parent)
        if s is not None:
            _feed(s, 0, c, out)


def _complete(stack: Any) -> bool:
    while True:
        frame, parent = stack
        tag = frame[0]
        if tag == SEQ:
            return frame[2] == len(frame[1])
        if (tag == NUM and frame[2] in ACCEPT) or (tag == LIT and not frame[3]
                                                   and any(len(o) == frame[2] for o in frame[1])):
            stack = _done(parent)
            if stack is None:
                return False
        else:
            return False
