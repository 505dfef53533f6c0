"""The model run through PagedAttentionBackend (scattered blocks, chunked prefill, ragged decode) equals Model.logits."""
import math

import pytest
import torch
import transformers

import inferflow
from inferflow.engine.kv_cache import KVLayer, PagedKVCache, kv_layers
from inferflow.engine.paged_backend import PagedAttentionBackend
from inferflow.model.context import AttentionBackend, ContiguousKVCache, ForwardContext, attention_core
from inferflow.model.model import Batch

from parity import DEVICE, save, sequences

VOCAB = 96
BS = 4
LENGTHS = (9, 14, 6)


def rel_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    tol = rel * ref.abs().max().item() + 1e-6
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"


def new_cache(m, seqs, **kw) -> PagedKVCache:
    need = sum(math.ceil(len(s) / BS) for s in seqs)
    return PagedKVCache(kv_layers(m), need + 6, BS, compute_dtype=m.dtype, device=m.device, **kw)


def scattered_tables(cache: PagedKVCache, seqs, seed=0) -> list[list[int]]:
    """Every sequence's blocks, taken from the pool and shuffled so no table is contiguous."""
    blocks = cache.pool.allocate(cache.pool.num_free)
    g = torch.Generator().manual_seed(seed)
    perm = [blocks[i] for i in torch.randperm(len(blocks), generator=g).tolist()]
    tables = []
    for s in seqs:
        n = math.ceil(len(s) / BS)
        tables.append(perm[:n])
        perm = perm[n:]
    cache.pool.release(perm)
    return tables


def padded(tables) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def step(m, cache, tables, seqs, done, take, enc_ids=None, cross=None, tensor_tables=False):
    """One packed forward of ``take[i]`` new tokens of each sequence i (0: not in this batch)."""
    rows = [i for i, n in enumerate(take) if n]
    parts = [seqs[i][done[i]:done[i] + take[i]] for i in rows]
    batch = Batch(parts, None, m.device)
    batch.positions = torch.cat([torch.arange(done[i], done[i] + take[i]) for i in rows]).to(m.device)
    k_lens = [done[i] + take[i] for i in rows]
    slots = cache.slot_mapping([tables[i] for i in rows], [done[i] for i in rows], [take[i] for i in rows])
    enc = None
    sub_cross = None
    if enc_ids is not None:
        sub_cross = [cross[i] for i in rows]
        missing = [i for i in rows if not cross[i]]
        if missing:
            eb = Batch([enc_ids[i] for i in missing], None, m.device)
            enc = (m._encode(eb), eb.lens)
        else:
            enc = (torch.zeros(0, 1), [])
    sub = [tables[i] for i in rows]
    backend = PagedAttentionBackend(cache, padded(sub).to(m.device) if tensor_tables else sub, slots, sub_cross)
    with torch.inference_mode():
        logits = m._head(m._decode(batch, None, backend, k_lens, enc))
    for i in rows:
        done[i] += take[i]
    return dict(zip(rows, torch.split(logits, [take[i] for i in rows])))


