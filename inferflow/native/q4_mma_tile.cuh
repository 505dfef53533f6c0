// The tensor-core GEMV's per-tile pieces (q4_mma.cu's kernels, 1-8 activation rows): a 16 x 64 tile's products
// with activations read straight from global memory, and a row tile's last step. The layout is documented in
// q4_mma.cu.
#pragma once
#include "cuda_common.cuh"
#include "q4_mma.cuh"

namespace inferflow_cuda {

// The W compute warps' barrier: the whole block, or (NAMED) barrier 1 of those W warps only, where the block has
// a copy warp that never joins (q4_mma_bulk.cuh).
template <int W, bool NAMED> __device__ __forceinline__ void warps_sync() {
  if constexpr (NAMED) asm volatile("bar.sync 1, %0;" ::"n"(W * 32) : "memory"); else __syncthreads();
}

// The row tile's last step: the W warps' partials summed in a fixed order through shared memory, stored.
template <typename T, int W, bool NAMED = false>
__device__ __forceinline__ void finish_tile(float (&part)[W][32][4], float (&acc)[4], int tile, int warp, int lane,
                                            const T* bias, T* y, int n, int m, long long sym) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
  warps_sync<W, NAMED>();
  if (warp == 0) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int w = 0; w < W; ++w)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] += part[w][lane][i];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // c0, c1: row g, columns (x rows) 2t, 2t + 1; c2, c3: row g + 8
      const int row = tile * 16 + g + 8 * (i >> 1), col = 2 * t + (i & 1);
      if (col < m && row < n) {
        float o = v[i];
        if (bias != nullptr) o += to_float(bias[row]);
        store(y + col * sym + row, o);
      }
    }
  }
  warps_sync<W, NAMED>();
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.f;
}

// A lane's activations of one tile: the B fragments of its 4 k-steps (b[2 s], b[2 s + 1]).
struct Operands {
  uint32_t b[8];
};

// From global memory (L1-resident: every warp reads the same x), or (STAGED) from the block's copy of the rows in
// shared memory (q4_mma_bulk.cuh); xr: activation row g (of either).
template <bool STAGED> __device__ __forceinline__ uint32_t x_word(const uint32_t* p) {
  if constexpr (STAGED) return *p; else return __ldg(p);
}

template <typename T, bool STAGED = false>
__device__ __forceinline__ Operands direct(const T* xr, bool xrow, int c, int t) {
  Operands op;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int k = c * 64 + 16 * s + 2 * t;
    op.b[2 * s] = xrow ? x_word<STAGED>(reinterpret_cast<const uint32_t*>(xr + k)) : 0u;
    op.b[2 * s + 1] = xrow ? x_word<STAGED>(reinterpret_cast<const uint32_t*>(xr + k + 8)) : 0u;
  }
  return op;
}

// One 16 x 64 tile's products: codes q (this lane's A fragments of its 4 k-steps), scales sc (lane group g's) and
// the lane's operands; adds the scaled float32 block sums to acc (the mma's C layout).
template <typename T>
__device__ __forceinline__ void tile_mma(const uint4& q, const uint2& sc, const Operands& op, uint32_t magic,
                                         float (&acc)[4]) {
  float2 d[2];
  tile_scales(sc, d);
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {  // the tile's two 32-column blocks, two k-steps each
    float part4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 2 * blk; s < 2 * blk + 2; ++s) {
      uint32_t a[4];
      fragment<T>(word(q, s), magic, a);
      mma<T>(part4, a, op.b[2 * s], op.b[2 * s + 1]);
    }
    const float dg = blk == 0 ? d[0].x : d[0].y, dg8 = blk == 0 ? d[1].x : d[1].y;
    acc[0] = __fmaf_rn(dg, part4[0], acc[0]);
    acc[1] = __fmaf_rn(dg, part4[1], acc[1]);
    acc[2] = __fmaf_rn(dg8, part4[2], acc[2]);
    acc[3] = __fmaf_rn(dg8, part4[3], acc[3]);
  }
}

}  // namespace inferflow_cuda
