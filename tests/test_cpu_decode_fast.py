"""CPU decode fast paths equal the general ones bit for bit: float32 RMSNorm as one kernel, RoPE from a cos/sin table,
a decode batch's key mask built once per forward, a lone decode through the batched decode call; q/k/v and
gate/up projections fused on the CPU give the same tokens."""
import math
from pathlib import Path

import pytest
import torch

from inferflow.engine.kv_cache import KVLayer, PagedKVCache
from inferflow.engine.paged_backend import PagedAttentionBackend
from inferflow.model.context import AttentionBackend, ContiguousKVCache, ForwardContext, attention_core
from inferflow.registry import create

import engine_models  # noqa: F401  (its autouse one-thread fixture)
from engine_models import llama, one_thread  # noqa: F401

BS = 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_in_float", [False, True])
def test_rmsnorm_is_the_formula_bitwise(dtype, weight_in_float):
    g = torch.Generator().manual_seed(0)
    for dim, shape in ((32, (5, 32)), (64, (3, 4, 64)), (576, (1, 576)), (48, (9, 48))):
        norm = create("rmsnorm", {"dim": dim, "eps": 1e-5, "weight_in_float": weight_in_float})
        norm.weight = torch.nn.Parameter(torch.randn(dim, generator=g).to(dtype), requires_grad=False)
        x = (torch.randn(*shape, generator=g) * 7).to(dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        ref = (h * norm.weight.float()).to(dtype) if weight_in_float else norm.weight * h.to(dtype)
        assert torch.equal(norm(x), ref)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_equals_per_forward_cos_sin(scaling, dtype):
    rope = create("rope", {"dim": 16, "theta": 10000.0, "scaling": scaling, "max_position_embeddings": 256})
    g = torch.Generator().manual_seed(1)
    for n, top in ((1, 40), (7, 300), (33, 1500)):  # later forwards grow the table
        pos = torch.randint(0, top, (n,), generator=g)
        q, k = torch.randn(n, 4, 16, generator=g).to(dtype), torch.randn(n, 2, 16, generator=g).to(dtype)
        ctx = ForwardContext(positions=pos, q_lens=[n], k_lens=[n], backend=None)
        rq, rk = rope.rotate(q, k, ctx)
        cos, sin = rope.cos_sin(ForwardContext(positions=pos, q_lens=[n], k_lens=[n], backend=None), dtype)
        assert torch.equal(rq, rope._rot(q, cos, sin)) and torch.equal(rk, rope._rot(k, cos, sin))


def _cache_with(lens, hkv=2, d=8, seed=0, consecutive=False):
    cache = PagedKVCache([KVLayer(0, hkv, d)], sum(math.ceil((n + 1) / BS) for n in lens) + 4, BS)
    blocks = cache.pool.allocate(cache.pool.num_free)
    perm = [blocks[i] for i in torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed)).tolist()]
    if consecutive:
        perm = sorted(blocks)[1:]
    tables = []
    for n in lens:
        tables.append(perm[:math.ceil((n + 1) / BS)])
        perm = perm[len(tables[-1]):]
    g = torch.Generator().manual_seed(seed + 1)
    for t, n in zip(tables, lens):  # the cached keys and values before the decode step
        slots = cache.slot_mapping([t], [0], [n])
        cache.write(0, slots, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g))
    return cache, tables


@pytest.mark.parametrize("lens,consecutive", [((9, 14, 6), False), ((5, 5), False), ((11,), False), ((11,), True),
                                              ((12,), True), ((3,), True)])
def test_decode_step_equals_bool_mask_attention(lens, consecutive, monkeypatch, torch_ops):
    """Pure decode rows (ragged, uniform and a lone one): the float key mask built once per forward and the batched
    call give exactly the per-call bool-mask attention over the same gathered keys; a lone sequence in consecutive
    blocks reads its keys in place (no gather) with the same result."""
    cache, tables = _cache_with(lens, consecutive=consecutive)
    gathers = []
    orig = cache.gather_idx
    monkeypatch.setattr(cache, "gather_idx", lambda key, idx: gathers.append(idx.shape) or orig(key, idx))
    g = torch.Generator().manual_seed(5)
    b = len(lens)
    q, k, v = torch.randn(b, 4, 8, generator=g), torch.randn(b, 2, 8, generator=g), torch.randn(b, 2, 8, generator=g)
    slots = cache.slot_mapping(tables, list(lens), [1] * b)
    k_lens = [n + 1 for n in lens]
    ctx = ForwardContext(positions=torch.tensor(lens), q_lens=[1] * b, k_lens=k_lens, backend=None)
    ours = PagedAttentionBackend(cache, tables, slots).self_attention(0, q, k, v, ctx, causal=True, scale=0.3)
    assert len(gathers) == (0 if consecutive else 1)
    kk, vv, mask = cache.gather_batch(0, tables, k_lens)
    ref = attention_core(q[:, :, None, :], kk, vv, q_start=0, causal=False, scale=0.3,
                         key_mask=mask if min(k_lens) != max(k_lens) else None)[:, :, 0, :]
    assert torch.equal(ours, ref)
    if b == 1:  # and the lone decode equals the dense cache's attention
        dense = AttentionBackend(ContiguousKVCache(), slots=[0])
        idx = cache.seq_index(tables[0], lens[0])
        k0, v0 = cache.gather_idx(0, idx)
        dense.cache.append(0, 0, k0, v0)
        ref1 = dense.self_attention(0, q, k, v, ctx, causal=True, scale=0.3)
        assert torch.equal(ours, ref1)


