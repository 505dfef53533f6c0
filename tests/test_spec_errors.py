"""Bad specs fail with one clear SpecError (or WeightError) naming the spec file, the key path and the problem.

Each test writes a broken copy of model_specs/llama.yaml into tmp_path and loads a tiny saved HF llama
with it, so nothing here depends on how the reference spec is laid out beyond its step names.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

import inferflow
from inferflow import SpecError, WeightError
from parity import save

LLAMA = Path(__file__).resolve().parent.parent / "model_specs" / "llama.yaml"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama"))


def doc() -> dict:
    return yaml.safe_load(LLAMA.read_text())


def idx(d: dict, name: str) -> int:
    """Position of a layer step by name (robust to steps being added to the reference spec)."""
    return next(n for n, s in enumerate(d["decoder"]["layers"]["steps"]) if s["name"] == name)


def step(d: dict, name: str) -> dict:
    return d["decoder"]["layers"]["steps"][idx(d, name)]


def write(tmp_path: Path, d: dict, name: str = "broken.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def fails(source: Path, spec: Path, key: str, *problem: str, error: type = SpecError, **overrides) -> SpecError:
    """Loading must raise exactly one ``error`` whose message names the file, ``key`` and every ``problem`` part."""
    with pytest.raises(SpecError) as info:
        inferflow.load(source, spec=spec, **overrides)
    e = info.value
    msg = str(e)
    assert type(e) is error, f"expected {error.__name__}, got {type(e).__name__}: {msg}"
    assert spec.name in msg, msg
    assert key in msg, f"key path {key!r} missing from: {msg}"
    for part in problem:
        assert part in msg, f"{part!r} missing from: {msg}"
    # one error, not a chain of tracebacks (internal exceptions are translated, not wrapped)
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), msg
    return e


def test_unbroken_copy_loads(model, tmp_path):
    m = inferflow.load(model, spec=write(tmp_path, doc(), "ok.yaml"))
    assert m.logits([1, 2, 3]).shape == (3, 64)


# ---- structure and components ------------------------------------------------------------------------------


def test_unknown_component(model, tmp_path):
    d = doc()
    step(d, "input_layernorm")["component"] = "rmsnorn"
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'input_layernorm')}]",
          "unknown component 'rmsnorn'", "rmsnorm")


def test_unknown_position_component(model, tmp_path):
    d = doc()
    d["decoder"]["position"]["component"] = "ropee"
    fails(model, write(tmp_path, d), "decoder.position", "unknown component 'ropee'")


def test_missing_architecture(model, tmp_path):
    d = doc()
    del d["architecture"]
    fails(model, write(tmp_path, d), "(top level)", "missing required key 'architecture'")


def test_step_without_component(model, tmp_path):
    d = doc()
    del step(d, "self_attn")["component"]
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'self_attn')}]", "missing required key 'component'")


def test_missing_component_parameter(model, tmp_path):
    d = doc()
    del step(d, "input_layernorm")["params"]["dim"]
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'input_layernorm')}].params",
          "component 'rmsnorm' needs parameter 'dim'")


def test_layer_count_wrong_type(model, tmp_path):
    d = doc()
    d["decoder"]["layers"]["count"] = "abc"
    fails(model, write(tmp_path, d), "decoder.layers.count", "expected", "integer", "'abc'")


def test_layer_count_expression_of_wrong_type(model, tmp_path):
    d = doc()
    d["decoder"]["layers"]["count"] = "${hidden_act}"
    fails(model, write(tmp_path, d), "decoder.layers.count", "expected a non-negative integer", "'silu'")


def test_component_parameter_wrong_type(model, tmp_path):
    d = doc()
    step(d, "input_layernorm")["params"]["eps"] = "x"
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'input_layernorm')}].params.eps",
          "component 'rmsnorm' expects float for 'eps'", "'x'")


def test_optional_component_parameter_wrong_type(model, tmp_path):
    # ``int | None`` parameters are checked as int too
    d = doc()
    step(d, "self_attn")["params"]["num_kv_heads"] = "two"
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'self_attn')}].params.num_kv_heads",
          "expects int", "'two'")


def test_component_rejects_parameter_value(model, tmp_path):
    d = doc()
    step(d, "mlp")["params"]["activation"] = "selu"
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'mlp')}].params.activation",
          "unknown activation 'selu'")


def test_component_constructor_value_error(model, tmp_path):
    d = doc()
    step(d, "self_attn")["params"]["qkv"] = "fuse"
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'self_attn')}].params",
          "component 'attention'", "'fuse'")


@pytest.mark.parametrize("where", ["top", "step", "param_decl", "component_param", "template"])
def test_unknown_key(model, tmp_path, where):
    d = doc()
    i = idx(d, "input_layernorm")
    if where == "top":
        d["wieghts"] = d.pop("weights")
        key, problem = "wieghts", ["unknown key 'wieghts'", "did you mean 'weights'"]
    elif where == "step":
        step(d, "input_layernorm")["inptu"] = "x"
        key, problem = f"decoder.layers.steps[{i}].inptu", ["unknown key 'inptu'", "did you mean 'input'"]
    elif where == "param_decl":
        d["params"]["rms_norm_eps"]["deafult"] = 1e-5
        key, problem = "params.rms_norm_eps.deafult", ["unknown key 'deafult'", "did you mean 'default'"]
    elif where == "component_param":
        step(d, "input_layernorm")["params"]["epsilon"] = 1e-5
        key, problem = f"decoder.layers.steps[{i}].params.epsilon", ["component 'rmsnorm' has no parameter 'epsilon'"]
    else:
        d["weights"]["hf"]["decoder.final.norm"] = {"name": "model.norm", "transpos": True}
        key, problem = "weights.hf['decoder.final.norm'].transpos", ["unknown key 'transpos'", "'transpose'"]
    fails(model, write(tmp_path, d), key, *problem)


def test_unknown_step_input(model, tmp_path):
    d = doc()
    step(d, "attn_out")["input"] = ["x", "self_atn"]
    fails(model, write(tmp_path, d), f"decoder.layers.steps[{idx(d, 'attn_out')}].input",
          "unknown input 'self_atn'", "self_attn")


def test_step_name_used_twice(model, tmp_path):
    d = doc()
    step(d, "post_attention_layernorm")["name"] = "self_attn"
    fails(model, write(tmp_path, d), ".name", "'self_attn'", "used twice")


# ---- weights -------------------------------------------------------------------------------------------------


def test_template_tensor_missing(model, tmp_path):
    d = doc()
    d["weights"]["hf"]["decoder.final.norm"] = "model.nrom"
    fails(model, write(tmp_path, d), "weights.hf['decoder.final.norm']", "'model.nrom.weight'", "not found",
          error=WeightError)


def test_unused_tensor_in_file(model, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(model, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.extra_scale"] = torch.ones(3)
    save_file(tensors, src / "model.safetensors")
    fails(src, write(tmp_path, doc()), "weights.hf", "model.extra_scale", "not used", "weights.ignore",
          error=WeightError)


def test_shape_mismatch_from_override(model, tmp_path):
    fails(model, write(tmp_path, doc()), "weights.hf['decoder.layers.{i}']", "shape mismatch",
          "decoder.layers.0.mlp", "[50, 32]", "[48, 32]", error=WeightError, intermediate_size=50)


def test_shape_mismatch_from_spec(model, tmp_path):
    d = doc()
    d["params"]["intermediate_size"] = 40  # a literal hyper-parameter that disagrees with the weights
    fails(model, write(tmp_path, d), "weights.hf['decoder.layers.{i}']", "shape mismatch", "[40, 32]", "[48, 32]",
          error=WeightError)


def test_transform_that_does_not_fit(model, tmp_path):
    d = doc()
    d["weights"]["hf"]["decoder.final.norm"] = {"name": "model.norm", "split": {"sizes": [16, 16], "index": 5}}
    fails(model, write(tmp_path, d), "weights.hf['decoder.final.norm']", "cannot build decoder.final.norm.weight",
          "IndexError", error=WeightError)


# ---- expressions and hyper-parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("place", ["param", "step"])
def test_bad_expression(model, tmp_path, place):
    d = doc()
    if place == "param":
        d["params"]["head_dim"] = {"expr": "${hidden_size //}"}
        key = "params.head_dim"
    else:
        step(d, "input_layernorm")["params"]["dim"] = "${hidden_size //}"
        key = f"decoder.layers.steps[{idx(d, 'input_layernorm')}].params.dim"
    fails(model, write(tmp_path, d), key, "invalid expression 'hidden_size //'")


@pytest.mark.parametrize("place", ["param", "step", "when"])
def test_unknown_name_in_expression(model, tmp_path, place):
    d = doc()
    i = idx(d, "input_layernorm")
    if place == "param":
        d["params"]["head_dim"] = {"expr": "${hidden_size // num_heads}"}
        key = "params.head_dim"
    elif place == "step":
        step(d, "input_layernorm")["params"]["eps"] = "${rms_eps}"
        key = f"decoder.layers.steps[{i}].params.eps"
    else:
        step(d, "input_layernorm")["when"] = "${layer_idx > 0}"
        key = f"decoder.layers.steps[{i}].when"
    e = fails(model, write(tmp_path, d), key, "unknown name")
    assert "known:" in str(e)


def test_refused_expression(model, tmp_path):
    d = doc()
    d["params"]["head_dim"] = {"expr": "${hidden_size.__class__}"}
    fails(model, write(tmp_path, d), "params.head_dim", "attribute access")


def test_circular_extends(model, tmp_path):
    (tmp_path / "fam_a.yaml").write_text("extends: fam_b\nname: fam_a\n")
    (tmp_path / "fam_b.yaml").write_text("extends: fam_a.yaml\nname: fam_b\n")
    e = fails(model, tmp_path / "fam_a.yaml", "extends", "circular extends", "fam_b.yaml")
    assert "fam_a.yaml -> fam_b.yaml -> fam_a.yaml" in str(e)


def test_missing_extends_base(model, tmp_path):
    d = doc()
    d["extends"] = "no_such_family"
    fails(model, write(tmp_path, d), "extends", "'no_such_family'", "no spec file found")


def test_hyperparameter_missing_without_default(model, tmp_path):
    d = doc()
    d["params"]["rms_norm_eps"] = {"hf": "rms_norm_epsilon", "type": "float"}
    fails(model, write(tmp_path, d), "params.rms_norm_eps", "not found in", "config.json", "rms_norm_epsilon",
          "no default")


def test_hyperparameter_missing_from_config(model, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(model, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["intermediate_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    fails(src, write(tmp_path, doc()), "params.intermediate_size", "not found in", "looked for intermediate_size")


def test_hyperparameter_wrong_type_in_config(model, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(model, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = "big"
    (src / "config.json").write_text(json.dumps(cfg))
    fails(src, write(tmp_path, doc()), "params.hidden_size", "expected int", "'big'")


def test_unknown_override(model, tmp_path):
    fails(model, write(tmp_path, doc()), "params", "unknown override", "hidden_sise", hidden_sise=3)


def test_invalid_yaml(model, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [llama\n")
    with pytest.raises(SpecError, match="broken.yaml: invalid YAML"):
        inferflow.load(model, spec=path)
