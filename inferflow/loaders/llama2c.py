"""llama2.c checkpoints: legacy v0 ``.bin`` (7-int header), v1 ("ak42", fp32), v2 ("ak42", Q8_0 groups) and
the ``{"model", "model_args"}`` training ``.pt`` files, exposed under HF llama tensor and config names.

llama2.c's model keeps q/k rows in Meta's interleaved-pair RoPE layout (run.c rotates pairs 2i, 2i+1;
export.py's HF import applies the inverse of HF's permutation), so q/k are un-permuted per head here
into HF's rotate-half order and the llama spec's mapping stays a plain rename.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import FormatError
from .source import WeightSource

MAGIC = 0x616B3432  # "ak42" as a little-endian uint32
V1_HEADER = 256


@dataclass(slots=True)
class Header:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared: bool
    version: int
    group_size: int = 0

    @property
    def kv_dim(self) -> int:
        return self.dim * self.n_kv_heads // self.n_heads

    def check(self, path: str) -> None:
        ok = (0 < self.dim <= 1 << 16 and 0 < self.hidden_dim <= 1 << 18 and 0 < self.n_layers <= 1024
              and 0 < self.n_heads <= self.dim and self.dim % self.n_heads == 0 and (self.dim // self.n_heads) % 2 == 0
              and 0 < self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0
              and 0 < self.vocab_size <= 1 << 24 and 0 < self.seq_len <= 1 << 24)
        if not ok:
            raise FormatError(path, f"implausible llama2.c header {self}")


def _hf_layer(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"rms_att": p + "input_layernorm.weight", "wq": p + "self_attn.q_proj.weight",
            "wk": p + "self_attn.k_proj.weight", "wv": p + "self_attn.v_proj.weight",
            "wo": p + "self_attn.o_proj.weight", "rms_ffn": p + "post_attention_layernorm.weight",
            "w1": p + "mlp.gate_proj.weight", "w2": p + "mlp.down_proj.weight", "w3": p + "mlp.up_proj.weight"}


def _shapes(h: Header) -> dict[str, tuple[int, ...]]:
    d, f = h.dim, h.hidden_dim
    return {"tok": (h.vocab_size, d), "rms_att": (d,), "wq": (d, d), "wk": (h.kv_dim, d), "wv": (h.kv_dim, d),
            "wo": (d, d), "rms_ffn": (d,), "w1": (f, d), "w2": (d, f), "w3": (f, d), "rms_final": (d,),
            "wcls": (h.vocab_size, d)}


def _layout(h: Header) -> list[tuple[str, int | None]]:
    """The file's tensor order as (kind, layer or None for a global tensor), as export.py writes it."""
    L = range(h.n_layers)
    per = lambda k: [(k, i) for i in L]  # noqa: E731
    cls = [] if h.shared else [("wcls", None)]
    mats = [x for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for x in per(k)]
    if h.version == 0:
        return ([("tok", None)] + per("rms_att") + [x for k in ("wq", "wk", "wv", "wo") for x in per(k)]
                + per("rms_ffn") + [x for k in ("w1", "w2", "w3") for x in per(k)]
                + [("rms_final", None), ("freq", None), ("freq", None)] + cls)
    return per("rms_att") + per("rms_ffn") + [("rms_final", None), ("tok", None)] + mats + cls


def read_header(path: str, mm: Any, size: int) -> Header:
    if size >= 12 and struct.unpack("<I", mm[:4])[0] == MAGIC:
        (version,) = struct.unpack("<i", mm[4:8])
        if version not in (1, 2) or size < V1_HEADER:
            raise FormatError(path, f"llama2.c 'ak42' file of unsupported version {version} (supported: 1, 2)")
        vals = struct.unpack("<7iB", mm[8:37])
        gs = struct.unpack("<i", mm[37:41])[0] if version == 2 else 0
        h = Header(*vals[:7], shared=bool(vals[7]), version=version, group_size=gs)
        if version == 2 and not (0 < gs and h.dim % gs == 0):
            raise FormatError(path, f"llama2.c v2 group size {gs} does not divide dim {h.dim}")
    else:
        if size < 28:
            raise FormatError(path, "too short for a llama2.c header")
        vals = struct.unpack("<7i", mm[:28])
        h = Header(*vals[:5], abs(vals[5]), vals[6], shared=vals[5] > 0, version=0)
    h.check(path)
    return h


def _nbytes(h: Header, kind: str) -> int:
    if kind == "freq":  # freq_cis_real / freq_cis_imag [seq_len, head_size / 2], unused
        return h.seq_len * (h.dim // h.n_heads // 2) * 4
    n = 1
    for s in _shapes(h)[kind]:
        n *= s
    if h.version == 2 and kind not in ("rms_att", "rms_ffn", "rms_final"):
        return n + n // h.group_size * 4  # int8 values, then one fp32 scale per group
    return n * 4


def expected_size(h: Header) -> int:
    return (28 if h.version == 0 else V1_HEADER) + sum(_nbytes(h, k) for k, _ in _layout(h))


def looks_like_v0(path: str | os.PathLike) -> bool:
    """A plausible legacy header whose dimensions account for the file size exactly."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(28)
        h = read_header(str(path), head, size)
    except (OSError, FormatError, struct.error):
        return False
    return h.version == 0 and expected_size(h) == size


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta interleaved-pair q/k rows -> HF rotate-half order (same math as weights._unpermute_rope)."""
    from ..model.weights import _unpermute_rope

    return _unpermute_rope(t, heads)


def _config(h: Header, eps: float = 1e-5) -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": h.dim, "intermediate_size": h.hidden_dim,
            "num_hidden_layers": h.n_layers, "num_attention_heads": h.n_heads, "num_key_value_heads": h.n_kv_heads,
            "vocab_size": h.vocab_size, "max_position_embeddings": h.seq_len, "tie_word_embeddings": h.shared,
            "rms_norm_eps": eps, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1,
            "eos_token_id": [2, 1]}  # run.c stops at BOS too: tinystories models emit it between stories


