// 4-bit GEMV for 1-2 activation rows (decode) over quant/triton_soa.py's interleaved layout: the CUDA twin of
// triton_q4.gemv4, with the same exact nibble decode (bit-identical weights) and float32 FMAs.
//
// Why CUDA C and not Triton: at M = 1 the Triton kernel read the Qwen3-8B-shaped weights at 0.9-1.6 TB/s of the
// H200's ~4.3, and an int8-activation variant with a fifth of the instructions was no faster: the kernel was bound
// by too few bytes in flight per SM. Here a warp issues all its 16-byte code and scale loads of a work item before
// it decodes anything, and the next item's while it decodes this one.
//
// Work split: each warp owns tiles of R output rows (see gemv4 below). Lane l takes 16 bytes (words 4t..4t+3,
// t = l % 8) of group 4 * step + l / 8 of each row, so a warp's load is 512 contiguous bytes of a row. Word j of
// group g holds column 256 g + 32 i + j in nibble i, so those 4 words need the activations at columns
// 256 g + 32 i + 4t + 0..3 for i = 0..7 (one 8- or 16-byte load each, shared by the R rows) and the scales of
// blocks 8 g + i (one 16-byte load per row). Each output is summed in a fixed order (a thread's FMAs, then a
// butterfly over the warp), so results do not depend on the batch or the launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"

namespace {

using inferflow_cuda::load_stream;
using inferflow_cuda::store;
using inferflow_cuda::to_float;
using inferflow_cuda::word;

template <typename T> __device__ __forceinline__ void load4(const T* p, bool ok, float (&v)[4]);

template <> __device__ __forceinline__ void load4<float>(const float* p, bool ok, float (&v)[4]) {
  float4 a = ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.f, 0.f, 0.f, 0.f);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}

template <> __device__ __forceinline__ void load4<__nv_bfloat16>(const __nv_bfloat16* p, bool ok, float (&v)[4]) {
  uint2 a = ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
  v[0] = __uint_as_float(a.x << 16); v[1] = __uint_as_float(a.x & 0xffff0000u);
  v[2] = __uint_as_float(a.y << 16); v[3] = __uint_as_float(a.y & 0xffff0000u);
}

template <> __device__ __forceinline__ void load4<__half>(const __half* p, bool ok, float (&v)[4]) {
  uint2 a = ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
  float2 lo = __half22float2(*reinterpret_cast<__half2*>(&a.x));
  float2 hi = __half22float2(*reinterpret_cast<__half2*>(&a.y));
  v[0] = lo.x; v[1] = lo.y; v[2] = hi.x; v[3] = hi.y;
}


__device__ __forceinline__ uint32_t half_at(const uint4& v, int i) {  // 16-bit scale i of 8
  return (word(v, i >> 1) >> (16 * (i & 1))) & 0xffffu;
}

// Nibble i of a word as the exact float 2^(23 - 4p) + q (p: the position it is moved to, see triton_q4._nibble):
// nibbles 0-1 from raw << 8, 2-4 in place, 5-7 from raw >> 12. Returns the bits; P(i) is the position.
__host__ __device__ constexpr int pos_of(int i) { return i < 2 ? i + 2 : i < 5 ? i : i - 3; }

// expo[p - 2]: the exponent bits of 2^(23 - 4p), held in registers (see gemv4).
template <int I> __device__ __forceinline__ float nibble(uint32_t raw, uint32_t lo, uint32_t hi,
                                                        const uint32_t (&expo)[3]) {
  constexpr int p = pos_of(I);
  constexpr uint32_t mask = 15u << (4 * p);
  const uint32_t src = I < 2 ? lo : I < 5 ? raw : hi;
  return __uint_as_float((src & mask) | expo[p - 2]);
}

// KIND 2 (q4_0): w = fma(f, d, -(base + 8) d), exact; KIND 0 (q4c): w = (f - (base + zc / 16)) * tab[c].
template <int KIND> struct Block {
  float a, b;
  __device__ __forceinline__ Block(uint32_t v, float base, const float* tab) {
    if (KIND == 2) {
      a = __half2float(__ushort_as_half(static_cast<unsigned short>(v)));
      b = -(base + 8.0f) * a;
    } else {
      a = __ldg(tab + (v & 255u));
      b = __fadd_rn(static_cast<float>((v >> 8) & 255u) * 0.0625f, base);
    }
  }
  __device__ __forceinline__ float weight(float f) const {
    return KIND == 2 ? __fmaf_rn(f, a, b) : __fmul_rn(__fsub_rn(f, b), a);
  }
};

