"""The native decode-step program (inferflow/model/native_decode.py, inferflow/native/step.c): a decode step run as
one native call gives the same logits, bit for bit, as the op-by-op path it replaces, for float32 / bfloat16 weights
and GGUF blocks, any batch, any thread count; models it cannot run keep the op-by-op path."""
from __future__ import annotations

import gguf
import pytest
import torch
import transformers

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.model.native_decode import MAX_ROWS, NativeDecoder
from inferflow.native import step

import engine_models
from engine_models import one_thread  # noqa: F401  (autouse)
from gguf_files import write_llama

pytestmark = pytest.mark.skipif(not step.available(), reason="no C compiler here: the op-by-op path runs")


def _llama_hf(tmp_path, **kw):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, **kw)
    torch.manual_seed(0)
    return engine_models._perturb(transformers.LlamaForCausalLM(cfg).eval())


def _float_model(tmp_path, dtype="float32", **kw):
    ref = _llama_hf(tmp_path, **kw)
    ref.save_pretrained(tmp_path / "hf")
    return inferflow.load(str(tmp_path / "hf"), dtype=dtype)


def _gguf_model(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama(_llama_hf(tmp_path), path, qtype)
    return inferflow.load(str(path), dtype="float32")


def _engine(model, native=True, **kw):
    cfg = dict(block_size=4, num_blocks=256, max_num_seqs=MAX_ROWS, max_num_batched_tokens=256, max_model_len=200)
    cfg.update(kw)
    return Engine(model, EngineConfig(native_decode=native, **cfg))


def _both_ways(eng, prompts, steps):
    """Prefill the prompts, then ``steps`` decode steps; at each, the program's logits and the op-by-op forward's
    (same items, same K/V slots: the second write stores the same values) are compared bit for bit."""
    runner = eng.runner
    assert runner.native is not None
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
    eng.step()  # prefill (op-by-op: many tokens per sequence)
    checked = 0
    orig = runner.forward

    def forward(items):
        nonlocal checked
        ours = orig(items)
        if all(len(t) == 1 for _, _, t, _ in items):
            runner.native, keep = None, runner.native
            try:
                ref = orig(items)
            finally:
                runner.native = keep
            assert ours.dtype == ref.dtype == torch.float32 and ours.shape == ref.shape
            assert torch.equal(ours, ref), (ours - ref).abs().max()
            checked += 1
        return ours

    runner.forward = forward
    for _ in range(steps):
        eng.step()
    assert checked == steps


PROMPTS = [[5, 17, 33, 9, 40, 41, 42], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], list(range(1, 30))]


def test_float32_same_logits_as_op_by_op(tmp_path):
    _both_ways(_engine(_float_model(tmp_path)), PROMPTS, 9)


def test_bfloat16_same_logits_as_op_by_op(tmp_path):
    _both_ways(_engine(_float_model(tmp_path, "bfloat16")), PROMPTS[:3], 6)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_1])
@pytest.mark.parametrize("q8x", ["1", "0"], ids=["int8-activations", "exact"])
def test_gguf_blocks_same_logits_as_op_by_op(tmp_path, monkeypatch, qtype, q8x):
    monkeypatch.setenv("INFERFLOW_NATIVE_Q8X", q8x)
    eng = _engine(_gguf_model(tmp_path, qtype))
    ops = {n.split()[0] for n in eng.runner.native.prog.names}
    assert ("gemv_q8x" in ops) == (q8x == "1" and step.has_op("gemv_q8x")), ops  # the head's too
    assert ("gemv_q" in ops) == (q8x == "0" or not step.has_op("gemv_q8x")), ops
    _both_ways(eng, PROMPTS, 6)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8", "int8"])
def test_narrower_cache_under_float32_model(tmp_path, kv):
    """kv_cache_dtype bfloat16 (llama.cpp's f16-cache setting, in bf16), fp8 (float8 e4m3) or int8 (per-row scales,
    like llama.cpp's q8_0 cache) with float32 activations stays in the program, same bits as op by op."""
    eng = _engine(_gguf_model(tmp_path, gguf.GGMLQuantizationType.Q4_0), kv_cache_dtype=kv)
    assert eng.runner.native is not None
    _both_ways(eng, PROMPTS, 5)


