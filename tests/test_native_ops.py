"""Native CPU decode ops (inferflow/native/cpu_ops.py) against the torch paths they replace: RMSNorm and residual
add + RMSNorm (bit for bit), SiLU*mul, RoPE (bit for bit), paged decode attention with its K/V write (GQA, ragged lengths crossing blocks, float32 and
bfloat16); a sequence's attention is the same bits alone or in a batch and on 1 or 2 threads; greedy tokens of a
tiny llama and of the default model are the same with the native ops on and off. RMSNorm reproduces torch's
summation order, so it is bit for bit the torch path too."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from inferflow.engine.kv_cache import KVLayer, PagedKVCache
from inferflow.engine.kv_store import raw
from inferflow.engine.paged_backend import PagedAttentionBackend
from inferflow.model.context import ForwardContext
from inferflow.native import cpu_ops
from inferflow.registry import create

import engine_models  # noqa: F401  (its autouse one-thread fixture)
from engine_models import one_thread  # noqa: F401

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="native kernels unavailable (no compiler / switched off)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def native(monkeypatch):
    """switch(on): the native ops on or off for the code that follows (re-read like a fresh process would)."""
    def switch(on: bool) -> None:
        monkeypatch.setenv(cpu_ops.ENV, "1" if on else "0")
        cpu_ops.refresh()
    yield switch
    monkeypatch.delenv(cpu_ops.ENV, raising=False)
    cpu_ops.refresh()


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: a few ulps; bfloat16: one rounding step of the result."""
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    scale = ref.float().abs().clamp_min(1.0)
    assert ((got.float() - ref.float()).abs() / scale).max().item() <= tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_float,offset", [(False, 0.0), (True, 0.0), (False, 1.0), (True, 1.0)])
def test_rmsnorm_equals_torch_bitwise(dtype, weight_in_float, offset, native):
    g = torch.Generator().manual_seed(0)
    for dim, shape in ((576, (1, 576)), (64, (3, 4, 64)), (48, (9, 48)), (7, (2, 7)), (5000, (2, 5000))):
        norm = create("rmsnorm", {"dim": dim, "eps": 1e-5, "offset": offset, "weight_in_float": weight_in_float})
        norm.weight = torch.nn.Parameter(torch.randn(dim, generator=g).to(dtype), requires_grad=False)
        x = (torch.randn(*shape, generator=g) * 7).to(dtype)
        native(False)
        ref = norm(x)
        native(True)
        got = cpu_ops.rmsnorm(x, norm.weight, 1e-5, offset, weight_in_float)
        assert torch.equal(got, ref)  # torch's summation order reproduced: the same bits
        assert torch.equal(norm(x), ref)
    wide = torch.randn(5, 2 * 64, generator=g).to(dtype)[:, :64]  # rows at a stride (a slice of a wider output)
    w = torch.randn(64, generator=g).to(dtype)
    _close(cpu_ops.rmsnorm(wide, w, 1e-6), cpu_ops.rmsnorm(wide.contiguous(), w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype, native):
    g = torch.Generator().manual_seed(1)
    for n, inter in ((1, 1536), (8, 48), (3, 2100)):
        gu = (torch.randn(n, 2 * inter, generator=g) * 4).to(dtype)
        gate, up = gu.split(inter, dim=-1)
        ref = F.silu(gate) * up
        native(True)
        _close(cpu_ops.silu_mul(gate, up), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_is_the_table_rotation_bitwise(dtype, native):
    rope = create("rope", {"dim": 16, "theta": 10000.0})
    g = torch.Generator().manual_seed(2)
    for n in (1, 7):
        pos = torch.randint(0, 300, (n,), generator=g)
        ctx = ForwardContext(positions=pos, q_lens=[n], k_lens=[n], backend=None)
        qkv = torch.randn(n, (4 + 2 + 2) * 16, generator=g).to(dtype)
        heads = qkv[:, :6 * 16].view(n, 6, 16)  # q|k heads of a fused projection: rows at a stride
        native(False)
        ref = rope.rotate_heads(heads, ctx)
        cos, ssin = rope._table(ctx, dtype)
        native(True)
        got = cpu_ops.rope(heads, cos, ssin)
        assert torch.equal(got, ref)


def _cache(lens, hkv, d, dtype, seed=0, store=None):
    """A one-layer paged cache holding ``lens[i]`` random keys of each sequence in shuffled blocks (each table has
    room for one more token: the decode step's); ``store``: the cache's dtype when not ``dtype``."""
    bs = 4
    cache = PagedKVCache([KVLayer(0, hkv, d)], sum(math.ceil((n + 1) / bs) for n in lens) + 3, bs,
                         dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                                torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[store or dtype],
                         compute_dtype=dtype)
    blocks = cache.pool.allocate(cache.pool.num_free)
    perm = [blocks[i] for i in torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed)).tolist()]
    tables = []
    for n in lens:
        tables.append(perm[:math.ceil((n + 1) / bs)])
        perm = perm[len(tables[-1]):]
    g = torch.Generator().manual_seed(seed + 1)
    for t, n in zip(tables, lens):
        cache.write(0, cache.slot_mapping([t], [0], [n]), torch.randn(n, hkv, d, generator=g).to(dtype),
                    torch.randn(n, hkv, d, generator=g).to(dtype))
    return cache, tables


