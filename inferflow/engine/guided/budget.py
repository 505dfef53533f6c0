"""What a matcher state still needs: the fewest bytes that complete it, and the whitespace it may still take.

``cost`` drives the guide's token budget (constraint.py): a candidate token is refused when what it leaves
cannot be finished in the tokens left. It is exact for everything but open object keys (a key that may become a
missing required one is costed both ways, the cheaper wins; any other key is an upper bound). Where it is exact,
one byte lowers it by at most one: the guide's vectorised filter uses that as a bound (where it is not, the
filter may pass over a candidate it could have kept; every admitted candidate is still checked in full).
"""
from __future__ import annotations

from typing import Any

from .json_matcher import ACCEPT, AFTER, COLON, LIT, MAX_WS, NEXT, NUM, OBJ, OPEN, SEQ, STR, VAL, VALUE
from .nodes import Obj

# bytes still owed by an unfinished escape: after '\\' 1, after 'u' 4, after 1 hex 3 (3: 'd' first), ...
_ESC_COST = {0: 0, 1: 1, 2: 4, 3: 3, 4: 3, 5: 2, 6: 1}


def ws_room(configs: tuple) -> int | None:
    """How many more whitespace bytes may follow as layout (None: whitespace may be content here, e.g. in a string;
    the guide uses it to rule out long whitespace tokens at once)."""
    if any(stack[0][0] in (STR, LIT, NUM) for stack, _ in configs):
        return None
    return MAX_WS - min(ws for _, ws in configs)


def cost(configs: tuple) -> int:
    """Fewest bytes that complete some configuration."""
    return min(_cost(stack) for stack, _ in configs)


def _tail(node: Obj, remaining: frozenset) -> int:
    """Bytes to close an object whose value just ended: ',"k":v' per missing required key, then '}'."""
    return sum(node.entry_of(k) + 1 for k in remaining) + 1


def _cost(stack: Any) -> int:
    total = 0
    while stack is not None:
        frame, parent = stack
        tag = frame[0]
        if tag == SEQ:
            total += sum(node.min_len for node, _ in frame[1][frame[2]:])
        elif tag == VAL:
            total += frame[1].min_len
        elif tag == NUM:
            total += 0 if frame[2] in ACCEPT else 1
        elif tag == STR:
            _, node, key, esc, need, _, _, n, acc = frame
            here = _ESC_COST[esc] + need + max(0, node.min_chars - n) + 1
            if key:  # then ':', the value and what the object still owes: the cheaper of finishing this key
                obj, left = parent[0][1], parent[0][1].required - parent[0][3]  # as some other key (a bound) ...
                here += 1 + obj.max_value_len + _tail(obj, left)
                typed = b'"' + acc
                for k in left:  # ... or as a missing required key it may still become
                    raw = obj.keys.get(k)
                    if raw is not None and raw.startswith(typed):
                        here = min(here, len(raw) - len(typed) + 1 + obj.props[k].min_len + _tail(obj, left - {k}))
                parent = parent[1]
            total += here
        elif tag == LIT:
            _, opts, pos, key = frame
            if key:
                obj = parent[0]
                node, left = obj[1], obj[1].required - obj[3]
                total += min(len(o) - pos + 1 + node.value(node.names[o]).min_len
                             + _tail(node, left - {node.names[o]}) for o in opts)
                parent = parent[1]
            else:
                total += min(len(o) - pos for o in opts)
        elif tag == OBJ:
            total += _object_cost(frame)
        else:
            _, node, phase, count = frame
            m, missing = (node.items.min_len if node.items is not None else 0), node.min_items - count
            if phase == OPEN:
                total += 1 + (missing * (m + 1) - 1 if missing > 0 else 0)
            elif phase == NEXT:
                total += m + max(0, missing - 1) * (m + 1) + 1
            else:  # VALUE: the item on top is counted already; AFTER: count includes it
                total += max(0, missing - (phase == VALUE)) * (m + 1) + 1
        stack = parent
    return total


def _object_cost(frame: tuple) -> int:
    _, node, phase, seen, cur = frame
    left = node.required - seen
    if phase == COLON:
        return 1 + node.value(cur).min_len + _tail(node, left - {cur})
    if phase == VALUE:
        return _tail(node, left - {cur})
    if phase == AFTER:
        return _tail(node, left)
    if left:  # OPEN / NEXT: the missing required keys, comma separated, then '}'
        return sum(node.entry_of(k) for k in left) + len(left)
    if phase == OPEN:
        return 1
    entries = [node.entry[k] for k in node.entry if k not in seen]  # NEXT: some key must follow the comma
    if node.additional is not None:
        entries.append(4 + node.additional.min_len)
    return min(entries) + 1
