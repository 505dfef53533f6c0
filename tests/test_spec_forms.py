"""The spec language itself: YAML and INI forms, new families without code, ``extends`` merging,
the expression language, auto-detection and user components from $INFERFLOW_COMPONENT_PATH."""
from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

import inferflow
from inferflow import SpecError, registry
from inferflow.loaders.hf import HFDirSource
from inferflow.model.detect import match_spec
from inferflow.spec import expr
from inferflow.spec.loader import deep_merge, load_spec, parse_ini
from parity import check_decoder, close, save, sequences

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "model_specs" / "llama.yaml"
VOCAB = 64


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spec_to_ini = _tool("spec_to_ini")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    return ref, save(ref, tmp_path_factory.mktemp("llama"))


def _retyped(folder: Path, dest: Path, model_type: str) -> Path:
    """A copy of a saved model whose config.json claims another HF model_type."""
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dest / "config.json").read_text())
    cfg["model_type"] = model_type
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# ---- YAML and INI ------------------------------------------------------------------------------------------


def test_ini_and_yaml_build_identical_models(llama, tmp_path):
    ref, folder = llama
    ini = tmp_path / "llama.ini"
    assert spec_to_ini.main([str(LLAMA), "-o", str(ini)]) == 0
    assert ini.read_text().lstrip().startswith("#")  # plain INI text, sections below
    assert load_spec(ini).data == load_spec(LLAMA).data
    a = inferflow.load(folder, spec=LLAMA)
    b = check_decoder(ref, folder, VOCAB, spec=ini)  # the INI form alone also matches the reference
    pa, pb = dict(a.net.named_parameters()), dict(b.net.named_parameters())
    assert list(pa) == list(pb)
    for name in pa:
        assert pa[name].shape == pb[name].shape and torch.equal(pa[name], pb[name]), name
    seqs = sequences(VOCAB)
    assert torch.equal(a.logits(seqs), b.logits(seqs))


def test_spec_to_ini_round_trips_every_shipped_spec():
    for path in sorted((ROOT / "model_specs").glob("*.y*ml")):
        doc = yaml.safe_load(path.read_text())
        assert parse_ini(spec_to_ini.to_ini(doc, path.name), path.name) == doc, path.name


def test_docs_examples_parse():
    text = (ROOT / "docs" / "specs.md").read_text()
    blocks = re.findall(r"```(yaml|ini)\n(.*?)```", text, re.S)
    assert len(blocks) > 10
    for lang, body in blocks:
        doc = yaml.safe_load(body) if lang == "yaml" else parse_ini(body, "docs/specs.md")
        assert isinstance(doc, dict) and doc, body


def test_ini_values_are_yaml_flow_scalars():
    text = """
[spec]
name = demo
description = "a: quoted string; with # signs"
[params]
n = {hf: n, default: 4, type: int}
eps = 1.0e-5
[decoder.layers.steps.1]
name = b
[decoder.layers.steps.0]
name = a
input = [x, y]
"""
    doc = parse_ini(text, "demo.ini")
    assert doc["description"] == "a: quoted string; with # signs"
    assert doc["params"] == {"n": {"hf": "n", "default": 4, "type": "int"}, "eps": 1.0e-5}
    assert doc["decoder"]["layers"]["steps"] == [{"name": "a", "input": ["x", "y"]}, {"name": "b"}]


def test_converter_quotes_what_yaml_would_misread():
    doc = {"name": "x", "description": "", "chat_template": "{% for m in messages %}\n{{ m }}\n{% endfor %}",
           "params": {"a": {"default": "yes"}, "b": {"default": "1e-06"}, "c": {"default": 1e-06},
                      "d": {"default": "#not a comment"}, "e": {"default": "null"}}}
    assert parse_ini(spec_to_ini.to_ini(doc), "x.ini") == doc


# ---- a new family is a file --------------------------------------------------------------------------------