def _decode(cache, tables, lens, q, k, v, rows=None, window=None):
    """One pure-decode attention step of the sequences ``rows`` (default all) through the paged backend."""
    rows = list(range(len(lens))) if rows is None else rows
    tabs, ls = [tables[i] for i in rows], [lens[i] for i in rows]
    slots = cache.slot_mapping(tabs, ls, [1] * len(rows))
    be = PagedAttentionBackend(cache, tabs, slots)
    ctx = ForwardContext(positions=torch.tensor(ls), q_lens=[1] * len(rows), k_lens=[n + 1 for n in ls], backend=be)
    return be.self_attention(0, q[rows], k[rows], v[rows], ctx, causal=True, scale=q.shape[-1] ** -0.5,
                             window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,hkv,d", [(4, 2, 8), (6, 2, 16), (3, 3, 64), (9, 3, 64), (4, 1, 128)])
def test_paged_decode_matches_torch(dtype, h, hkv, d, native):
    lens = [9, 14, 3, 4, 0, 21]  # ragged, crossing block boundaries (block size 4), one empty history
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    k = torch.randn(len(lens), hkv, d, generator=g).to(dtype)
    v = torch.randn(len(lens), hkv, d, generator=g).to(dtype)
    native(False)
    ref_cache, tables = _cache(lens, hkv, d, dtype)
    ref = _decode(ref_cache, tables, lens, q, k, v)
    native(True)
    cache, tables = _cache(lens, hkv, d, dtype)
    called = []
    orig = cpu_ops.paged_decode
    try:
        cpu_ops.paged_decode = lambda *a, **kw: called.append(1) or orig(*a, **kw)
        got = _decode(cache, tables, lens, q, k, v)
    finally:
        cpu_ops.paged_decode = orig
    assert called, "the native kernel did not serve"
    _close(got, ref, dtype)
    for store in ("k", "v"):  # the kernel stored the new K/V exactly where (and as) the torch write does
        assert torch.equal(getattr(cache._dev[0], store), getattr(ref_cache._dev[0], store))
    alone = [_decode(*_cache(lens, hkv, d, dtype), lens, q, k, v, rows=[i])[0] for i in range(len(lens))]
    assert torch.equal(torch.stack(alone), got)  # a sequence's result does not depend on its batch


@pytest.mark.parametrize("dtype,store", [(torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
                                         (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.int8),
                                         (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (4, 2, 16), (8, 2, 128)])
def test_paged_decode_narrower_cache(dtype, store, h, hkv, d, native):
    """kv_cache_dtype bfloat16 for a float32 model, or fp8 (float8 e4m3) or int8 for either: the kernel rounds the new
    K/V as the torch write does (fp8: to nearest even, saturating at 448, subnormals below 2^-6; int8: the row's
    absmax / 127 as its scale, codes rounded half to even) and reads the rows exactly."""
    lens = [9, 14, 3, 40]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(len(lens), n, d, generator=g) for n in (h, hkv, hkv))
    k[0, 0, :8] = torch.tensor([500.0, -1e4, 3e-3, -1e-3, 0.0, 0.01953125, 448.0, 0.0146484375])  # ties, saturation
    v[1, 0, :4] = torch.tensor([-480.0, 2e-4, 464.0, 0.00341796875])
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    native(False)
    ref_cache, tables = _cache(lens, hkv, d, dtype, store=store)
    ref = _decode(ref_cache, tables, lens, q, k, v)
    native(True)
    cache, tables = _cache(lens, hkv, d, dtype, store=store)
    called = []
    orig = cpu_ops.paged_decode
    try:
        cpu_ops.paged_decode = lambda *a, **kw: called.append(orig(*a, **kw)) or called[-1]
        got = _decode(cache, tables, lens, q, k, v)
    finally:
        cpu_ops.paged_decode = orig
    assert called and called[0] is not None, "the native kernel did not serve"
    assert cache._dev[0].k.dtype == store and got.dtype == dtype
    for which in ("k", "v", "ks", "vs"):  # the same bytes (and int8 scales) as torch's cast
        got_t, want_t = getattr(cache._dev[0], which), getattr(ref_cache._dev[0], which)
        assert (got_t is None) == (want_t is None) and (got_t is None or torch.equal(raw(got_t), raw(want_t)))
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("window", [1, 5, 17])
def test_paged_decode_sliding_window_matches_torch(dtype, d, window, native):
    """A sliding window (each query sees its last ``window`` keys) through the native kernel, as the torch path
    masks it; windows starting mid-block and longer than some histories."""
    lens = [9, 14, 3, 4, 0, 21, 40]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(len(lens), n, d, generator=g).to(dtype) for n in (4, 2, 2))
    native(False)
    ref = _decode(*_cache(lens, 2, d, dtype), lens, q, k, v, window=window)
    native(True)
    called = []
    orig = cpu_ops.paged_decode
    try:
        cpu_ops.paged_decode = lambda *a, **kw: called.append(1) or orig(*a, **kw)
        got = _decode(*_cache(lens, 2, d, dtype), lens, q, k, v, window=window)
    finally:
        cpu_ops.paged_decode = orig
    assert called, "the native kernel did not serve"
    _close(got, ref, dtype)


def test_paged_decode_thread_count_invariant(native):
    native(True)
    lens = [600, 393, 192, 750, 21, 297, 540, 99]  # enough keys that 2 threads split the work (cpu_ops.c: par)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(8, n, 64, generator=g) for n in (8, 2, 2))
    outs = []
    for nt in (1, 2):
        torch.set_num_threads(nt)
        outs.append(_decode(*_cache(lens, 2, 64, torch.float32), lens, q, k, v))
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])


