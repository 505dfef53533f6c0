// Q4_0 GEMM for up to 64 activation rows on tensor cores (mma.sync m16n8k16): batched decode. The weight layout
// and the decode are the tensor-core GEMV's (q4_mma.cu, q4_mma.cuh); what differs is where the activations come
// from and how a block's warps share the work.
//
// Why another kernel: the GEMV gives each warp one 16-row tile and loads its B fragments (the activations) from
// global memory, 4 bytes per lane per row group. With 64 rows that is 14 bytes of activations per byte of weights,
// per warp, and the loads, not the weights, would set the pace. Here a block of W warps, R row tiles each (16 R W
// weight rows), stages each 64-column tile of the activations (rows padded to 8 NT, zeros past m) in shared memory
// once, with cp.async, STAGES - 1 column tiles ahead, together with its warps' codes and scales. A warp then
// decodes each A fragment once, uses it for NT mmas, and reads its B fragments with ldmatrix (the 16-byte chunks of
// a row swizzled by row & 7: the 8 rows of one 8x8 matrix hit 8 different banks).
//
// Sums: float32 per 32-column block, scaled by the block's fp16 d (exact, as the GEMV). Or, FOLD: d folded into
// the A fragment (one 16-bit multiply per pair of weights: d (q - 8) rounded to the activations' type, as Marlin
// and a dequantized weight do) and the mmas summing straight into the accumulators: at 64 rows the exact way costs
// 2 NT zeroings and FFMAs per row tile and block against NT mmas, which made the loop ALU-bound. Split K: where row groups
// are fewer than the resident blocks (o, down, qkv), blocks also split the column tiles S ways (gridDim.y). Their
// float32 partials go to a workspace; the block that finishes a row group last adds them up in split order (so the
// result does not depend on which block ran first), adds the bias, stores, and resets the group's counter to zero
// for the next call (a CUDA graph replays it as it is).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "q4_mma.cuh"
#include "q4_rows_finish.cuh"

