"""Tiny reference models and a spawn harness for the placement tests (inferflow/parallel): every rank loads the
same folder twice, once whole and once sharded, and checks the sharded logits against the whole model's."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from parity import sequences

VOCAB = 97  # odd: the vocab-parallel embedding and head take uneven slices


def _randomise(ref: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """HF zero-initialises routers and biases and sets norms to one: random values exercise every shard."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return ref.eval()


def build(kind: str, folder: Path) -> Path:
    t = transformers
    if kind == "llama":  # GQA: 4 query heads, 2 KV heads (split by rank)
        ref = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, attention_bias=True))
    elif kind == "llama_mqa":  # 1 KV head: replicated on every rank
        ref = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                               max_position_embeddings=64, tie_word_embeddings=True))
    elif kind == "q4":  # block-quantized at load: row-parallel slices must fall on whole blocks (64 columns)
        ref = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64))
    elif kind == "gpt2":  # fused qkv with biases, learned positions
        ref = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    elif kind == "moe":  # sparse layers with a gated shared expert, one dense layer
        ref = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]))
    elif kind == "t5":  # encoder-decoder, relative position bias per head, cross-attention
        ref = t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, decoder_start_token_id=0))
    elif kind == "bloom":  # ALiBi: a per-head bias, sliced to each rank's heads
        ref = t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4))
    elif kind == "bert":  # encoder-only with an MLM head (dense + norm + vocab projection + bias)
        ref = t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=48,
                                             max_position_embeddings=64))
    else:
        raise ValueError(kind)
    _randomise(ref).save_pretrained(folder / kind, safe_serialization=True)
    return folder / kind


# load options per kind (both the whole and the sharded model)
LOAD_KW = {"q4": {"quant": "q4", "quant_kernels": "reference"}}


def check_same(whole, part, kind: str, rank: int) -> None:
    def close(a, b, what):
        tol = 1e-5 * b.abs().max().item() + 1e-6
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"rank {rank} {kind} {what}: max |diff| {diff:.3g} > {tol:.3g}"

    if whole.architecture == "encoder_only":
        seqs = sequences(VOCAB)
        close(part.logits(seqs), whole.logits(seqs), "batch")
        close(part.hidden_states(seqs), whole.hidden_states(seqs), "hidden states")
        return
    if kind == "t5":
        enc = sequences(VOCAB, seed=1)
        dec = [[0] + s[:-1] for s in sequences(VOCAB, seed=2, lengths=(5, 9))]
        close(part.logits(dec, encoder_input_ids=enc), whole.logits(dec, encoder_input_ids=enc), "batch")
        close(part.incremental_logits(dec[1], encoder_input_ids=enc[1]),
              whole.incremental_logits(dec[1], encoder_input_ids=enc[1]), "incremental")
        return
    seqs = sequences(VOCAB)
    close(part.logits(seqs), whole.logits(seqs), "batch")
    close(part.hidden_states(seqs), whole.hidden_states(seqs), "hidden states")
    close(part.incremental_logits(seqs[1], chunk=3), whole.incremental_logits(seqs[1], chunk=3), "incremental")
    assert part.generate_ids(seqs[0], max_new_tokens=5, stop_ids=set()) == \
        whole.generate_ids(seqs[0], max_new_tokens=5, stop_ids=set())


