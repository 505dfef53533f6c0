"""The GPU fast path's logic on the CPU: the padded static decode step (what a CUDA graph captures), run eagerly,
gives the normal path's logits and tokens; fused q/k/v and gate/up projections give the unfused logits."""
import pytest
import torch

import engine_models
from engine_models import one_thread  # noqa: F401 - autouse fixture
from parity import DEVICE
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.engine.cuda_graphs import DecodeGraphs, buckets
from inferflow.errors import InferflowError
from inferflow.engine.static_decode import pure_decode
from inferflow.model.fuse import fuse_projections


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def decoder(request, tmp_path_factory):
    return getattr(engine_models, request.param)(tmp_path_factory.mktemp(request.param))


def _engine(m, static: bool, use_kernel: bool = False, **cfg) -> Engine:
    # synchronous steps: every decode goes through ModelRunner.run (overlapped steps: test_engine_overlap.py)
    # graph_prefill_tokens 0 unless a test asks: the decode tests compare pure-decode steps only
    eng = Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 48,
                                    "max_num_seqs": 12, "async_scheduling": False, "graph_prefill_tokens": 0,
                                    **cfg}))
    if static:  # the static step, eagerly (no graphs on the CPU), through the torch attention path or the kernel
        eng.runner.graphs = DecodeGraphs(m, eng.cache, eng.config.max_num_seqs, eng.max_model_len, graphs=False,
                                         use_kernel=use_kernel, chained_rows=eng.config.graph_prefill_tokens)
    return eng


def _gathered(runner, monkeypatch):
    """``runner.forward_eager`` (the packed pass, never a static step) with the mixed step's decode rows on the
    gather path (not the kernel the static step may also use): the reference pass."""
    from inferflow.engine import paged_rows

    plain_run = runner.forward_eager

    def gathered(items):
        monkeypatch.setitem(paged_rows._kernel, "ok", False)
        try:
            return plain_run(items)
        finally:
            monkeypatch.setitem(paged_rows._kernel, "ok", True)

    return gathered


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 40, 48, 56, 64]
    assert buckets(300) == [1, 2, 4, 8, 16, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 300]
    # a batch pads to at most a quarter more rows from 32 on (powers of two alone: 65 sequences ran 128 rows)
    for n in range(33, 1025):
        assert next(b for b in buckets(1024) if b >= n) <= n * 1.25
    assert buckets(100, [64, 8, 8, 200, 1]) == [1, 8, 64, 100]  # cuda_graph_sizes: sorted, capped, closed


