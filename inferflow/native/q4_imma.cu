// EXPERIMENT: Q4_0 GEMV for 1-8 activation rows on the integer tensor cores (mma.sync m16n8k32 s8.s8), with the
// activations quantized to int8 per 32-column block (llama.cpp's q8_1 arithmetic on its GPU path).
//
// Why: the bf16 tensor-core GEMV (q4_mma.cu) spends about 80 warp instructions per 16 x 64 tile, half of them
// turning codes into bf16 pairs (a shift, a LOP3 and an HSUB2 per pair), and ncu had its issue slots half busy.
// Here a code nibble sits in the high half of its byte as the two's complement of q - 8 (q ^ 8), so a byte masked
// out of the word is 16 (q - 8) as an int8, exactly: 8 weights cost one LOP3 plus a shift and a LOP3, no subtract,
// and one mma covers a whole 32-column block.
//
// Layout (the benchmark's repack): a tile is 16 rows x 64 columns; lane l = 4 g + t holds 4 words, word 2 s + h
// for k-step s (the tile's block s); byte e of that word: low nibble row g, high nibble row g + 8, both at column
// 32 s + 16 h + 4 t + e (the A fragment: a[2h] = the low nibbles shifted up, a[2h + 1] = the high nibbles). Scales
// as q4_mma.cu's. Activations: x8 int8 [m][K], dx float [m][K / 32] (the block's scale / 16).
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"

namespace {

using inferflow_cuda::load_stream;

__device__ __forceinline__ void imma(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

template <int W, int U>
__global__ void __launch_bounds__(W * 32) q4_imma(const int8_t* __restrict__ x8, const float* __restrict__ dx,
                                                  const uint4* __restrict__ codes, const uint2* __restrict__ scales,
                                                  float* __restrict__ y, int n, int kt, int m) {
  __shared__ float part[W][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rt = (n + 15) >> 4, k = kt * 64, steps = (kt + W * U - 1) / (W * U);
  const bool xrow = g < m;
  const int8_t* xr = x8 + (xrow ? g : 0) * k;
  // this lane's output columns (activation rows) 2t, 2t + 1: their block scales (zero past m)
  const float* d0 = dx + (2 * t < m ? 2 * t : 0) * (k / 32);
  const float* d1 = dx + (2 * t + 1 < m ? 2 * t + 1 : 0) * (k / 32);
  const bool c0ok = 2 * t < m, c1ok = 2 * t + 1 < m;
  int tile = blockIdx.x, step = 0;
  if (tile >= rt) return;
  uint4 q[U];
  uint2 sc[U];
  auto load = [&](int tl, int st, uint4 (&qq)[U], uint2 (&ss)[U]) {  // the step's codes, one step ahead
    const int cb = (st * W + warp) * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long at = static_cast<long long>(tl) * kt + cb + u;
      if (cb + u < kt) {
        qq[u] = load_stream(codes + at * 32 + lane);
        ss[u] = __ldg(scales + at * 8 + g);
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
    const int cb = (step * W + warp) * U;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = cb + u;
      if (c >= kt) break;
      const float2 dg = __half22float2(*reinterpret_cast<const __half2*>(&sc[u].x));   // row g: blocks 0, 1
      const float2 dg8 = __half22float2(*reinterpret_cast<const __half2*>(&sc[u].y));  // row g + 8
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const uint32_t w0 = s == 0 ? q[u].x : q[u].z, w1 = s == 0 ? q[u].y : q[u].w;
        const uint32_t a[4] = {(w0 << 4) & 0xF0F0F0F0u, w0 & 0xF0F0F0F0u, (w1 << 4) & 0xF0F0F0F0u,
                               w1 & 0xF0F0F0F0u};
        const int kk = c * 64 + 32 * s + 4 * t;
        const uint32_t b0 = xrow ? __ldg(reinterpret_cast<const uint32_t*>(xr + kk)) : 0u;
        const uint32_t b1 = xrow ? __ldg(reinterpret_cast<const uint32_t*>(xr + kk + 16)) : 0u;
        int ci[4];
        imma(ci, a, b0, b1);
        const int blk = 2 * c + s;
        const float x0 = c0ok ? __ldg(d0 + blk) : 0.f, x1 = c1ok ? __ldg(d1 + blk) : 0.f;
        const float wg = s == 0 ? dg.x : dg.y, wg8 = s == 0 ? dg8.x : dg8.y;
        acc[0] = __fmaf_rn(wg * x0, __int2float_rn(ci[0]), acc[0]);
        acc[1] = __fmaf_rn(wg * x1, __int2float_rn(ci[1]), acc[1]);
        acc[2] = __fmaf_rn(wg8 * x0, __int2float_rn(ci[2]), acc[2]);
        acc[3] = __fmaf_rn(wg8 * x1, __int2float_rn(ci[3]), acc[3]);
      }
    }
    if (step == steps - 1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
      __syncthreads();
      if (warp == 0) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < W; ++w)
#pragma unroll
          for (int i = 0; i < 4; ++i) v[i] += part[w][lane][i];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = tile * 16 + g + 8 * (i >> 1), col = 2 * t + (i & 1);
          if (col < m && row < n) y[static_cast<long long>(col) * n + row] = v[i];
        }
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = 0.f;
    }
    if (!more) break;
#pragma unroll
    for (int u = 0; u < U; ++u) { q[u] = qn[u]; sc[u] = sn[u]; }
    tile = ntile;
    step = nstep;
  }
}

template <int W, int U>
cudaError_t launch(const void* x8, const void* dx, const void* codes, const void* scales, void* y, int n, int kt,
                   int m, cudaStream_t s) {
  const int blocks = inferflow_cuda::balanced_blocks<q4_imma<W, U>>(W * 32, (n + 15) / 16, 1);
  q4_imma<W, U><<<blocks, W * 32, 0, s>>>(static_cast<const int8_t*>(x8), static_cast<const float*>(dx),
                                         static_cast<const uint4*>(codes), static_cast<const uint2*>(scales),
                                         static_cast<float*>(y), n, kt, m);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

int q4_imma_configs() { return 6; }

// (W, U) per config: (4, 2), (8, 2), (8, 1), (16, 1), (16, 2), (12, 1); y: float32 [m][n].
int q4_imma(int device, int cfg, const void* x8, const void* dx, const void* codes, const void* scales, void* y,
            int n, int kt, int m, void* stream) {
  if (m < 1 || m > 8) return cudaErrorInvalidValue;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (cfg) {
    case 0: return launch<4, 2>(x8, dx, codes, scales, y, n, kt, m, s);
    case 1: return launch<8, 2>(x8, dx, codes, scales, y, n, kt, m, s);
    case 2: return launch<8, 1>(x8, dx, codes, scales, y, n, kt, m, s);
    case 3: return launch<16, 1>(x8, dx, codes, scales, y, n, kt, m, s);
    case 4: return launch<16, 2>(x8, dx, codes, scales, y, n, kt, m, s);
    case 5: return launch<12, 1>(x8, dx, codes, scales, y, n, kt, m, s);
    default: return cudaErrorInvalidValue;
  }
}

const char* q4_imma_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
