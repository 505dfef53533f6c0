"""The guided-decoding JSON matcher and schema compiler, without a model: valid and invalid prefixes, multi-byte
UTF-8, the schema subset, refusal of unsupported keywords, and random walks whose every completion parses."""
import json
import random

import jsonschema
import pytest

from inferflow.engine.guided import SchemaError, compile_schema
from inferflow.engine.guided import json_matcher as jm
from inferflow.engine.guided.budget import cost
from inferflow.engine.guided.schema import ANY_OBJECT, Lit, inline_refs

OBJ = ((ANY_OBJECT, True),)


def state(text, items=OBJ):
    return jm.feed(jm.initial(items), text.encode() if isinstance(text, str) else text)


def schema_items(schema):
    return ((compile_schema(schema), True),)


@pytest.mark.parametrize("text", ['{', ' \n{', '{"a', '{"a":', '{"a": [1, -2.5e+3, 0.0', '{"a": "x\\u00e9\\n\\"',
                                  '{"a": {"b": [true, false, null, {}]}, "c"', '{"a":"é🙂', '{"\\u0041": 1,'])
def test_valid_prefixes(text):
    st = state(text)
    assert st and not jm.complete(st)


@pytest.mark.parametrize("text", ['[', '"a"', '1', '{a', "{'a'", '{"a" 1', '{"a":01', '{"a":1.}', '{"a":1e}',
                                  '{"a":-}', '{"a":tru}', '{"a":"\x01', '{"a":"\\x', '{"a":"\\ud800"', '{,',
                                  '{"a":1,}', '{"a":1 "b"', '{"a":1}}', '{"a":1} x', '{"a":1,"a"', '{"a":[1,]'])
def test_invalid_prefixes(text):
    assert not state(text)


def test_complete_values_parse():
    for text in ['{}', ' {"a": 1}', '{"a": [1, {"b": null}], "c": "\\u00e9\\t", "d": -0.5E-7}']:
        st = state(text)
        assert st and jm.complete(st) and cost(st) == 0
        json.loads(text)


def test_multibyte_utf8_split_across_feeds():
    st = state('{"a":"')
    for b in "é你🙂".encode():
        st = jm.feed(st, bytes([b]))
        assert st
    assert jm.complete(jm.feed(st, b'"}'))
    head = state('{"a":"')
    for bad in (b"\xc3A", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5", b"\x80", b"\xe4\xbd"b'"', b"\xf4\x90"):
        assert not jm.feed(head, bad), bad
    assert not state(b'{\xc3\xa9')  # non-ASCII outside strings


def test_whitespace_and_digits_are_bounded():
    assert state("{" + " " * jm.MAX_WS) and not state("{" + " " * (jm.MAX_WS + 1))
    assert state('{"a": "' + " " * 100)  # inside strings whitespace is content
    assert state('{"a":' + "9" * jm.INT_DIGITS) and not state('{"a":' + "9" * (jm.INT_DIGITS + 1))
    assert not state('{"a":1e' + "9" * (jm.EXP_DIGITS + 1))


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 3}, "age": {"type": "integer"},
    "kind": {"enum": ["cat", "dog", 7]}, "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                                  "maxItems": 2},
    "x": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]}},
    "required": ["name", "age", "kind"], "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"p": {"const": [1, "a"]}}, "required": ["p"]}}}


@pytest.mark.parametrize("text, ok", [
    ('{"name": "ab", "age": 3, "kind": "dog"}', True), ('{"name": "", ', False), ('{"name": "abcd', False),
    ('{"age": 1.5', False), ('{"age": 1e3', False), ('{"kind": "cow', False), ('{"kind": 7,', True),
    ('{"other"', False), ('{"tags": []', False), ('{"tags": [true, false, true', False), ('{"tags": [1', False),
    ('{"x": null', True), ('{"x": {"p": [1,"a"]}', True), ('{"x": {"p": [1, "a"]', False), ('{"x": {}', False),
    ('{"name": "a", "age": 1}', False), ('{"name": "a", "name"', False)])
def test_schema_subset(text, ok):
    st = state(text, schema_items(SCHEMA))
    assert bool(st) == ok, text
    assert not st or jm.complete(st) == text.endswith('"dog"}')


def test_budget_cost_is_the_shortest_completion():
    items = schema_items(SCHEMA)
    shortest = '{"name":"a","age":0,"kind":7}'
    assert cost(jm.initial(items)) == len(shortest) and jm.complete(state(shortest, items))
    assert cost(state('{"age": 12', items)) == len(',"name":"a","kind":7}')
    assert cost(state('{"na', items)) == len('me":"a","age":0,"kind":7}')


