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
// benchmarks.md): a cp.async ring keeping 3-7 steps of codes in flight (no faster: the SMs issue on 2 cycles of
// 3, bytes in flight were not the limit), and activations staged in shared memory with the -8 folded into
// per-block activation sums (18% fewer instructions per tile, but the per-block staging pass cost more).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "q4_mma.cuh"

namespace {

using inferflow_cuda::load_stream;
using inferflow_cuda::store;
using inferflow_cuda::to_float;
using inferflow_cuda::word;
using inferflow_cuda::fragment;
using inferflow_cuda::mma;
using inferflow_cuda::Pair;
using inferflow_cuda::tile_scales;

// The row tile's last step: the W warps' partials summed in a fixed order through shared memory, stored.
template <typename T, int W>
__device__ __forceinline__ void finish_tile(float (&part)[W][32][4], float (&acc)[4], int tile, int warp, int lane,
                                            const T* bias, T* y, int n, int m, long long sym) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
  __syncthreads();
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
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.f;
}

// A lane's activations of one tile: the B fragments of its 4 k-steps (b[2 s], b[2 s + 1]), read from global
// memory (L1-resident: every warp reads the same x).
struct Operands {
  uint32_t b[8];
};

template <typename T>
__device__ __forceinline__ Operands direct(const T* xr, bool xrow, int c, int t) {
  Operands op;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int k = c * 64 + 16 * s + 2 * t;
    op.b[2 * s] = xrow ? __ldg(reinterpret_cast<const uint32_t*>(xr + k)) : 0u;
    op.b[2 * s + 1] = xrow ? __ldg(reinterpret_cast<const uint32_t*>(xr + k + 8)) : 0u;
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

template <typename T, int W, int U, bool EVEN>
cudaError_t start(const void* x, const void* codes, const void* scales, const void* bias, void* y, int n, int kt,
                  int m, long long sxm, long long sym, cudaStream_t stream) {
  const int rt = (n + 15) / 16;
  const int blocks = inferflow_cuda::balanced_blocks<q4_mma<T, W, U, EVEN>>(W * 32, rt, 1);
  q4_mma<T, W, U, EVEN><<<blocks, W * 32, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const uint4*>(codes), static_cast<const uint2*>(scales),
      static_cast<const T*>(bias), static_cast<T*>(y), n, kt, m, sxm, sym);
  return cudaGetLastError();
}

template <typename T, int W, int U>
cudaError_t launch(const void* x, const void* codes, const void* scales, const void* bias, void* y, int n, int kt,
                   int m, long long sxm, long long sym, cudaStream_t s) {
  return kt % (W * U) == 0 ? start<T, W, U, true>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s)
                           : start<T, W, U, false>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
}

template <typename T>
cudaError_t by_config(int cfg, const void* x, const void* codes, const void* scales, const void* bias, void* y,
                      int n, int kt, int m, long long sxm, long long sym, cudaStream_t s) {
  switch (cfg) {  // (W warps per row tile, U column tiles per warp step): cuda_q4_mma.CONFIGS, in order
    case 0: return launch<T, 4, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 1: return launch<T, 4, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 2: return launch<T, 8, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 3: return launch<T, 8, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 4: return launch<T, 2, 4>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 5: return launch<T, 16, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 6: return launch<T, 16, 2>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    case 7: return launch<T, 12, 1>(x, codes, scales, bias, y, n, kt, m, sxm, sym, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int q4_mma_configs() { return 8; }

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
