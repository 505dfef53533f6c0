"""ggml block dequantization: bit-exact against gguf-py's reference (gguf.quants.dequantize) in float32."""
import gguf
import numpy as np
import pytest
import torch

from inferflow.errors import FormatError
from inferflow.quant import PackedTensor, ggml
from inferflow.quant.packed import dequantize_rows

Q = gguf.GGMLQuantizationType
LEGACY = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
# byte offsets of the fp16 scale fields of each k-quant block (ggml-common.h)
K_FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def same_bits(ours: torch.Tensor, ref: np.ndarray) -> None:
    ours = ours.numpy()
    assert ours.dtype == np.float32 and ours.shape == ref.shape, (ours.dtype, ours.shape, ref.shape)
    assert np.array_equal(ours.view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32))


def test_block_sizes_match_gguf():
    for qtype, (_, elems, nbytes) in ggml.GGML_TYPES.items():
        if qtype in gguf.GGML_QUANT_SIZES and qtype != Q.Q8_1:  # gguf-py lists a stale Q8_1 size
            assert gguf.GGML_QUANT_SIZES[qtype] == (elems, nbytes), ggml.type_name(qtype)
        assert Q(qtype).name == ggml.type_name(qtype)


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_legacy_types_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 256)).astype(np.float32) * rng.uniform(1e-3, 10, (6, 1)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block (d = 0)
    x[1, 32:64] = 7.5  # a constant block
    packed = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(packed, qtype)
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8))
    same_bits(ggml.dequantize(raw, int(qtype), (6, 256)), ref)


def k_blocks(qtype, n: int, rng) -> np.ndarray:
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    # finite fp16 scales of all magnitudes, including subnormals, zero and negative values
    scales = np.concatenate([rng.standard_normal(n - 4) * 10.0 ** rng.integers(-6, 4, n - 4),
                             [0.0, -0.0, 6e-8, 65504.0]]).astype(np.float16)
    for off in K_FP16_FIELDS[qtype]:
        b[:, off:off + 2] = rng.permutation(scales).view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.parametrize("qtype", list(K_FP16_FIELDS), ids=lambda q: q.name)
def test_k_quants_exact(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    b = k_blocks(qtype, 96, rng)
    ref = gguf.quants.dequantize(b, qtype)
    same_bits(ggml.dequantize(torch.from_numpy(b), int(qtype), (96, 256)), ref)
    # rows of several blocks, as tensors hold them
    rows = b.reshape(8, -1)
    same_bits(ggml.dequantize(torch.from_numpy(rows), int(qtype), (8, 12 * 256)), gguf.quants.dequantize(rows, qtype))


def test_f32_and_bf16_bits():
    x = torch.tensor([1.5, -0.0, float("inf"), 3.0e38, 1e-40], dtype=torch.float32)
    same_bits(ggml.dequantize(x.view(torch.uint8), ggml.F32, (5,)), x.numpy())
    raw = np.array([0x7FC1, 0x0001, 0xFF80, 0x3F80], dtype=np.uint16).view(np.uint8)
    same_bits(ggml.dequantize(torch.from_numpy(raw.copy()), ggml.BF16, (4,)), gguf.quants.dequantize(raw, Q.BF16))


def test_packed_rows_and_dtype():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 64)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(x, Q.Q4_1))
    p = PackedTensor(raw, int(Q.Q4_1), (10, 64))
    full = p.dequantize()
    ids = torch.tensor([[3, 0], [9, 3]])
    assert torch.equal(dequantize_rows(p.data, p.qtype, 64, ids, torch.float32), full[ids])
    assert p.dequantize(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        PackedTensor(raw, int(Q.Q4_1), (10, 60))


def test_iq4_nl_exact():
    """IQ4_NL (llama.cpp's fallback for k-quant tensors with rows not a multiple of 256) against gguf-py."""
    rng = np.random.default_rng(20)
    b = rng.integers(0, 256, (40, 18), dtype=np.uint8)
    scales = np.concatenate([rng.standard_normal(36) * 10.0 ** rng.integers(-6, 4, 36),
                             [0.0, -0.0, 6e-8, 65504.0]]).astype(np.float16)
    b[:, :2] = scales.view(np.uint8).reshape(40, 2)
    ref = gguf.quants.dequantize(b, Q.IQ4_NL)
    same_bits(ggml.dequantize(torch.from_numpy(b), int(Q.IQ4_NL), (40, 32)), ref)
    ggml.check_supported(int(Q.IQ4_NL))
    rows = PackedTensor(torch.from_numpy(b.reshape(20, 36)), int(Q.IQ4_NL), (20, 64))  # rows of 2 blocks
    same_bits(rows.dequantize(), ref.reshape(20, 64))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.Q8_K], ids=lambda q: q.name)
def test_unsupported_types_named(qtype):
    with pytest.raises(FormatError) as e:
        ggml.check_supported(int(qtype), "blk.3.ffn_up.weight", "m.gguf")
    assert qtype.name in str(e.value) and "blk.3.ffn_up.weight" in str(e.value) and "m.gguf" in str(e.value)