namespace {

using inferflow_cuda::cp_async16;
using inferflow_cuda::cp_async_commit;
using inferflow_cuda::cp_async_wait;
using inferflow_cuda::each;
using inferflow_cuda::finish_rows;
using inferflow_cuda::fragment;
using inferflow_cuda::ldmatrix_x4;
using inferflow_cuda::mma;
using inferflow_cuda::mul2;
using inferflow_cuda::Pair;
using inferflow_cuda::scale_pair;
using inferflow_cuda::tile_scales;
using inferflow_cuda::word;

// One pipeline stage: a 64-column tile of 8 NT activation rows (row r's 16-byte chunk c at r * 8 + (c ^ (r & 7)))
// and the codes and scales of the block's W R row tiles at that column tile.
template <int NT, int TILES> struct Stage {
  uint4 x[8 * NT * 8];
  uint4 codes[TILES][32];
  uint2 scales[TILES][8];
};

// MINB: blocks per SM that the register allocation must allow (1: no bound; more trades spills for occupancy).
template <typename T, int NT, int R, int W, int STAGES, bool FOLD, int MINB>
__global__ void __launch_bounds__(W * 32, MINB) q4_mma_rows(const T* __restrict__ x, const uint4* __restrict__ codes,
                                                      const uint2* __restrict__ scales, const T* __restrict__ bias,
                                                      T* __restrict__ y, float* __restrict__ ws,
                                                      int* __restrict__ counters, int n, int kt, int m,
                                                      long long sxm, long long sym) {
  constexpr int MP = 8 * NT, TILES = W * R;
  __shared__ Stage<NT, TILES> st[STAGES];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int rt = (n + 15) >> 4, np = rt * 16;
  const int group = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int c0 = static_cast<int>(static_cast<long long>(kt) * split / splits);
  const int c1 = static_cast<int>(static_cast<long long>(kt) * (split + 1) / splits);
  const int tile0 = group * TILES + warp * R;  // this warp's first row tile
  const uint32_t magic = kt >= 0 ? Pair<T>::magic : 0u;  // in a register: one LOP3 per pair (see q4_mma.cu)

  // A thread's copies are the same at every column tile but for the column: sources and destinations computed
  // once (a stage is then ~2 instructions a copy; computed in the loop they were half of its instructions)
  constexpr int XCH = MP * 8, PER = (XCH + W * 32 - 1) / (W * 32);  // 16-byte chunks of a stage's activations
  const T* xsrc[PER];
  int xdst[PER];
  bool xok[PER];
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = threadIdx.x + p * W * 32, row = i >> 3, ch = i & 7;
    xok[p] = row < m;
    xsrc[p] = x + (xok[p] ? row * sxm : 0) + ch * 8;
    xdst[p] = row * 8 + (ch ^ (row & 7));
  }
  const uint4* csrc[R];
  const uint4* ssrc[R];
  bool cok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    cok[r] = tile0 + r < rt;
    const long long at = static_cast<long long>(cok[r] ? tile0 + r : 0) * kt;
    csrc[r] = codes + at * 32 + lane;
    ssrc[r] = reinterpret_cast<const uint4*>(scales + at * 8) + (lane & 3);
  }
  auto stage = [&](int c, int slot) {
    Stage<NT, TILES>& s = st[slot];
#pragma unroll
    for (int p = 0; p < PER; ++p)
      if (XCH % (W * 32) == 0 || threadIdx.x + p * W * 32 < XCH) cp_async16(&s.x[xdst[p]], xsrc[p] + c * 64, xok[p]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      cp_async16(&s.codes[warp * R + r][lane], csrc[r] + c * 32, cok[r]);
      if (lane < 4) cp_async16(reinterpret_cast<uint4*>(s.scales[warp * R + r]) + lane, ssrc[r] + c * 4, cok[r]);
    }
  };

  float acc[R][NT][4];
  each<R, NT>([&](int r, int j, int i) { acc[r][j][i] = 0.f; });

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (c0 + i < c1) stage(c0 + i, i);
    cp_async_commit();
  }
  for (int c = c0; c < c1; ++c) {
    const int slot = (c - c0) % STAGES;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // column tile c is in; every warp is done with the slot refilled next
    {
      const int nc = c + STAGES - 1;
      if (nc < c1) stage(nc, (nc - c0) % STAGES);
      cp_async_commit();
    }
    const Stage<NT, TILES>& s = st[slot];
    uint4 q[R];
    float2 d[R][2];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      q[r] = s.codes[warp * R + r][lane];
      tile_scales(s.scales[warp * R + r][g], d[r]);
    }
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {  // the two 32-column blocks: k-steps 2 blk, 2 blk + 1
      // n-tile j's B fragments: b0, b1 of k-step 2 blk, then of 2 blk + 1
      auto load_b = [&](int j, uint32_t (&bj)[4]) {
        const int row = 8 * j + (lane & 7), ch = 4 * blk + (lane >> 3);
        ldmatrix_x4(bj, &s.x[row * 8 + (ch ^ (row & 7))]);
      };
      if constexpr (FOLD) {
        // both k-steps' A fragments first, then one n-tile at a time: 4 B registers live, not 4 NT (at NT = 8
        // the kernel's registers, with shared memory, held it to 4 blocks per SM)
        uint32_t a[R][2][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t dg = scale_pair<T>(blk == 0 ? d[r][0].x : d[r][0].y);  // rows g (a0, a2), g + 8 (a1, a3)
          const uint32_t dg8 = scale_pair<T>(blk == 0 ? d[r][1].x : d[r][1].y);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            fragment<T>(word(q[r], 2 * blk + h), magic, a[r][h]);
            a[r][h][0] = mul2<T>(a[r][h][0], dg);
            a[r][h][1] = mul2<T>(a[r][h][1], dg8);
            a[r][h][2] = mul2<T>(a[r][h][2], dg);
            a[r][h][3] = mul2<T>(a[r][h][3], dg8);
          }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          uint32_t bj[4];
          load_b(j, bj);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) mma<T>(acc[r][j], a[r][h], bj[2 * h], bj[2 * h + 1]);
        }
      } else {
        uint32_t b[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) load_b(j, b[j]);
        float part[R][NT][4];
        each<R, NT>([&](int r, int j, int i) { part[r][j][i] = 0.f; });
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            uint32_t a[4];
            fragment<T>(word(q[r], 2 * blk + h), magic, a);
#pragma unroll
            for (int j = 0; j < NT; ++j) mma<T>(part[r][j], a, b[j][2 * h], b[j][2 * h + 1]);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const float dg = blk == 0 ? d[r][0].x : d[r][0].y, dg8 = blk == 0 ? d[r][1].x : d[r][1].y;
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            acc[r][j][0] = __fmaf_rn(dg, part[r][j][0], acc[r][j][0]);
            acc[r][j][1] = __fmaf_rn(dg, part[r][j][1], acc[r][j][1]);
            acc[r][j][2] = __fmaf_rn(dg8, part[r][j][2], acc[r][j][2]);
            acc[r][j][3] = __fmaf_rn(dg8, part[r][j][3], acc[r][j][3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  finish_rows<T, R, NT>(acc, tile0, lane, bias, y, ws, counters, &last, group, split, splits, n, np, m, sym);
}

// The grid: one block per row group, times S splits of the column tiles so that the blocks fill the resident
// slots (at most one split per 16 column tiles, and only as many as the workspace and the counters hold).
template <typename T, int NT, int R, int W, bool FOLD, int MINB>
cudaError_t start(const void* x, const void* codes, const void* scales, const void* bias, void* y, float* ws,
                  long long ws_floats, int* counters, int counter_slots, int n, int kt, int m, long long sxm,
                  long long sym, cudaStream_t stream) {
  constexpr int STAGES = NT >= 8 ? 3 : 4;  // 12.5 KB a stage at NT = 8, W R = 8: 37.5 KB of shared memory
  constexpr auto kernel = q4_mma_rows<T, NT, R, W, STAGES, FOLD, MINB>;
  const int rt = (n + 15) / 16, groups = (rt + W * R - 1) / (W * R);
  const int slots = inferflow_cuda::resident_blocks<kernel>(W * 32);
  const int splits = inferflow_cuda::rows_splits(slots, groups, kt, static_cast<long long>(m) * rt * 16, ws_floats,
                                                 counter_slots);
  kernel<<<dim3(groups, splits), W * 32, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const uint4*>(codes), static_cast<const uint2*>(scales),
      static_cast<const T*>(bias), static_cast<T*>(y), ws, counters, n, kt, m, sxm, sym);
  return cudaGetLastError();
}

template <typename T, int R, int W, bool FOLD, int MINB = 1>
cudaError_t by_rows(const void* x, const void* codes, const void* scales, const void* bias, void* y, float* ws,
                    long long wsf, int* cnt, int slots, int n, int kt, int m, long long sxm, long long sym,
                    cudaStream_t s) {
  if (m <= 16) return start<T, 2, R, W, FOLD, MINB>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
  if (m <= 32) return start<T, 4, R, W, FOLD, MINB>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
  return start<T, 8, R, W, FOLD, MINB>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
}

template <typename T>
cudaError_t by_config(int cfg, const void* x, const void* codes, const void* scales, const void* bias, void* y,
                      float* ws, long long wsf, int* cnt, int slots, int n, int kt, int m, long long sxm,
                      long long sym, cudaStream_t s) {
  switch (cfg) {  // (R row tiles per warp, W warps per block, FOLD, MINB): cuda_q4_mma.ROWS_CONFIGS, in order
    case 0: return by_rows<T, 1, 8, false>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 1: return by_rows<T, 1, 4, false>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 2: return by_rows<T, 2, 4, false>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 3: return by_rows<T, 1, 8, true>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 4: return by_rows<T, 1, 4, true>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 5: return by_rows<T, 2, 4, true>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 6: return by_rows<T, 1, 4, true, 5>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 7: return by_rows<T, 1, 4, true, 6>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    case 8: return by_rows<T, 1, 8, true, 3>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int q4_mma_rows_configs() { return 9; }

// dtype: 1 bfloat16, 2 float16; m: activation rows, 1..64; kt: column tiles (K / 64); x: 16-byte aligned rows.
// ws: float32 workspace of ws_floats, counters: counter_slots ints, zero (the kernel leaves them zero).
int q4_mma_rows(int device, int dtype, int cfg, const void* x, const void* codes, const void* scales,
                const void* bias, void* y, float* ws, long long ws_floats, int* counters, int counter_slots, int n,
                int kt, int m, long long sxm, long long sym, void* stream) {
  if (m < 1 || m > 64) return cudaErrorInvalidValue;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 1)
    return by_config<__nv_bfloat16>(cfg, x, codes, scales, bias, y, ws, ws_floats, counters, counter_slots, n, kt,
                                    m, sxm, sym, s);
  if (dtype == 2)
    return by_config<__half>(cfg, x, codes, scales, bias, y, ws, ws_floats, counters, counter_slots, n, kt, m, sxm,
                             sym, s);
  return cudaErrorInvalidValue;
}

const char* q4_mma_rows_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
