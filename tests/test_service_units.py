"""Service pieces that need no server: configs, request validation, tool-call parsing, framing, errors,
Inferflow decoding strategies and prompt templates."""
import json
from types import SimpleNamespace

import pytest

from inferflow.engine.sampling_params import SamplingParams
from inferflow.service.chat_request import chat_options
from inferflow.service.config import ServiceConfigError, config_from_dict, load_service_config
from inferflow.service.decoding_alg import STRATEGIES, strategy_params
from inferflow.service.errors import APIError, context_overflow, overloaded
from inferflow.service.framing import Utf8Guard, ndjson_line, sse_event
from inferflow.service.metrics import ServiceMetrics
from inferflow.service.protocol import sampling_params, stream_options
from inferflow.service.tool_calls import HermesParser, JsonParser, MistralParser, ToolStream, parser_for
from inferflow.errors import InferflowError


# ---- config ---------------------------------------------------------------------------------------
def test_yaml_config(tmp_path):
    (tmp_path / "m").mkdir()
    f = tmp_path / "s.yaml"
    f.write_text("port: 9000\napi_keys: ['${env:IF_TEST_KEY}']\nmodels:\n  - name: a\n    source: m\n"
                 "    engine: {max_num_seqs: 4, block_size: 8}\n    sampling: {temperature: 0.5}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IF_TEST_KEY", "sk-1")
        cfg = load_service_config(f)
    assert cfg.port == 9000 and cfg.host == "127.0.0.1" and cfg.api_keys == ["sk-1"]
    m = cfg.models[0]
    assert m.source == str(tmp_path / "m")  # relative to the config file
    assert m.engine.max_num_seqs == 4 and m.engine.block_size == 8 and m.sampling == {"temperature": 0.5}
    assert load_service_config(None).models[0].source is None  # the default model


@pytest.mark.parametrize("doc, where", [
    ({"models": [{"name": "a", "engine": {"max_num_seq": 3}}]}, "models[0].engine: unknown key(s) max_num_seq"),
    ({"models": [{"name": "a", "sampling": {"temperature": -1}}]}, "models[0].sampling: temperature"),
    ({"models": [{"name": "a", "colour": 1}]}, "models[0]: unknown key(s) colour"),
    ({"port": "x"}, "port: 'x' is not an integer"),
    ({"porty": 1}, "unknown key(s) porty"),
    ({"cors": {"origins": ["*"]}}, "cors: unknown key(s) origins"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "duplicate model name(s) a"),
    ({"api_keys": [""]}, "api_keys"),
])
def test_config_errors_name_file_and_key(doc, where):
    with pytest.raises(ServiceConfigError) as e:
        config_from_dict(doc, "conf.yaml")
    assert str(e.value).startswith("conf.yaml: ") and where in str(e.value), str(e.value)


def test_ini_config(tmp_path):
    f = tmp_path / "inferflow_service.ini"
    f.write_text("""
[main]
http_port = 8090
worker_count = 32
global_model_dir = ${config_dir}
api_keys = k1, k2
cors_allow_origins = http://a.example

[transformer_engine]
models = tiny
devices = 0
max_concurrent_queries = 6

[model.tiny]
model_dir = ${global_model_dir}/${model_name}/
model_specification_file = model_spec.json
device_weight_data_type = F16
device_kv_cache_data_type = Q8
host_kv_cache_percent = 25
max_context_len = 1024
decoding_strategy = {"name":"sample.top_p","top_p":0.8,"eos_bypassing_max":2}
prompt_template = chat
engine.block_size = 8
sampling.max_tokens = 64

[prompt_templates]
prompt_template_count = 1
prompt_template1 = chat

[prompt_template.chat]
line_count = 2
line1 = {bos}<|user|>{query}
line2 = <|assistant|>{res_prefix}
""")
    cfg = load_service_config(f)
    assert cfg.port == 8090 and cfg.api_keys == ["k1", "k2"] and cfg.cors == {"allow_origins": ["http://a.example"]}
    m = cfg.models[0]
    assert m.name == "tiny" and m.source == f"{tmp_path}/tiny/" and m.spec == f"{tmp_path}/tiny/model_spec.json"
    assert m.dtype == "float16" and m.device == "cuda:0"
    e = m.engine
    assert (e.max_num_seqs, e.kv_cache_dtype, e.host_kv_layers, e.max_model_len, e.block_size) == \
        (6, "int8", 0.25, 1024, 8)
    assert m.prompt_template == "{bos}<|user|>{query}<|assistant|>{res_prefix}" and m.sampling == {"max_tokens": 64}
    assert strategy_params(m.decoding_strategy) == {"top_p": 0.8, "top_k": 8, "eos_bypass_max": 2}
    f.write_text("[transformer_engine]\nmodels = x\n[model.x]\nmodel_dir = a\nfrobnicate = 1\n")
    with pytest.raises(ServiceConfigError, match=r"inferflow_service.ini: \[model.x\] frobnicate: unknown key"):
        load_service_config(f)


