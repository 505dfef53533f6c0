"""The GPU fast path's Triton kernels under TRITON_INTERPRET=1 (CPU): the paged decode kernel against the engine's
torch paged attention (PagedAttentionBackend) and the reference, for GQA, ragged lengths, block_size 16, soft-cap
and a sliding window; the fused RMSNorm / RoPE / SwiGLU ops against the components' torch compositions."""
import pytest
from triton_modes import interpreter_in_process, keep_one_mode, run_file_in_subprocess
import torch

IN_PROCESS = interpreter_in_process()  # before anything here imports Triton
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from inferflow.engine import triton_attention  # noqa: E402
from inferflow.model import fused_ops  # noqa: E402
from inferflow.registry import create  # noqa: E402
from inferflow.engine.kv_cache import KVLayer, PagedKVCache  # noqa: E402
from inferflow.engine.paged_backend import PagedAttentionBackend  # noqa: E402
from inferflow.engine.static_decode import StaticDecodeBackend  # noqa: E402
from inferflow.model.context import ForwardContext  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    return triton_attention


def test_in_subprocess():
    """Run this file's kernel tests in a fresh interpreter when Triton was imported earlier in this session."""
    run_file_in_subprocess(__file__)


@pytest.mark.parametrize("dtype,softcap,window,kw", [
    (torch.float32, None, None, {"min_part": 64}),                      # splits merged by the last program
    (torch.float16, 20.0, None, {"min_part": 16, "ticket": False}),     # many splits, the merge kernel
    (torch.float32, None, 21, {"min_part": 16}),                        # window: splits of the live keys only
    (torch.float32, None, None, {"max_splits": 1}),                     # one split: written directly
    (torch.float16, None, 40, {"min_part": 32, "ticket": False})])  # (bf16 stores are wrong in the interpreter)
def test_kernel_vs_reference(kernels, dtype, softcap, window, kw):
    g = torch.Generator().manual_seed(1)
    B, H, hkv, bs, nb = 3, 8, 2, 16, 40
    D = 8 if window == 21 else 32  # a head smaller than tl.dot's minimum K (16) is padded
    kc, vc = (torch.randn(nb, bs, hkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, D, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 150])
    tables = torch.stack([torch.randperm(nb, generator=g)[:10] for _ in range(B)])
    for _ in range(2):  # twice: the merging program must leave its ticket at 0 for the next call
        out = kernels.paged_decode(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=160, softcap=softcap,
                                   window=window, block_n=16, **kw)
        ref = kernels.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, softcap=softcap,
                                             window=window)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out.float() - ref.float()).abs().max().item() <= tol
    if kw.get("ticket", True):
        assert not kernels._tickets[q.device].any()


def test_splits_bound():
    assert triton_attention.num_splits(100, block_n=64, min_part=64) == (2, 64)
    s, part = triton_attention.num_splits(40960, block_n=64)
    assert s <= 16 and s * part >= 40960 and part % 64 == 0
    # the grid: about two programs per SM; none extra once (sequence, KV head) programs fill the GPU
    assert triton_attention.grid_splits(288, programs=8, sms=132, min_part=64) == 5
    assert triton_attention.grid_splits(40960, programs=8, sms=132) == 16
    assert triton_attention.grid_splits(40960, programs=512, sms=132) == 1


@pytest.mark.parametrize("block_n", [16, None])
def test_kernel_ignores_keys_past_the_length(kernels, block_n):
    """Unused cache blocks holding NaN and table padding out of range (-1, huge) change nothing (masked loads)."""
    g = torch.Generator().manual_seed(4)
    hkv, H, D, bs, nb = 2, 4, 16, 16, 12
    kc, vc = (torch.full((nb, bs, hkv, D), float("nan")) for _ in range(2))
    tables = torch.tensor([[3, 5, -1, 10 ** 6], [7, 10 ** 6, -1, -1]])
    for blk in (3, 5, 7):
        kc[blk], vc[blk] = torch.randn(bs, hkv, D, generator=g), torch.randn(bs, hkv, D, generator=g)
    q = torch.randn(2, H, D, generator=g)
    lens = torch.tensor([20, 3])
    out = kernels.paged_decode(q, kc, vc, tables, lens, scale=0.3, max_len=64, block_n=block_n, min_part=16)
    ref = kernels.paged_decode_reference(q, kc.nan_to_num(), vc.nan_to_num(), tables.clamp(0, nb - 1), lens, scale=0.3)
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [None, 9])
def test_static_backend_kernel_vs_paged_backend(kernels, window):
    """Decode rows through the paged cache: the kernel path equals the engine's torch decode path."""
    g = torch.Generator().manual_seed(2)
    bs, hkv, H, D = 16, 2, 6, 16
    cache = PagedKVCache([KVLayer(0, hkv, D)], 24, bs)
    lens = [5, 33, 17, 48]
    tables, free = [], list(torch.randperm(24, generator=g).tolist())
    for n in lens:
        k = -(-n // bs)
        tables.append(free[:k])
        free = free[k:]
    # history: the first len-1 tokens of each sequence
    cache.write(0, cache.slot_mapping(tables, [0] * 4, [n - 1 for n in lens]),
                *(torch.randn(sum(lens) - 4, hkv, D, generator=g) for _ in range(2)))
    q, k, v = torch.randn(4, H, D, generator=g), torch.randn(4, hkv, D, generator=g), torch.randn(4, hkv, D, generator=g)
    slots = cache.slot_mapping(tables, [n - 1 for n in lens], [1] * 4)
    ctx = ForwardContext(positions=torch.tensor([n - 1 for n in lens]), q_lens=[1] * 4, k_lens=lens, backend=None)
    ref = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.25,
                                                                    window=window)
    width = 4
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = StaticDecodeBackend(cache, slots, tab, torch.tensor(lens), 64, use_kernel=True).self_attention(
        0, q, k, v, ctx, causal=True, scale=0.25, window=window)
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_match_torch(kernels, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3 * 64, generator=g) * 3).to(dtype)
    for offset, in_float in ((0.0, False), (1.0, True), (1.0, False)):
        norm = create("rmsnorm", {"dim": 64, "eps": 1e-6, "offset": offset, "weight_in_float": in_float})
        norm.weight = torch.nn.Parameter(torch.randn(64, generator=g).to(dtype), requires_grad=False)
        part = x[:, 64:128]                           # a strided 2-D view
        heads = x.view(5, 3, 64)                      # [N, H, D]
        for t in (part, heads):
            assert (fused_ops.rmsnorm(t, norm.weight, 1e-6, offset, in_float).float() - norm(t).float()).abs().max() \
                <= (1e-5 if dtype == torch.float32 else 2e-3)
    rope = create("rope", {"dim": 64, "theta": 10000.0})
    ctx = ForwardContext(positions=torch.tensor([0, 3, 7, 100, 9]), q_lens=[5], k_lens=[5], backend=None)
    cos, sin = rope.cos_sin(ctx, dtype)
    for t in (heads, x[:, :128].reshape(5, 2, 64)):
        assert (fused_ops.rope_half(t, cos, sin).float() - rope._rot(t, cos, sin).float()).abs().max() \
            <= (1e-5 if dtype == torch.float32 else 2e-3)
    gu = (torch.randn(4, 2 * 96, generator=g) * 4).to(dtype)
    gate, up = gu.split(96, -1)
    ref = torch.nn.functional.silu(gate) * up
    assert (fused_ops.silu_mul(gate, up).float() - ref.float()).abs().max() <= (1e-5 if dtype == torch.float32
                                                                                else 1e-2)


keep_one_mode(globals(), IN_PROCESS)
