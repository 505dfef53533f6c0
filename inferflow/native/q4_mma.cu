// Q4_0 GEMV/GEMM for 1-8 activation rows on tensor cores (mma.sync m16n8k16): the decode kernel for bf16/fp16
// activations. The weight is the A operand (16 output rows x 16 columns per mma), the activations the B operand
// (8 columns: rows 0..m-1 of x, the rest zero).
//
// Why: a float32 FMA decode costs ~4.5 instructions per weight (nibble, decode FMA, product FMA and shares of
// shifts, scales and conversions); at 4 TB/s of Q4_0 that is about what an H200's SMs can issue. Here a pair of
// weights costs one LOP3 (two nibbles into a 16-bit float pair: 0x4300 | q is the bf16 128 + q, 0x6400 | q the fp16
// 1024 + q), one HSUB2 (minus 136 or 1032: q - 8, exact), and a share of a shift; the products go to the tensor
// cores, and the block scale is applied to the float32 mma result of each 32-column block (FFMA per output).
// So the weights multiplied are exactly q - 8, the sums float32, the scale exact: the torch decoder's d * (q - 8)
// up to float32 summation order.
//
// Layout (cuda_q4_mma.repack): a tile is 16 rows x 64 columns (2 blocks of each row), 512 bytes of codes, lane
// l = 4 g + t holding word s (k-step s: columns 16 s .. 16 s + 15) with its A fragment's 8 codes: nibble 4 h + a is
// row g + 8 (a & 1), column 16 s + 2 t + h + 8 (a >> 1). Scales: per tile 8 x 4 fp16, lane group g's four being
// (row g, block 0), (row g, block 1), (row g + 8, block 0), (row g + 8, block 1).
// Codes [row tiles][column tiles][32 lanes] uint4, scales [row tiles][column tiles][8] uint2.
//
// Work: a block of W warps owns a row tile at a time (persistent over tiles; every block the same number), its
// warps splitting the column tiles, U of them per step, the next step's codes loaded before this step's mma; the
// warps' float32 partials are summed in a fixed order through shared memory. 12-16 warps per row tile are for
// the shapes with few row tiles (qkv, o, down: 256-384): with 8, their blocks left half of each SM's warp slots
// empty, and 16 took down from 18.0 to 14.0 us and o from 8.1 to 6.9 (M = 1, L2 flushed; docs/benchmarks.md).
//
// Why every block gets the same number of row tiles (ncu, gate/up 24576 x 4096, M = 1): with one block per
// resident slot, 1188 blocks for 1536 row tiles, the SMs sat idle for 28% of the kernel while a third of the
// blocks did their second tile; the balanced grid took the kernel from 31 to 24.5 us. Tried and dropped (docs/
// benchmarks.md): a cp.async ring keeping 3-7 steps of codes in flight (no faster), and activations staged in
// shared memory by the warps with the -8 folded into per-block activation sums (the staging pass cost more). What
// did pay, on Hopper: the bulk-copy engine filling a ring with the codes AND the activations (q4_mma_bulk.cuh,
// configs with S > 0), 4-5% on gate/up, down and the head; selection times both kinds per shape.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "q4_mma.cuh"
#include "q4_mma_bulk.cuh"
#include "q4_mma_tile.cuh"

namespace {

using inferflow_cuda::direct;
using inferflow_cuda::finish_tile;
using inferflow_cuda::load_stream;
using inferflow_cuda::Pair;
using inferflow_cuda::tile_mma;

// EVEN: the column tiles split into whole steps (kt a multiple of W U): no bounds checks in the loop.
template <typename T, int W, int U, bool EVEN>
__global__ void __launch_bounds__(W * 32) q4_mma(const T* __restrict__ x, const uint4* __restrict__ codes,
                                                 const uint2* __restrict__ scales, const T* __restrict__ bias,
                                                 T* __restrict__ y, int n, int kt, int m, long long sxm,
                                                 long long sym) {
  __shared__ float part[W][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rt = (n + 15) >> 4;                  // row tiles
  const int steps = (kt + W * U - 1) / (W * U);  // steps per row tile (every warp the same count)
  // in a register: (a & mask) | magic with two immediates is two LOP3s, with one a register it is one
  const uint32_t magic = kt >= 0 ? Pair<T>::magic : 0u;
  int tile = blockIdx.x, step = 0;
  if (tile >= rt) return;
  const T* xr = x + (g < m ? g : 0) * sxm;  // lane group g reads activation row g (rows >= m: zeros)

  uint4 q[U];
  uint2 sc[U];
  auto load = [&](int tl, int st, uint4 (&qq)[U], uint2 (&ss)[U]) {
    const int c0 = (st * W + warp) * U;
    const uint4* cp = codes + (static_cast<long long>(tl) * kt + c0) * 32 + lane;
    const uint2* sp = scales + (static_cast<long long>(tl) * kt + c0) * 8 + g;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (EVEN || c0 + u < kt) {
        qq[u] = load_stream(cp + u * 32);
        ss[u] = __ldg(sp + u * 8);
      } else {
        qq[u] = make_uint4(0u, 0u, 0u, 0u);
        ss[u] = make_uint2(0u, 0u);
      }
    }
  };
  load(tile, step, q, sc);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  while (true) {
    int ntile = tile, nstep = step + 1;
    if (nstep == steps) { nstep = 0; ntile += gridDim.x; }
    const bool more = ntile < rt;
    uint4 qn[U];
    uint2 sn[U];
    if (more) load(ntile, nstep, qn, sn);
    const int c0 = (step * W + warp) * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!EVEN && c0 + u >= kt) break;  // warp-uniform
      const int c = c0 + u;
      tile_mma<T>(q[u], sc[u], direct<T>(xr, g < m, c, t), magic, acc);
    }
    if (step == steps - 1) finish_tile<T, W>(part, acc, tile, warp, lane, bias, y, n, m, sym);
    if (!more) break;
#pragma unroll
    for (int u = 0; u < U; ++u) { q[u] = qn[u]; sc[u] = sn[u]; }
    tile = ntile;
    step = nstep;
  }
}

