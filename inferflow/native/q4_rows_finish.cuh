// The 4-bit GEMMs' last step (q4_mma_rows.cu, q4_wgmma.cu): a block's float32 sums of R row tiles x 8 NT
// activation rows stored, or, where blocks split K, added up in split order first, and how many splits a grid gets.
#pragma once
#include "cuda_common.cuh"

namespace inferflow_cuda {

// f(r, j, i) for every accumulator of a warp: row tile r, n-tile j, C-fragment element i (unrolled).
template <int R, int NT, typename F> __device__ __forceinline__ void each(F f) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) f(r, j, i);
}

// acc[r][j][i]: weight row (tile0 + r) * 16 + g + 8 (i >> 1), activation row 8 j + 2 t + (i & 1). Split K
// (splits > 1): the float32 partials go to the workspace `ws`; the block that finishes row group `group` last adds
// them up in split order (so the result does not depend on which block ran first), adds the bias, stores, and
// resets the group's counter to zero for the next call (a CUDA graph replays it as it is). `last`: a shared int;
// np: the rows padded to whole tiles (the workspace's row stride).
template <typename T, int R, int NT>
__device__ __forceinline__ void finish_rows(float (&acc)[R][NT][4], int tile0, int lane, const T* __restrict__ bias,
                                            T* __restrict__ y, float* __restrict__ ws, int* __restrict__ counters,
                                            int* last, int group, int split, int splits, int n, int np, int m,
                                            long long sym) {
  const int g = lane >> 2, t = lane & 3;
  if (splits > 1) {
    float* mine = ws + static_cast<long long>(split) * m * np;
    each<R, NT>([&](int r, int j, int i) {
      const int row = (tile0 + r) * 16 + g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
      if (col < m && row < n) mine[static_cast<long long>(col) * np + row] = acc[r][j][i];
    });
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *last = atomicAdd(&counters[group], 1) == splits - 1;
    __syncthreads();
    if (!*last) return;
    __threadfence();
    // every split's partial, in split order (this block's own included); split by split, so that a split's
    // loads are all in flight at once (one load after another, this block took most of the kernel's time)
    each<R, NT>([&](int r, int j, int i) { acc[r][j][i] = 0.f; });
    for (int sp = 0; sp < splits; ++sp) {
      const float* part = ws + static_cast<long long>(sp) * m * np;
      int base = 2 * t * np + tile0 * 16 + g;  // entry (r, j, i) at base + (8 j + (i & 1)) np + 16 r + 8 (i >> 1)
      // opaque to the compiler: the 4 R NT entry offsets are recomputed per split, not held in registers through
      // the whole kernel (that took the main loop from 110 to 174 registers)
      asm volatile("" : "+r"(base));
      each<R, NT>([&](int r, int j, int i) {
        const int row = (tile0 + r) * 16 + g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
        if (col < m && row < n) acc[r][j][i] += __ldcg(part + base + (8 * j + (i & 1)) * np + 16 * r + 8 * (i >> 1));
      });
    }
  }
  // the store as a plain loop: as a lambda (an early return per element) it compiled to other SASS than the
  // kernel that was measured
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = (tile0 + r) * 16 + g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
        if (col >= m || row >= n) continue;
        float o = acc[r][j][i];
        if (bias != nullptr) o += to_float(bias[row]);
        store(y + col * sym + row, o);
      }
  if (splits > 1 && threadIdx.x == 0) counters[group] = 0;
}

// Splits of the column tiles for `groups` row groups so that the blocks fill `slots` resident slots: at most one
// per 16 column tiles, only as many as the workspace (`ws_floats`, `per_split` floats each) and the counters hold.
inline int rows_splits(int slots, int groups, int kt, long long per_split, long long ws_floats, int counter_slots) {
  int splits = (slots + groups / 2) / groups;
  if (splits > kt / 16) splits = kt / 16;
  if (splits * per_split > ws_floats) splits = static_cast<int>(ws_floats / per_split);
  if (groups > counter_slots || splits < 1) splits = 1;
  return splits;
}

}  // namespace inferflow_cuda
