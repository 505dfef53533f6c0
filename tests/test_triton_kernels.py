"""The GPU fast path's Triton kernels under TRITON_INTERPRET=1 (CPU): the paged decode kernel against the engine's
torch paged attention (PagedAttentionBackend) and the reference, for GQA, ragged lengths, block_size 16, soft-cap
and a sliding window; the fused RMSNorm / RoPE / SwiGLU ops against the components' torch compositions."""
import warnings

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


@pytest.mark.parametrize("dtype,window,kw", [(torch.float32, None, {"min_part": 64}),
                                             (torch.float16, 21, {"min_part": 16, "ticket": False}),
                                             (torch.float32, None, {"max_splits": 1})])
def test_kernel_int8_cache_vs_reference(kernels, dtype, window, kw):
    """An int8 cache read in place with its per-row scales: the kernel against the dequantized reference."""
    from inferflow.engine.kv_store import quantize_int8

    g = torch.Generator().manual_seed(11)
    B, H, hkv, bs, nb, D = 3, 8, 2, 16, 40, 32
    (kc, ks), (vc, vs) = (quantize_int8(torch.randn(nb * bs, hkv, D, generator=g) * 4) for _ in range(2))
    kc, vc = kc.view(nb, bs, hkv, D), vc.view(nb, bs, hkv, D)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    lens = torch.tensor([1, 37, 150])
    tables = torch.stack([torch.randperm(nb, generator=g)[:10] for _ in range(B)])
    out = kernels.paged_decode(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=160, window=window, block_n=16,
                               k_scales=ks, v_scales=vs, **kw)
    ref = kernels.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, window=window, k_scales=ks,
                                         v_scales=vs)
    rel = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert rel <= (1e-6 if dtype == torch.float32 else 2e-3)  # float16: the output's own rounding
    with pytest.raises(ValueError, match="k_scales"):
        kernels.paged_decode(q, kc, vc, tables, lens, scale=1.0, max_len=160)


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


@pytest.mark.parametrize("window,dtype", [(None, "float32"), (9, "float32"), (9, "int8")])
def test_static_backend_kernel_vs_paged_backend(kernels, window, dtype):
    """Decode rows through the paged cache: the kernel path equals the engine's torch decode path (an int8 cache:
    both read the same codes and scales)."""
    g = torch.Generator().manual_seed(2)
    bs, hkv, H, D = 16, 2, 6, 16
    cache = PagedKVCache([KVLayer(0, hkv, D)], 24, bs, dtype=dtype)
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