def run(m, seqs, cache, tables, *, prompt_chunks=(3, 5), enc_ids=None, stagger=True, tensor_tables=False):
    """Staggered starts, chunked prompts, then one token per step: mixed and pure (ragged) decode batches."""
    done = [0] * len(seqs)
    prompt = [max(1, len(s) // 2) for s in seqs]
    cross = [{} for _ in seqs] if enc_ids is not None else None
    out = [[] for _ in seqs]
    t = 0
    while any(d < len(s) for d, s in zip(done, seqs)):
        take = []
        for i, s in enumerate(seqs):
            if (stagger and t < i) or done[i] >= len(s):
                take.append(0)
            elif done[i] < prompt[i]:
                take.append(min(prompt_chunks[(t + i) % len(prompt_chunks)], prompt[i] - done[i]))
            else:
                take.append(1)
        for i, lg in step(m, cache, tables, seqs, done, take, enc_ids, cross, tensor_tables).items():
            out[i].append(lg)
        t += 1
    return [torch.cat(o) for o in out]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # random reference weights, the same every run


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    return inferflow.load(save(ref, tmp_path_factory.mktemp("llama")), dtype="float32", device=DEVICE)


def check_decoder_model(m, tensor_tables=False, **cache_kw):
    seqs = sequences(VOCAB, lengths=LENGTHS)
    cache = new_cache(m, seqs, **cache_kw)
    tables = scattered_tables(cache, seqs)
    got = run(m, seqs, cache, tables, tensor_tables=tensor_tables)
    for i, s in enumerate(seqs):
        rel_close(got[i], m.logits(s), f"{m.spec.name} seq {i}")
    cache.pool.release([b for t in tables for b in t])
    cache.pool.assert_clean()
    return got


def test_llama_gqa(llama):
    assert [(x.num_kv_heads, x.head_dim) for x in kv_layers(llama)] == [(2, 8), (2, 8)]
    check_decoder_model(llama)
    check_decoder_model(llama, tensor_tables=True)  # block tables as one padded tensor


def test_mqa_fp16_storage(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64)
    m = inferflow.load(save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path), dtype="float32", device=DEVICE)
    check_decoder_model(m)
    seqs = sequences(VOCAB, lengths=LENGTHS)
    cache = new_cache(m, seqs, dtype="float16")
    got = run(m, seqs, cache, scattered_tables(cache, seqs))
    for i, s in enumerate(seqs):
        rel_close(got[i], m.logits(s), f"fp16 kv seq {i}", rel=2e-3)


def test_gemma2_sliding_window_softcap(tmp_path):
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=8,
                                    attn_logit_softcapping=0.5, final_logit_softcapping=None)
    m = inferflow.load(save(transformers.Gemma2ForCausalLM(cfg).eval(), tmp_path), dtype="float32", device=DEVICE)
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [4, None]
    check_decoder_model(m)


def test_bloom_alibi(tmp_path):
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    m = inferflow.load(save(transformers.BloomForCausalLM(cfg).eval(), tmp_path), dtype="float32", device=DEVICE)
    check_decoder_model(m)


def _seq2seq(m, start=0):
    enc = sequences(VOCAB, seed=1, lengths=(7, 11, 5))
    dec = [[start] + s[:-1] for s in sequences(VOCAB, seed=2, lengths=(5, 9, 7))]
    cache = new_cache(m, dec)
    tables = scattered_tables(cache, dec)
    got = run(m, dec, cache, tables, enc_ids=enc)
    for i in range(len(dec)):
        rel_close(got[i], m.logits(dec[i], encoder_input_ids=enc[i]), f"{m.spec.name} seq {i}")


def test_t5_relative_bias_cross_attention(tmp_path):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0)
    m = inferflow.load(save(transformers.T5ForConditionalGeneration(cfg).eval(), tmp_path), dtype="float32", device=DEVICE)
    assert len(kv_layers(m)) == 2  # decoder self-attention only
    _seq2seq(m)


def test_bart_cross_attention(tmp_path):
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64)
    ref = transformers.BartForConditionalGeneration(cfg).eval()
    _seq2seq(inferflow.load(save(ref, tmp_path), dtype="float32", device=DEVICE), start=cfg.decoder_start_token_id)


def test_single_sequence_steps_and_prefix_on_cached_blocks(llama):
    """One sequence at a time (no decode batching), then a second request reusing its first blocks."""
    m = llama
    (s,) = sequences(VOCAB, lengths=(13,))
    cache = new_cache(m, [s, s])
    tables = scattered_tables(cache, [s])
    got = run(m, [s], cache, tables, prompt_chunks=(4,))
    rel_close(got[0], m.logits(s), "single sequence")
    # a new request sharing the first 2 full blocks: only its tail is computed, on top of the cached blocks
    other = s[:8] + [5, 6, 7]
    t2 = [tables[0][:2] + cache.pool.allocate(1)]
    done = [8]
    lg = step(m, cache, t2, [other], done, [3])[0]
    rel_close(lg, m.logits(other)[8:], "chunk on cached prefix")


def test_int8_close_to_float(llama):
    m = llama
    seqs = sequences(VOCAB, lengths=LENGTHS)
    cache = new_cache(m, seqs, dtype="int8")
    got = run(m, seqs, cache, scattered_tables(cache, seqs))
    for i, s in enumerate(seqs):
        ref = m.logits(s)
        rel_close(got[i], ref, f"int8 seq {i}", rel=1e-2)  # measured ~2e-3
    f32 = PagedKVCache.bytes_per_block(kv_layers(m), BS, "float32")
    assert PagedKVCache.bytes_per_block(kv_layers(m), BS, "int8") == f32 // 4 + 2 * 2 * 2 * 4 * BS  # + fp32 scales


