"""Guided decoding through the engine: a random tiny llama is forced to write valid JSON (greedy, seeded sampling,
n > 1), JSON matching a schema, one of a few choices, and tool calls in each chat-template format whose arguments
validate against the tool's parameters; on a toy byte-level BPE and on a real 49k-token vocabulary."""
import json
import time

import jsonschema
import pytest

import guided_models
from engine_models import one_thread  # noqa: F401 - autouse fixture
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.engine.guided.token_bytes import token_table
from inferflow.service.guided import tool_guidance
from inferflow.service.tool_calls import HermesParser, JsonParser, MistralParser

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
    "where": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"lat": {"type": "number"}},
                                            "required": ["lat"], "additionalProperties": False}]}},
    "required": ["name", "age", "ok", "tags", "where"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/n"}}, "required": ["a", "b"],
        "additionalProperties": False, "$defs": {"n": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    m = guided_models.json_llama(tmp_path_factory.mktemp("json"))
    return Engine(m, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=16))


def texts(eng, prompt, **kw):
    res = eng.generate(prompt, SamplingParams(**kw))[0]
    assert res.error is None, res.error
    return [o.text for o in res.outputs]


def test_any_json_object_greedy_and_sampled(engine):
    unguided = texts(engine, "hello", temperature=0, max_tokens=30)[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(unguided)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}, {"temperature": 0.7, "top_k": 20,
                                                                            "top_p": 0.9, "seed": 1, "n": 2}):
        outs = texts(engine, "hello", guided_json=True, max_tokens=40, **kw)
        assert len(outs) == kw.get("n", 1)
        assert all(isinstance(json.loads(t), dict) for t in outs), outs
    # seeds still reproduce, and each of the n samples differs
    a = texts(engine, "hi", guided_json={}, max_tokens=25, temperature=1.0, seed=7, n=2)
    assert a == texts(engine, "hi", guided_json={}, max_tokens=25, temperature=1.0, seed=7, n=2) and a[0] != a[1]


def test_schema_is_matched(engine):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "n": 4}):
        for t in texts(engine, "data", guided_json=SCHEMA, max_tokens=70, **kw):
            jsonschema.validate(json.loads(t), SCHEMA)


def test_budget_closes_the_value_before_max_tokens(engine):
    # the shortest valid object is 57 bytes: a tight budget still ends with a complete value
    for n in (57, 64):
        for t in texts(engine, "data", guided_json=SCHEMA, max_tokens=n, temperature=1.0, seed=2, n=3):
            jsonschema.validate(json.loads(t), SCHEMA)


def test_choice_and_mixed_batch(engine):
    params = [SamplingParams(guided_choice=["yes", "no", "maybe so"], temperature=1.0, seed=s, max_tokens=8)
              for s in range(6)] + [SamplingParams(temperature=0, max_tokens=5)]
    res = engine.generate(["q"] * 7, params)
    assert all(r.outputs[0].text in ("yes", "no", "maybe so") for r in res[:6])
    assert res[6].outputs[0].finish_reason == "length"  # the unconstrained neighbour is untouched


@pytest.mark.parametrize("parser", [HermesParser(), MistralParser(), JsonParser(), None])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_call_parses_and_validates(engine, parser, choice):
    parser, fields = tool_guidance(TOOLS, choice, parser)
    for t in texts(engine, "call", max_tokens=90, temperature=1.0, seed=0, n=2, **fields):
        content, calls = parser.parse(t)
        assert content == "" and len(calls) >= 1, t
        for call in calls:
            tool = next(x["function"] for x in TOOLS if x["function"]["name"] == call.name)
            assert choice == "required" or call.name == "add"
            jsonschema.validate(json.loads(call.arguments), tool["parameters"])


def test_refused_combinations(engine):
    for kw in ({"use_beam_search": True, "beam_width": 2}, {"mirostat": 2}, {"ignore_eos": True},
               {"eos_bypass_max": 1}, {"guided_choice": ["a"]}):
        res = engine.generate("x", SamplingParams(guided_json=True, max_tokens=4, **kw))[0]
        assert res.error and "guided" in res.error
    res = engine.generate("x", SamplingParams(guided_json={"type": "string", "pattern": "a+"}, max_tokens=4))[0]
    assert "pattern" in res.error


def test_speculative_requests_with_a_constraint_take_the_normal_path(tmp_path):
    target = guided_models.json_llama(tmp_path / "t")
    draft = guided_models.json_llama(tmp_path / "d", seed=1)
    plain = Engine(target, EngineConfig(block_size=4, num_blocks=256))
    spec = Engine(target, EngineConfig(block_size=4, num_blocks=256, num_speculative_tokens=3), draft=draft)
    kw = {"guided_json": SCHEMA, "max_tokens": 60, "temperature": 0}
    assert texts(spec, "abc", **kw) == texts(plain, "abc", **kw)
    assert spec.counters.spec_draft_tokens == 0
    texts(spec, "abc", max_tokens=8, temperature=0)
    assert spec.counters.spec_draft_tokens > 0  # unconstrained requests still speculate


def test_real_vocabulary(tmp_path):
    m = guided_models.gguf_llama(tmp_path / "g")
    tok = m.tokenizer
    table = token_table(tok, tok.vocab_size)
    assert table is token_table(tok, tok.vocab_size)  # cached on the tokenizer
    for s in ['Hello wörld 你好 🙂 {"a": [1, 2.5]}', "  \n\tx = '\\u00e9'"]:
        assert b"".join(table.data[i] for i in tok.encode(s, add_special_tokens=False)) == s.encode()
    assert all(table.data[i] is None for i in tok.stop_ids)
    eng = Engine(m, EngineConfig(block_size=16, num_blocks=64))
    t0 = time.perf_counter()
    outs = texts(eng, "hello", guided_json=SCHEMA, max_tokens=80, temperature=0) + \
        texts(eng, "hello", guided_json=SCHEMA, max_tokens=80, temperature=0.8, top_p=0.9, seed=1, n=2)
    for t in outs:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert time.perf_counter() - t0 < 20