def check_engine(whole, part, kind: str, rank: int) -> None:
    """Greedy generation through the engine (paged KV, continuous batching) is token-identical. SPMD: every rank
    runs the same deterministic schedule on the same requests (rank 0 broadcasting its step plan is not built)."""
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    prompts = sequences(VOCAB, seed=3, lengths=(9, 6, 12))  # encoder inputs for an encoder-decoder model
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cfg = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in Engine(part, EngineConfig(**cfg)).generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in Engine(whole, EngineConfig(**cfg)).generate(prompts, params)]
    assert got == want, f"rank {rank} {kind} engine: {got} != {want}"
    # unseeded sampling: parallelize seeded every rank's RNG alike, so ranks draw the same tokens (else the
    # collectives would mix different sequences)
    hot = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    mine = [o.outputs[0].token_ids for o in Engine(part, EngineConfig(**cfg)).generate(prompts, hot)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert all(x == mine for x in every), f"{kind}: ranks sampled different tokens: {every}"


def _worker(rank: int, world: int, init: str, placement, folders: dict[str, str], engine: bool) -> None:
    torch.set_num_threads(1)
    import inferflow
    from inferflow.parallel import parallelize
    from inferflow.parallel.groups import init_groups
    from inferflow.parallel.placement import Placement

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        p = Placement.from_config(placement)
        g = init_groups(p)
        for kind, folder in folders.items():
            kw = {"dtype": "float32", **LOAD_KW.get(kind, {})}
            whole = inferflow.load(folder, **kw)
            part = parallelize(inferflow.load(folder, **kw), p, g, quant_kernels=kw.get("quant_kernels"))
            if kind == "q4":
                assert any(getattr(m, "packed", None) for m in part.net.modules()), "q4: nothing held packed"
            # each rank holds a real shard, not a copy
            numel = lambda m: sum(t.numel() for t in [*m.net.parameters(), *m.net.buffers()])  # noqa: E731
            assert numel(part) < 0.8 * numel(whole), f"{kind}: rank {rank} holds {numel(part)} of {numel(whole)}"
            check_same(whole, part, kind, rank)
            if engine and whole.architecture != "encoder_only":
                check_engine(whole, part, kind, rank)
    finally:
        dist.destroy_process_group()


def _spawn(worker, world: int, *args) -> None:
    """Spawn ``world`` gloo ranks of ``worker(rank, world, init_method, *args)``; an assertion in any rank fails the
    caller."""
    fd, name = tempfile.mkstemp(prefix="inferflow-dist-")
    os.close(fd)
    os.unlink(name)
    mp.spawn(worker, args=(world, f"file://{name}", *args), nprocs=world, join=True)


def run_parallel(world: int, placement, folders: dict[str, Path], engine: bool = True) -> None:
    """Spawn ``world`` gloo ranks; an assertion in any rank fails the caller."""
    _spawn(_worker, world, placement, {k: str(v) for k, v in folders.items()}, engine)


def _replicated_worker(rank: int, world: int, init: str, placement, folder: str) -> None:
    torch.set_num_threads(1)
    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams
    from inferflow.parallel import parallelize
    from inferflow.parallel.replicated import ReplicatedEngine

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16)
        part = parallelize(inferflow.load(folder, dtype="float32"), placement)
        eng = ReplicatedEngine(part, EngineConfig(**cfg))
        if rank != 0:
            eng.follow()  # requests exist only on rank 0; this rank replays its step plans
            return
        prompts = sequences(VOCAB, seed=3, lengths=(9, 6, 12))
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in eng.generate(prompts, greedy)]
        # sampled, and an abort in flight: followers must stay in step (a mismatch would hang or fail them)
        h = eng.add_request(prompts[0], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
        eng.step()
        eng.abort(h.request_id)
        sampled = eng.generate(prompts[1:], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 5 for o in sampled)
        eng.stop_followers()
        whole = inferflow.load(folder, dtype="float32")
        want = [o.outputs[0].token_ids for o in Engine(whole, EngineConfig(**cfg)).generate(prompts, greedy)]
        assert got == want, f"replicated engine: {got} != {want}"
    finally:
        dist.destroy_process_group()


def run_replicated(world: int, placement, folder: Path) -> None:
    _spawn(_replicated_worker, world, placement, str(folder))


def _mapped_ranges(obj, seen: set | None = None, out: list | None = None) -> list:
    """(address, length, keep-alive) of every memory map reachable from a weight source's attributes."""
    import ctypes
    import mmap

    seen = set() if seen is None else seen
    out = [] if out is None else out
    if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, type, str, bytes)):
        return out
    seen.add(id(obj))
    if isinstance(obj, mmap.mmap):
        buf = (ctypes.c_char * len(obj)).from_buffer(obj)
        out.append((ctypes.addressof(buf), len(obj), buf))
        return out
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
        items += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
    for v in items:
        _mapped_ranges(v, seen, out)
    return out


