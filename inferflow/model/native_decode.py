"""CPU decode steps as one native program (``inferflow/native/step.c``): the decoder stack lowered step by step.

Why: on a CPU a small model's decode step is mostly fixed costs (see step.c); one call per step removes them.

The lowering walks the assembled flows as :class:`~inferflow.model.flow.Flow` runs them and maps each step's
component to native ops over preallocated buffers of :data:`MAX_ROWS` rows: RMSNorm, residual adds, attention
(projections, per-head q/k RMSNorms, rotate-half RoPE, the K/V write and paged attention over the engine's cache, the
output projection), gated SiLU MLPs and linears over float weights (float32 / bfloat16 / float16) or ggml blocks
(Q4_0 / Q4_1 / Q8_0 on int8 activations, as the op-by-op path: cpu_kernels.q8x_takes). The ops are the kernels
the op-by-op path calls, so the logits are the same bits. A step it does not know (another
component, or a feature the kernels lack: ALiBi, soft-caps, whole-projection q/k norms, quantized or
host-resident K/V) raises :class:`Unsupported` and the model keeps its op-by-op path. The token lookup (float rows or
ggml blocks, decoded exactly), the final block and the head are in the program too (a scaled embedding stays a torch
lookup).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..native import cpu_ops, step
from ..quant import cpu_kernels, ggml, native_linear
from .context import AttentionBackend, ForwardContext
from .flow import Flow, Stack
from .native_attention import AttentionLowering
from .native_lowering import DT, GEMV_T, MAX_ROWS, Unsupported, Val, label, name_of

log = logging.getLogger(__name__)


class NativeDecoder(AttentionLowering):
    """A decoder-only model's decode step (1..MAX_ROWS sequences of one new token each) as one native program over
    the engine's paged K/V cache. Build with :meth:`build` (None where anything is unsupported)."""

    max_rows = MAX_ROWS

    def __init__(self, model: Any, cache: Any):
        self.model, self.cache = model, cache
        self.dtype = model.dtype
        if self.dtype not in DT:
            raise Unsupported(f"activations in {self.dtype}")
        self.dt = DT[self.dtype]
        net = model.net
        if net.encoder is not None or net.decoder is None or net.head is None:
            raise Unsupported("not a decoder-only model with a head")
        g = getattr(model, "parallel", None)
        if (g is not None and g.world > 1) or type(net.decoder) is not Stack:
            raise Unsupported("a model split over processes (pipeline or tensor parallel)")
        if cache.device.type != "cpu" or cache.host_layers or not (
                cache.store_dtype in (self.dtype, torch.float8_e4m3fn, torch.int8)
                or (cache.store_dtype == torch.bfloat16 and self.dt == 0)):
            raise Unsupported("K/V cache not plain CPU storage in the model's dtype (or bfloat16 under float32, "
                              "float8 e4m3 or int8)")
        self.stack = net.decoder
        self.prog = step.Program()
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []
        self._ropes: list[ctypes.Structure] = []
        self._rope_tab: tuple | None = None
        self.q8x = cpu_kernels.native_q8x() and step.has_op("gemv_q8x")
        self._scratch: torch.Tensor | None = None
        hidden = self._embed_dim()
        self.x0 = self._buf(hidden, "embed")
        self.native_embed = self._embed_op()
        x = Val(self.x0, hidden, hidden)
        for i, layer in enumerate(self.stack.layers):
            x = self._flow(layer, x, f"L{i % 2}")
        if self.stack.final is not None:
            x = self._flow(self.stack.final, x, "final")
        out = self._flow(net.head, x, "head")
        self.logits = out
        # where the last op writes the logits buffer (a head GEMV), each step gets a fresh float32 output instead
        last = self.prog.args[-1]
        self._out_args = last if (getattr(last, "y", None) == out.t.data_ptr() and out.t.dtype == torch.float32
                                  and out.ld == out.n) else None

    @classmethod
    def build(cls, model: Any, cache: Any) -> "NativeDecoder | None":
        """The program for ``model`` over ``cache``, or None (logged: why) where it does not apply."""
        if not (step.available() and cpu_ops.enabled_all()) or model.device.type != "cpu":
            return None
        try:
            return cls(model, cache)
        except Unsupported as e:
            log.info("native decode step off: %s", e)
            return None

    # ---- buffers -------------------------------------------------------------------------------
    def _buf(self, n: int, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A [MAX_ROWS, n] buffer, shared by the steps of the same ``key``: layers alternate between two sets
        ("L0", "L1"), so layer i + 2 reuses layer i's (dead by then: a layer reads only the previous one's output)
        and a step's working set stays in cache."""
        dtype = dtype or self.dtype
        t = self._bufs.get((key, n, dtype))
        if t is None:
            t = self._bufs[(key, n, dtype)] = torch.zeros(MAX_ROWS, n, dtype=dtype)
        return t

    def _embed_dim(self) -> int:
        emb = self.stack.embed
        m = getattr(emb, emb.plan[0][0]) if emb is not None and len(emb.plan) == 1 else None
        if m is None or name_of(m) != "token_embedding":
            raise Unsupported("embedding block is not one token lookup")
        self.embed_mod = m
        return m.packed["weight"][1][1] if m.packed is not None else m.weight.shape[1]

    def _embed_op(self) -> bool:
        """The token lookup as the program's first op where the table is float rows of the model's dtype or ggml
        blocks the kernels decode (exactly, as the lookup does), unscaled; else it stays a torch lookup."""
        m, dim = self.embed_mod, self.x0.shape[1]
        if m.scale is not None:
            return False
        if m.packed is not None:
            qtype, shape = m.packed["weight"]
            blocks = m._buffers.get("weight_blocks")
            if (blocks is None or qtype not in native_linear.SUPPORTED or blocks.device.type != "cpu"
                    or blocks.dim() != 2 or blocks.stride(1) != 1 or dim % 32 or m.out_dtype != self.dtype):
                return False
            self.vocab = shape[0]
            self.prog.add("embed", "embed", w=blocks, y=self.x0, qt=qtype, rb=blocks.stride(0), D=dim, dt=self.dt)
            return True
        w = m.weight
        if w.dtype != self.dtype or w.device.type != "cpu" or not w.is_contiguous():
            return False
        self.vocab = w.shape[0]
        self.prog.add("embed", "embed", w=w, y=self.x0, qt=-1, rb=dim * w.element_size(), D=dim, dt=self.dt)
        return True

    # ---- flows ----------------------------------------------------------------------------------
    def _flow(self, flow: Flow, x: Val, tag: str) -> Val:
        env: dict[str, Any] = {flow.first_input: x, "x": x}
        cur: Any = x
        for name, inputs in flow.plan:
            if inputs is not None:
                cur = env[inputs[0]] if len(inputs) == 1 else [env[n] for n in inputs]
            m = getattr(flow, name)
            kind = name_of(m)
            lower = _LOWER.get(kind)
            if lower is None or getattr(m, "_forward_hooks", None) or getattr(m, "_forward_pre_hooks", None):
                raise Unsupported(f"step {name!r} ({kind})")
            cur = lower(self, m, cur, f"{tag}.{name}")
            env[name] = cur
        return cur

    def _norm(self, m: Any, x: Val, tag: str) -> Val:
        if "fused_pending" in m.__dict__ or m.weight.dtype not in DT or m.weight.shape != (x.n,):
            raise Unsupported(f"{tag}: norm form")
        y = self._buf(x.n, tag)
        self.prog.add("rmsnorm", label(tag), a=x.t, w=m.weight, y=y, sx=x.ld, D=x.n, dt=self.dt, wdt=DT[m.weight.dtype],
                      wif=int(m.weight_in_float or self.dt == 0), lanes=8, eps=m.eps, offset=m.offset)
        return Val(y, x.n, x.n)

    def _add(self, m: Any, xs: Sequence[Val], tag: str) -> Val:
        if m.fused_norm is not None or not isinstance(xs, list) or len(xs) < 2:
            raise Unsupported(f"{tag}: add form")
        cur = xs[0]
        for x in xs[1:]:
            if x.n != cur.n or x.ld != x.n or cur.ld != cur.n:
                raise Unsupported(f"{tag}: add of strided values")
            y = self._buf(cur.n, tag)
            self.prog.add("add", label(tag), a=cur.t, b=x.t, y=y, D=cur.n, dt=self.dt)
            cur = Val(y, cur.n, cur.n)
        return cur

    def _linear(self, m: Any, x: Val, tag: str, col: int = 0) -> Val:
        """y = x[:, col:col + K] W^T (+ b) into a new buffer."""
        n, k = m.out_features, m.in_features
        xp = x.at(col)
        if m.packed is not None:
            if (getattr(m, "kernels", None) or {}).get("weight") != "native" or self.dt != 0:
                raise Unsupported(f"{tag}: a quantized kernel other than the native block GEMV")
            blocks = m._buffers["weight_blocks"]
            qtype, shape = m.packed["weight"]
            bias = None if m.bias is None else m.bias.float().contiguous()
            y = self._buf(n, tag, torch.float32)
            if bias is not None:
                self._keep.append(bias)  # a float32 copy: kept alive with the program
            if self.q8x and cpu_kernels.q8x_takes(qtype, shape):
                scratch = self._q8x_scratch(k)
                self.prog.add("quant_x", label(tag), x=xp, scratch=scratch, ldx=x.ld, K=k)
                self.prog.add("gemv_q8x", f"{label(tag)} {n}x{k} {ggml.type_name(qtype)}", w=blocks, bias=bias,
                              scratch=scratch, y=y, qt=qtype, rb=blocks.stride(0), ldy=n, N=n, K=k)
            else:
                self.prog.add("gemv_q", f"{label(tag)} {n}x{k} {ggml.type_name(qtype)}", w=blocks, x=xp, bias=bias,
                              y=y, qt=qtype, rb=blocks.stride(0), ldx=x.ld, ldy=n, N=n, K=k)
            return Val(y, n, n)
        w = m.weight
        if w.dtype != self.dtype or not w.is_contiguous() or w.device.type != "cpu" or tuple(w.shape) != (n, k):
            raise Unsupported(f"{tag}: weight {w.dtype} {tuple(w.shape)}")
        if m.bias is not None and (m.bias.dtype != w.dtype or not m.bias.is_contiguous()):
            raise Unsupported(f"{tag}: bias form")
        y = self._buf(n, tag)
        self.prog.add("gemv_f", f"{label(tag)} {n}x{k} {w.dtype}", x=xp, w=w, bias=m.bias, y=y, ldx=x.ld, N=n, K=k,
                      t=GEMV_T[w.dtype])
        return Val(y, n, n)

    def _q8x_scratch(self, k: int) -> torch.Tensor:
        need = MAX_ROWS * (k + 8 * (k // 32))
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.zeros(need, dtype=torch.uint8)
            self._keep.append(self._scratch)
        return self._scratch

    def _mlp(self, m: Any, x: Val, tag: str) -> Val:
        if m.act is not F.silu:
            raise Unsupported(f"{tag}: activation {m.act}")
        inter = m.inter
        out = self._buf(inter, tag + ".act")
        if m.fused:
            gu = self._linear(m.gate_up_proj, x, tag + ".gate_up")
            g, u, sg = gu.t.data_ptr(), gu.at(inter), gu.ld
            su = sg
        else:
            gate, up = self._linear(m.gate_proj, x, tag + ".gate"), self._linear(m.up_proj, x, tag + ".up")
            g, u, sg, su = gate.t.data_ptr(), up.t.data_ptr(), gate.ld, up.ld
        self.prog.add("silu_mul", label(tag), g=g, u=u, out=out, sg=sg, su=su, I=inter, dt=self.dt)
        return self._linear(m.down_proj, Val(out, inter, inter), tag + ".down")

    # ---- running ---------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """float32 logits [M, vocab] of one decode step: row i is token ``ids[i]`` at ``positions[i]`` of the
        sequence whose block table is ``tables[i]`` (its K/V is stored at that position's slot)."""
        M = len(ids)
        if not 1 <= M <= MAX_ROWS:
            raise ValueError(f"native decode: 1..{MAX_ROWS} rows, got {M}")
        bs, nb = self.cache.block_size, self.cache.num_blocks
        width = max(len(t) for t in tables)
        for t, p in zip(tables, positions):
            if not 0 <= p < len(t) * bs or min(t) < 0 or max(t) >= nb:
                raise ValueError("native decode: block ids or positions outside the cache")
        # one tensor for ids, positions, slots, key counts and the padded tables (views of it)
        flat = [*ids, *positions, *[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
                *[p + 1 for p in positions]]
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        packed = torch.tensor(flat, dtype=torch.int64)
        ids_t, pos, slots, lens = (packed[i * M:(i + 1) * M] for i in range(4))
        tab = packed[4 * M:].view(M, width)
        if self.stack.position is not None and self._ropes:
            self._rope_tables(max(positions) + 1)
        if self.native_embed:
            if min(ids) < 0 or max(ids) >= self.vocab:
                raise IndexError(f"native decode: token ids outside the vocabulary [0, {self.vocab})")
        else:
            ctx = ForwardContext(positions=pos, q_lens=[1] * M, k_lens=[p + 1 for p in positions],
                                 backend=_NO_BACKEND)
            self.x0[:M].copy_(self.stack.embed(self.model._env(ids_t, ctx), ctx))
        st = step.StepState(M=M, ids=ids_t.data_ptr(), pos=pos.data_ptr(), slots=slots.data_ptr(), lens=lens.data_ptr(),
                            tables=tab.data_ptr(), tstride=tab.stride(0))
        # the logits are the caller's own: a caller may hold several steps' (fault isolation reruns rows one by one)
        fresh = None
        if self._out_args is not None:
            fresh = torch.empty(M, self.logits.n, dtype=torch.float32)
            self._out_args.y = fresh.data_ptr()
        self.prog.run(st, torch.get_num_threads())
        if fresh is not None:
            return fresh
        out = self.logits.t[:M]
        return out.clone() if out.dtype == torch.float32 else out.float()


_NO_BACKEND = AttentionBackend()  # the embedding block's context needs one; it attends to nothing

_LOWER = {
    "rmsnorm": NativeDecoder._norm,
    "add": NativeDecoder._add,
    "linear": NativeDecoder._linear,
    "gated_mlp": NativeDecoder._mlp,
    "attention": AttentionLowering._attention,
}
