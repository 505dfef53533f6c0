"""The CUDA 4-bit decode kernels, chosen per shape against Triton's ``gemv4`` (1-2 activation rows) or ``gemm4``
(3-64 rows).

- ``fma`` (``inferflow/native/q4_gemv.cu``): q4_0 and inferflow q4 on quant/triton_soa.py's layout, the same exact
  float32 decode as ``gemv4`` (bit-identical weights), but persistent warps that keep the next work item's codes
  and scales in flight while they decode this one: the bytes in flight per SM that the Triton kernel lacked.
- ``mma`` (``inferflow/native/q4_mma.cu``, layout in cuda_q4_mma.py): q4_0 with bf16/fp16 activations on the
  tensor cores (exact q - 8 as 16-bit floats, float32 sums, the block scale applied to each block's sum). Its own
  copy of the weight, made only for weights where some key picked it. On Hopper, half its configs stream the
  codes through shared memory with the bulk-copy engine (``q4_mma_bulk.cuh``) instead of registers.
- ``rows`` (``inferflow/native/q4_mma_rows.cu``): the same layout and decode for up to 64 rows (batched decode),
  activations staged in shared memory and shared by a block's warps, split K where row groups are few; half its
  configs fold the block scale into the weights before the mma (rounded to the activations' type: fewer
  instructions, which pays from ~32 rows).
- ``wg`` (``inferflow/native/q4_wgmma.cu``, sm_90 only): the same layout on Hopper's warpgroup MMA, the scale
  folded, the activations read by the tensor cores from shared memory; up to 256 rows (more than 64: through
  quant/q4_wide.py, inside CUDA graphs).

Selection: the first eager call of a (rows, N, K, kind, dtype, bias) key, outside a CUDA-graph capture, checks
every launch config of both against Triton's result, times them and Triton's autotuned pick as CUDA-graph replays
with L2 flushed between calls (how a decode step runs them), and caches the fastest; the engine's warm-up makes
that call before it captures. A key first seen inside a capture runs Triton. ``INFERFLOW_CUDA_KERNELS=0`` keeps
Triton everywhere; without ``nvcc`` nothing here is built and Triton runs as before. ``INFERFLOW_Q4_WGMMA=0``
leaves out the ``wg`` kernel.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from ..native import choices

# R: output rows per work item (tile), in q4_gemv.cu's order
CONFIGS: tuple[int, ...] = (4, 2, 8, 1)
_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_KIND = {"q4c": 0, "q4_0": 2}
TRITON = "triton"  # a choice: Triton's gemv4
_GEMMS = {"rows": "q4_mma_rows", "wg": "q4_wgmma"}  # the GEMM kinds' libraries
_LAYOUT_KINDS = ("mma", *_GEMMS)  # the kinds that run on the tensor-core layout

log = logging.getLogger(__name__)
_lock = threading.Lock()
_choice: dict[tuple, tuple[str, int]] = {}
_mma_users: set[tuple] = set()  # weights (blocks pointer, device) some key runs on the tensor cores: layout kept


def _lib(device: torch.device) -> ctypes.CDLL | None:
    from ..native import cuda

    lib = cuda.load("q4_gemv", device)
    if lib is not None:
        p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        cuda.bind(lib, "q4_gemv", [i, i, i, i, i, p, p, p, p, p, p, i, i, i, ll, ll, p], len(CONFIGS))
    return lib


def _fma_supports(x2: torch.Tensor, kind: str) -> bool:
    """The FMA kernel's operands: 1-2 rows of float32/bf16/fp16 with 16-byte aligned rows (its vector loads)."""
    return (kind in _KIND and x2.dtype in _DTYPE and 1 <= x2.shape[0] <= 2 and x2.stride(-1) == 1
            and x2.data_ptr() % 16 == 0 and (x2.shape[0] == 1 or (x2.stride(0) * x2.element_size()) % 16 == 0))


def supports(x2: torch.Tensor, kind: str, bias: torch.Tensor | None) -> bool:
    """Whether some CUDA kernel takes these operands (``x2`` [M, K] on a GPU, a bias of its dtype): the FMA kernel
    (1-2 rows, see :func:`_fma_supports`) or the tensor-core ones (Q4_0, bf16/fp16, up to 64 rows; more:
    :func:`wide_supports`)."""
    from . import cuda_q4_mma

    k = x2.shape[-1]
    return (_bias_ok(x2, bias) and (_fma_supports(x2, kind) or cuda_q4_mma.supports(x2, kind, k)
                                    or cuda_q4_mma.rows_supports(x2, kind, k)))


