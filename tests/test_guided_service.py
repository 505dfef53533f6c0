"""Guided decoding through the OpenAI routes (official client, real uvicorn): response_format json_object and
json_schema, tool_choice "required" / named with a random model, vLLM's guided extras, and the 400s."""
import json

import jsonschema
import openai
import pytest

import guided_models
from service_helpers import LiveServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop"}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10},
                                           "score": {"type": "number"}, "ok": {"type": "boolean"}},
          "required": ["answer", "score", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "reply in json please"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from inferflow.service import config_from_dict, create_app

    folder = guided_models.json_folder(tmp_path_factory.mktemp("guided") / "m")
    app = create_app(config_from_dict({"models": [{"name": "m", "source": str(folder)}]}))
    with LiveServer(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_json_object(client):
    r = client.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=40, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=40, temperature=1.0, seed=4, n=2)
    assert [isinstance(json.loads(c.message.content), dict) for c in r.choices] == [True, True]


def test_json_schema_and_streaming(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="m", messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = client.chat.completions.create(model="m", messages=ASK, response_format=fmt, max_tokens=60,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_tool_choice_required_and_named(client):
    msgs = [{"role": "user", "content": "what is the weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=1.0, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    call = c.message.tool_calls[0].function
    params = next(t["function"].get("parameters") or {"type": "object"} for t in TOOLS
                  if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), params)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=80,
                                           temperature=0, stream=stream)
        if stream:
            calls = [tc for ch in r for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
        else:
            calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[0]["function"]["parameters"])


def test_vllm_guided_extras(client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=1.0, seed=0, n=3,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    r = client.completions.create(model="m", prompt="x", max_tokens=60, temperature=0,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("kw, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^a"}}}}, "response_format.json_schema.schema", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "format"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex", "not supported"),
    ({"extra_body": {"guided_json": {"oneOf": []}}}, "guided_json", "oneOf"),
    ({"extra_body": {"guided_choice": "yes"}}, "guided_choice", "list"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"mirostat": 2}}, "guided_json", "mirostat")])
def test_unsupported_requests_are_400(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