def _greedy(model, prompts, tokens):
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    eng = Engine(model, EngineConfig(block_size=4, num_blocks=64 * len(prompts), max_num_batched_tokens=64))
    res = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return [r.outputs[0].token_ids for r in res]


def test_tiny_llama_tokens_equal_native_on_off(tmp_path, native):
    model = engine_models.llama(tmp_path)
    prompts = [[5, 17, 33, 9, 40, 41, 42], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    outs = {}
    for on in (False, True):
        native(on)
        outs[on] = (_greedy(model, prompts, 12), [_greedy(model, [p], 12)[0] for p in prompts])
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][1]  # batched == alone


def test_default_model_tokens_equal_native_on_off(native, monkeypatch):
    import inferflow
    from inferflow.default_model import default_model_path

    # the exact block decode: int8 activations (the default) re-round any last-bit difference of the ops into a
    # different code, enough to flip this nonsense prompt's low-margin tokens; the ops' arithmetic is the question
    monkeypatch.setenv("INFERFLOW_NATIVE_Q8X", "0")

    try:
        path = default_model_path()
    except Exception:  # noqa: BLE001 - not installed here
        pytest.skip("default model not installed")
    model = inferflow.load(str(path), dtype="float32")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 30, 31, 32], [1, 2000, 2001, 2002, 2003, 2004, 2005, 2006, 2007]]
    outs = {}
    for on in (False, True):
        native(on)
        outs[on] = (_greedy(model, prompts, 6), _greedy(model, prompts[:1], 6))
    assert outs[True] == outs[False]


