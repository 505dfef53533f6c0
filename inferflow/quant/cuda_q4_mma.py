"""Q4_0 weights in the tensor-core layout (``inferflow/native/q4_mma.cu``, which documents it) and the calls of its
kernels: the GEMV for 1-8 activation rows (``q4_mma.cu``), the GEMM for up to 64 (``q4_mma_rows.cu``) and, on
Hopper, the warpgroup-MMA GEMM for up to 256 (``q4_wgmma.cu``).

The layout is made once per weight on its device (``triton_soa.soa(..., make=repack)``: cached with the blocks,
freed with them): 4.5 bits per weight, as the blocks, rows padded to whole 16-row tiles.
"""
from __future__ import annotations

import ctypes

import torch

from ..native import cuda

# (W, U, S), q4_mma.cu's order: W warps per row tile, U column tiles per warp step; 12-16 warps: the shapes with
# few row tiles (qkv, o, down) fill the SMs. S = 0: codes prefetched one step ahead in registers; S > 0: a ring of
# S chunks in shared memory filled by the bulk-copy engine (q4_mma_bulk.cuh: sm_90 and later, see bulk_ok)
CONFIGS: tuple[tuple[int, int, int], ...] = (
    (4, 2, 0), (4, 4, 0), (8, 2, 0), (8, 1, 0), (2, 4, 0), (16, 1, 0), (16, 2, 0), (12, 1, 0),
    (8, 2, 4), (16, 1, 4), (8, 1, 8), (4, 2, 8), (16, 2, 2))
_DTYPE = {torch.bfloat16: 1, torch.float16: 2}
MAX_ROWS = 8
# (R, W, FOLD, MINB), q4_mma_rows.cu's order; FOLD: the block scale multiplied into the weights before the mma
# (rounded); MINB: blocks per SM the registers must allow (1: unbounded)
ROWS_CONFIGS: tuple[tuple[int, int, bool, int], ...] = (
    (1, 8, False, 1), (1, 4, False, 1), (2, 4, False, 1), (1, 8, True, 1), (1, 4, True, 1), (2, 4, True, 1),
    (1, 4, True, 5), (1, 4, True, 6), (1, 8, True, 3))
ROWS_MAX = 64
# (WG warpgroups per block, RW row sets of 64 per warpgroup, KS column tiles per ring slot, STAGES ring slots),
# q4_wgmma.cu's order: Hopper's warpgroup MMA, 1-256 rows (sm_90 only: its instructions are sm_90a's)
WG_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 1, 1, 6), (1, 2, 1, 6), (2, 1, 1, 4), (1, 1, 2, 4), (1, 1, 2, 3), (1, 2, 2, 3), (2, 1, 2, 3))
WG_MAX = 256
WORKSPACE_FLOATS = 1 << 22  # split-K partials of one call (16 MB); the kernel splits less where they would not fit
COUNTERS = 4096  # row groups a split call can have (more: no split)
_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
ARGTYPES = [_I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _LL, _LL, _P]  # q4_mma(): see q4_mma.cu
ROWS_ARGTYPES = [_I, _I, _I, _P, _P, _P, _P, _P, _P, _LL, _P, _I, _I, _I, _I, _LL, _LL, _P]  # q4_mma_rows(), q4_wgmma()
ROW_TILES_PER_PASS = 1024  # repack this many 16-row tiles at a time: bounded temporaries for a vocabulary head