def test_graph_sizes_config():
    assert EngineConfig(cuda_graph_sizes=[1, 4, 16]).cuda_graph_sizes == [1, 4, 16]
    for bad in ([], [0, 8], [8, 5000], "1,2", [True], [1.5]):
        with pytest.raises(InferflowError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_static_step_equals_normal_path(decoder, kv, monkeypatch):
    """Every pure-decode step runs both ways on the same cache: same logits; then same greedy tokens overall. On
    CUDA the static step takes the paged decode kernel and the normal path the gather (an int8 cache: codes and
    scales read in place against dequantized gathers of the same codes)."""
    prompts, outs = engine_models.mix(20, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    eng = _engine(decoder, static=True, use_kernel=DEVICE == "cuda", kv_cache_dtype=kv)
    runner, checked = eng.runner, []
    gathered = _gathered(runner, monkeypatch)

    def both(scheduled):
        ref = gathered([(sc.seq, sc.start, sc.seq.tokens(sc.start, sc.start + 1), 1) for sc in scheduled]) \
            if pure_decode(scheduled) else None
        out = type(runner).run(runner, scheduled)
        if ref is not None:
            checked.append(len(scheduled))
            tol = 1e-5 * ref.abs().max().item() + 1e-6
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= tol
        return out

    runner.run = both
    got = [r.outputs[0].token_ids for r in eng.generate(prompts, params)]
    eng.cache.pool.assert_clean()
    assert checked and max(checked) > 4 and any(n not in buckets(12) for n in checked)  # padded buckets ran
    plain = _engine(decoder, static=False, kv_cache_dtype=kv)
    want = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    assert got == want


def test_fused_projections_same_logits(tmp_path):
    m = engine_models.llama(tmp_path)
    ids = torch.tensor([[5, 9, 3, 17, 40, 7]])
    ref = m.logits(ids)
    names = {n for n, _ in m.net.named_parameters()}
    assert fuse_projections(m.net) == 4  # 2 layers x (q/k/v, gate/up)
    attn = m.net.decoder.layers[0].self_attn
    assert attn.fused and attn.qkv_proj.weight.shape[0] == attn.qd + 2 * attn.kvd
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()  # a view, not a copy
    assert names <= {n for n, _ in m.net.named_parameters()}
    assert (m.logits(ids) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6
    assert fuse_projections(m.net) == 0  # idempotent


def test_engine_fuses_on_request(tmp_path):
    m = engine_models.llama(tmp_path)
    prompts, outs = engine_models.mix(6, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    want = [r.outputs[0].token_ids for r in _engine(m, False).generate(prompts, params)]
    eng = _engine(m, False, fuse_projections=True)
    assert m.net.decoder.layers[0].mlp.fused
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want
    if m.device.type == "cpu":
        assert eng.runner.graphs is None  # static decode steps are a CUDA path


def test_kernel_failure_falls_back_to_torch(tmp_path, monkeypatch):
    """A kernel that cannot run (a compiler or driver problem; here: one that raises) gives way to the torch path
    for good, with the same tokens."""
    from inferflow.engine import triton_attention

    m = engine_models.llama(tmp_path)
    prompts, outs = engine_models.mix(5, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    want = [r.outputs[0].token_ids for r in _engine(m, False).generate(prompts, params)]
    eng = _engine(m, True)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("kernel cannot run here")

    monkeypatch.setattr(triton_attention, "paged_decode", broken)
    eng.runner.graphs.static.use_kernel = True
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want
    assert calls and eng.runner.graphs.static.use_kernel is False


def test_capture_all_at_start(tmp_path, monkeypatch):
    """capture_all captures every bucket, largest first, on one scratch block that goes back to the pool: the
    padded rows all write that block's first slot, nothing else in the cache changes. The capture is emulated on
    the CPU by the eager step (what the real capture records); a failed capture stops it and frees the block."""
    m = engine_models.llama(tmp_path)
    eng = _engine(m, True)
    g = eng.runner.graphs
    cache = eng.cache
    before = [(cache._dev[k].k.clone(), cache._dev[k].v.clone()) for k in cache._dev]
    free, seen = cache.pool.num_free, []

    def capture(rows, chained=False):
        seen.append((rows, g.static.slots[:rows].tolist(), g.static.pos[:rows].tolist()))
        g._graphs[rows] = (None, g._eager(rows))
        return g._graphs[rows]

    monkeypatch.setattr(g, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    g.graphs_on = True
    assert g.capture_all(cache.pool) == 5 and [r for r, _, _ in seen] == [12, 8, 4, 2, 1]
    slots = {x for _, s, _ in seen for x in s}
    assert len(slots) == 1 and all(p == [0] * r for r, _, p in seen)  # one slot: scratch block * block_size + 0
    (scratch,) = slots
    assert cache.pool.num_free == free
    cache.pool.assert_clean()
    for (k0, v0), key in zip(before, cache._dev):
        st = cache._dev[key]
        keep = torch.ones(k0.shape[0] * k0.shape[1], dtype=torch.bool, device=k0.device)
        keep[scratch] = False
        for now, old in ((st.k, k0), (st.v, v0)):
            flat, flat0 = now.view(-1, *now.shape[2:]), old.view(-1, *old.shape[2:])
            assert torch.equal(flat[keep], flat0[keep]) and not torch.equal(flat[scratch], flat0[scratch])
    assert g.capture_all(cache.pool) == 5 and len(seen) == 5  # nothing left to capture
    g._graphs.clear()
    monkeypatch.setattr(g, "_capture", lambda rows, chained=False: seen.append(rows))  # a failed capture: None
    assert g.capture_all(cache.pool) == 0 and seen[-1] == 12 and cache.pool.num_free == free

    def oom(rows, chained=False):
        if rows < 12:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return capture(rows)

    monkeypatch.setattr(g, "_capture", oom)  # a warm-up that raises: the engine still starts, the rest stay lazy
    assert g.capture_all(cache.pool) == 1 and list(g._graphs) == [12] and cache.pool.num_free == free


def test_engine_captures_at_start_when_asked(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(DecodeGraphs, "capture_all", lambda self, pool: calls.append(pool) or 0)
    m = engine_models.llama(tmp_path)
    engines = [_engine(m, False, async_scheduling=True, capture_graphs_at_start=at) for at in (True, False)]
    assert all(e.runner.graphs is not None for e in engines)  # forced async scheduling: static steps on the CPU too
    assert calls == [engines[0].cache.pool]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_chained_prefill_rows_equal_normal_path(decoder, kv, monkeypatch):
    """graph_prefill_tokens: a step with prefill chunks of up to 40 new tokens in all runs as the static step, each
    token a decode row (its K/V stored before any row attends). Every such step runs both ways on the same cache
    (same logits of the rows that sample), prompts sharing a prefix hit the prefix cache (chunks on cached keys),
    prompts past 40 tokens run eagerly, and the greedy tokens are the normal path's."""
    prompts, outs = engine_models.mix(16, seed=5, max_prompt=30)
    prompts += [prompts[0] + prompts[1], prompts[0][:9] + [4, 5], list(range(3, 50))]  # prefix hits, one too long
    outs += [4, 3, 2]
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    eng = _engine(decoder, static=True, use_kernel=DEVICE == "cuda", kv_cache_dtype=kv, graph_prefill_tokens=40)
    g, runner, chained, eager, errs = eng.runner.graphs, eng.runner, [], [], []
    assert g.chained_rows == 40 and g.buckets[-1] == 40 and g.decode_buckets == [1, 2, 4, 8, 16]
    gathered = _gathered(runner, monkeypatch)

    def both(scheduled):
        new = sum(sc.num_tokens for sc in scheduled)
        if pure_decode(scheduled):
            return type(runner).run(runner, scheduled)
        ref = gathered([(sc.seq, sc.start, sc.seq.tokens(sc.start, sc.start + sc.num_tokens),
                         int(sc.start + sc.num_tokens == sc.seq.num_tokens)) for sc in scheduled])
        out = type(runner).run(runner, scheduled)
        (chained if new <= 40 else eager).append((new, len(scheduled)))
        errs.append(((out - ref).abs().max().item() / ref.abs().max().item(), out.shape == ref.shape))
        return out

    runner.run = both
    got = [r.outputs[0].token_ids for r in eng.generate(prompts, params)]
    eng.cache.pool.assert_clean()
    # checked here, not in ``both``: the engine turns a step's exception into failed requests. int8: the chained
    # rows read a chunk's own K/V back quantized, the eager pass attends to them as computed
    assert all(same for _, same in errs) and max(e for e, _ in errs) <= (1e-5 if kv == "auto" else 1e-2)
    assert chained and eager and any(k > 1 for _, k in chained)  # mixed steps of several chunks ran chained
    assert eng.scheduler.num_cached_prompt_tokens > 0
    plain = _engine(decoder, static=False, kv_cache_dtype=kv)
    want = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    assert got == want


def test_chained_graphs_captured_at_start(tmp_path, monkeypatch):
    """capture_all captures the decode buckets, then the chained ones up to graph_prefill_tokens."""
    m = engine_models.llama(tmp_path)
    eng = _engine(m, True, graph_prefill_tokens=20)
    g = eng.runner.graphs
    seen = []

    def capture(rows, chained=False):
        seen.append((rows, chained))
        (g._chained if chained else g._graphs)[rows] = (None, g._eager(rows, chained))
        return True

    monkeypatch.setattr(g, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    g.graphs_on = True
    assert g.capture_all(eng.cache.pool) == 5 + 6
    assert seen == [(r, False) for r in (16, 8, 4, 2, 1)] + [(r, True) for r in (20, 16, 8, 4, 2, 1)]


@pytest.mark.parametrize("bad", [-1, 513, 1.5])
def test_graph_prefill_tokens_is_checked(bad):
    from inferflow.errors import InferflowError

    with pytest.raises(InferflowError, match="graph_prefill_tokens .* expected an integer from 0 .off. to 512"):
        EngineConfig(graph_prefill_tokens=bad)


def test_prepare_stages_each_rows_table(tmp_path):
    """prepare: runs of rows of one sequence (a chained step) take their table by one copy, other rows their own;
    every staged row holds its sequence's table, slot and key count, padded rows repeat row 0."""
    m = engine_models.llama(tmp_path)
    eng = _engine(m, True, graph_prefill_tokens=12)
    st, bs = eng.runner.graphs.static, eng.cache.block_size

    class Seq:
        def __init__(self, table):
            self.block_table = table

    a, b, c = Seq([7, 3, 9]), Seq([2]), Seq([5, 6])
    items = [(a, 0, 11), (a, 1, 12), (a, 9, 13), (b, 2, 14), (a, 4, 15), (a, 5, 16), (c, 6, 17)]
    st.prepare(items, 8)
    for i, (seq, p, tok) in enumerate(items + [items[0]]):  # row 7: padding, row 0 again
        t = seq.block_table
        assert st.tables[i, :len(t)].tolist() == t and st.ids[i] == tok and st.pos[i] == p
        assert st.slots[i] == t[p // bs] * bs + p % bs and st.lens[i] == p + 1