def test_choice_and_fixed_text():
    items = ((Lit((b"<tool_call>\n",)), False), (ANY_OBJECT, True), (Lit((b"\n</tool_call>",)), False))
    st = state('<tool_call>\n {"a": 1}\n</tool_call>', items)
    assert st and jm.complete(st)
    assert not state('<tool_call>{"a": 1}  \n</tool_call>', items) and not state("x", items)
    choice = ((Lit((b"yes", b"yesterday", b"no")), False),)
    assert jm.complete(state("yes", choice)) and not jm.complete(state("yest", choice))
    assert jm.complete(state("yesterday", choice)) and not state("yess", choice) and not state("yes ", choice)


@pytest.mark.parametrize("schema, word", [
    ({"type": "string", "pattern": "^a"}, "pattern"), ({"type": "string", "format": "date"}, "format"),
    ({"type": "number", "minimum": 0}, "minimum"), ({"oneOf": [{"type": "string"}]}, "oneOf"),
    ({"allOf": [{"type": "string"}]}, "allOf"), ({"type": "array", "items": [{"type": "string"}]}, "tuple"),
    ({"anyOf": [{"type": "string"}], "minLength": 2}, "anyOf next to"), ({"type": "complex"}, "type"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}}, "recursive"),
    ({"$ref": "http://example.com/s.json"}, "local"), ({"enum": ["a"], "type": "integer"}, "no enum"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength")])
def test_unsupported_or_unsatisfiable_schemas_are_refused(schema, word):
    with pytest.raises(SchemaError, match=word):
        compile_schema(schema)


def test_inline_refs_makes_a_nestable_schema():
    flat = inline_refs(SCHEMA)
    assert "$defs" not in flat and flat["properties"]["x"]["anyOf"][1]["required"] == ["p"]
    compile_schema({"type": "object", "properties": {"args": flat}})


ALPHABET = sorted(set(range(32, 127)) | set(b"\n\t") | set("é你🙂".encode()))


def random_document(items, rng, soft_len=60):
    """A random byte walk through the matcher: any allowed byte, then (past soft_len) bytes that shorten the
    shortest completion, until the grammar may end."""
    st, out = jm.initial(items), b""
    for _ in range(2000):
        if jm.complete(st) and (len(out) >= soft_len or rng.random() < 0.05):
            return out
        nxt = [(b, s) for b in ALPHABET for s in [jm.feed(st, bytes([b]))] if s]
        if not nxt and jm.complete(st):
            return out
        assert nxt, f"dead end after {out!r}"
        if len(out) >= soft_len:
            best = min(cost(s) for _, s in nxt)
            nxt = [(b, s) for b, s in nxt if cost(s) == best]
        b, st = rng.choice(nxt)
        out += bytes([b])
    raise AssertionError(f"no end after {out!r}")


@pytest.mark.parametrize("schema", [None, SCHEMA, {"type": "array", "items": {"anyOf": [
    {"type": "string", "maxLength": 2}, {"type": "number"}, {"enum": [1, 12, 123]}]}, "minItems": 2, "maxItems": 4}])
def test_random_walks_are_valid_json(schema):
    rng = random.Random(0)
    items = OBJ if schema is None else schema_items(schema)
    for _ in range(40):
        doc = random_document(items, rng)
        value = json.loads(doc.decode("utf-8"))
        if schema is None:
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, schema)


def test_serialised_values_are_accepted():
    rng = random.Random(1)

    def value(depth):
        k = rng.randrange(7 if depth < 3 else 4)
        return [lambda: rng.choice([True, False, None]), lambda: rng.randint(-10**6, 10**6),
                lambda: rng.uniform(-1e3, 1e3), lambda: "".join(rng.choice('ab "\\\n\té你🙂/') for _ in range(4)),
                lambda: [value(depth + 1) for _ in range(rng.randrange(3))],
                lambda: {f"k{i}": value(depth + 1) for i in range(rng.randrange(3))},
                lambda: {"x": value(depth + 1)}][k]()

    for _ in range(100):
        v = {"root": value(0)}
        for text in (json.dumps(v, ensure_ascii=False), json.dumps(v, indent=1, ensure_ascii=False)):
            st = state(text)
            assert st and jm.complete(st), text