@pytest.mark.parametrize("value,exact_only,all_ops", [(None, True, True), ("norms", True, False), ("0", False, False)])
def test_modes_choose_the_ops(monkeypatch, value, exact_only, all_ops):
    if value is None:
        monkeypatch.delenv(cpu_ops.ENV, raising=False)  # the default: every native op
    else:
        monkeypatch.setenv(cpu_ops.ENV, value)
    cpu_ops.refresh()
    try:
        assert cpu_ops.enabled() == exact_only and cpu_ops.enabled_all() == all_ops
        x = torch.randn(2, 16, 8)
        cos = torch.randn(2, 1, 8)
        assert (cpu_ops.rope(x, cos, cos) is not None) == all_ops
        assert (cpu_ops.rmsnorm(x[:, 0], torch.ones(8), 1e-6) is not None) == exact_only
    finally:
        cpu_ops.refresh()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_equals_add_then_norm_bitwise(dtype, native):
    native(True)
    g = torch.Generator().manual_seed(6)
    add = create("add", {})
    for shape in ((1, 576), (5, 48), (2, 3, 64)):
        a, b = ((torch.randn(*shape, generator=g) * 3).to(dtype) for _ in range(2))
        for offset, in_float in ((0.0, False), (1.0, True), (1.0, False)):
            norm = create("rmsnorm", {"dim": shape[-1], "eps": 1e-6, "offset": offset, "weight_in_float": in_float})
            norm.weight = torch.nn.Parameter(torch.randn(shape[-1], generator=g).to(dtype), requires_grad=False)
            s, y = cpu_ops.add_rmsnorm(a, b, norm.weight, 1e-6, offset, in_float)
            ref_s = add([a, b])
            assert torch.equal(s, ref_s) and torch.equal(y, norm(ref_s))


def test_fused_add_norm_on_cpu_same_logits_and_tokens(tmp_path, native, monkeypatch):
    """The add -> RMSNorm links (model/fuse_add_norm.py) served natively on the CPU: the same logits bit for bit."""
    from inferflow.model import fuse_add_norm as fan

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not fan.enabled():
        pytest.skip("the fusion pass needs Triton importable")
    native(True)
    m = engine_models.llama(tmp_path)
    prompts = [[5, 17, 33, 9, 40], [7, 8, 9]]
    ref_logits, ref_tokens = m.logits(prompts), _greedy(m, prompts, 8)
    assert fan.fuse_add_norms(m.net) > 0
    calls = []
    real = cpu_ops.add_rmsnorm
    monkeypatch.setattr(cpu_ops, "add_rmsnorm", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(m.logits(prompts), ref_logits) and calls
    assert _greedy(m, prompts, 8) == ref_tokens


def test_argmax_equals_torch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1000, generator=g)
    x[1, 17] = x[1, 900] = 50.0                      # ties: the first wins
    x[2] = float("-inf")                              # all -inf: index 0
    x[3, 333] = float("nan")                          # a NaN is the maximum
    x[4, 5] = x[4, 7] = float("nan")                  # the first NaN
    x[5, 999] = float("inf")
    for rows in (x, x[:, :997], x[2:3]):              # strided rows, a tail under 16, one row
        got = cpu_ops.argmax(rows)
        assert got is not None and torch.equal(got, rows.argmax(-1))
    assert cpu_ops.argmax(x.double()) is None and cpu_ops.argmax(x.t()) is None