def test_new_family_by_extends_is_auto_detected(llama, tmp_path, monkeypatch):
    ref, folder = llama
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "tinyfam.yaml").write_text(
        "extends: llama\n"
        "name: tinyfam\n"
        "description: A made-up family that is llama under another model_type.\n"
        "match: {hf_model_type: [tinyfam], gguf_architecture: null}\n")
    monkeypatch.setenv("INFERFLOW_SPEC_PATH", str(specs))
    model = _retyped(folder, tmp_path / "tinyfam-model", "tinyfam")
    m = check_decoder(ref, model, VOCAB)  # no spec argument: found through $INFERFLOW_SPEC_PATH
    assert m.spec.name == "tinyfam" and Path(m.spec.file).parent == specs
    assert "gguf_architecture" not in m.spec.data["match"]  # null deleted the inherited key


def test_new_family_written_from_scratch_as_ini(llama, tmp_path, monkeypatch):
    ref, folder = llama
    doc = yaml.safe_load(LLAMA.read_text())
    doc.update(name="tinyfam_ini", match={"hf_model_type": ["tinyfam_ini"]})
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "tinyfam_ini.ini").write_text(spec_to_ini.to_ini(doc))
    monkeypatch.setenv("INFERFLOW_SPEC_PATH", str(specs))
    m = check_decoder(ref, _retyped(folder, tmp_path / "m", "tinyfam_ini"), VOCAB)
    assert m.spec.name == "tinyfam_ini" and m.spec.file.endswith(".ini")


def test_match_when_and_priority(llama, tmp_path, monkeypatch):
    _, folder = llama
    specs = tmp_path / "specs"
    specs.mkdir()
    common = "extends: llama\nmatch: {hf_model_type: [tinyfam], gguf_architecture: null"
    (specs / "fam_plain.yaml").write_text(f"{common}}}\nname: fam_plain\n")
    (specs / "fam_big.yaml").write_text(f"{common}, when: '${{num_hidden_layers > 100}}', priority: 9}}\n"
                                        "name: fam_big\n")
    (specs / "fam_small.yaml").write_text(f"{common}, when: '${{num_hidden_layers <= 2}}', priority: 5}}\n"
                                          "name: fam_small\n")
    monkeypatch.setenv("INFERFLOW_SPEC_PATH", str(specs))
    src = HFDirSource(_retyped(folder, tmp_path / "m", "tinyfam"))
    assert match_spec(src).name == "fam_small"  # fam_big's condition fails; fam_small outranks fam_plain


def test_detection_checks_only_candidates_and_skips_broken_ones(llama, tmp_path, monkeypatch):
    """Detection schema-checks the specs that fit, not all of them; a broken override of a shipped name falls back
    to the shipped file, and a broken spec that fits is skipped, then named when nothing else matches."""
    from inferflow.spec import loader

    _, folder = llama
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "llama.yaml").write_text(f"extends: {LLAMA}\nname: llama\nnorm_eps_bogus_key: 1\n")  # unknown key
    (specs / "fam_bad.yaml").write_text(f"extends: {LLAMA}\nname: fam_bad\nmatch: {{hf_model_type: [fambad]}}\n"
                                        "architecture: sideways\n")
    monkeypatch.setenv("INFERFLOW_SPEC_PATH", str(specs))
    checked = []
    real = loader.validate
    monkeypatch.setattr(loader, "validate", lambda doc, file: (checked.append(Path(file).name), real(doc, file)))
    spec = match_spec(HFDirSource(folder))
    assert spec.name == "llama" and Path(spec.file).parent != specs  # the shipped llama, past the broken override
    assert len(checked) <= 3 and "bert.yaml" not in checked  # the override and the shipped llama (and its family)
    with pytest.raises(SpecError, match=r"model_type 'fambad'.*skipped broken spec .*fam_bad\.yaml.*architecture"):
        match_spec(HFDirSource(_retyped(folder, tmp_path / "m", "fambad")))


def test_no_matching_spec_is_a_clear_error(llama, tmp_path):
    _, folder = llama
    model = _retyped(folder, tmp_path / "m", "nosuchfam")
    with pytest.raises(SpecError, match="model_type 'nosuchfam'.*spec=NAME_OR_PATH"):
        inferflow.load(model)


# ---- extends ------------------------------------------------------------------------------------------------


