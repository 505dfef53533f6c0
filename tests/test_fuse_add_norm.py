"""The decode step's fused Triton kernels under TRITON_INTERPRET=1 (CPU): residual add + RMSNorm
(inferflow/model/fuse_add_norm.py) against the torch composition, the pass's pattern detection (pre-norm, sandwich
norms, across layers) and tiny models with the pass applied giving the unfused logits and tokens; the q/k norm +
RoPE kernel (fused_qk_rope.py) and the one-launch K/V cache write (engine/triton_kv_write.py) likewise."""
import pytest
from triton_modes import interpreter_in_process, keep_one_mode, run_file_in_subprocess
import torch
import transformers

IN_PROCESS = interpreter_in_process()  # before anything here imports Triton
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

import engine_models  # noqa: E402
from engine_models import one_thread  # noqa: E402,F401 - autouse fixture
from inferflow.model import fuse_add_norm as fan  # noqa: E402
from inferflow.registry import create  # noqa: E402
from parity import save  # noqa: E402


@pytest.fixture(scope="module")
def interp():
    """The kernels run under Triton's interpreter (keep_one_mode, at the end, keeps these tests only where they can)."""


def test_in_subprocess():
    """Run this file's tests in a fresh interpreter when Triton was imported earlier in this session."""
    run_file_in_subprocess(__file__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch(interp, dtype):
    g = torch.Generator().manual_seed(5)
    a, b = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(2))  # 48: a masked (padded) block
    add = create("add", {})
    for offset, in_float in ((0.0, False), (1.0, True), (1.0, False)):
        norm = create("rmsnorm", {"dim": 48, "eps": 1e-6, "offset": offset, "weight_in_float": in_float})
        norm.weight = torch.nn.Parameter(torch.randn(48, generator=g).to(dtype), requires_grad=False)
        s, y = fan.add_rmsnorm(a, b, norm.weight, 1e-6, offset, in_float)
        ref_s = add([a, b])
        assert torch.equal(s, ref_s)  # the sum is exact
        assert (y.float() - norm(ref_s).float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-3)
    assert fan.add_rmsnorm(a, b[:, :47].contiguous(), norm.weight, 1e-6) is None  # shapes differ: torch path
    assert fan.add_rmsnorm(a, b.double(), norm.weight, 1e-6) is None


def _qwen3(tmp):
    cfg = transformers.Qwen3Config(vocab_size=engine_models.VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128)
    return _load(transformers.Qwen3ForCausalLM(cfg), tmp)


def _gemma2(tmp):
    cfg = transformers.Gemma2Config(vocab_size=engine_models.VOCAB, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=128, sliding_window=16)
    return _load(transformers.Gemma2ForCausalLM(cfg), tmp)


def _load(hf, tmp):
    import inferflow

    torch.manual_seed(0)
    engine_models._perturb(hf)  # non-trivial norm weights
    m = inferflow.load(save(hf, tmp), dtype="float32", device="cpu")
    m.tokenizer = engine_models.CharTokenizer()
    return m