def test_fp8_close_to_float(llama):
    """float8 e4m3 K/V (one byte per element, no scales): every path of a ragged, chunked run reads them widened to
    the compute dtype (on CUDA the decode rows through the Triton kernel's own widening)."""
    m = llama
    seqs = sequences(VOCAB, lengths=LENGTHS)
    cache = new_cache(m, seqs, dtype="fp8")
    assert cache._dev[kv_layers(m)[0].key].k.dtype == torch.float8_e4m3fn
    got = run(m, seqs, cache, scattered_tables(cache, seqs))
    for i, s in enumerate(seqs):
        rel_close(got[i], m.logits(s), f"fp8 seq {i}", rel=5e-2)
    f32 = PagedKVCache.bytes_per_block(kv_layers(m), BS, "float32")
    assert PagedKVCache.bytes_per_block(kv_layers(m), BS, "fp8") == f32 // 4


def test_host_layers_equal_device_run(llama, monkeypatch):
    import inferflow.engine.paged_rows as pr

    # both runs' decode rows on one path: host-resident K/V never take the GPU's Triton kernel, device K/V would
    monkeypatch.setattr(pr, "KERNEL_DEVICES", ())
    m = llama
    keys = [x.key for x in kv_layers(m)]
    base = check_decoder_model(m)
    for host_compute in (False, True):
        seqs = sequences(VOCAB, lengths=LENGTHS)
        cache = new_cache(m, seqs, host_layers=frozenset(keys[-1:]), host_compute=host_compute)
        assert cache.memory_bytes()["host_layers"] == cache.memory_bytes()["device"] > 0
        got = run(m, seqs, cache, scattered_tables(cache, seqs))
        for a, b in zip(got, base):  # the same kernels on the same values; only CPU-vs-GPU attention may round
            if m.device.type == "cpu" or not host_compute:
                assert torch.equal(a, b)
            else:
                rel_close(a, b, "host compute")


@pytest.mark.parametrize("dtype", ["float32", "fp8"])  # fp8: copied as bytes (torch has no CPU float8 index_copy_)
def test_swap_round_trip(llama, dtype):
    m = llama
    a, b = sequences(VOCAB, lengths=(10, 12))
    cache = PagedKVCache(kv_layers(m), 6, BS, compute_dtype=m.dtype, device=m.device, num_host_blocks=4, dtype=dtype)
    (ta,) = scattered_tables(cache, [a])
    done = [0]
    out = [step(m, cache, [ta], [a], done, [7])[0]]
    keys = [x.key for x in kv_layers(m)]
    saved = {k: cache.gather(k, ta, 7) for k in keys}
    host = cache.swap_out(ta)
    assert cache.num_free_host == 1 and cache.host_pool.num_used == 3
    cache.pool.release(ta)
    # another request reuses (and overwrites) the freed device blocks meanwhile
    tb = cache.pool.allocate(3)
    step(m, cache, [tb], [b], [0], [12])
    cache.pool.release(tb)
    new = cache.swap_in(host)
    assert cache.num_free_host == 4 and cache.pool.num_used == 3
    cache.host_pool.assert_clean()
    for k in keys:
        for x, y in zip(cache.gather(k, new, 7), saved[k]):
            assert torch.equal(x, y)
    while done[0] < len(a):  # decoding continues on the swapped-in blocks
        out.append(step(m, cache, [new], [a], done, [1])[0])
    rel_close(torch.cat(out), m.logits(a), "after swap in", rel=1e-5 if dtype == "float32" else 5e-2)
    with pytest.raises(inferflow.errors.InferflowError):
        cache.swap_out(new + cache.pool.allocate(2))  # host tier too small: nothing taken
    assert cache.num_free_host == 4


def test_copy_blocks(llama):
    cache = PagedKVCache(kv_layers(llama), 4, BS, dtype="int8", compute_dtype=torch.float32)
    key = kv_layers(llama)[0].key
    k = torch.randn(BS, 2, 8)
    cache.write(key, torch.arange(BS) + BS, k, -k)
    cache.copy_blocks([1], [3])
    for x, y in zip(cache.gather(key, [3], BS), cache.gather(key, [1], BS)):
        assert torch.equal(x, y)
    rel_close(cache.gather(key, [3], BS)[0], k, "int8 round trip", rel=1e-2)


