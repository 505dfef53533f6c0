// The tensor-core GEMV (1-8 activation rows, q4_mma.cu's layout and decode) with its weight streamed into shared
// memory by the bulk-copy engine (Hopper's TMA, `cp.async.bulk`), S chunks ahead.
//
// Why: the register-pipelined kernel (q4_mma.cu) keeps one step of codes in flight per warp, so each warp waits
// out one DRAM latency per step. qkv and o (K = 4096) are 4 such steps per warp at 16 warps per row tile, down 6,
// and their times match 4-6 latencies plus the launch, not their bytes (docs/benchmarks.md). Here one copy warp
// per block issues whole chunks (the W U column tiles a step takes: 512 bytes of codes and 64 of scales each) into
// a ring of S slots, S - 1 chunks ahead of the W compute warps, across the block's row tiles without a drain in
// between; a chunk costs one instruction to issue, not one load per lane. The activation rows are copied in the
// same way, once per block, so the compute warps read codes, scales and activations from shared memory only:
// ncu had the register kernel's warps stalled on global loads ("long scoreboard") 5-8 cycles per instruction.
// Compute warps release a slot once they hold its codes, then run the same tile_mma as q4_mma.cu.
//
// Sync: per slot a `full` mbarrier (the copy warp's arrive with the chunk's byte count; the copies complete it)
// and an `empty` one (each compute warp arrives once it holds its codes in registers). The compute warps' own
// barrier for a row tile's sum is named barrier 1, since the copy warp finishes early and never joins.
#pragma once
#include "q4_mma_tile.cuh"

namespace inferflow_cuda {

__device__ __forceinline__ unsigned smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra WAIT;\n\t}" ::"r"(smem(b)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16, 16-byte aligned at both ends) global -> shared, completing on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem(dst)),
               "l"(src), "r"(bytes), "r"(smem(bar))
               : "memory");
}

// Shared memory of one block: the ring (S chunks of W U tiles: codes, then scales) and the m activation rows.
template <int W, int U, int S> __host__ __device__ constexpr int ring_bytes() { return S * W * U * (512 + 64); }

template <typename T, int W, int U, int S, bool EVEN>
__global__ void __launch_bounds__((W + 1) * 32) q4_mma_bulk(const T* __restrict__ x, const uint4* __restrict__ codes,
                                                            const uint2* __restrict__ scales,
                                                            const T* __restrict__ bias, T* __restrict__ y, int n,
                                                            int kt, int m, long long sxm, long long sym) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int CT = W * U;  // column tiles per chunk (one step of every compute warp)
  extern __shared__ __align__(128) unsigned char dyn[];
  uint4* ring_q = reinterpret_cast<uint4*>(dyn);                           // [S][CT * 32]
  uint2* ring_s = reinterpret_cast<uint2*>(dyn + S * CT * 512);            // [S][CT * 8]
  T* xs = reinterpret_cast<T*>(dyn + ring_bytes<W, U, S>());              // [m][K]
  __shared__ __align__(8) uint64_t full[S], empty[S], xbar;
  __shared__ float part[W][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rt = (n + 15) >> 4, k = kt * 64;
  const int steps = (kt + CT - 1) / CT;
  const int chunks = (rt - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x * steps;  // the grid <= rt
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], W);
    }
    mbar_init(&xbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
  }
  __syncthreads();
  if (warp == W) {  // the copy warp: one lane issues the activations, then every chunk of this block, in order
    if (lane == 0) {
      mbar_expect(&xbar, m * k * static_cast<int>(sizeof(T)));
      for (int r = 0; r < m; ++r) bulk_copy(xs + r * k, x + r * sxm, k * sizeof(T), &xbar);
      for (int i = 0; i < chunks; ++i) {
        const int s = i % S, tile = blockIdx.x + i / steps * gridDim.x, c0 = i % steps * CT;
        if (i >= S) mbar_wait(&empty[s], (i / S - 1) & 1);  // its slot's last chunk released by every warp
        const int tiles = EVEN ? CT : min(CT, kt - c0);
        const long long first = static_cast<long long>(tile) * kt + c0;
        mbar_expect(&full[s], tiles * (512 + 64));
        bulk_copy(ring_q + s * CT * 32, codes + first * 32, tiles * 512, &full[s]);
        bulk_copy(ring_s + s * CT * 8, scales + first * 8, tiles * 64, &full[s]);
      }
    }
    return;
  }
  const int g = lane >> 2, t = lane & 3;
  const uint32_t magic = kt >= 0 ? Pair<T>::magic : 0u;  // in a register: one LOP3 per pair (q4_mma.cu)
  const T* xr = xs + (g < m ? g : 0) * k;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mbar_wait(&xbar, 0);
  for (int i = 0; i < chunks; ++i) {
    const int s = i % S, step = i % steps, c0 = step * CT + warp * U;
    mbar_wait(&full[s], (i / S) & 1);
    uint4 q[U];
    uint2 sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      q[u] = ring_q[(s * CT + warp * U + u) * 32 + lane];
      sc[u] = ring_s[(s * CT + warp * U + u) * 8 + g];
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!EVEN && c0 + u >= kt) break;  // warp-uniform; the slot's words past the chunk were never read
      tile_mma<T>(q[u], sc[u], direct<T, true>(xr, g < m, c0 + u, t), magic, acc);
    }
    if (step == steps - 1)
      finish_tile<T, W, true>(part, acc, blockIdx.x + i / steps * gridDim.x, warp, lane, bias, y, n, m, sym);
  }
#else
  __trap();  // sm_90 and later only: the Python side offers these configs there alone
#endif
}

}  // namespace inferflow_cuda