def test_deep_merge_semantics():
    base = {"a": {"x": 1, "y": 2, "z": {"k": 1}}, "l": [1, 2, 3], "gone": 1, "keep": "b"}
    over = {"a": {"y": 20, "z": {"k2": 2}}, "l": [9], "gone": None, "new": None}
    out = deep_merge(base, over)
    assert out == {"a": {"x": 1, "y": 20, "z": {"k": 1, "k2": 2}}, "l": [9], "keep": "b", "new": None}
    assert base["a"]["y"] == 2 and base["l"] == [1, 2, 3]  # inputs untouched


def test_extends_files(tmp_path):
    (tmp_path / "base.yaml").write_text(LLAMA.read_text())
    (tmp_path / "mid.yaml").write_text(
        "extends: base\nname: mid\n"
        "params: {hidden_act: {hf: hidden_activation, default: gelu}, sliding_window: null}\n"
        "weights: {ignore: []}\n")
    (tmp_path / "leaf.ini").write_text(
        "[spec]\nextends = [mid.yaml]\nname = leaf\n"
        "[decoder.layers]\ncount = 1\nsteps = [{name: only, component: rmsnorm, params: {dim: $hidden_size}}]\n")
    base, mid, leaf = (load_spec(tmp_path / f) for f in ("base.yaml", "mid.yaml", "leaf.ini"))
    assert mid.data["params"]["hidden_act"] == {"hf": "hidden_activation", "default": "gelu"}  # dict replaced
    assert list(mid.data["params"])[:3] == list(base.data["params"])[:3]  # other params merged in
    assert "sliding_window" not in mid.data["params"]  # null deletes
    assert mid.data["weights"]["ignore"] == [] and mid.data["weights"]["hf"] == base.data["weights"]["hf"]
    assert leaf.name == "leaf" and "extends" not in leaf.data
    assert leaf.data["decoder"]["layers"] == {"count": 1, "steps": [  # list replaced, not appended
        {"name": "only", "component": "rmsnorm", "params": {"dim": "$hidden_size"}}]}
    assert leaf.data["decoder"]["final"] == base.data["decoder"]["final"]


# ---- expressions --------------------------------------------------------------------------------------------


NAMES = {"hidden_size": 64, "heads": 4, "act": "gelu", "types": ["full", "sliding"], "cfg": {"a": 1}, "none": None}


@pytest.mark.parametrize("text, value", [
    ("hidden_size // heads", 16), ("hidden_size / heads", 16.0), ("hidden_size % 10", 4), ("2 ** 10", 1024),
    ("-hidden_size + 1", -63), ("(1 + 2) * 3", 9), ("1 < heads <= 4", True), ("1 < heads < 4", False),
    ("heads if act == 'gelu' else 0", 4), ("'x' if none is None else 'y'", "x"), ("act in ['gelu', 'relu']", True),
    ("not act", False), ("0 or heads", 4), ("0 and unknown_is_never_evaluated", 0),
    ("get(types, 1)", "sliding"), ("get(types, 5, 'full')", "full"), ("get(cfg, 'a')", 1), ("get(cfg, 'b', 2)", 2),
    ("get(none, 'a', 3)", 3), ("types[0]", "full"), ("cfg['a']", 1), ("len(types)", 2), ("max(1, heads, 3)", 4),
    ("min([3, 2])", 2), ("int(sqrt(hidden_size))", 8), ("log2(hidden_size)", 6.0), ("round(2.6)", 3),
    ("abs(-2)", 2), ("str(heads) + 'x'", "4x"), ("float(1)", 1.0), ("bool(0)", False), ("[heads, 1]", [4, 1]),
    ("{'k': heads}", {"k": 4}), ("True", True), ("None", None),
])
def test_expression_values(text, value):
    got = expr.evaluate(text, NAMES)
    assert got == value and type(got) is type(value)


def test_resolve_forms():
    assert expr.resolve("$heads", NAMES) == 4
    assert expr.resolve("${heads * 2}", NAMES) == 8
    assert expr.resolve({"a": ["$heads", "plain", 1.5], "b": "${act}"}, NAMES) == {"a": [4, "plain", 1.5], "b": "gelu"}
    # only a whole value is an expression: no string interpolation, "$" elsewhere is literal
    assert expr.resolve("cost: $5", NAMES) == "cost: $5"
    assert not expr.is_expression("x$heads") and expr.is_expression(" $heads ") and expr.is_expression("${1}")