// Persistent warps: warp w of the grid streams work items (tile, step), tile = w, w + warps, ...: R rows, step =
// 4 groups of each (lane l takes group 4 step + l / 8). The next item's codes and scales are loaded before this
// one is decoded, so every warp keeps R x 512 bytes of codes in flight from its first item to its last, across
// tile boundaries (a block-per-tile kernel drains its loads at every tile's end).
// EVEN: whole steps (groups a multiple of 4), no padding columns and whole tiles: no bounds checks.
template <typename T, int KIND, int R, int MP, bool EVEN>
__global__ void __launch_bounds__(128) gemv4(const T* __restrict__ x, const uint32_t* __restrict__ codes,
                                             const uint16_t* __restrict__ scales, const float* __restrict__ tab,
                                             const T* __restrict__ bias, T* __restrict__ y, int n, int k, int kw,
                                             long long sxm, long long sym) {
  const int lane = threadIdx.x & 31;
  const int nwarps = gridDim.x * (blockDim.x >> 5);
  const int t = lane & 7, gl = lane >> 3;
  const int ng = kw >> 5, steps = (ng + 3) >> 2, ntiles = (n + R - 1) / R;
  int tile = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), step = 0;
  if (tile >= ntiles) return;
  uint4 c[R], s[R];
  auto load = [&](int tl, int st, uint4 (&cc)[R], uint4 (&ss)[R]) {
    const int g = 4 * st + gl;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const long long row = EVEN ? tl * R + r : min(tl * R + r, n - 1);  // past n: row n - 1, never stored
      if (EVEN || g < ng) {
        cc[r] = load_stream(codes + row * kw + g * 32 + 4 * t);
        ss[r] = __ldg(reinterpret_cast<const uint4*>(scales + row * (kw >> 2) + g * 8));
      } else {
        cc[r] = make_uint4(0u, 0u, 0u, 0u);  // zero codes and scales decode to 0 * x, x read as 0
        ss[r] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  load(tile, step, c, s);
  // The exponents as run-time values: with two immediates (mask and exponent) one (a & b) | c is two LOP3s, with
  // the exponent in a register it is one (k >= 0 always; the compiler cannot know it)
  const uint32_t e0 = k >= 0 ? 150u << 23 : 0u;
  const uint32_t expo[3] = {e0 - (8u << 23), e0 - (12u << 23), e0 - (16u << 23)};
  float acc[MP][R];
#pragma unroll
  for (int m = 0; m < MP; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
  while (true) {
    int ntile = tile, nstep = step + 1;
    if (nstep == steps) { nstep = 0; ntile += nwarps; }
    const bool more = ntile < ntiles;
    uint4 cn[R], sn[R];
    if (more) load(ntile, nstep, cn, sn);
    const int g = 4 * step + gl;
    float xv[MP][8][4];
#pragma unroll
    for (int m = 0; m < MP; ++m)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int col = g * 256 + 32 * i + 4 * t;
        load4<T>(x + m * sxm + col, EVEN || col < k, xv[m][i]);
      }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t raw[4], lo[4], hi[4];
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) { raw[wd] = word(c[r], wd); lo[wd] = raw[wd] << 8; hi[wd] = raw[wd] >> 12; }
#define INFERFLOW_NIBBLE(I)                                                                            \
  {                                                                                                    \
    const Block<KIND> blk(half_at(s[r], I), static_cast<float>(1u << (23 - 4 * pos_of(I))), tab);       \
    _Pragma("unroll") for (int wd = 0; wd < 4; ++wd) {                                                 \
      const float w = blk.weight(nibble<I>(raw[wd], lo[wd], hi[wd], expo));                                  \
      _Pragma("unroll") for (int m = 0; m < MP; ++m) acc[m][r] = __fmaf_rn(w, xv[m][I][wd], acc[m][r]); \
    }                                                                                                  \
  }
      INFERFLOW_NIBBLE(0) INFERFLOW_NIBBLE(1) INFERFLOW_NIBBLE(2) INFERFLOW_NIBBLE(3)
      INFERFLOW_NIBBLE(4) INFERFLOW_NIBBLE(5) INFERFLOW_NIBBLE(6) INFERFLOW_NIBBLE(7)
#undef INFERFLOW_NIBBLE
    }
    if (step == steps - 1) {  // the tile's last step: a fixed butterfly over the warp, lane m R + r stores
#pragma unroll
      for (int m = 0; m < MP; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float v = acc[m][r];
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
          const int row = tile * R + r;
          if (lane == m * R + r && (EVEN || row < n)) {
            if (bias != nullptr) v += to_float(bias[row]);
            store(y + m * sym + row, v);
          }
          acc[m][r] = 0.f;
        }
    }
    if (!more) break;
#pragma unroll
    for (int r = 0; r < R; ++r) { c[r] = cn[r]; s[r] = sn[r]; }
    tile = ntile;
    step = nstep;
  }
}