# ---- the backend alone against the dense cached backend, for attention options models rarely combine ----
def _bias_fn(qi, ki):
    return (ki[None, :] - qi[:, None]).float()[None].expand(4, -1, -1) * torch.tensor([0.1, 0.2, 0.3, 0.4])[:, None, None]


# per sequence, the new tokens it brings at each step (0: not in that step's batch)
SCHEDULES = {
    "chunks": [[4, 6], [7], [5, 1, 1, 5], [1, 1, 1]],
    # whole new sequences of one length next to each other: batched runs (3 x 6 then 1 x 9 and 1 x 3; at step 1,
    # a run of 2 after a chunk on cached blocks, then decode rows mixed with a run)
    "runs": [[6, 1, 1], [6, 1], [6], [9, 1, 1], [3, 3, 1], [0, 6, 1], [0, 6], [0, 0, 4], [0, 0, 4]],
    "one_run": [[5, 1, 1], [5, 1], [5, 1, 1]],  # step 0's batch is a single run: no scatter into an output buffer
    "hits": [[4, 3], [6, 2], [5, 4, 1]],  # step 1: only chunks on cached blocks (as prefix-cache hits give)
}


def run_schedule(schedule: str, hkv: int, seed: int, table_seed: int, **kw):
    """Every step of ``SCHEDULES[schedule]`` through a fresh PagedAttentionBackend and the dense cached backend
    (``kw``: the attention options), compared step by step; yields each step's backend after it ran."""
    g = torch.Generator().manual_seed(seed)
    chunks = SCHEDULES[schedule]
    lens = [sum(c) for c in chunks]
    cache = PagedKVCache([KVLayer(0, hkv, 8)], 32, BS, compute_dtype=torch.float32)
    tables = scattered_tables(cache, [[0] * n for n in lens], seed=table_seed)
    dense = AttentionBackend(ContiguousKVCache(), slots=list(range(len(lens))))
    done = [0] * len(lens)
    for t in range(max(map(len, chunks))):
        take = [c[t] if t < len(c) else 0 for c in chunks]
        rows = [i for i, n in enumerate(take) if n]
        n = sum(take)
        q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(n, hkv, 8, generator=g), torch.randn(n, hkv, 8, generator=g)
        ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=[take[i] for i in rows],
                             k_lens=[done[i] + take[i] for i in rows], backend=None)
        slots = torch.tensor([tables[i][p // BS] * BS + p % BS for i in rows for p in range(done[i], done[i] + take[i])])
        backend = PagedAttentionBackend(cache, [tables[i] for i in rows], slots)
        ours = backend.self_attention(0, q, k, v, ctx, **kw)
        dense.slots = rows
        rel_close(ours, dense.self_attention(0, q, k, v, ctx, **kw), f"step {t}")
        yield backend
        for i in rows:
            done[i] += take[i]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("causal,window,softcap,bias,hkv", [
    (True, None, None, False, 4), (True, 3, None, False, 2), (False, None, None, False, 2), (False, 3, None, False, 1),
    (True, 3, 2.0, True, 2),
    (False, None, 1.5, True, 4), (True, 5, None, True, 1)])
def test_backend_matches_dense(causal, window, softcap, bias, hkv, schedule):
    kw = dict(causal=causal, scale=0.3, window=window, softcap=softcap, bias_fn=_bias_fn if bias else None)
    runs = [[r[2:] for r in b._plan.runs] for b in run_schedule(schedule, hkv, 0, 3, **kw)]
    want = {"chunks": [[(1, 4), (1, 7), (1, 5), (1, 1)], [], [], []], "one_run": [[(3, 5)], [], []],  # (sequences, length) per run
            "runs": [[(3, 6), (1, 9), (1, 3)], [(2, 6)], [(2, 4)]], "hits": [[(1, 4), (1, 6), (1, 5)], [], []]}
    assert runs == want[schedule]


def test_pure_decode_is_one_attention_call_per_layer(llama, monkeypatch, torch_ops):
    import inferflow.engine.paged_rows as pb

    monkeypatch.setattr(pb, "KERNEL_DEVICES", ())  # the gather path (on CUDA the Triton kernel would take the rows)
    m = llama
    seqs = sequences(VOCAB, lengths=(5, 9, 7))
    cache = new_cache(m, seqs)
    tables = scattered_tables(cache, seqs)
    done = [0, 0, 0]
    step(m, cache, tables, seqs, done, [len(s) - 1 for s in seqs])
    calls, gathers = [], []
    monkeypatch.setattr(pb, "attention_core", lambda q, k, *a, **kw: calls.append(q.shape) or attention_core(q, k, *a, **kw))
    orig_gather = cache.gather_idx
    monkeypatch.setattr(cache, "gather_idx", lambda key, idx: gathers.append(idx.shape) or orig_gather(key, idx))
    lg = step(m, cache, tables, seqs, done, [1, 1, 1])
    assert calls == [(3, 4, 1, 8)] * 2 and gathers == [(3, 9)] * 2
    for i, s in enumerate(seqs):
        rel_close(lg[i], m.logits(s)[-1:], f"decode row {i}")


def test_slot_mapping_and_index():
    cache = PagedKVCache([KVLayer(0, 1, 4)], 64, BS)
    tables = [[5, 3, 9], [1], [7, 8, 2, 4], list(range(10, 40))]
    for starts, counts in (([2, 0, 5, 0], [8, 3, 1, 1]), ([2, 0, 5, 0], [8, 3, 1, 117]), ([0, 0, 0, 0], [0, 2, 0, 0])):
        want = [t[p // BS] * BS + p % BS for t, s, n in zip(tables, starts, counts) for p in range(s, s + n)]
        assert cache.slot_mapping(tables, starts, counts).tolist() == want
    idx, mask = cache.slot_index(tables[:3], [10, 2, 13])
    assert idx.shape == (3, 13) and mask.sum(1).tolist() == [10, 2, 13]
    assert idx[0, :10].tolist() == cache.seq_index(tables[0], 10).tolist() and idx[1, 2:].eq(0).all()
    with pytest.raises(inferflow.errors.InferflowError):
        cache.slot_mapping(tables, [0, 0, 0, 0], [13, 1, 1, 1])


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, enable_gqa=False, window_size=None,
                      is_causal=None):
    """torch's varlen_attn contract on the CPU: causal attention of queries [cu_q[i], cu_q[i+1]) to keys
    [cu_k[i], cu_k[i+1]), aligned bottom-right (the last query sees every key of its sequence), as flash does."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and (window_size == (-1, 0) or is_causal)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert q.shape[0] == cq[-1] and k.shape[0] == v.shape[0] == ck[-1] and len(cq) == len(ck)
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
    outs = [attention_core(q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
                           q_start=(d - c) - (b - a), causal=True, scale=scale)[0].transpose(0, 1)
            for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
    _varlen_reference.calls += 1
    return torch.cat(outs)


@pytest.mark.parametrize("lens,varlen_calls", [((5, 3, 7, 3), 1), ((4, 4, 6), 0), ((4, 4, 4, 4), 0)])
def test_new_prompts_of_many_lengths_take_one_varlen_call(monkeypatch, lens, varlen_calls):
    """From VARLEN_MIN_RUNS runs of new prompts on, the backend hands the whole packed step to varlen attention (on
    the CPU here through a reference with the kernel's contract: the offsets, the lengths, the packed layout)."""
    import inferflow.engine.paged_backend as pb
    from inferflow.engine import varlen

    impl = varlen._impl()
    assert impl is not None  # torch >= 2.11 has torch.nn.attention.varlen
    _varlen_reference.calls = 0
    monkeypatch.setattr(varlen, "_impl", lambda: (_varlen_reference, impl[1]))
    monkeypatch.setattr(pb.varlen, "usable", lambda q, d: True)
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache([KVLayer(0, 2, 8)], 16, BS, compute_dtype=torch.float32)
    tables = scattered_tables(cache, [[0] * n for n in lens], seed=2)
    n = sum(lens)
    q, k, v = torch.randn(n, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=list(lens), k_lens=list(lens), backend=None)
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, m in zip(tables, lens) for p in range(m)])
    ours = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3)
    ref = AttentionBackend(ContiguousKVCache(), slots=list(range(len(lens)))).self_attention(
        0, q, k, v, ctx, causal=True, scale=0.3)
    rel_close(ours, ref, f"lens {lens}")
    assert _varlen_reference.calls == varlen_calls


@pytest.mark.parametrize("schedule,calls,cap", [("chunks", [1, 1, 0, 1], None), ("runs", [1, 1, 0], None),
                                                ("one_run", [0, 0, 0], None), ("hits", [1, 1, 0], None),
                                                ("hits", [1, 2, 0], 16)])
def test_chunks_on_cached_keys_take_one_varlen_call(monkeypatch, schedule, calls, cap):
    """A step with prefill chunks on cached blocks (a lone decode among prefills counts as one) runs them as ONE
    varlen call over their gathered keys, whole new prompts beside them as runs on their fresh K/V, decode rows as
    their own batch; the result matches the dense backend step by step (the kernel's contract, bottom-right causal
    limit included, by the reference). ``cap``: keys per call (CHUNK_KEYS_PER_CALL), here so few that three chunks on
    7, 8 and 9 keys take two calls."""
    import inferflow.engine.paged_backend as pb
    from inferflow.engine import varlen

    if cap is not None:
        monkeypatch.setattr(pb, "CHUNK_KEYS_PER_CALL", cap)
    # the CUDA path's logic on CPU tensors: the CPU's own path for chunks (one native call) stands aside
    monkeypatch.setattr(pb.PagedAttentionBackend, "_native_rows", lambda *a, **kw: None)
    impl = varlen._impl()
    monkeypatch.setattr(varlen, "_impl", lambda: (_varlen_reference, impl[1]))
    monkeypatch.setattr(pb.varlen, "usable", lambda q, d: True)
    got, _varlen_reference.calls = [], 0
    for _ in run_schedule(schedule, 2, 4, 5, causal=True, scale=0.3):
        got.append(_varlen_reference.calls)
        _varlen_reference.calls = 0
    assert got == calls


@pytest.mark.parametrize("schedule,calls", [("chunks", [0, 1, 0, 1]), ("hits", [0, 1, 0]), ("runs", [0, 1, 1])])
def test_cpu_decode_rows_and_chunks_take_one_native_call(monkeypatch, schedule, calls):
    """On the CPU a step's decode rows and chunks on cached keys (each chunk token a decode row over its causal
    limit) attend in ONE native call, whole new prompts beside them in their own calls; a pure-decode step keeps its
    own native call (K/V write included). Every step equals the dense backend."""
    from inferflow.native import cpu_ops

    if not cpu_ops.enabled_all():
        pytest.skip("native CPU kernels unavailable")
    rows_calls, real = [], cpu_ops.paged_decode
    monkeypatch.setattr(cpu_ops, "paged_decode", lambda q, k, *a, **kw: (rows_calls.append(q.shape[0]) if k is None
                                                                          else None) or real(q, k, *a, **kw))
    got = []
    for _ in run_schedule(schedule, 2, 7, 8, causal=True, scale=0.3, window=5):
        got.append(len(rows_calls))
        rows_calls.clear()
    assert got == calls


@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention's varlen kernel runs on CUDA only")
def test_varlen_kernel_on_cuda():
    """torch's varlen kernel against per-prompt SDPA, on q / k / v that are strided views of one fused projection
    (as the attention component hands them over)."""
    from inferflow.engine import varlen

    lens = [37, 300, 5, 128, 64]
    n, h, hkv, d = sum(lens), 8, 2, 64
    qkv = torch.randn(n, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.unflatten(1, (-1, d)) for t in qkv.split([h * d, hkv * d, hkv * d], dim=1))
    assert varlen.usable(q, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = varlen.varlen_causal(q, k, v, cu, max(lens), 0.1)
    want = torch.cat([attention_core(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                     v[a:b].transpose(0, 1)[None], q_start=0, causal=True, scale=0.1)[0].transpose(0, 1)
                      for a, b in zip(cu.tolist(), cu.tolist()[1:])])
    assert (got.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention's varlen kernel runs on CUDA only")
def test_backend_varlen_on_cuda(monkeypatch):
    """The backend's varlen path with torch's kernel: bf16 new prompts of four lengths against the dense backend."""
    import inferflow.engine.paged_backend as pb

    calls = []
    real = pb.varlen.varlen_causal
    monkeypatch.setattr(pb.varlen, "varlen_causal", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lens = [5, 33, 17, 64]
    n = sum(lens)
    cache = PagedKVCache([KVLayer(0, 2, 64)], 64, BS, dtype="bfloat16", compute_dtype=torch.bfloat16, device="cuda")
    tables = scattered_tables(cache, [[0] * m for m in lens], seed=2)
    q, k, v = (torch.randn(n, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=lens, k_lens=lens, backend=None)
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, m in zip(tables, lens) for p in range(m)], device="cuda")
    ours = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.125)
    ref = AttentionBackend(ContiguousKVCache(), slots=list(range(len(lens)))).self_attention(
        0, q, k, v, ctx, causal=True, scale=0.125)
    assert calls == [1] and (ours.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention's varlen kernel runs on CUDA only")
def test_backend_chunks_varlen_on_cuda(monkeypatch):
    """torch's kernel on steps of chunks over cached blocks (beside a new prompt and decode rows, then with a lone
    decode): its bottom-right causal limit and key offsets against the dense backend, bf16."""
    import inferflow.engine.paged_backend as pb

    calls = []
    real = pb.varlen.varlen_causal
    monkeypatch.setattr(pb.varlen, "varlen_causal", lambda *a, **kw: calls.append(kw.get("max_k")) or real(*a, **kw))
    steps = [[40, 17, 64, 0, 5], [8, 33, 1, 70, 1], [1, 1, 24, 0, 1]]  # new tokens per sequence and step
    cache = PagedKVCache([KVLayer(0, 2, 64)], 128, BS, dtype="bfloat16", compute_dtype=torch.bfloat16, device="cuda")
    tables = scattered_tables(cache, [[0] * sum(c) for c in zip(*steps)], seed=6)
    dense = AttentionBackend(ContiguousKVCache(), slots=[])
    done = [0] * len(tables)
    for t, take in enumerate(steps):
        rows = [i for i, n in enumerate(take) if n]
        n = sum(take)
        q, k, v = (torch.randn(n, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
        ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=[take[i] for i in rows],
                             k_lens=[done[i] + take[i] for i in rows], backend=None)
        slots = torch.tensor([tables[i][p // BS] * BS + p % BS for i in rows for p in range(done[i], done[i] + take[i])],
                             device="cuda")
        ours = PagedAttentionBackend(cache, [tables[i] for i in rows], slots).self_attention(
            0, q, k, v, ctx, causal=True, scale=0.125)
        dense.slots = rows
        ref = dense.self_attention(0, q, k, v, ctx, causal=True, scale=0.125)
        assert (ours.float() - ref.float()).abs().max().item() < 2e-2, f"step {t}"
        for i in rows:
            done[i] += take[i]
    assert calls == [None, 50, 89]  # new prompts of 4 lengths (no key offsets), then the chunks: their longest keys


def test_varlen_probe_failure_turns_it_off(monkeypatch):
    """A GPU or torch where the kernel raises at the engine's warm-up: varlen is off for that device, no crash."""
    from inferflow.engine import varlen

    impl = varlen._impl()

    def broken(*a, **kw):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer")

    monkeypatch.setattr(varlen, "_failed", set())
    q = torch.zeros(2, 1, 64)
    monkeypatch.setattr(varlen, "_impl", lambda: (_varlen_reference, impl[1]))
    _varlen_reference.calls = 0
    assert varlen.probe(q) and not varlen._failed
    monkeypatch.setattr(varlen, "_impl", lambda: (broken, impl[1]))
    assert not varlen.probe(q) and varlen._failed == {-1}  # -1: the key of a non-CUDA device


def test_cpu_engines_never_import_torchs_varlen_module():
    """Importing torch.nn.attention.varlen costs ~144 MB of RSS (a soak test saw it as a leak): CPU runs must not."""
    code = ("import sys, torch\n"
            "from inferflow.engine import varlen\n"
            "assert not varlen.usable(torch.zeros(2, 1, 64, dtype=torch.bfloat16), 64)\n"
            "assert 'torch.nn.attention.varlen' not in sys.modules\n")
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True)