class Llama2cSource(WeightSource):
    """llama2.c weights by HF llama name; ``get`` memory-maps (v0/v1), dequantizes (v2) and un-permutes q/k."""

    kind = "llama2c"

    def __init__(self, path: str | os.PathLike, config: dict[str, Any],
                 tensors: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]):
        self.path, self.config, self.config_name = str(path), config, str(path)
        self.tensors = tensors

    @classmethod
    def from_bin(cls, path: str | os.PathLike) -> "Llama2cSource":
        p = str(path)
        try:
            size = os.path.getsize(p)
            with open(p, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise FormatError(p, f"cannot read: {e}") from None
        h = read_header(p, mm, size)
        need = expected_size(h)
        if size < need:
            raise FormatError(p, f"llama2.c v{h.version} file is {size} bytes, its header needs {need}")
        shapes, order = _shapes(h), _layout(h)
        pos = 28 if h.version == 0 else V1_HEADER
        tensors: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}
        for kind, i in order:
            n = _nbytes(h, kind)
            name = {"tok": "model.embed_tokens.weight", "rms_final": "model.norm.weight",
                    "wcls": "lm_head.weight"}.get(kind) or (_hf_layer(i)[kind] if i is not None else None)
            if name is not None:
                heads = {"wq": h.n_heads, "wk": h.n_kv_heads}.get(kind)
                tensors[name] = (shapes[kind], _reader(mm, pos, shapes[kind], h, kind, heads))
            pos += n
        return cls(p, _config(h), tensors)

    @classmethod
    def from_checkpoint(cls, path: str, args: dict[str, Any], sd: dict[str, Any]) -> "Llama2cSource":
        """A llama2.c training checkpoint: ``sd`` maps llama2.c names to lazy tensors (``.size``, ``.load()``)."""
        emb = sd.get("tok_embeddings.weight")
        w1 = sd.get("layers.0.feed_forward.w1.weight")
        try:
            n_heads, n_layers = int(args["n_heads"]), int(args["n_layers"])
            n_kv = int(args.get("n_kv_heads") or n_heads)
            h = Header(int(args["dim"]), w1.size[0], n_layers, n_heads, n_kv, emb.size[0],
                       int(args.get("max_seq_len") or 2048), shared="output.weight" not in sd, version=0)
            eps = float(args.get("norm_eps") or 1e-5)
        except (TypeError, ValueError, IndexError, AttributeError, OverflowError):  # OverflowError: int(inf)
            raise FormatError(path, "llama2.c checkpoint: bad model_args or no tok_embeddings / w1 weights") from None
        h.check(path)
        rename = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
        shapes = _shapes(h)
        want = {"model.embed_tokens.weight": shapes["tok"], "model.norm.weight": shapes["rms_final"],
                "lm_head.weight": shapes["wcls"]}
        meta = {"rms_att": "attention_norm", "wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv",
                "wo": "attention.wo", "rms_ffn": "ffn_norm", "w1": "feed_forward.w1", "w2": "feed_forward.w2",
                "w3": "feed_forward.w3"}
        heads: dict[str, int] = {}
        for i in range(n_layers):
            for kind, hf in _hf_layer(i).items():
                rename[f"layers.{i}.{meta[kind]}.weight"] = hf
                want[hf] = shapes[kind]
                if kind in ("wq", "wk"):
                    heads[hf] = n_heads if kind == "wq" else n_kv
        tensors = {}
        for name, ref in sd.items():
            hf = rename.get(name)
            if hf is None:
                raise FormatError(path, f"unexpected tensor {name!r} in a llama2.c checkpoint")
            if tuple(ref.size) != want[hf]:
                raise FormatError(path, f"{name}: shape {list(ref.size)}, model_args imply {list(want[hf])}")
            load = (lambda r=ref, k=heads.get(hf): unpermute(r.load(), k) if k else r.load())
            tensors[hf] = (tuple(ref.size), load)
        return cls(path, _config(h, eps), tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][0]

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name][1]()


def _reader(mm: Any, pos: int, shape: tuple[int, ...], h: Header, kind: str,
            heads: int | None) -> Callable[[], torch.Tensor]:
    n = 1
    for s in shape:
        n *= s

    def f32(offset: int, count: int) -> torch.Tensor:
        if offset % 4:  # v2 scales after an odd-sized int8 block: copy to align
            return torch.frombuffer(bytearray(mm[offset:offset + 4 * count]), dtype=torch.float32)
        return torch.frombuffer(mm, dtype=torch.float32, count=count, offset=offset)

    def read() -> torch.Tensor:
        if h.version == 2 and kind not in ("rms_att", "rms_ffn", "rms_final"):
            q = torch.frombuffer(mm, dtype=torch.int8, count=n, offset=pos)
            s = f32(pos + n, n // h.group_size)
            t = (q.float().view(-1, h.group_size) * s[:, None]).view(shape)
        else:
            t = f32(pos, n).view(shape)
        return unpermute(t, heads) if heads else t

    return read