# links: per layer the attention add -> next norm (+ sandwich: pre-FF norm), each layer's last add -> next norm
@pytest.mark.parametrize("family,links", [("llama", 4), ("qwen3", 4), ("gemma2", 4)])
def test_fused_model_same_logits(interp, tmp_path, monkeypatch, family, links):
    m = engine_models.llama(tmp_path) if family == "llama" else globals()[f"_{family}"](tmp_path)
    ids = torch.tensor([[5, 9, 3, 17, 40, 7, 11]])
    ref = m.logits(ids)
    names = {n for n, _ in m.net.named_parameters()}
    assert fan.fuse_add_norms(m.net) == links
    assert {n for n, _ in m.net.named_parameters()} == names  # the links add no parameters
    calls = []
    real = fan.add_rmsnorm
    monkeypatch.setattr(fan, "add_rmsnorm", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = m.logits(ids)
    assert len(calls) == links
    assert not any("fused_pending" in mod.__dict__ for mod in m.net.modules())  # every norm took its output
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6
    assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_engine_fuses_on_request_and_switch(interp, tmp_path, monkeypatch):
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    m = _qwen3(tmp_path)
    prompts, outs = engine_models.mix(4, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    cfg = {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 48, "max_num_seqs": 8}
    want = [r.outputs[0].token_ids for r in Engine(m, EngineConfig(**cfg)).generate(prompts, params)]
    assert m.net.decoder.layers[0].attn_out.fused_norm is None  # CPU default: off
    monkeypatch.setenv(fan.ENV, "0")
    assert fan.fuse_add_norms(m.net) == 0  # switched off
    monkeypatch.delenv(fan.ENV)
    eng = Engine(m, EngineConfig(**cfg, fuse_add_norm=True))
    assert m.net.decoder.layers[0].attn_out.fused_norm is not None
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want


def test_kernel_failure_falls_back(interp, tmp_path, monkeypatch):
    m = engine_models.llama(tmp_path)
    ids = torch.tensor([[5, 9, 3, 17]])
    ref = m.logits(ids)
    fan.fuse_add_norms(m.net)

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel here")

    monkeypatch.setattr(fan, "_add_rmsnorm", Broken())
    monkeypatch.setitem(fan._state, "ok", True)
    with pytest.warns(RuntimeWarning, match="fused add"):
        out = m.logits(ids)
    assert torch.equal(out, ref)  # the torch path, exactly
    assert not fan.enabled()


@pytest.mark.parametrize("dtype,store", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                         (torch.float32, torch.float16)])
def test_kv_write_kernel_matches_index_copy(interp, dtype, store):
    """The paged cache's one-launch K/V write (inferflow/engine/triton_kv_write.py) against two index_copy_."""
    from inferflow.engine import triton_kv_write as kvw

    g = torch.Generator().manual_seed(7)
    N, hkv, D, S = 5, 2, 24, 40                                       # row 48: a masked block
    qkv = (torch.randn(N, 4 * hkv * D, generator=g) * 3).to(dtype)
    k = qkv[:, hkv * D:2 * hkv * D].view(N, hkv, D)                   # views into a fused projection output
    v = qkv[:, 2 * hkv * D:3 * hkv * D].view(N, hkv, D)
    slots = torch.tensor([3, 17, 0, 39, 17])                          # a padded row repeats a slot
    v[4] = v[1]
    k[4] = k[1]
    kf, vf = (torch.randn(S, hkv, D, generator=g).to(store) for _ in range(2))
    rk, rv = kf.clone(), vf.clone()
    rk.index_copy_(0, slots, k.to(store))
    rv.index_copy_(0, slots, v.to(store))
    assert kvw.write_kv(kf, vf, slots, k, v)
    assert torch.equal(kf, rk) and torch.equal(vf, rv)
    assert not kvw.write_kv(kf, vf, slots, k.transpose(1, 2), v.transpose(1, 2))  # odd layout: index_copy_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_int8_kernel_matches_quantize_int8(interp, dtype):
    """An int8 cache's one-launch write quantizes as kv_store.quantize_int8 does: identical codes and scales,
    ties to even, an all-zero row (scale 1), a row of one value, the odd head count (a masked tile) included."""
    from inferflow.engine import triton_kv_write as kvw
    from inferflow.engine.kv_store import quantize_int8

    g = torch.Generator().manual_seed(9)
    N, hkv, D, S = 6, 3, 16, 30
    qkv = (torch.randn(N, 4 * hkv * D, generator=g) * 5).to(dtype)
    k = qkv[:, hkv * D:2 * hkv * D].view(N, hkv, D)
    v = qkv[:, 2 * hkv * D:3 * hkv * D].view(N, hkv, D)
    k[0, 1] = 0.0                                                     # scale 1, codes 0
    k[1, 0] = torch.tensor([127.0, 63.5, -0.5, 1.5, 2.5, -62.5] + [0.25] * (D - 6), dtype=dtype)  # exact ties
    v[2, 2] = 3.0                                                     # one value: every code 127
    slots = torch.tensor([3, 17, 0, 29, 5, 11])
    kf, vf = (torch.randint(-127, 128, (S, hkv, D), generator=g, dtype=torch.int8) for _ in range(2))
    ks, vs = torch.rand(S, hkv, generator=g), torch.rand(S, hkv, generator=g)
    rk, rv, rks, rvs = kf.clone(), vf.clone(), ks.clone(), vs.clone()
    for x, codes, scales in ((k, rk, rks), (v, rv, rvs)):
        c, sc = quantize_int8(x)
        codes.index_copy_(0, slots, c)
        scales.index_copy_(0, slots, sc)
    assert kvw.write_kv_int8(kf, vf, ks, vs, slots, k, v)
    assert torch.equal(kf, rk) and torch.equal(vf, rv) and torch.equal(ks, rks) and torch.equal(vs, rvs)
    assert rk[17, 0, :6].tolist() == [127, 64, 0, 2, 2, -62]         # ties went to even
    assert not kvw.write_kv_int8(kf, vf, ks[:, :2], vs, slots, k, v)  # scales of another shape: not served


@pytest.mark.parametrize("dtype,offset,in_float", [(torch.float32, 0.0, False), (torch.float16, 0.0, False),
                                                   (torch.float16, 1.0, True)])
@pytest.mark.parametrize("rows", [False, True])
def test_qk_norm_rope_kernel_matches_torch(interp, dtype, offset, in_float, rows, monkeypatch):
    """q/k per-head RMSNorm + rotate-half RoPE in one kernel (inferflow/model/fused_qk_rope.py) on a q|k|v row, in
    either grid: a program per (token, head), or per token over all its heads (prefill sizes: forced here)."""
    from types import SimpleNamespace

    from inferflow.model import fused_qk_rope
    from inferflow.model.context import ForwardContext

    monkeypatch.setattr(fused_qk_rope, "ROWS_MIN", 1 if rows else 1 << 30)
    launched = []
    for name in ("_qk_norm_rope", "_qk_norm_rope_rows"):
        kern = getattr(fused_qk_rope, name)
        monkeypatch.setattr(fused_qk_rope, name, _Recorder(kern, name, launched))

    g = torch.Generator().manual_seed(11)
    N, H, hkv, D = 5, 4, 2, 16
    qkv = (torch.randn(N, (H + 2 * hkv) * D, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split([H * D, hkv * D, hkv * D], -1)
    norms = []
    for _ in range(2):
        nm = create("rmsnorm", {"dim": D, "eps": 1e-6, "offset": offset, "weight_in_float": in_float})
        nm.weight = torch.nn.Parameter(torch.randn(D, generator=g).to(dtype), requires_grad=False)
        norms.append(nm)
    rope = create("rope", {"dim": D, "theta": 10000.0})
    ctx = ForwardContext(positions=torch.tensor([0, 3, 7, 100, 9]), q_lens=[5], k_lens=[5], backend=None)
    ctx.position = rope
    attn = SimpleNamespace(use_position=True, q_norm=norms[0], k_norm=norms[1], d=D, h=H, hkv=hkv,
                           qk_norm_per_head=True)
    qo, ko = fused_qk_rope.norm_rope(attn, q, k, ctx)
    cos, sin = rope.cos_sin(ctx, dtype)
    rq = rope._rot(norms[0](q.reshape(N, H, D)), cos, sin)
    rk = rope._rot(norms[1](k.reshape(N, hkv, D)), cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert (qo.float() - rq.float()).abs().max() <= tol and (ko.float() - rk.float()).abs().max() <= tol
    assert launched == ["_qk_norm_rope_rows" if rows else "_qk_norm_rope"]


class _Recorder:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded by name."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("store", ["float32", "float16", "int8"])
def test_qk_norm_rope_writes_kv_cache(interp, store):
    """With the static decode step's backend (a cache and per-row slots), the q/k norm + RoPE launch also stores
    the roped k and the v heads at their cache slots, as the cache's write would (an int8 cache: the same codes and
    scales), and that write is then skipped."""
    from types import SimpleNamespace

    from inferflow.engine.kv_cache import KVLayer, PagedKVCache
    from inferflow.model import fused_qk_rope
    from inferflow.model.context import ForwardContext

    g = torch.Generator().manual_seed(12)
    N, H, hkv, D, bs = 3, 4, 2, 16, 4
    qkv = torch.randn(N, (H + 2 * hkv) * D, generator=g) * 3
    q, k, v = qkv.split([H * D, hkv * D, hkv * D], -1)
    norms = []
    for _ in range(2):
        nm = create("rmsnorm", {"dim": D, "eps": 1e-6})
        nm.weight = torch.nn.Parameter(torch.randn(D, generator=g), requires_grad=False)
        norms.append(nm)
    rope = create("rope", {"dim": D, "theta": 10000.0})
    cache = PagedKVCache([KVLayer(7, hkv, D)], 6, bs, dtype=store)
    ref = PagedKVCache([KVLayer(7, hkv, D)], 6, bs, dtype=cache.dtype)
    slots = torch.tensor([5, 0, 13])
    ctx = ForwardContext(positions=torch.tensor([5, 0, 13]), q_lens=[1] * N, k_lens=[6, 1, 14],
                         backend=SimpleNamespace(cache=cache, slots=slots))
    ctx.position = rope
    attn = SimpleNamespace(use_position=True, q_norm=norms[0], k_norm=norms[1], d=D, h=H, hkv=hkv,
                           qk_norm_per_head=True, cache_key=7)
    qo, ko = fused_qk_rope.norm_rope(attn, q, k, ctx, v)
    cos, sin = rope.cos_sin(ctx, torch.float32)
    rk = rope._rot(norms[1](k.reshape(N, hkv, D)), cos, sin)
    assert (ko - rk).abs().max() <= 1e-5
    ref.write(7, slots, ko, v.reshape(N, hkv, D))
    cache.write(7, slots, ko, torch.zeros(N, hkv, D))  # the kernel's own k: skipped (else v would be zeros)
    for a, b in zip(cache._dev[7].tensors(), ref._dev[7].tensors()):
        assert torch.equal(a, b)
    cache.write(7, slots, ko, torch.zeros(N, hkv, D))  # the claim is used once
    assert not cache._dev[7].v.any()
    # no slots on the backend (a prefill or the dense path): no cache write, same q/k
    ctx.backend = SimpleNamespace(cache=cache)
    qo2, ko2 = fused_qk_rope.norm_rope(attn, q, k, ctx, v)
    assert torch.equal(qo, qo2) and torch.equal(ko, ko2) and cache._claimed is None


def _greedy(m, n: int, seed: int, max_out: int):
    """Prompts, greedy params and the engine config of the decode tests below, and the plain engine's tokens."""
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    prompts, outs = engine_models.mix(n, seed=seed, max_prompt=8, max_out=max_out)
    params = [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]
    cfg = {"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 48, "max_num_seqs": 4}
    want = [r.outputs[0].token_ids for r in Engine(m, EngineConfig(**cfg)).generate(prompts, params)]
    return prompts, params, cfg, want


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_engine_static_decode_fused_kv_write_same_tokens(interp, tmp_path, monkeypatch, kv):
    """The static decode step (forced on the CPU through async scheduling) with fused projections and the q/k norm
    + RoPE kernel storing K/V into the cache itself (an int8 cache: quantized there): the plain engine's greedy
    tokens over the same cache dtype."""
    from inferflow.engine import Engine, EngineConfig
    from inferflow.engine.kv_cache import PagedKVCache
    from inferflow.model import fused_qk_rope

    m = _qwen3(tmp_path)
    prompts, params, cfg, want = _greedy(m, 2, seed=4, max_out=5)
    cfg = {**cfg, "kv_cache_dtype": kv}
    if kv != "auto":
        want = [r.outputs[0].token_ids for r in Engine(m, EngineConfig(**cfg)).generate(prompts, params)]
    monkeypatch.setenv(fused_qk_rope.ENV, "force")
    claims = []
    real = PagedKVCache.claim_write
    monkeypatch.setattr(PagedKVCache, "claim_write", lambda self, *a: claims.append(1) or real(self, *a))
    targets, target = [], fused_qk_rope._cache_target
    monkeypatch.setattr(fused_qk_rope, "_cache_target", lambda *a: (lambda t: targets.append(t and len(t)) or t)(
        target(*a)))
    eng = Engine(m, EngineConfig(**cfg, fuse_projections=True, async_scheduling=True))
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want
    assert claims  # the decode steps wrote K/V from the fused kernel: slots, stores (and an int8 cache's scales)
    assert targets and set(targets) == {5 if kv == "int8" else 3}


def test_qwen3_all_fusions_same_tokens(interp, tmp_path, monkeypatch):
    """A q/k-norm model with fused projections, fused q/k norm + RoPE and fused add + norm: the unfused logits."""
    from inferflow.model import fused_qk_rope
    from inferflow.model.fuse import fuse_projections

    m = _qwen3(tmp_path)
    ids = torch.tensor([[5, 9, 3, 17, 40, 7, 11]])
    ref = m.logits(ids)
    fuse_projections(m.net)
    fan.fuse_add_norms(m.net)
    monkeypatch.setenv(fused_qk_rope.ENV, "force")
    calls = []
    real = fused_qk_rope.norm_rope
    monkeypatch.setattr(fused_qk_rope, "norm_rope", lambda *a: calls.append(1) or real(*a))
    out = m.logits(ids)
    assert len(calls) == 2 and real(m.net.decoder.layers[0].self_attn, *_qk(m, ids)) is not None
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6
    assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()


def _qk(m, ids):
    from inferflow.model.context import ForwardContext

    attn = m.net.decoder.layers[0].self_attn
    x = torch.randn(3, attn.qkv_proj.weight.shape[1])
    q, k, _ = attn.qkv_proj(x).split([attn.qd, attn.kvd, attn.kvd], -1)
    ctx = ForwardContext(positions=torch.tensor([0, 1, 2]), q_lens=[3], k_lens=[3], backend=None)
    ctx.position = m.net.decoder.position
    return q, k, ctx


keep_one_mode(globals(), IN_PROCESS)


@pytest.mark.parametrize("dtype,store,softcap,window", [(torch.float32, torch.float32, None, None),
                                                        (torch.float16, torch.float16, 30.0, 40),
                                                        (torch.float16, torch.float32, None, None)])
def test_norm_rope_attention_kernel(interp, dtype, store, softcap, window):
    """q/k norms, RoPE, the K/V store and paged decode attention in one kernel (triton_attention.
    paged_decode_norm_rope): the norm + RoPE kernel, the cache write and the attention reference composed, for rows
    of one or two splits (the new key in the last one), GQA and a padded row repeating row 0."""
    from inferflow.engine import triton_attention as ta
    from inferflow.model import fused_qk_rope

    g = torch.Generator().manual_seed(21)
    H, hkv, D, bs, blocks = 4, 2, 16, 16, 40
    lens = torch.tensor([150, 5, 70, 150])  # row 3 pads as row 0 does (same slot, same table)
    B = len(lens)
    qkv = (torch.randn(B, (H + 2 * hkv) * D, generator=g) * 3).to(dtype)
    qkv[3] = qkv[0]
    wq, wk = (torch.randn(D, generator=g).to(dtype) for _ in range(2))
    pos = lens - 1
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([f.cos()] * 2, -1).to(dtype), torch.cat([f.sin()] * 2, -1).to(dtype)
    perm = torch.randperm(blocks, generator=g)
    tables = torch.stack([perm[:10], perm[10:20], perm[20:30], perm[:10]])
    slots = tables[torch.arange(B), pos // bs] * bs + pos % bs
    kc = (torch.randn(blocks, bs, hkv, D, generator=g)).to(store)
    vc = (torch.randn(blocks, bs, hkv, D, generator=g)).to(store)
    rk, rv = kc.clone(), vc.clone()
    out = ta.paged_decode_norm_rope(qkv, H, wq, wk, 1e-6, 0.0, False, cos, sin, slots, kc, vc, tables, lens,
                                    scale=0.3, max_len=160, softcap=softcap, window=window, min_part=64)
    # the same steps one at a time: norm + RoPE (its kernel), the cache write, the attention reference
    qo, ko = torch.empty(B, H, D, dtype=dtype), torch.empty(B, hkv, D, dtype=dtype)
    fused_qk_rope._qk_norm_rope[(B * (H + hkv),)](qkv, wq, wk, cos, sin, qo, ko, qkv.stride(0), cos.stride(0), H,
                                                  hkv, 1e-6, 0.0, slots, ko, ko, ko, ko, HALF=D // 2,
                                                  WEIGHT_IN_FLOAT=False, HAS_OFFSET=False, WRITE_KV=False, QUANT=False)
    v = qkv[:, (H + hkv) * D:].reshape(B, hkv, D)
    rk.view(-1, hkv, D).index_copy_(0, slots, ko.to(store))
    rv.view(-1, hkv, D).index_copy_(0, slots, v.to(store))
    # stored as the cache write stores them (k: up to the order of the norm's float32 sum, an ulp of ``dtype``)
    assert torch.equal(vc, rv) and (kc.float() - rk.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * 8
    ref = ta.paged_decode_reference(qo.to(store), rk, rv, tables, lens, scale=0.3, softcap=softcap, window=window)
    tol = 1e-5 if dtype == torch.float32 and store == torch.float32 else 4e-3
    assert (out.float() - ref.float()).abs().max().item() <= tol * 10
    assert torch.equal(out[3], out[0])
    if window is None:  # rows 0, 2 and 3 ran in two splits (the interpreter counts 8 SMs)
        assert ta.grid_splits(160, B * hkv, 8, min_part=64) == 2


def test_engine_static_decode_norm_rope_attention_same_tokens(interp, tmp_path, monkeypatch):
    """The static decode step (forced on the CPU through async scheduling) with q/k norms, RoPE, the K/V store and
    attention in one kernel per layer: the plain engine's greedy tokens; ``INFERFLOW_FUSE_QK_ATTENTION=0`` keeps
    the two kernels, as do fewer (row, KV head) programs than SMs."""
    from inferflow.engine import Engine, EngineConfig, static_decode, triton_attention
    from inferflow.model import fused_qk_rope

    cfg = transformers.Qwen3Config(vocab_size=engine_models.VOCAB, hidden_size=64, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128)
    m = _load(transformers.Qwen3ForCausalLM(cfg), tmp_path)
    prompts, params, ecfg, want = _greedy(m, 3, seed=5, max_out=6)
    monkeypatch.setenv(fused_qk_rope.ENV, "force")
    calls = []
    real = triton_attention.paged_decode_norm_rope
    monkeypatch.setattr(triton_attention, "paged_decode_norm_rope", lambda *a, **k: calls.append(1) or real(*a, **k))
    # sms: fused once the (row, KV head) programs are at least the SMs (1: always; 1000: never)
    for env, sms, fused in (("1", 1, True), ("0", 1, False), ("1", 1000, False)):
        monkeypatch.setenv(static_decode.FUSE_ENV, env)
        monkeypatch.setattr(triton_attention, "_sms", lambda device, sms=sms: sms)
        calls.clear()
        eng = Engine(m, EngineConfig(**ecfg, fuse_projections=True, async_scheduling=True))
        eng.runner.graphs.static.use_kernel = True  # the Triton attention, as on a GPU (here: its interpreter)
        assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want
        assert bool(calls) == fused