@pytest.mark.parametrize("window", [None, 3])
def test_static_backend_chained_rows_vs_paged_backend(kernels, window):
    """A prefill chunk as decode rows of the static step (graph_prefill_tokens): 4 new tokens of one sequence on
    5 cached ones, beside another sequence's decode, through the kernel; each row sees the rows before it (their K/V
    stored in the same step), as the engine's causal prefill does."""
    g = torch.Generator().manual_seed(4)
    bs, hkv, H, D = 4, 2, 4, 16
    cache = PagedKVCache([KVLayer(0, hkv, D)], 16, bs, compute_dtype=torch.float32)
    tables = [[3, 9, 1], [7, 2, 12, 5, 0]]
    cache.write(0, cache.slot_mapping(tables, [0, 0], [5, 16]), *(torch.randn(21, hkv, D, generator=g) for _ in "kv"))
    q, k, v = (torch.randn(5, h, D, generator=g) for h in (H, hkv, hkv))
    slots = cache.slot_mapping(tables, [5, 16], [4, 1])
    ctx = ForwardContext(positions=torch.tensor([5, 6, 7, 8, 16]), q_lens=[4, 1], k_lens=[9, 17], backend=None)
    ref = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3,
                                                                    window=window)
    tab = torch.tensor([tables[0] + [0, 0]] * 4 + [tables[1]])
    out = StaticDecodeBackend(cache, slots, tab, torch.tensor([6, 7, 8, 9, 17]), 20, use_kernel=True,
                              chained=True).self_attention(0, q, k, v, ctx, causal=True, scale=0.3, window=window)
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 3.0)])
def test_mixed_step_decode_rows_take_the_kernel(kernels, monkeypatch, window, softcap):
    """The decode rows of mixed steps (and a lone one) read their keys in place through the Triton paged kernel,
    no gather; every step equals the dense backend, new prompts and chunks beside them included."""
    from inferflow.engine import paged_rows
    from inferflow.model.context import AttentionBackend, ContiguousKVCache

    monkeypatch.setattr(paged_rows, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(PagedAttentionBackend, "_native_rows", lambda *a, **kw: None)  # the CPU's own path aside
    calls = []
    real = kernels.paged_decode
    monkeypatch.setattr(kernels, "paged_decode", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    g = torch.Generator().manual_seed(5)
    bs, hkv, H, D = 4, 2, 4, 16
    cache = PagedKVCache([KVLayer(0, hkv, D)], 40, bs, compute_dtype=torch.float32)
    steps = [[4, 3, 0, 0], [1, 1, 5, 0], [1, 1, 1, 6], [0, 0, 0, 1]]  # new tokens per sequence and step
    lens = [sum(c) for c in zip(*steps)]
    free = torch.randperm(40, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    dense = AttentionBackend(ContiguousKVCache(), slots=[])
    done = [0] * 4
    for t, take in enumerate(steps):
        rows = [i for i, n in enumerate(take) if n]
        n = sum(take)
        q, k, v = torch.randn(n, H, D, generator=g), torch.randn(n, hkv, D, generator=g), torch.randn(n, hkv, D, generator=g)
        ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=[take[i] for i in rows],
                             k_lens=[done[i] + take[i] for i in rows], backend=None)
        slots = cache.slot_mapping([tables[i] for i in rows], [done[i] for i in rows], [take[i] for i in rows])
        kw = dict(causal=True, scale=0.3, window=window, softcap=softcap)
        ours = PagedAttentionBackend(cache, [tables[i] for i in rows], slots).self_attention(0, q, k, v, ctx, **kw)
        dense.slots = rows
        assert (ours - dense.self_attention(0, q, k, v, ctx, **kw)).abs().max().item() <= 1e-5, f"step {t}"
        for i in rows:
            done[i] += take[i]
    # steps 1-3: their decode rows (step 0 has none); step 3's lone decode on the CPU is the native kernel's unless
    # soft-capped
    assert calls == ([2, 3] if softcap is None else [2, 3, 1])


def test_mixed_step_int8_cache_takes_the_kernel(kernels, monkeypatch):
    """With an int8 cache the decode rows of mixed steps read codes and scales in place through the kernel; each
    step equals the gather path (which dequantizes the same codes) on a twin cache."""
    from inferflow.engine import paged_rows

    monkeypatch.setattr(paged_rows, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(PagedAttentionBackend, "_native_rows", lambda *a, **kw: None)
    monkeypatch.setattr(PagedAttentionBackend, "_native_decode", lambda *a, **kw: None)
    calls = []
    real = kernels.paged_decode
    monkeypatch.setattr(kernels, "paged_decode", lambda q, *a, **kw: calls.append(kw["k_scales"].dtype)
                        or real(q, *a, **kw))
    g = torch.Generator().manual_seed(12)
    twins = [PagedKVCache([KVLayer(0, 2, 16)], 40, 4, dtype="int8", compute_dtype=torch.float32) for _ in "ab"]
    tables, done = [[3, 7, 30], [9, 1, 12, 20], [4, 5, 6]], [0, 0, 0]
    for take in ([5, 9, 0], [1, 1, 6], [1, 1, 1]):
        rows = [i for i, n in enumerate(take) if n]
        q, k, v = torch.randn(sum(take), 4, 16, generator=g), *(torch.randn(sum(take), 2, 16, generator=g) for _ in "kv")
        ctx = ForwardContext(positions=torch.zeros(sum(take), dtype=torch.long), q_lens=[take[i] for i in rows],
                             k_lens=[done[i] + take[i] for i in rows], backend=None)
        outs = []
        for cache, ok in zip(twins, (True, False)):
            monkeypatch.setitem(paged_rows._kernel, "ok", ok)
            t = [tables[i] for i in rows]
            slots = cache.slot_mapping(t, [done[i] for i in rows], [take[i] for i in rows])
            outs.append(PagedAttentionBackend(cache, t, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3,
                                                                              window=6))
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-5
        for i in rows:
            done[i] += take[i]
    assert calls == [torch.float32, torch.float32]  # the two steps with decode rows


def test_mixed_step_kernel_failure_falls_back(kernels, monkeypatch):
    """A kernel that raises in a mixed step (a compiler or driver problem) warns once and gives way to the gather
    path for good; the step's result is still right."""
    from inferflow.engine import paged_rows
    from inferflow.model.context import AttentionBackend, ContiguousKVCache

    monkeypatch.setattr(paged_rows, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setitem(paged_rows._kernel, "ok", True)
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("kernel cannot run here")

    monkeypatch.setattr(kernels, "paged_decode", broken)
    g = torch.Generator().manual_seed(6)
    cache = PagedKVCache([KVLayer(0, 2, 16)], 16, 4, compute_dtype=torch.float32)
    tables = [[3, 7], [9, 1, 12]]
    dense = AttentionBackend(ContiguousKVCache(), slots=[0, 1])
    for take, done in (([5, 9], [0, 0]), ([1, 1], [5, 9]), ([1, 1], [6, 10])):
        q, k, v = torch.randn(sum(take), 4, 16, generator=g), *(torch.randn(sum(take), 2, 16, generator=g) for _ in "kv")
        ctx = ForwardContext(positions=torch.zeros(sum(take), dtype=torch.long), q_lens=take,
                             k_lens=[a + b for a, b in zip(done, take)], backend=None)
        slots = cache.slot_mapping(tables, done, take)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ours = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3,
                                                                              softcap=2.0)
        assert (ours - dense.self_attention(0, q, k, v, ctx, causal=True, scale=0.3, softcap=2.0)).abs().max() <= 1e-5
        assert len(w) == (1 if take == [1, 1] and done == [5, 9] else 0)
    assert calls == [1] and not paged_rows._kernel["ok"]


def test_mixed_step_kernel_widens_a_narrower_cache(kernels, monkeypatch):
    """float16 K/V under float32 queries (``kv_cache_dtype`` below the compute dtype; an fp8 cache on a GPU takes the
    same cast): the kernel widens each K/V tile to the queries' dtype, as a gather would. On an H200 this case was a
    compile error (the dot products' operands differed) that switched the kernel off for the whole process."""
    from inferflow.engine import paged_rows
    from inferflow.model.context import AttentionBackend, ContiguousKVCache

    monkeypatch.setattr(paged_rows, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(PagedAttentionBackend, "_native_rows", lambda *a, **kw: None)
    monkeypatch.setitem(paged_rows._kernel, "ok", True)
    calls = []
    real = kernels.paged_decode
    monkeypatch.setattr(kernels, "paged_decode", lambda q, k, *a, **kw: calls.append((q.dtype, k.dtype)) or real(q, k, *a, **kw))
    g = torch.Generator().manual_seed(8)
    cache = PagedKVCache([KVLayer(0, 2, 16)], 16, 4, dtype="float16", compute_dtype=torch.float32)
    tables = [[3, 7], [9, 1, 12], [4, 5]]
    dense = AttentionBackend(ContiguousKVCache(), slots=[0, 1, 2])
    for take, done in (([5, 9, 0], [0, 0, 0]), ([1, 1, 6], [5, 9, 0])):  # then two decode rows beside a new prompt
        q, k, v = torch.randn(sum(take), 4, 16, generator=g), *(torch.randn(sum(take), 2, 16, generator=g) for _ in "kv")
        ctx = ForwardContext(positions=torch.zeros(sum(take), dtype=torch.long), q_lens=take,
                             k_lens=[a + b for a, b in zip(done, take)], backend=None)
        slots = cache.slot_mapping(tables, done, take)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3)
        assert (ours - dense.self_attention(0, q, k, v, ctx, causal=True, scale=0.3)).abs().max() <= 5e-3
    assert calls == [(torch.float32, torch.float16)] and paged_rows._kernel["ok"]


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
