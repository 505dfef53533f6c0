import transformers
from safetensors.torch import load_file, save_file

from parity import check_decoder, save


def _cfg(**kw):
    return transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64, **kw)


def test_gpt2(tmp_path):
    ref = transformers.GPT2LMHeadModel(_cfg()).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "gpt2"


def test_gpt2_unprefixed_with_mask_buffers(tmp_path):
    """The OpenAI-style layout: GPT2Model names (no "transformer."), n_inner set, saved attn.bias buffers."""
    ref = transformers.GPT2LMHeadModel(_cfg(n_inner=80, scale_attn_by_inverse_layer_idx=True)).eval()
    folder = save(ref, tmp_path)
    f = folder / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(f).items() if k != "lm_head.weight"}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = ref.transformer.wte.weight.new_ones(1, 1, 64, 64).tril()
        tensors[f"h.{i}.attn.masked_bias"] = ref.transformer.wte.weight.new_tensor(-1e4)
    save_file(tensors, f, metadata={"format": "pt"})
    m = check_decoder(ref, folder, 96)
    assert m.spec.name == "gpt2"
