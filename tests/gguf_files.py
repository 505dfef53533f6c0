"""Test fixtures: tiny HF models written to GGUF the way llama.cpp's convert_hf_to_gguf.py writes them,
and raw GGUF byte builders for malformed-file tests."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved-pair RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _store(writer: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: Q, permute_heads: int | None) -> np.ndarray:
    """Write ``arr`` (HF layout) under ``name``; return the values the file holds, in HF layout.

    Quantization works on whole rows, so quantize(permute(W)) holds exactly the rows of
    dequantize(quantize(W)), reordered: the reference needs no un-permutation of ours."""
    arr = arr.astype(np.float32)
    if arr.ndim == 1 or qtype == Q.F32:
        stored, held = arr, arr
    elif qtype == Q.F16:
        stored = arr.astype(np.float16)
        held = stored.astype(np.float32)
    else:
        held = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        stored = gguf.quants.quantize(permute(arr, permute_heads) if permute_heads else arr, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
        return held
    writer.add_tensor(name, permute(stored, permute_heads) if permute_heads else stored)
    return held


def rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def write_llama(model: torch.nn.Module, path: Path, qtype: Q, arch: str = "llama", permute_qk: bool = True,
                extra=None) -> dict[str, torch.Tensor]:
    """Write an HF Llama-layout causal LM as GGUF; returns the HF state dict of the values as stored."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if head_dim != cfg.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if extra:
        extra(w)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    held = {}
    sd = model.state_dict()
    tied = getattr(cfg, "tie_word_embeddings", False)
    for hf_name, t in sd.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        heads_for = None
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, i, rest = hf_name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[module]}.{suffix}"
            if permute_qk and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads_for = heads if module == "self_attn.q_proj" else kv
        held[hf_name] = torch.from_numpy(_store(w, name, t.float().numpy(), qtype, heads_for))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if tied:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    return held


def write_gpt2(model: torch.nn.Module, path: Path, qtype: Q) -> dict[str, torch.Tensor]:
    """GPT-2 as convert_hf_to_gguf.py writes it: Conv1D weights transposed to [out, in], the tied head
    written again as output.weight."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_context_length(cfg.n_positions)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(cfg.vocab_size)
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    held = {}
    for hf_name, t in model.state_dict().items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")) or hf_name == "lm_head.weight":
            continue
        arr = t.float().numpy()
        if hf_name == "transformer.wte.weight":
            name = "token_embd.weight"
        elif hf_name == "transformer.wpe.weight":
            name = "position_embd.weight"
        elif hf_name.startswith("transformer.ln_f."):
            name = "output_norm." + hf_name.rsplit(".", 1)[1]
        else:
            _, _, i, rest = hf_name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{i}.{names[module]}.{suffix}"
        conv = arr.ndim == 2 and name.startswith("blk.")
        stored = _store(w, name, arr.T if conv else arr, qtype, None)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(stored.T if conv else stored))
        if name == "token_embd.weight":
            _store(w, "output.weight", arr, qtype, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    held["lm_head.weight"] = held["transformer.wte.weight"]
    return held


def with_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The same architecture holding ``state`` (the values a GGUF file stores)."""
    import copy

    ref = copy.deepcopy(model)
    ref.load_state_dict(state, strict=False)
    return ref.eval()


# ---- raw GGUF bytes, for malformed files -------------------------------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, v: int) -> bytes:
    return gstr(key) + struct.pack("<II", 4, v)


def kv_str(key: str, v: str) -> bytes:
    return gstr(key) + struct.pack("<I", 8) + gstr(v)


def tensor_info(name: str, dims: list[int], qtype: int, offset: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", qtype, offset)


def raw_gguf(kvs: list[bytes], infos: list[bytes], data: bytes, version: int = 3, n_kv: int | None = None,
             n_tensors: int | None = None, align: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % align)
    return body + data


def write_phi2(model: torch.nn.Module, path: Path, qtype: Q, fused: bool = False) -> dict[str, torch.Tensor]:
    """Phi (HF PhiForCausalLM) as convert_hf_to_gguf.py's Phi2Model writes it: arch "phi2", the rotated
    dimensions as rope.dimension_count, no q/k permutation; ``fused``: Q|K|V in one attn_qkv (older files)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or {}
    rot_pct = params.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", 0.5)
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(4 * cfg.hidden_size)  # what the converter writes, whatever intermediate_size says
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_rope_dimension_count(int(rot_pct * cfg.hidden_size) // heads)
    w.add_vocab_size(cfg.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "input_layernorm": "attn_norm"}
    top = {"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm", "lm_head": "output"}
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    held = {}
    for hf_name, arr in sd.items():
        module, suffix = hf_name.rsplit(".", 1)
        if module in top:
            held[hf_name] = torch.from_numpy(_store(w, f"{top[module]}.{suffix}", arr, qtype, None))
            continue
        _, _, i, rest = module.split(".", 3)
        if fused and rest in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            if rest == "self_attn.q_proj":
                parts = [sd[f"model.layers.{i}.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
                stored = _store(w, f"blk.{i}.attn_qkv.{suffix}", np.concatenate(parts), qtype, None)
                for p, part in zip("qkv", np.split(stored, 3)):
                    held[f"model.layers.{i}.self_attn.{p}_proj.{suffix}"] = torch.from_numpy(part.copy())
            continue
        held[hf_name] = torch.from_numpy(_store(w, f"blk.{i}.{names[rest]}.{suffix}", arr, qtype, None))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


# fp16 scale fields of each k-quant block (ggml-common.h)
K_FP16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes]: gguf-py's encoder on Gaussian weights (legacy types) or random bytes with
    Gaussian fp16 scales (k-quants, which gguf-py cannot encode)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return torch.from_numpy(gguf.quants.quantize(w, qtype).copy())
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // elems
    b = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for off in K_FP16_FIELDS[qtype]:
        b[:, off:off + 2] = (rng.standard_normal(n) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
    return torch.from_numpy(b.reshape(rows, -1))