template <typename T, int KIND, int R, int MP, bool EVEN>
void start(const void* x, const void* codes, const void* scales, const void* tab, const void* bias, void* y, int n,
           int k, int kw, long long sxm, long long sym, cudaStream_t stream) {
  const int blocks = inferflow_cuda::balanced_blocks<gemv4<T, KIND, R, MP, EVEN>>(128, (n + R - 1) / R, 4);
  gemv4<T, KIND, R, MP, EVEN><<<blocks, 128, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const uint32_t*>(codes), static_cast<const uint16_t*>(scales),
      static_cast<const float*>(tab), static_cast<const T*>(bias), static_cast<T*>(y), n, k, kw, sxm, sym);
}

template <typename T, int KIND, int R>
cudaError_t launch(int mp, const void* x, const void* codes, const void* scales, const void* tab, const void* bias,
                   void* y, int n, int k, int kw, long long sxm, long long sym, cudaStream_t s) {
  const bool even = (kw >> 5) % 4 == 0 && k == kw * 8 && n % R == 0;
  auto go = even ? (mp == 1 ? start<T, KIND, R, 1, true> : start<T, KIND, R, 2, true>)
                 : (mp == 1 ? start<T, KIND, R, 1, false> : start<T, KIND, R, 2, false>);
  go(x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
  return cudaGetLastError();
}

template <typename T, int KIND>
cudaError_t by_config(int cfg, int mp, const void* x, const void* codes, const void* scales, const void* tab,
                      const void* bias, void* y, int n, int k, int kw, long long sxm, long long sym, cudaStream_t s) {
  switch (cfg) {  // R rows per tile: the configs of cuda_q4.CONFIGS, in order
    case 0: return launch<T, KIND, 4>(mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    case 1: return launch<T, KIND, 2>(mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    case 2: return launch<T, KIND, 8>(mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    case 3: return launch<T, KIND, 1>(mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t by_kind(int kind, int cfg, int mp, const void* x, const void* codes, const void* scales, const void* tab,
                    const void* bias, void* y, int n, int k, int kw, long long sxm, long long sym, cudaStream_t s) {
  if (kind == 2) return by_config<T, 2>(cfg, mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
  if (kind == 0) return by_config<T, 0>(cfg, mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

int q4_gemv_configs() { return 4; }

// dtype: 0 float32, 1 bfloat16, 2 float16 (activations, bias and output); kind: triton_soa's code (0 q4c, 2 q4_0);
// mp: activation rows (1 or 2), sxm / sym their strides in elements. Returns the CUDA error of the launch (0: none).
int q4_gemv(int device, int dtype, int kind, int cfg, int mp, const void* x, const void* codes, const void* scales,
            const void* tab, const void* bias, void* y, int n, int k, int kw, long long sxm, long long sym,
            void* stream) {
  if (mp < 1 || mp > 2) return cudaErrorInvalidValue;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return by_kind<float>(kind, cfg, mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    case 1: return by_kind<__nv_bfloat16>(kind, cfg, mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    case 2: return by_kind<__half>(kind, cfg, mp, x, codes, scales, tab, bias, y, n, k, kw, sxm, sym, s);
    default: return cudaErrorInvalidValue;
  }
}

const char* q4_gemv_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