def test_shipped_service_configs_parse():
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "service_configs"
    files = sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".ini"))
    assert len(files) >= 3 and any(p.suffix == ".ini" for p in files)
    for p in files:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("INFERFLOW_API_KEY", "sk-example")
            assert load_service_config(p).models, p


# ---- request validation ---------------------------------------------------------------------------
def _params(body, **kw):
    return sampling_params(body, kw.pop("defaults", {}), 100, max_tokens_field=kw.pop("field", "max_tokens"),
                           default_max_tokens=16)


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"), ({"n": 500}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 3}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999": 1}}, "logit_bias"), ({"seed": 2 ** 70}, "seed"), ({"top_k": -5}, "top_k"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"best_of": 3}, "best_of"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_invalid_sampling_fields_are_named(body, param):
    with pytest.raises(APIError) as e:
        _params(body)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_sampling_fields_and_defaults():
    p = _params({"temperature": 0.5, "top_k": 4, "stop": "x", "seed": 3, "logit_bias": {"5": -100},
                 "stop_token_ids": [7], "frequency_penalty": 0.5, "unknown_field": 1}, defaults={"top_p": 0.9})
    assert (p.temperature, p.top_k, p.top_p, p.stop, p.seed, p.logit_bias, p.stop_token_ids, p.max_tokens) == \
        (0.5, 4, 0.9, ["x"], 3, {5: -100.0}, [7], 16)
    assert _params({"max_tokens": 5}, field="max_completion_tokens").max_tokens == 5
    assert _params({}, defaults={"max_tokens": 7}).max_tokens == 7


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
])
def test_invalid_chat_fields_are_named(body, param):
    with pytest.raises(APIError) as e:
        chat_options(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_chat_options_normalise_messages():
    o = chat_options({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "user", "content": "reply in JSON"}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"},
        "tool_choice": "required"})
    assert o.messages[0] == {"role": "system", "content": "a\nb"}
    assert o.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1} and o.messages[1]["content"] == ""
    assert o.json_mode and o.tools_active and o.tool_choice == "required"
    assert chat_options({"messages": [{"role": "user", "content": "x"}], "tools": [],
                         "tool_choice": "required"}).tool_choice == "none"


def test_stream_options():
    with pytest.raises(APIError) as e:
        stream_options({"stream_options": {"include_usage": True}})
    assert e.value.param == "stream_options"
    assert stream_options({"stream": True, "stream_options": {"include_usage": True}}).include_usage


# ---- tool calls -----------------------------------------------------------------------------------
def test_parser_chosen_by_template():
    assert isinstance(parser_for("...<tool_call>..."), HermesParser)
    assert isinstance(parser_for("[AVAILABLE_TOOLS] ... [TOOL_CALLS]"), MistralParser)
    assert isinstance(parser_for("<|start_header_id|>ipython<|end_header_id|>"), JsonParser)
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_hermes_parse():
    text = 'Let me look.\n<tool_call>\n{"name": "w", "arguments": {"city": "Zürich"}}\n</tool_call>\n' \
           '<tool_call>{"name": "t", "arguments": {}}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me look." and [c.name for c in calls] == ["w", "t"]
    assert json.loads(calls[0].arguments) == {"city": "Zürich"} and calls[0].id.startswith("call_")
    assert HermesParser().parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert HermesParser().parse('<tool_call>{"name": "w", "arguments": {}}')[1][0].name == "w"  # unclosed at EOS


