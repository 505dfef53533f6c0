"""q/k/v and gate/up fusion (inferflow/model/fuse.py) of block-quantized linears held for the Triton kernels: the
blocks are concatenated row-wise into one wide linear (the parts keep views, no copy), the component switches to
its fused path, and outputs match the unfused linears (CPU, TRITON_INTERPRET=1)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built (lazily, at first use)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from inferflow.model.fuse import fuse_projections, out_rows  # noqa: E402
from inferflow.quant import cpu_kernels, formats  # noqa: E402
from inferflow.registry import create  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")
H = 64


def _hold(lin, n, k, seed, name="q4_0"):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    with cpu_kernels.using("fast"), cpu_kernels.prefer_triton(True):
        assert lin.load_packed("weight", formats.quantize(w, name), torch.float32)
    assert lin.kernels["weight"] == "triton"


def test_gated_mlp_gate_up_fused():
    mlp = create("gated_mlp", {"hidden_size": H, "intermediate_size": 96})
    for i, n in enumerate(("gate_proj", "up_proj", "down_proj")):
        lin = getattr(mlp, n)
        _hold(lin, lin.out_features, lin.in_features, i)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(9))
    ref = mlp(x)
    assert fuse_projections(mlp) == 1 and mlp.fused
    fused = mlp.gate_up_proj
    assert out_rows(fused) == 192 and fused.kernels["weight"] == "triton"
    blocks = fused.weight_blocks
    # the parts are views into the fused blocks (no second copy of the weight)
    assert mlp.gate_proj.weight_blocks.data_ptr() == blocks.data_ptr()
    assert mlp.up_proj.weight_blocks.data_ptr() == blocks[96:].data_ptr()
    y = mlp(x)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_attention_qkv_fused_with_bias(name):
    attn = create("attention", {"hidden_size": H, "num_heads": 4, "num_kv_heads": 2, "bias": True})
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(3))
    refs = []
    for i, n in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        lin = getattr(attn, n)
        _hold(lin, lin.out_features, lin.in_features, 10 + i, name)
        lin.bias = torch.nn.Parameter(torch.randn(lin.out_features, generator=torch.Generator().manual_seed(i)),
                                      requires_grad=False)
        if n != "o_proj":
            refs.append(lin(x))
    assert fuse_projections(attn) == 1 and attn.fused
    y = attn.qkv_proj(x)
    ref = torch.cat(refs, -1)
    assert y.shape == (2, 64 + 2 * 32) and (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert attn.k_proj.bias.data_ptr() == attn.qkv_proj.bias[64:].data_ptr()


def test_mixed_block_types_stay_separate():
    mlp = create("gated_mlp", {"hidden_size": H, "intermediate_size": 96})
    _hold(mlp.gate_proj, 96, H, 0, "q4_0")
    _hold(mlp.up_proj, 96, H, 1, "q8_0")
    assert fuse_projections(mlp) == 0 and not mlp.fused