def materialized_bytes(model) -> tuple[int, int]:
    """(bytes of parameters/buffers that are NOT views of the model file's memory map, all their bytes)."""
    ranges = _mapped_ranges(model.source)
    assert ranges, "the source holds no memory map"
    mat = total = 0
    for t in [*model.net.parameters(), *model.net.buffers()]:
        nb = t.numel() * t.element_size()
        total += nb
        if not any(a <= t.data_ptr() < a + n for a, n, _ in ranges):
            mat += nb
    return mat, total


def _load_worker(rank: int, world: int, init: str, placement, folder: str) -> None:
    torch.set_num_threads(1)
    import inferflow
    from inferflow.parallel.apply import load_parallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        whole = inferflow.load(folder, dtype="float32")
        wmat, wtotal = materialized_bytes(whole)
        assert wmat <= 0.01 * wtotal, f"whole model: {wmat} of {wtotal} bytes copied (expected views of the file)"
        part = load_parallel(folder, placement, dtype="float32")
        mat, _ = materialized_bytes(part)
        # sharded while loading: this rank copied only its slices (norms etc. stay views of the file)
        assert 0.3 * wtotal / world <= mat <= 1.15 * wtotal / world, \
            f"rank {rank}: {mat} bytes materialised, the model has {wtotal} ({world} ranks)"
        check_same(whole, part, "llama", rank)
    finally:
        dist.destroy_process_group()


def run_load(world: int, placement, folder: Path) -> None:
    _spawn(_load_worker, world, placement, str(folder))


def _micro_worker(rank: int, world: int, init: str, placement, folders: dict[str, str]) -> None:
    torch.set_num_threads(1)
    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams
    from inferflow.parallel import parallelize
    from inferflow.parallel.micro import use_micro_batches

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        prompts = sequences(VOCAB, seed=5, lengths=(9, 6, 12, 3, 7))
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        cfg = dict(block_size=4, num_blocks=96, max_num_batched_tokens=16)
        for kind, folder in folders.items():
            want = [o.outputs[0].token_ids for o in Engine(inferflow.load(folder, dtype="float32"),
                                                           EngineConfig(**cfg)).generate(prompts, params)]
            eng = Engine(parallelize(inferflow.load(folder, dtype="float32"), placement), EngineConfig(**cfg))
            use_micro_batches(eng, 3)
            got = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
            assert eng.runner.micro_forwards > 0, f"{kind}: no step ran as micro-batches"
            assert got == want, f"rank {rank} {kind} micro-batched: {got} != {want}"
    finally:
        dist.destroy_process_group()


def run_micro(world: int, placement, folders: dict[str, Path]) -> None:
    _spawn(_micro_worker, world, placement, {k: str(v) for k, v in folders.items()})


def _replicated_encoder_worker(rank: int, world: int, init: str, placement, folder: str) -> None:
    """Embedding and fill-mask batches through ReplicatedEngine: rank 0 queues them, the other ranks replay."""
    torch.set_num_threads(1)
    import inferflow
    from inferflow.engine import Engine, EngineConfig
    from inferflow.parallel import parallelize
    from inferflow.parallel.replicated import ReplicatedEngine

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = EngineConfig(block_size=4, num_blocks=8, max_num_batched_tokens=16)
        eng = ReplicatedEngine(parallelize(inferflow.load(folder, dtype="float32"), placement), cfg)
        if rank != 0:
            eng.follow()
            return
        seqs = sequences(VOCAB, seed=4, lengths=(9, 6, 12))
        masked = [s[:3] + [3] + s[4:] for s in seqs]
        got, mlm = eng.embed(seqs), eng.fill_mask(masked, top_k=3, mask_token_id=3)
        eng.stop_followers()
        ref = Engine(inferflow.load(folder, dtype="float32"), cfg)
        want, want_mlm = ref.embed(seqs), ref.fill_mask(masked, top_k=3, mask_token_id=3)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6
        ids = lambda outs: [[[c.id for c in cands] for cands in o.predictions] for o in outs]  # noqa: E731
        assert all(o.error is None for o in mlm) and ids(mlm) == ids(want_mlm), (mlm, want_mlm)
    finally:
        dist.destroy_process_group()


def run_replicated_encoder(world: int, placement, folder: Path) -> None:
    _spawn(_replicated_encoder_worker, world, placement, str(folder))