def test_mistral_and_json_parse():
    c, calls = MistralParser().parse('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert c == "" and [x.name for x in calls] == ["a", "b"] and json.loads(calls[0].arguments) == {"x": 1}
    c, calls = MistralParser().parse('ok[TOOL_CALLS]a[ARGS]{"x": 2}')
    assert c == "ok" and calls[0].name == "a" and json.loads(calls[0].arguments) == {"x": 2}
    c, calls = JsonParser().parse('  {"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}')
    assert [x.name for x in calls] == ["a", "b"] and json.loads(calls[0].arguments) == {"q": "x"}
    assert JsonParser().parse("The answer is {1, 2}")[1] == []


def test_tool_stream_holds_back_marker_prefixes():
    ts = ToolStream(HermesParser())
    sent = "".join(ts.feed(d) for d in ["Sure", ". <tool", "_c", "all>", '{"name": "w", "arguments": {}}', "</tool_call>"])
    assert sent == "Sure. "
    rest, calls = ts.finish()
    assert rest == "" and calls[0].name == "w"
    ts = ToolStream(HermesParser())
    sent = "".join(ts.feed(d) for d in ["a <tool", "box> b"])
    rest, calls = ts.finish()
    assert sent + rest == "a <toolbox> b" and calls == []


# ---- framing, errors, metrics ---------------------------------------------------------------------
def test_framing():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert ndjson_line({"text": "你"}) == '{"text":"你"}\n'.encode()
    g = Utf8Guard()
    assert g.feed("ab\ufffd") == "ab" and g.feed("\ufffdc") == "\ufffd\ufffdc" and g.feed("\ufffd", final=True) == "\ufffd"


def test_error_shapes():
    e = overloaded("busy", 503, 2.2)
    assert e.response().status_code == 503 and e.headers() == {"Retry-After": "2"}
    body = json.loads(e.response().body)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "service_unavailable"
    c = context_overflow(128, 200, 16)
    assert c.status == 400 and "128" in c.message and "216" in c.message and "200 in the prompt" in c.message


def test_metrics_render():
    m = ServiceMetrics()
    m.request_done("/v1/chat/completions", 200)
    m.request_done("/v1/chat/completions", 400)
    m.generation_done("tiny", 5, 3, 0.02, 0.1, ["stop"])
    engine = SimpleNamespace(metrics=lambda: {"running": 1, "kv_blocks_used": 4, "prefix_cache_hit_rate": 0.5})
    text = m.render({"tiny": engine})
    assert 'inferflow_http_requests_total{route="/v1/chat/completions",status="400"} 1' in text
    assert 'inferflow_time_to_first_token_seconds_bucket{model="tiny",le="0.02"} 1' in text
    assert 'inferflow_time_per_output_token_seconds_count{model="tiny"} 1' in text
    assert 'inferflow_engine_kv_blocks_used{model="tiny"} 4' in text
    assert 'inferflow_engine_prefix_cache_hit_rate{model="tiny"} 0.5' in text


# ---- Inferflow strategies and templates -----------------------------------------------------------
def test_decoding_alg_mapping():
    for name in STRATEGIES:
        for spelled in (name, f"sample.{name}"):
            SamplingParams(**strategy_params(spelled))  # every strategy is valid SamplingParams
    assert strategy_params("sample.greedy") == {"temperature": 0.0}
    assert SamplingParams(**strategy_params("greedy")).greedy
    assert strategy_params("fsd")["fsd_alpha"] == 0.5 and strategy_params("mirostat")["mirostat"] == 2
    assert strategy_params("tfs") == {"tfs_z": 0.95} and strategy_params("typical") == {"typical_p": 0.95}
    assert strategy_params({"name": "sample.top_k", "max_k": 3}) == {"top_p": 1.0, "top_k": 3}
    assert strategy_params("") == {}
    with pytest.raises(InferflowError, match="unknown strategy 'beam'"):
        strategy_params("beam")


class _WordTok:
    bos_token_id, eos_token_id = 1, 2
    vocab = {"<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "\u2581": 5}

    def encode(self, text, add_special_tokens=True):
        return [100 + len(w) for w in text.split()]

    def token_to_id(self, t):
        return self.vocab.get(t)


def test_inferflow_prompt_template():
    from inferflow.service.prompt_template import render_template, unescape

    tok = _WordTok()
    ids = render_template("{bos}{[INST]}{query} hi{[/INST]}{#9}{ }{res_prefix}ignored", tok, query="abc de",
                          res_prefix="xy")
    assert ids == [1, 3, 103, 102, 102, 4, 9, 5, 102]
    assert render_template("{_query}{eos}", tok, query="a") == [101, 2]
    assert unescape("a{\\n}b{\\t}") == "a\nb\t"
    with pytest.raises(InferflowError, match="not a token"):
        render_template("{<nope>}", tok)