def test_bias_and_full_batch(tmp_path):
    """q/k/v and MLP biases, and all MAX_ROWS rows at once."""
    model = _float_model(tmp_path, attention_bias=True, mlp_bias=True)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(3 + i % 5)] for i in range(MAX_ROWS)]
    _both_ways(_engine(model), prompts, 4)


def test_thread_count_invariant_and_batch_invariant(tmp_path):
    model = _float_model(tmp_path)
    outs = []
    for threads, prompts in ((1, PROMPTS), (2, PROMPTS), (2, PROMPTS[:1])):
        torch.set_num_threads(threads)
        eng = _engine(model)
        res = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1))
        outs.append([(r.outputs[0].token_ids, [lp for lp in r.outputs[0].logprobs]) for r in res])
    assert outs[0] == outs[1]
    # alone == in a batch: the tokens (the prefill's GEMMs, outside the program, round by batch shape)
    assert outs[2][0][0] == outs[1][0][0]


def test_tokens_match_native_off(tmp_path):
    model = _float_model(tmp_path)
    got = [_engine(model, native).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                                      ignore_eos=True)) for native in (True, False)]
    assert [r.outputs[0].token_ids for r in got[0]] == [r.outputs[0].token_ids for r in got[1]]


def test_qk_norms_same_logits_as_op_by_op(tmp_path):
    """Per-head q/k RMSNorms (a Qwen3-style layer) run in the program too."""
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    engine_models._perturb(transformers.Qwen3ForCausalLM(cfg).eval()).save_pretrained(tmp_path / "q3")
    for dtype in ("float32", "bfloat16"):
        model = inferflow.load(str(tmp_path / "q3"), dtype=dtype)
        eng = _engine(model)
        assert any(n.startswith("head_rmsnorm") for n in eng.runner.native.prog.names)
        _both_ways(eng, PROMPTS[:3], 5)


def test_sliding_window_same_logits_as_op_by_op(tmp_path):
    """A Mistral-style sliding window shorter than the prompts: each query attends to its last 6 keys."""
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                     max_position_embeddings=256)
    torch.manual_seed(0)
    engine_models._perturb(transformers.MistralForCausalLM(cfg).eval()).save_pretrained(tmp_path / "m")
    eng = _engine(inferflow.load(str(tmp_path / "m")))
    assert eng.runner.native.prog.args[next(i for i, n in enumerate(eng.runner.native.prog.names)
                                            if n.startswith("attention"))].win == 6
    _both_ways(eng, PROMPTS, 5)


def test_unsupported_models_keep_the_op_by_op_path(tmp_path):
    # LayerNorm and learned positions (a GPT-2 layer) are not in the program
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(tmp_path / "g2")
    eng = _engine(inferflow.load(str(tmp_path / "g2")))
    assert eng.runner.native is None
    out = eng.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # switched off
    model = _float_model(tmp_path)
    assert _engine(model, native=False).runner.native is None
    assert _engine(model).runner.native is not None


def test_bad_rows_are_refused(tmp_path):
    eng = _engine(_float_model(tmp_path))
    nd = eng.runner.native
    with pytest.raises(ValueError, match="rows"):
        nd.decode([], [], [])
    with pytest.raises(ValueError, match="outside the cache"):
        nd.decode([1], [3], [[10_000]])
    with pytest.raises(ValueError, match="outside the cache"):
        nd.decode([1], [9], [[0]])  # position 9 needs a third block of 4
    assert nd.native_embed
    with pytest.raises(IndexError, match="vocabulary"):
        nd.decode([96], [0], [[0]])


def test_program_profile_times_every_op(tmp_path):
    eng = _engine(_float_model(tmp_path))
    nd: NativeDecoder = eng.runner.native
    eng.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    eng.step()
    times = torch.zeros(len(nd.prog), dtype=torch.float64)
    run = nd.prog.run
    nd.prog.run = lambda st, n: run(st, n, times)
    eng.step()
    assert len(nd.prog.names) == len(nd.prog) and (times > 0).all()
    assert any(n.startswith("gemv_f mlp.gate_up") for n in nd.prog.names)
    assert any(n.startswith("attention") for n in nd.prog.names)