@pytest.mark.parametrize("text, problem", [
    ("hidden_size.real", "attribute access"),
    ("().__class__", "attribute access"),
    ("__import__('os')", "function '__import__' is not allowed"),
    ("open('x')", "function 'open' is not allowed"),
    ("eval('1')", "function 'eval' is not allowed"),
    ("(lambda: 1)()", "not allowed"),
    ("int('7', base=8)", "keyword arguments are not allowed"),
    ("[x for x in types]", "unsupported syntax ListComp"),
    ("lambda: 1", "unsupported syntax Lambda"),
    ("2 ** 100000", "exponent 100000 too large"),
    ("(2 ** 4096) ** 4096", "larger than"),
    ("'a' * 1000", "repetition is not allowed"),
    ("unknown + 1", "unknown name 'unknown'"),
    ("hidden_size //", "invalid expression"),
    ("1 / 0", "ZeroDivisionError"),
    ("types[9]", "IndexError"),
    ("+".join(["1"] * 3000), "longer than"),
])
def test_expression_refusals(text, problem):
    with pytest.raises(SpecError) as info:
        expr.evaluate(text, NAMES, where=("spec.yaml", "params.x"))
    msg = str(info.value)
    assert problem in msg and msg.startswith("spec.yaml: params.x: "), msg


def test_chained_parameters_cannot_build_huge_numbers():
    names: dict = {"p0": 2 ** 4000}
    with pytest.raises(SpecError, match="larger than"):
        for n in range(1, 40):
            names[f"p{n}"] = expr.evaluate(f"p{n - 1} * p{n - 1}", names)


def test_nothing_is_ever_evald(monkeypatch):
    tree = ast.parse(Path(expr.__file__).read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__", "getattr"}

    def refuse(*a, **k):
        raise AssertionError("eval/exec used")

    real_compile = builtins.compile

    def parse_only(source, filename, mode, flags=0, *a, **k):
        # ast.parse compiles to a syntax tree only; compiling to code would be a way to run it
        assert flags & ast.PyCF_ONLY_AST, "compiled to code"
        return real_compile(source, filename, mode, flags, *a, **k)

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(builtins, "compile", parse_only)
    assert expr.evaluate("max(hidden_size // heads, 2) if act else 0", NAMES) == 16


# ---- user components ----------------------------------------------------------------------------------------

_USER_COMPONENT = '''
from dataclasses import dataclass

from inferflow.component import Component
from inferflow.registry import register


@register("test_user_scale")
class UserScale(Component):
    """Multiplies by a constant: a stand-in for any component a user ships in their own folder."""

    @dataclass(slots=True)
    class Params:
        factor: float

    def __init__(self, p: Params):
        super().__init__()
        self.factor = p.factor

    def forward(self, x, ctx=None):
        return x * self.factor
'''


def test_component_from_user_folder(llama, tmp_path, monkeypatch):
    ref, folder = llama
    comps = tmp_path / "my_components"
    comps.mkdir()
    (comps / "user_scale.py").write_text(_USER_COMPONENT)
    monkeypatch.setenv("INFERFLOW_COMPONENT_PATH", str(comps))
    monkeypatch.setattr(registry, "_loaded", False)  # the registry imports component folders once per process
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # keep the registration local to this test
    try:
        doc = yaml.safe_load(LLAMA.read_text())
        doc["decoder"]["final"].append({"name": "halve", "component": "test_user_scale", "params": {"factor": 0.5}})
        path = tmp_path / "scaled.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        m = inferflow.load(folder, spec=path)
        assert "test_user_scale" in registry.names()
        s = sequences(VOCAB)[0]
        with torch.no_grad():
            r = ref(torch.tensor([s])).logits[0]
        close(m.logits(s), 0.5 * r, "user component")  # lm_head is linear without bias: logits halve
    finally:
        for name in [n for n in sys.modules if n.startswith("inferflow_user_components_")]:
            del sys.modules[name]
