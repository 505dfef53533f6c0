"""Chat template rendering against transformers' apply_chat_template, and the sandbox around it."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inferflow import InferflowError
from inferflow.tokenizers.chat import render_chat
from inferflow.tokenizers.hf import from_source

TOOLS_TEMPLATE = """
{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}{% if m.role == 'stop' %}{% break %}{% endif %}
<{{ m.role }}>{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{%- generation %}{{ m.content }}{% endgeneration %}
{%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}
n={{ ns.n }} year={{ strftime_now('%Y') }} {{ dict(a='é<') | tojson }} {{ bos_token }}|{{ eos_token }}
"""
PLAIN = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "wetter", "description": "Wetter für <Ort>",
                                           "parameters": {"type": "object", "properties": {"ort": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "sé nice"}, {"role": "user", "content": "hi", "tool_calls": None},
        {"role": "assistant", "content": "ok", "reasoning": "hmm 🤔",
         "tool_calls": [{"type": "function", "function": {"name": "wetter", "arguments": {"ort": "Zürich"}}}]},
        {"role": "stop", "content": "never shown"}, {"role": "user", "content": "after"}]


def make_folder(folder: Path, config: dict) -> Path:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello world", "héllo"], trainers.BpeTrainer(vocab_size=60, special_tokens=["<s>", "</s>"],
                                                                         show_progress=False))
    tk.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def both(folder: Path):
    return from_source(SimpleNamespace(folder=folder), None), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"enable_thinking": False}, {"add_generation_prompt": False},
                                    {"tools": TOOLS, "enable_thinking": True, "bos_token": "override"}])
def test_matches_transformers(tmp_path, kwargs):
    tok, ref = both(make_folder(tmp_path, {"chat_template": TOOLS_TEMPLATE}))
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours = tok.apply_chat_template(CHAT, **kwargs)
    assert ours == ref.apply_chat_template(CHAT, tokenize=False, **kwargs)
    assert '"Wetter für <Ort>"' in ours or "tools" not in kwargs  # tojson keeps non-ASCII and "<" as they are
    assert "<think>hmm 🤔</think>" in ours and "never shown" not in ours


def test_named_templates_and_template_files(tmp_path):
    named = [{"name": "default", "template": PLAIN}, {"name": "tool_use", "template": TOOLS_TEMPLATE}]
    tok, ref = both(make_folder(tmp_path, {"chat_template": named}))
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}, {"chat_template": "{{ messages | length }}"}):
        assert tok.apply_chat_template(CHAT, **kw) == ref.apply_chat_template(CHAT, tokenize=False,
                                                                             add_generation_prompt=True, **kw)
    assert tok.apply_chat_template(CHAT[:2]) == "[system]sé nice[user]hi"
    # chat_template.jinja (and additional_chat_templates/) replace the templates in tokenizer_config.json
    (tmp_path / "chat_template.jinja").write_text("jinja:" + PLAIN)
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "short.jinja").write_text("{{ messages[0].content }}")
    tok, ref = both(tmp_path)
    assert sorted(tok.chat_templates) == ["default", "short"]
    for kw in ({}, {"chat_template": "short"}):
        assert tok.apply_chat_template(CHAT, **kw) == ref.apply_chat_template(CHAT, tokenize=False, **kw)
    assert tok.apply_chat_template(CHAT, chat_template="short") == "sé nice"


def test_chat_template_json(tmp_path):
    make_folder(tmp_path, {})
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": PLAIN}))
    tok = from_source(SimpleNamespace(folder=tmp_path), None)
    assert render_chat(tok, CHAT[:1]) == "[system]sé nice"


def test_errors_and_sandbox(tmp_path):
    tok = from_source(SimpleNamespace(folder=make_folder(tmp_path, {})), None)
    with pytest.raises(InferflowError, match="no chat template"):
        tok.apply_chat_template(CHAT)
    bad = {
        "{{ raise_exception('roles must alternate') }}": "roles must alternate",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}": "chat template",
        "{{ messages.append(1) }}": "chat template",
        "{% set ns = namespace(_x=1) %}": "underscore|_x",
        "{{ cycler.__init__.__globals__ }}": "chat template",
        "{% for m in messages %}": "syntax",
    }
    for template, message in bad.items():
        with pytest.raises(InferflowError, match=message):
            tok.apply_chat_template(CHAT, chat_template=template)
    with pytest.raises(InferflowError, match="empty"):
        tok.apply_chat_template([], chat_template=PLAIN)
    assert tok.apply_chat_template(CHAT[:1], chat_template="{{ not_given }}!") == "!"  # undefined renders empty