def test_logits_are_the_callers_own(tmp_path):
    """Each call returns its own tensor: a caller may hold several steps' logits (the engine's fault isolation
    reruns sequences one by one and keeps every result)."""
    eng = _engine(_float_model(tmp_path))
    nd = eng.runner.native
    a = nd.decode([5], [0], [[3]])
    keep = a.clone()
    b = nd.decode([9], [0], [[4]])
    assert torch.equal(a, keep) and not torch.equal(a, b)


def _with_and_without_program(runner, items):
    """``runner.forward(items)`` with the program (and the rows of each of its calls), and op by op."""
    calls = []
    decode = runner.native.decode
    runner.native.decode = lambda *a: calls.append(len(a[0])) or decode(*a)
    try:
        ours = runner.forward(items)
    finally:
        runner.native.decode = decode
    runner.native, keep = None, runner.native
    try:
        ref = runner.forward(items)
    finally:
        runner.native = keep
    return ours, ref, calls


def test_short_chunks_run_as_decode_rows(tmp_path):
    """A step of at most MAX_ROWS new tokens (speculative verification, short chunks) runs as ONE program call, each
    token a decode row at its position: the same logits as the op-by-op forward, only the rows asked for returned."""
    eng = _engine(_float_model(tmp_path))
    runner = eng.runner
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()  # prefill (49 tokens: op by op)
    seqs = list(eng.scheduler.running)
    assert len(seqs) == 3
    # re-run each sequence's last tokens (same ids at the same slots: the cache keeps its values), rows 3 / 1 / 0
    items = [(s, s.num_tokens - n, s.tokens(s.num_tokens - n, s.num_tokens), rows)
             for s, n, rows in zip(seqs, (4, 2, 3), (3, 1, 0))]
    ours, ref, calls = _with_and_without_program(runner, items)
    assert calls == [9] and ours.shape == ref.shape == (4, 96)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def _prefilled(tmp_path, prompts):
    """An engine with one sequence per prompt (as many as it runs at once), after their prefill step."""
    eng = _engine(_float_model(tmp_path), max_num_seqs=len(prompts))
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()
    seqs = list(eng.scheduler.running)
    assert len(seqs) == len(prompts)
    return eng, seqs


def test_more_rows_than_the_program_takes(tmp_path):
    """More decode rows than MAX_ROWS: program calls of up to MAX_ROWS rows each. The program is batch-invariant,
    so each row's logits are the bits it gets alone; op by op (other kernels at this many rows) within rounding."""
    n = 2 * MAX_ROWS + 3
    eng, seqs = _prefilled(tmp_path, [[(7 * i + j) % 90 + 1 for j in range(3 + i % 5)] for i in range(n)])
    runner = eng.runner
    # each prompt's last token again (same id at the same slot: the cache keeps its values)
    items = [(s, s.num_tokens - 2, s.tokens(s.num_tokens - 2, s.num_tokens - 1), 1) for s in seqs]
    ours, ref, calls = _with_and_without_program(runner, items)
    assert calls == [MAX_ROWS, MAX_ROWS, 3]
    assert torch.equal(ours, torch.cat([runner.forward([it]) for it in items]))
    assert ours.shape == ref.shape == (n, 96)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    res = eng.generate([[3, 4, 5]] * 2, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert all(len(r.outputs[0].token_ids) == 3 for r in res)  # the engine still steps


def test_more_rows_with_a_longer_item(tmp_path):
    """A pass of decode rows and a longer item (a prefill chunk, a speculative verification): the decode rows in
    program calls, the longer item as a pass of its own; logits in item order, as the op-by-op forward's."""
    n = MAX_ROWS + 2
    eng, seqs = _prefilled(tmp_path, [[(5 * i + j) % 90 + 1 for j in range(4 + i % 3)] for i in range(n)])
    runner = eng.runner
    # the prompts' tokens again (same ids at the same slots): the first one's last 3, with 2 rows of logits; the
    # others' last one
    items = [(s, s.num_tokens - 1 - k, s.tokens(s.num_tokens - 1 - k, s.num_tokens - 1), rows)
             for s, k, rows in [(seqs[0], 3, 2)] + [(s, 1, 1) for s in seqs[1:]]]
    items = items[1:4] + items[:1] + items[4:]  # the longer item among the decode rows
    ours, ref, calls = _with_and_without_program(runner, items)
    assert sorted(calls) == sorted([MAX_ROWS, 1, 3]) and ours.shape == ref.shape == (n + 1, 96)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