// S = 0: the register-pipelined kernel above; S > 0: the bulk-copy ring of S chunks (q4_mma_bulk.cuh, one copy
// warp more per block).
template <auto Kernel, int Threads, typename T>
cudaError_t start(const void* x, const void* codes, const void* scales, const void* bias, void* y, int n, int kt,
                  int m, long long sxm, long long sym, cudaStream_t stream, int smem = 0) {
  int blocks;
  if (smem == 0) {
    blocks = inferflow_cuda::balanced_blocks<Kernel>(Threads, (n + 15) / 16, 1);
  } else {  // dynamic shared memory: its size depends on m and K, so no cached occupancy
    cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    blocks = inferflow_cuda::balanced_blocks_for(Kernel, Threads, smem, (n + 15) / 16);
  }
  Kernel<<<blocks, Threads, smem, stream>>>(static_cast<const T*>(x), static_cast<const uint4*>(codes),
                                            static_cast<const uint2*>(scales), static_cast<const T*>(bias),
                                            static_cast<T*>(y), n, kt, m, sxm, sym);
  return cudaGetLastError();
}

// S = 0: the register-pipelined kernel above; S > 0: the bulk-copy ring of S chunks (q4_mma_bulk.cuh, one copy
// warp more per block), for activation rows 16-byte aligned (the copy engine's unit) that fit in shared memory
// with the ring; else the S = 0 kernel.
template <typename T, int W, int U, int S, bool EVEN>
cudaError_t pick(const void* x, const void* codes, const void* scales, const void* bias, void* y, int n, int kt,
                 int m, long long sxm, long long sym, cudaStream_t s) {
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && (m == 1 || sxm * sizeof(T) % 16 == 0);
  if constexpr (S > 0) {
    const int smem = inferflow_cuda::ring_bytes<W, U, S>() + m * kt * 64 * static_cast<int>(sizeof(T));
    if (aligned && smem <= 200 * 1024) {
      return start<inferflow_cuda::q4_mma_bulk<T, W, U, S, EVEN>, (W + 1) * 32, T>(x, codes, scales, bias, y, n,
                                                                                 kt, m, sxm, sym, s, smem);
    }
  }
  return start<q4_mma<T, W, U, EVEN>, W * 32, T>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
}

template <typename T, int W, int U, int S = 0>
cudaError_t launch(const void* x, const void* codes, const void* scales, const void* bias, void* y, int n, int kt,
                   int m, long long sxm, long long sym, cudaStream_t s) {
  return kt % (W * U) == 0 ? pick<T, W, U, S, true>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s)
                           : pick<T, W, U, S, false>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
}

template <typename T>
cudaError_t by_config(int cfg, const void* x, const void* codes, const void* scales, const void* bias, void* y,
                      int n, int kt, int m, long long sxm, long long sym, cudaStream_t s) {
  switch (cfg) {  // (W warps per row tile, U column tiles per warp step, S ring slots): cuda_q4_mma.CONFIGS
    case 0: return launch<T, 4, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 1: return launch<T, 4, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 2: return launch<T, 8, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 3: return launch<T, 8, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 4: return launch<T, 2, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 5: return launch<T, 16, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 6: return launch<T, 16, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 7: return launch<T, 12, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 8: return launch<T, 8, 2, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 9: return launch<T, 16, 1, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 10: return launch<T, 8, 1, 8>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 11: return launch<T, 4, 2, 8>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 12: return launch<T, 16, 2, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int q4_mma_configs() { return 13; }

// dtype: 1 bfloat16, 2 float16 (activations, bias, output); m: activation rows, 1..8; kt: column tiles (K / 64).
int q4_mma(int device, int dtype, int cfg, const void* x, const void* codes, const void* scales, const void* bias,
           void* y, int n, int kt, int m, long long sxm, long long sym, void* stream) {
  if (m < 1 || m > 8) return cudaErrorInvalidValue;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 1) return by_config<__nv_bfloat16>(cfg, x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
  if (dtype == 2) return by_config<__half>(cfg, x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
  return cudaErrorInvalidValue;
}

const char* q4_mma_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
