import json

import torch
import transformers
from safetensors.torch import save_file

from parity import check_decoder, save


def _reference(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=[1])
    ref = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**base, **kw})).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # HF zero-initialises the router; a random one spreads tokens over the experts
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    return ref


def test_qwen2_moe(tmp_path):
    # layer 1 is a dense MLP (mlp_only_layers); layers 0 and 2 are sparse with a gated shared expert
    ref = _reference()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "qwen2_moe"
    kinds = [type(layer.mlp).__name__ for layer in m.net.decoder.layers]
    assert kinds == ["MoE", "GatedMLP", "MoE"]


def test_qwen2_moe_normalized_sliding_fused(tmp_path):
    # fused 3-D expert tensors, renormalised top-k, and the default sliding pattern (no layer_types)
    ref = _reference(norm_topk_prob=True, use_sliding_window=True, sliding_window=4, max_window_layers=3,
                     mlp_only_layers=[], decoder_sparse_step=2)
    folder = save(ref, tmp_path)
    (folder / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    conf = json.loads((folder / "config.json").read_text())
    assert conf.pop("layer_types") == ["sliding_attention", "full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(conf))
    m = check_decoder(ref, folder, 96)
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [4, None, 4]
    assert [type(layer.mlp).__name__ for layer in m.net.decoder.layers] == ["GatedMLP", "MoE", "GatedMLP"]
