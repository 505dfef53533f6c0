"""CPU weights and K/V stores in huge pages (inferflow/model/hugepages.py): same values, same sharing, same
results; the memory asks the kernel for huge pages where it offers them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.model import hugepages

import engine_models

HUGE = 2 << 20


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


def _smaps(ptr: int, field: str) -> str | None:
    """Field ``field`` (``THPeligible``, ``Rss``, ...) of the mapping holding address ``ptr`` (None: the kernel does
    not say)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == field + ":":
            return line.split()[1]
    return None


def _thp_eligible(ptr: int) -> bool | None:
    """Whether the mapping holding address ``ptr`` may get huge pages (None: the kernel does not say)."""
    v = _smaps(ptr, "THPeligible")
    return None if v is None else v == "1"


def _resident(t: torch.Tensor) -> float:
    """The fraction of ``t``'s pages in memory (mincore on exactly its range: smaps would count a neighbouring
    mapping that the kernel merged with it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    lo = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - lo) // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / n


def _check_huge(t: torch.Tensor, first: bool = False) -> None:
    """t lies in memory that asks for huge pages (where the kernel offers them and says); ``first``: it starts an
    arena, on a huge-page boundary."""
    assert t.data_ptr() % (HUGE if first else 64) == 0
    if sys.platform.startswith("linux") and _thp_mode() in ("madvise", "always"):
        assert _thp_eligible(t.data_ptr()) in (True, None)
        assert _thp_eligible(t.data_ptr() + t.numel() * t.element_size() - 1) in (True, None)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        fused = torch.randn(3072, 512)  # 6 MiB: parts are views of it, as model/fuse.py makes them
        self.q = nn.Parameter(fused[:1024])
        self.kv = nn.Parameter(fused[1024:])
        self.emb = nn.Embedding(2048, 512)
        self.head = nn.Linear(512, 2048, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.norm = nn.Parameter(torch.randn(512))  # small: stays where it is
        self.register_buffer("table", torch.randn(1024, 1024))


def test_move_module_keeps_values_identity_and_sharing(monkeypatch):
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    params = dict(net.named_parameters())
    moved = hugepages.move_module(net)
    assert moved == (3072 * 512 + 2048 * 512 + 512 + 1024 * 1024) * 4  # every storage, the small one too
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(p is params[n] for n, p in net.named_parameters())
    assert net.q.untyped_storage().data_ptr() == net.kv.untyped_storage().data_ptr()  # fused parts still share
    assert net.kv.data_ptr() == net.q.data_ptr() + 1024 * 512 * 4
    assert net.head.weight is net.emb.weight
    starts = {t.untyped_storage().data_ptr() for t in (net.q, net.emb.weight, net.norm, net.table)}
    assert len(starts) == 4  # the others keep storages of their own
    assert net.q.untyped_storage().nbytes() == 3072 * 512 * 4
    _check_huge(net.q, first=True)  # the arena's first storage starts on a huge page
    for t in (net.emb.weight, net.norm, net.table):
        _check_huge(t)
    with torch.no_grad():
        net.q.add_(1.0)  # still ordinary, writable tensors
    assert torch.equal(net.q, before["q"] + 1.0)


def test_a_small_module_stays(monkeypatch):
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    lin = nn.Linear(64, 64)
    ptr = lin.weight.data_ptr()
    assert hugepages.move_module(lin) == 0 and lin.weight.data_ptr() == ptr


def test_switched_off_moves_nothing(monkeypatch):
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "0")
    net = Net()
    ptr = net.q.data_ptr()
    assert hugepages.move_module(net) == 0 and net.q.data_ptr() == ptr
    assert hugepages.Arena.for_shapes([((1024, 1024), torch.float32)]).zeros((1024, 1024), torch.float32).sum() == 0


def test_arena_carves_zeroed_aligned_tensors(monkeypatch):
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    shapes = [((64, 16, 3, 64), torch.bfloat16), ((7, 5), torch.float32), ((512, 1024), torch.float32)]
    arena = hugepages.Arena.for_shapes(shapes)
    made = [arena.zeros(s, d) for s, d in shapes]
    assert [(t.shape, t.dtype) for t in made] == [(torch.Size(s), d) for s, d in shapes]
    assert all(t.data_ptr() % 64 == 0 and not t.any() for t in made)
    assert len({t.untyped_storage().data_ptr() for t in made}) == 3  # a storage each
    _check_huge(made[0], first=True)
    _check_huge(made[2])
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in made)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlap
    extra = arena.zeros((4, 4), torch.float32)  # past what it was sized for: an ordinary tensor
    assert extra.shape == (4, 4) and not extra.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and mincore: Linux")
def test_kv_cache_pages_are_resident_from_the_start(monkeypatch):
    """A CPU K/V cache's arena is faulted in when the cache is made (MADV_POPULATE_WRITE), as torch.zeros would
    write it, so no request waits on the kernel for its pages; a plain arena stays untouched until used."""
    from inferflow.engine.kv_cache import KVLayer, PagedKVCache

    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    lazy = hugepages.Arena([8 << 20]).zeros((8 << 20,), torch.uint8)
    cache = PagedKVCache([KVLayer(k, 2, 64) for k in range(4)], 512, 16)  # 4 x 2 x 4 MiB of float32
    stores = [t for st in cache._dev.values() for t in (st.k, st.v)]
    hugepages.settle()  # the pages are faulted in on a thread of their own
    assert all(_resident(t) == 1.0 for t in stores)  # all of it, before anything read or wrote it
    assert _resident(lazy) == 0.0
    assert stores[0].data_ptr() % HUGE == 0 and not any(t.any() for t in stores)


def _model(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    engine_models._perturb(transformers.LlamaForCausalLM(cfg).eval()).save_pretrained(tmp_path / "hf")
    return inferflow.load(str(tmp_path / "hf"), dtype="float32")


@pytest.mark.parametrize("native", [True, False])
def test_engine_gives_the_same_tokens_with_and_without(tmp_path, monkeypatch, native):
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("INFERFLOW_HUGEPAGES", on)
        model = _model(tmp_path)
        eng = Engine(model, EngineConfig(block_size=16, num_blocks=1100, max_num_seqs=4, max_model_len=256,
                                         native_decode=native))
        big = [p for p in model.net.parameters() if p.numel() * p.element_size() >= HUGE]
        assert big, "the test model must have a weight of at least one huge page"
        if on == "1":
            for p in big:
                _check_huge(p)
            store = eng.runner.cache._dev[eng.runner.cache.layers[0].key].k
            _check_huge(store, first=True)  # the first store of the arena starts it
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        hs = [eng.add_request(list(range(3 + i, 20 + 3 * i)), params) for i in range(3)]
        while eng.has_unfinished():
            eng.step()
        runs.append([h.result().outputs[0].token_ids for h in hs])
    assert runs[0] == runs[1]


def test_file_pages_dropped_after_the_move_stay_readable(tmp_path, monkeypatch):
    """The engine drops the model file's pages once the weights are copied (they would count twice): the source
    still reads the same bytes afterwards (a private mapping faults the file back in)."""
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    model = _model(tmp_path)
    maps = model.source.mapped()
    assert maps, "a safetensors folder is read through a file mapping"
    name = next(n for n in model.source.names() if n.endswith("embed_tokens.weight"))
    before = model.source.get(name).clone()
    Engine(model, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=2, max_model_len=128))
    assert torch.equal(model.source.get(name), before)
    emb = [p for p in model.net.parameters() if p.shape == before.shape]
    assert emb and torch.equal(emb[0].float(), before.float())


def test_a_second_engine_on_the_same_model_moves_nothing(tmp_path, monkeypatch):
    """Both engines' native programs point at the same weights: the second engine must not move them."""
    monkeypatch.setenv("INFERFLOW_HUGEPAGES", "1")
    model = _model(tmp_path)
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=2, max_model_len=128)
    first = Engine(model, EngineConfig(**cfg))
    ptrs = [p.data_ptr() for p in model.net.parameters()]
    second = Engine(model, EngineConfig(**cfg))
    assert [p.data_ptr() for p in model.net.parameters()] == ptrs
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for eng in (first, second, first):
        h = eng.add_request(list(range(5, 30)), params)
        while eng.has_unfinished():
            eng.step()
        outs.append(h.result().outputs[0].token_ids)
    assert outs[0] == outs[1] == outs[2]