def wide_supports(x2: torch.Tensor, kind: str, bias: torch.Tensor | None, build: bool = True) -> bool:
    """Whether the warpgroup-MMA GEMM takes these operands (up to 256 rows on an sm_90 GPU, ``nvcc`` present).
    ``build=False`` leaves out the last condition: no ``nvcc`` run at a step that would not use the kernel."""
    from ..native import cuda
    from . import cuda_q4_mma

    return (cuda.enabled() and wg_enabled() and _bias_ok(x2, bias)
            and cuda_q4_mma.wg_supports(x2, kind, x2.shape[-1])
            and (not build or _mma_lib(x2.device, "q4_wgmma") is not None))


def wg_enabled() -> bool:
    """False when ``$INFERFLOW_Q4_WGMMA`` is 0 (read at each call: an A/B run captures one engine with each)."""
    return os.environ.get("INFERFLOW_Q4_WGMMA", "1") not in ("0", "false", "off")


def _bias_ok(x2: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return x2.device.type == "cuda" and (bias is None or (bias.dtype == x2.dtype and bias.is_contiguous()))


def gemv(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor, kind: str, n: int, k: int,
         bias: torch.Tensor | None, cfg: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x2 @ W^T (+ bias)`` [M, N] with launch config ``cfg`` (an index into :data:`CONFIGS`)."""
    from ..native import cuda

    lib = _lib(x2.device)
    if lib is None:
        raise RuntimeError("the CUDA q4 GEMV is not available here")
    m = x2.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    stream = torch.cuda.current_stream(x2.device).cuda_stream
    err = lib.q4_gemv(x2.device.index or 0, _DTYPE[x2.dtype], _KIND[kind], cfg, m, x2.data_ptr(), codes.data_ptr(),
                      scales.data_ptr(), tab.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
                      n, k, codes.shape[1], x2.stride(0), y.stride(0), ctypes.c_void_p(stream))
    cuda.check(lib, "q4_gemv", err)
    return y


def _mma_lib(device: torch.device, name: str = "q4_mma") -> ctypes.CDLL | None:
    """The tensor-core GEMV (``q4_mma``) or GEMM (``q4_mma_rows``, ``q4_wgmma``) library, bound, or None."""
    from ..native import cuda
    from . import cuda_q4_mma

    lib = cuda.load(name, device)
    if lib is not None:
        if name == "q4_mma":
            cuda.bind(lib, name, cuda_q4_mma.ARGTYPES, len(cuda_q4_mma.CONFIGS))
        elif name == "q4_wgmma":
            cuda.bind(lib, name, cuda_q4_mma.ROWS_ARGTYPES, len(cuda_q4_mma.WG_CONFIGS))
        else:
            cuda.bind(lib, name, cuda_q4_mma.ROWS_ARGTYPES, len(cuda_q4_mma.ROWS_CONFIGS))
    return lib


def choose(x2: torch.Tensor, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor,
           kind: str, n: int, k: int, bias: torch.Tensor | None,
           triton_call: Callable[[], torch.Tensor], baseline: str = "") -> tuple[str, int]:
    """The cached choice for this key, timed at the first eager call: (TRITON, 0), ("fma", config), ("mma",
    config) or ("rows", config). ``baseline`` names the Triton kernel ``triton_call`` runs: part of the key."""
    from ..native import cuda

    if not cuda.enabled():  # read at each call: A/B runs switch it between two engines' graph captures
        return TRITON, 0
    if not wg_enabled():
        baseline += "-nowg"  # another candidate set: another choice
    key = (x2.shape[0], n, codes.shape[1], kind, x2.dtype, bias is not None, baseline, x2.device)
    hit = _choice.get(key)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing() or _lib(x2.device) is None:
        return TRITON, 0  # never timed inside a capture; not cached, so an eager call still times it
    with _lock:
        if key not in _choice:
            got = _stored(key, x2, blocks, codes, scales, tab, kind, n, k, bias, triton_call)
            if got is None:
                got = _time(x2, blocks, codes, scales, tab, kind, n, k, bias, triton_call)
                STORE.put(key[:7], x2.device, list(got))
            _choice[key] = got
    return _choice[key]


_NATIVE = Path(__file__).resolve().parent.parent / "native"
# choices timed by earlier processes on this GPU, valid while these sources (the candidates) are unchanged
STORE = choices.ChoiceStore("cuda_q4", [Path(__file__), Path(__file__).with_name("cuda_q4_mma.py"),
                                        Path(__file__).with_name("triton_q4.py"),
                                        Path(__file__).with_name("triton_soa.py"),
                                        Path(__file__).with_name("triton_q4_swap.py"),
                                        *sorted(_NATIVE.glob("q4_*.cu*"))])


def _stored(key: tuple, x2, blocks, codes, scales, tab, kind, n, k, bias, triton_call) -> tuple[str, int] | None:
    """An earlier process's choice for ``key`` that still names a candidate here and matches Triton's result on
    these operands (one call each, as :func:`_time` checks a candidate; only the timing is skipped); else None."""
    got = STORE.get(key[:7], x2.device)
    if not (isinstance(got, list) and len(got) == 2 and isinstance(got[1], int)):
        return None
    choice = (str(got[0]), got[1])
    if choice == (TRITON, 0):
        return choice
    if choice not in _candidates(x2, kind, k)[0]:
        return None
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    try:
        out = run(choice, x2, blocks, codes, scales, tab, kind, n, k, bias, y)
        if out is None or not _matches(out, triton_call().float()):
            return None
    except RuntimeError:
        return None
    if choice[0] in _LAYOUT_KINDS:
        _mma_users.add((blocks.data_ptr(), blocks.device))
    return choice


def _candidates(x2: torch.Tensor, kind: str, k: int) -> tuple[list[tuple[str, int]], bool]:
    """Every CUDA launch config that takes these operands, and whether any of them runs the tensor-core layout."""
    from . import cuda_q4_mma

    cands = [("fma", c) for c in range(len(CONFIGS))] if _fma_supports(x2, kind) else []
    mma = False
    if cuda_q4_mma.supports(x2, kind, k) and _mma_lib(x2.device) is not None:
        cands += [("mma", c) for c in cuda_q4_mma.gemv_configs(x2.device)]
        mma = True
    if cuda_q4_mma.rows_supports(x2, kind, k) and _mma_lib(x2.device, "q4_mma_rows") is not None:
        cands += [("rows", c) for c in range(len(cuda_q4_mma.ROWS_CONFIGS))]
        mma = True
    if wg_enabled() and cuda_q4_mma.wg_supports(x2, kind, k) and _mma_lib(x2.device, "q4_wgmma") is not None:
        cands += [("wg", c) for c in range(len(cuda_q4_mma.WG_CONFIGS))]
        mma = True
    return cands, mma


def _matches(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """A CUDA kernel's output against Triton's (``ref``, float32): the same weights summed in another order (and,
    for the tensor cores, rounded activations are not: both take x as it is), so within a few output ulps."""
    top = ref.abs().max().item()
    return (y.float() - ref).abs().max().item() <= 1e-3 * top + 1e-6 + 2 * top * _ulp(y.dtype)


def run(choice: tuple[str, int], x2: torch.Tensor, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
        tab: torch.Tensor, kind: str, n: int, k: int, bias: torch.Tensor | None,
        out: torch.Tensor) -> torch.Tensor | None:
    """Run a CUDA choice of :func:`choose` (not TRITON); None where it cannot run here (the caller runs Triton)."""
    if choice[0] == "fma":
        return gemv(x2, codes, scales, tab, kind, n, k, bias, choice[1], out=out)
    from . import cuda_q4_mma, triton_soa

    layout = triton_soa.cached(blocks, kind, (n, k), make=cuda_q4_mma.repack)
    if layout is None and torch.cuda.is_current_stream_capturing():
        # never repack inside a capture (the graph would replay it): a weight first seen here takes the FMA kernel
        # (or, for more rows than it takes, Triton)
        return gemv(x2, codes, scales, tab, kind, n, k, bias, 0, out=out) if _fma_supports(x2, kind) else None
    mc, ms = layout or triton_soa.soa(blocks, kind, (n, k), make=cuda_q4_mma.repack)
    if choice[0] in _GEMMS:
        name = _GEMMS[choice[0]]
        return cuda_q4_mma.gemm(_mma_lib(x2.device, name), x2, mc, ms, n, bias, choice[1], out, name)
    return cuda_q4_mma.gemv(_mma_lib(x2.device), x2, mc, ms, n, bias, choice[1], out)


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype != torch.float32 else 0.0


def _time(x2, blocks, codes, scales, tab, kind, n, k, bias, triton_call) -> tuple[str, int]:
    from . import cuda_q4_mma, triton_soa
    from .triton_q4 import _flushed_graph_ms

    ref = triton_call().float()  # Triton's autotuner runs first (it times with its own graphs)
    best, best_ms = (TRITON, 0), _flushed_graph_ms(triton_call)
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    cands, mma = _candidates(x2, kind, k)
    for cand in cands:
        call = lambda cand=cand: run(cand, x2, blocks, codes, scales, tab, kind, n, k, bias, y)  # noqa: E731
        try:
            call()
            if not _matches(y, ref):
                log.warning("q4 GEMV %s differs from Triton's by %g; not used", cand,
                            (y.float() - ref).abs().max().item())
                continue
            ms = _flushed_graph_ms(call)
        except RuntimeError as e:
            log.warning("q4 GEMV %s failed: %s", cand, e)
            continue
        if ms < best_ms:
            best, best_ms = cand, ms
    users = (blocks.data_ptr(), blocks.device)
    if best[0] in _LAYOUT_KINDS:
        _mma_users.add(users)
    elif mma and users not in _mma_users:  # its layout lost here and nowhere else: give its memory back
        triton_soa.forget(blocks, kind, (n, k), make=cuda_q4_mma.repack)
    return best
