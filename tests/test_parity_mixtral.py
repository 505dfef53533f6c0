import torch
import transformers
from safetensors.torch import save_file

from parity import check_decoder, save


def _reference(**kw):
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2, **kw)
    ref = transformers.MixtralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a sharper router so the test tokens spread over all experts
        for layer in ref.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    return ref


def test_mixtral(tmp_path):
    # transformers 5 saves per-expert w1/w2/w3 tensors under block_sparse_moe (the original checkpoint layout)
    ref = _reference(sliding_window=5)
    folder = save(ref, tmp_path)
    m = check_decoder(ref, folder, 96)
    assert m.spec.name == "mixtral"
    assert m.net.decoder.layers[0].block_sparse_moe.w_gate.shape == (4, 48, 64)


def test_mixtral_fused_expert_tensors(tmp_path):
    # the same weights in transformers' in-memory layout: fused 3-D gate_up_proj / down_proj under mlp.experts
    ref = _reference()
    folder = save(ref, tmp_path)
    (folder / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    check_decoder(ref, folder, 96)