def _lanes(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in the 16 x 64 tile of nibble j of word s of lane l: [32, 4, 8] each (see q4_mma.cu)."""
    lane = torch.arange(32).view(32, 1, 1)
    s = torch.arange(4).view(1, 4, 1)
    j = torch.arange(8).view(1, 1, 8)
    g, t, h, a = lane // 4, lane % 4, j // 4, j % 4
    row = g + 8 * (a & 1)
    col = 16 * s + 2 * t + h + 8 * (a >> 1)
    return row.expand(32, 4, 8).to(device), col.expand(32, 4, 8).to(device)


def repack(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [row tiles, column tiles, 32, 4], scales fp16 [row tiles, column tiles, 8, 4]) of Q4_0
    ``blocks`` (uint8 [N, K / 32 * 18])."""
    if kind != "q4_0":
        raise ValueError(f"the tensor-core layout takes q4_0 blocks, not {kind}")
    n, k = shape
    if k % 64:
        raise ValueError(f"the tensor-core layout needs K a multiple of 64, got {k}")
    g, kt, rt = k // 32, k // 64, -(-n // 16)
    b = blocks.reshape(n, g, 18)
    rows, cols = _lanes(blocks.device)
    codes = torch.empty(rt, kt, 32, 4, dtype=torch.int32, device=blocks.device)
    scales = torch.empty(rt, kt, 8, 4, dtype=torch.float16, device=blocks.device)
    for r0 in range(0, rt, ROW_TILES_PER_PASS):
        r1 = min(rt, r0 + ROW_TILES_PER_PASS)
        part = b[r0 * 16:r1 * 16]
        pad = (r1 - r0) * 16 - part.shape[0]
        if pad:  # zero codes and scales: rows past N add 0 and are never stored
            part = torch.cat([part, part.new_zeros(pad, g, 18)])
        d = part[:, :, :2].contiguous().view(torch.float16).reshape(r1 - r0, 2, 8, kt, 2)  # [tile, +8, g, kt, blk]
        scales[r0:r1] = d.permute(0, 3, 2, 1, 4).reshape(r1 - r0, kt, 8, 4)
        nib = part[:, :, 2:]
        q = torch.cat([nib & 15, nib >> 4], dim=-1).reshape(r1 - r0, 16, kt, 64).permute(0, 2, 1, 3)
        v = q[:, :, rows, cols]  # [tiles, kt, 32, 4, 8]: nibble j of each lane's word
        packed = (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous()  # byte i: nibbles 2i, 2i + 1
        codes[r0:r1] = packed.view(torch.int32).reshape(r1 - r0, kt, 32, 4)
    return codes, scales


def gemv_configs(device: torch.device) -> list[int]:
    """Indices into :data:`CONFIGS` that run on ``device``: the bulk-copy ones need sm_90 (Hopper) or later."""
    bulk = torch.cuda.get_device_capability(device) >= (9, 0)
    return [i for i, c in enumerate(CONFIGS) if bulk or c[2] == 0]


def supports(x2: torch.Tensor, kind: str, k: int) -> bool:
    """bf16/fp16 activations, 1..8 rows with 4-byte aligned pairs, Q4_0, K a multiple of 64."""
    return (kind == "q4_0" and x2.dtype in _DTYPE and 1 <= x2.shape[0] <= MAX_ROWS and k % 64 == 0
            and x2.stride(-1) == 1 and x2.data_ptr() % 4 == 0 and (x2.shape[0] == 1 or x2.stride(0) % 2 == 0))


def rows_supports(x2: torch.Tensor, kind: str, k: int, most: int = ROWS_MAX) -> bool:
    """The GEMMs' operands: bf16/fp16 activations, 1..``most`` rows starting 16 bytes apart (their cp.async copies),
    Q4_0, K a multiple of 64."""
    return (kind == "q4_0" and x2.dtype in _DTYPE and 1 <= x2.shape[0] <= most and k % 64 == 0
            and x2.stride(-1) == 1 and x2.data_ptr() % 16 == 0 and (x2.shape[0] == 1 or x2.stride(0) % 8 == 0))


def wg_supports(x2: torch.Tensor, kind: str, k: int) -> bool:
    """The warpgroup-MMA GEMM's operands: those of :func:`rows_supports` from :data:`MAX_ROWS` + 1 to
    :data:`WG_MAX` rows, on an sm_90 GPU. Fewer rows are the GEMVs': offered the GEMM too, batch-1 decode lost 1.5%
    (an A/B on an H200, docs/benchmarks.md)."""
    return (x2.device.type == "cuda" and x2.shape[0] > MAX_ROWS and rows_supports(x2, kind, k, WG_MAX)
            and torch.cuda.is_available() and torch.cuda.get_device_capability(x2.device) == (9, 0))


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GEMM's split-K partials and per-row-group counters on ``device``, made at its first eager call (None
    if that would be inside a CUDA-graph capture: the counters' zeros would only be a node of that graph). The
    kernel leaves the counters zero. One per device: a model's GEMMs run on one stream at a time."""
    if device not in _workspaces:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.inference_mode(False):
            _workspaces[device] = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                                   torch.zeros(COUNTERS, dtype=torch.int32, device=device))
    return _workspaces[device]


def gemm(lib: ctypes.CDLL, x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
         bias: torch.Tensor | None, cfg: int, out: torch.Tensor, name: str = "q4_mma_rows") -> torch.Tensor | None:
    """``out = x2 @ W^T (+ bias)`` [M, N] by the GEMM ``name`` (``q4_mma_rows`` or ``q4_wgmma``, the same
    arguments) with launch config ``cfg`` (an index into :data:`ROWS_CONFIGS` or :data:`WG_CONFIGS`); None where
    its workspace cannot be made now (see :func:`workspace`)."""
    space = workspace(x2.device)
    if space is None:
        return None
    ws, counters = space
    stream = torch.cuda.current_stream(x2.device).cuda_stream
    err = getattr(lib, name)(x2.device.index or 0, _DTYPE[x2.dtype], cfg, x2.data_ptr(), codes.data_ptr(),
                          scales.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                          ws.data_ptr(), ws.numel(), counters.data_ptr(), counters.numel(), n, codes.shape[1],
                          x2.shape[0], x2.stride(0), out.stride(0), ctypes.c_void_p(stream))
    cuda.check(lib, name, err)
    return out


def gemv(lib: ctypes.CDLL, x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, n: int,
         bias: torch.Tensor | None, cfg: int, out: torch.Tensor) -> torch.Tensor:
    """``out = x2 @ W^T (+ bias)`` [M, N] with launch config ``cfg`` (an index into :data:`CONFIGS`)."""
    stream = torch.cuda.current_stream(x2.device).cuda_stream
    err = lib.q4_mma(x2.device.index or 0, _DTYPE[x2.dtype], cfg, x2.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                     bias.data_ptr() if bias is not None else None, out.data_ptr(), n, codes.shape[1], x2.shape[0],
                     x2.stride(0), out.stride(0), ctypes.c_void_p(stream))
    cuda.check(lib, "q4_mma", err)
    return out