def test_fused_projections_on_cpu_are_exact(tmp_path: Path):
    """q/k/v and gate/up as one GEMM each (fuse_projections on the CPU): the same greedy tokens through the engine
    and the same logits (bit for bit at SmolLM2-135M's shapes; BLAS may pick another kernel for these tiny ones)."""
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    prompts = [[5, 9, 14, 3, 22], [7, 7, 30, 2, 41, 18, 6, 12], [60]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, logits = [], []
    for fuse in (False, True):
        m = llama(tmp_path / str(fuse))
        eng = Engine(m, EngineConfig(max_num_seqs=4, max_model_len=64, num_blocks=32, block_size=BS,
                                     fuse_projections=fuse))
        hs = [eng.add_request(p, params) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        outs.append([h.result().outputs[0].token_ids for h in hs])
        logits.append(m.logits(prompts[1]))
        assert any(getattr(mod, "fused", False) for mod in m.net.modules()) == fuse
    assert outs[0] == outs[1]
    assert (logits[0] - logits[1]).abs().max() <= 1e-5 * logits[0].abs().max()


def test_fused_qk_rotation_in_one_pass_is_exact(tmp_path: Path, monkeypatch, torch_ops):
    """With fused q/k/v, q and k heads rotate as one tensor: the same logits bit for bit (ragged batch, incremental
    through the cache, and a paged engine's decode tokens) as rotating them separately."""
    from inferflow.engine import Engine, EngineConfig, SamplingParams
    from inferflow.model.fuse import fuse_projections

    m = llama(tmp_path)
    assert fuse_projections(m.net) > 0
    rope = type(m.net.decoder.position)
    seqs = [[5, 9, 14, 3, 22, 40, 41], [7, 7, 30]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    calls = []
    orig = rope.rotate_heads
    monkeypatch.setattr(rope, "rotate_heads", lambda self, x, ctx: calls.append(1) or orig(self, x, ctx))

    def run():
        eng = Engine(m, EngineConfig(max_num_seqs=4, max_model_len=64, num_blocks=16, block_size=BS))
        hs = [eng.add_request(s, params) for s in seqs]
        while eng.has_unfinished():
            eng.step()
        return m.logits(seqs), m.incremental_logits(seqs[0], chunk=3), [h.result().outputs[0].token_ids for h in hs]

    fast = run()
    assert calls
    monkeypatch.setattr(rope, "rotate_heads", lambda self, x, ctx: None)
    slow = run()
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]) and fast[2] == slow[2]


def test_bf16_prepacked_linears_are_exact(tmp_path: Path):
    """bfloat16 linears with a oneDNN-packed weight (model/cpu_prepack.py, set up by the engine on the CPU): the same
    multi-row outputs bit for bit and the same greedy tokens; fused parts and one-row inputs keep their paths."""
    import transformers

    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams
    from inferflow.model.cpu_prepack import KEY, prepack_linears
    from parity import save

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    m = inferflow.load(save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path), dtype="bfloat16")
    prompts = [[5, 9, 14, 3, 22], [7, 7, 30, 2, 41, 18, 6, 12], [60, 61]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref_logits = m.logits(prompts)
    ref_tokens = [m.generate_ids(p, max_new_tokens=6, stop_ids=set()) for p in prompts]
    eng = Engine(m, EngineConfig(max_num_seqs=4, max_model_len=64, num_blocks=32, block_size=BS))
    lins = [x for x in m.net.modules() if type(x).__name__ == "Linear"]
    packed = [x for x in lins if KEY in x.__dict__]
    assert packed and len(packed) < len(lins)  # the fused projections' parts are not packed
    assert prepack_linears(m.net) == 0          # idempotent
    hs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert [h.result().outputs[0].token_ids for h in hs] == ref_tokens
    assert torch.equal(m.logits(prompts), ref_logits)


def test_float32_prepack_is_opt_in_and_close(tmp_path: Path, monkeypatch):
    """float32 linears are packed only with INFERFLOW_CPU_PREPACK=float32: oneDNN rounds differently from MKL, so
    the logits are close (not bitwise) and the greedy tokens the same."""
    from inferflow.model.cpu_prepack import KEY, prepack_linears

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    m = llama(tmp_path)
    seqs = [[5, 9, 14, 3, 22, 40, 41], [7, 7, 30]]
    ref = m.logits(seqs)
    assert prepack_linears(m.net) == 0
    monkeypatch.setenv("INFERFLOW_CPU_PREPACK", "float32")
    assert prepack_linears(m.net) > 0 and any(KEY in x.__dict__ for x in m.net.modules())
    out = m.logits(seqs)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max() and torch.equal(out.argmax(-1), ref.argmax(-1))
