// A chain of 4-bit tensor-core GEMVs (1-2 activation rows) in one persistent kernel: a decode layer's
// o -> (+ residual, RMSNorm) -> gate|up -> (SiLU * up) -> down -> (+ residual, RMSNorm) -> next layer's qkv.
//
// Why: at batch 1 each of a layer's four GEMVs reads 9-57 MB, and a lone kernel reading that little reaches
// only 1.8-2.4 TB/s of the H200's ~4 TB/s (docs/benchmarks.md: the read-only ceiling): DRAM idles while a kernel
// ramps up, drains its last wave and the next launches, and the norms and the SwiGLU product between them are
// kernels of their own. Here one copy warp per block streams the weights of every stage, one after another,
// through the bulk-copy ring of q4_mma_bulk.cuh, and never waits for the activations: weights do not depend on
// them. So while the compute warps wait at the grid barrier between two stages (the next stage needs all of this
// one's outputs), the ring is already filling with the next stage's weight. Each stage starts with a prologue the
// compute warps run from the previous stage's outputs (L2-coherent loads): a copy, the residual add + RMSNorm of
// fuse_add_norm.py, or fused_ops.silu_mul, with those kernels' float32 math and roundings; block 0 also stores
// the sums and norms, so every tensor the unfused steps would return exists.
//
// The grid is the resident blocks (a cooperative launch: the barrier needs them all on the GPU at once). The
// barrier counter counts arrivals over the whole kernel; the last block to finish resets both counters for the
// next launch (a CUDA-graph replay).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "q4_mma_bulk.cuh"

namespace {

using namespace inferflow_cuda;

constexpr int MAX_STAGES = 6;
constexpr int MAX_ROWS = 2;
enum Prologue : int { COPY = 0, ADD_NORM = 1, SILU_MUL = 2 };

// One GEMV of the chain and the prologue that makes its input (q4_chain.py builds these; rows of every tensor
// are contiguous, row r of `in` at in + r * sin).
struct Stage {
  const uint4* codes;     // the weight in q4_mma.cu's tile layout
  const uint2* scales;
  const void* bias;       // [n] or null
  void* y;                // [m, n]
  const void* in;         // COPY: the input; ADD_NORM: the branch added to the residual; SILU_MUL: gate | up
  const void* resid;      // ADD_NORM: the residual [m, K], or null: the block's sum of the previous ADD_NORM
  void* resid_out;        // ADD_NORM: the sum [m, K] (block 0 stores it), or null
  void* norm_out;         // ADD_NORM: the norm [m, K] (block 0 stores it), or null
  const void* norm_w;     // ADD_NORM: the RMSNorm weight [K]
  long long sin, sres;    // row strides of in and resid, elements
  int n, kt, kind, weight_in_float;
  float eps, offset;
};
struct Chain {
  Stage st[MAX_STAGES];
  int count;
};

template <typename T> struct Two;
template <> struct Two<__nv_bfloat16> {
  using P = __nv_bfloat162;
  static __device__ __forceinline__ float2 f(P v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ P r(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <> struct Two<__half> {
  using P = __half2;
  static __device__ __forceinline__ float2 f(P v) { return __half22float2(v); }
  static __device__ __forceinline__ P r(float a, float b) { return __floats2half2_rn(a, b); }
};

// 8 values of T in 16 bytes, as float32, and back (rounded to T).
template <typename T> __device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const typename Two<T>::P* p = reinterpret_cast<const typename Two<T>::P*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = Two<T>::f(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
template <typename T> __device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  typename Two<T>::P* p = reinterpret_cast<typename Two<T>::P*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = Two<T>::r(f[2 * i], f[2 * i + 1]);
  return v;
}
template <typename T> __device__ __forceinline__ void round8(float (&f)[8]) {  // each value rounded to T
  float r[8];
  unpack8<T>(pack8<T>(f), r);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = r[i];
}

// The sum over the W compute warps' threads, the same in every thread (fixed order).
template <int W> __device__ __forceinline__ float block_sum(float v, float* red, int warp, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) red[warp] = v;
  warps_sync<W, true>();
  float s = 0.f;
  for (int w = 0; w < W; ++w) s += red[w];
  warps_sync<W, true>();
  return s;
}

// The stage's input rows into xs, 16 bytes per thread and step (K is a multiple of 64), up to VB steps' loads in
// flight at once: the inputs were written by other blocks just before (L2-coherent loads), and one L2 round trip
// per step would leave the stage waiting several microseconds. rs: the block's residual sum [m][K] (ADD_NORM).
template <typename T, int W>
__device__ void prologue(const Stage& st, int m, uint4* xs, uint4* rs, float* red, int warp, int lane) {
  constexpr int NT = W * 32, VB = 2;
  const int tid = threadIdx.x, nv = st.kt * 8;  // 16-byte vectors per row
  const bool lead = blockIdx.x == 0;
  for (int r = 0; r < m; ++r) {
    uint4* x = xs + r * nv;
    const uint4* in = reinterpret_cast<const uint4*>(st.in) + r * st.sin / 8;
    if (st.kind == COPY) {
      for (int b = 0; b < nv; b += VB * NT) {
        uint4 v[VB];
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) v[u] = __ldcg(in + b + u * NT + tid);
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) x[b + u * NT + tid] = v[u];
      }
    } else if (st.kind == SILU_MUL) {  // fused_ops.silu_mul: silu(g) rounded, times u, rounded
      for (int b = 0; b < nv; b += VB * NT) {
        uint4 gv[VB], uv[VB];
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) {
            gv[u] = __ldcg(in + b + u * NT + tid);
            uv[u] = __ldcg(in + nv + b + u * NT + tid);
          }
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) {
            float g[8], up[8];
            unpack8<T>(gv[u], g);
            unpack8<T>(uv[u], up);
#pragma unroll
            for (int e = 0; e < 8; ++e) g[e] = g[e] / (1.f + expf(-g[e]));
            round8<T>(g);
#pragma unroll
            for (int e = 0; e < 8; ++e) g[e] *= up[e];
            x[b + u * NT + tid] = pack8<T>(g);
          }
      }
    } else {  // fuse_add_norm.add_rmsnorm: s = a + b rounded; rms_apply(s)
      uint4* s = rs + r * nv;
      const uint4* res = reinterpret_cast<const uint4*>(st.resid) + r * st.sres / 8;
      float ss = 0.f;
      for (int b = 0; b < nv; b += VB * NT) {
        uint4 av[VB], bv[VB];
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) {
            av[u] = st.resid != nullptr ? __ldcg(res + b + u * NT + tid) : s[b + u * NT + tid];
            bv[u] = __ldcg(in + b + u * NT + tid);
          }
#pragma unroll
        for (int u = 0; u < VB; ++u)
          if (b + u * NT + tid < nv) {
            float a[8], c[8];
            unpack8<T>(av[u], a);
            unpack8<T>(bv[u], c);
#pragma unroll
            for (int e = 0; e < 8; ++e) a[e] += c[e];
            round8<T>(a);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = __fmaf_rn(a[e], a[e], ss);
            s[b + u * NT + tid] = pack8<T>(a);
          }
      }
      const float rstd = 1.f / sqrtf(block_sum<W>(ss, red, warp, lane) / (st.kt * 64) + st.eps);
      const uint4* w = reinterpret_cast<const uint4*>(st.norm_w);
      uint4* so = reinterpret_cast<uint4*>(st.resid_out) + r * nv;
      uint4* no = reinterpret_cast<uint4*>(st.norm_out) + r * nv;
      for (int i = tid; i < nv; i += NT) {
        float f[8], wv[8], y[8];
        unpack8<T>(s[i], f);
        unpack8<T>(__ldg(w + i), wv);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] *= rstd;
        if (st.weight_in_float) {
#pragma unroll
          for (int e = 0; e < 8; ++e) y[e] = f[e] * (wv[e] + st.offset);
        } else {  // torch: w.to(dtype) * h.to(dtype)
          if (st.offset != 0.f) {
#pragma unroll
            for (int e = 0; e < 8; ++e) wv[e] += st.offset;
            round8<T>(wv);
          }
          round8<T>(f);
#pragma unroll
          for (int e = 0; e < 8; ++e) y[e] = wv[e] * f[e];
        }
        const uint4 yv = pack8<T>(y);
        x[i] = yv;
        if (lead) {
          if (st.resid_out != nullptr) so[i] = s[i];
          if (st.norm_out != nullptr) no[i] = yv;
        }
      }
    }
  }
  warps_sync<W, true>();
}

// FOLD: tile_mma (q4_mma_tile.cuh) without the HSUB2 per weight pair: the A fragment is base + q, exact in T,
// and each 32-column block's sum is corrected by base8 times the block's activation sum (xsum of the lane's two
// activation rows, staged by the prologue). One instruction per weight pair fewer on the path that bounds a
// batch-1 GEMV's issue rate; the float32 sums then cancel ~base8 x |x| terms (bf16: ~7 of float32's 24 bits).
template <typename T>
__device__ __forceinline__ void tile_mma_fold(const uint4& q, const uint2& sc, const Operands& op, uint32_t magic,
                                              const float (&xsum)[2][2], float (&acc)[4]) {
  float2 d[2];
  tile_scales(sc, d);
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    float part4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 2 * blk; s < 2 * blk + 2; ++s) {
      const uint32_t w = word(q, s);
      const uint32_t a[4] = {(w & 0x000F000Fu) | magic, (w >> 4 & 0x000F000Fu) | magic,
                             (w >> 8 & 0x000F000Fu) | magic, (w >> 12 & 0x000F000Fu) | magic};
      mma<T>(part4, a, op.b[2 * s], op.b[2 * s + 1]);
    }
    const float dg = blk == 0 ? d[0].x : d[0].y, dg8 = blk == 0 ? d[1].x : d[1].y;
    const float b0 = Pair<T>::base8 * xsum[0][blk], b1 = Pair<T>::base8 * xsum[1][blk];
    acc[0] = __fmaf_rn(dg, part4[0] - b0, acc[0]);
    acc[1] = __fmaf_rn(dg, part4[1] - b1, acc[1]);
    acc[2] = __fmaf_rn(dg8, part4[2] - b0, acc[2]);
    acc[3] = __fmaf_rn(dg8, part4[3] - b1, acc[3]);
  }
}

// FOLD: each 32-column block's sum of the staged activations, float32 [m][K / 32].
template <int W> __device__ __forceinline__ void block_sums(const uint4* xs, float* xsum, int m, int nv, bool bf16) {
  for (int i = threadIdx.x; i < m * nv / 4; i += W * 32) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint4 x = xs[i * 4 + v];
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 f;
        if (bf16) f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
        else f = __half22float2(*reinterpret_cast<const __half2*>(&w[e]));
        s += f.x + f.y;
      }
    }
    xsum[i] = s;
  }
  warps_sync<W, true>();
}

__device__ __forceinline__ unsigned long long now() {  // ns (a diagnostic trace)
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block's compute warps past their stores of this stage: `arrivals` more arrivals than before.
template <int W> __device__ __forceinline__ void grid_barrier(unsigned* count, unsigned arrivals) {
  warps_sync<W, true>();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    while (load_acquire(count) < arrivals) __nanosleep(32);
  }
  warps_sync<W, true>();
}

template <typename T, int W, int U, int S, bool FOLD, int MINB, int MODE>
__global__ void __launch_bounds__((W + 1) * 32, MINB) q4_chain(const __grid_constant__ Chain chain, int m, int xs_off,
                                                         int rs_off, int sum_off, unsigned* sync,
                                                         unsigned long long* trace) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int CT = W * U;
  extern __shared__ __align__(128) unsigned char dyn[];
  uint4* ring_q = reinterpret_cast<uint4*>(dyn);                 // [S][CT * 32]
  uint2* ring_s = reinterpret_cast<uint2*>(dyn + S * CT * 512);  // [S][CT * 8]
  uint4* xs = reinterpret_cast<uint4*>(dyn + xs_off);            // [m][K / 8] this stage's input
  uint4* rs = reinterpret_cast<uint4*>(dyn + rs_off);            // [m][K / 8] the residual sum
  float* xsum = reinterpret_cast<float*>(dyn + sum_off);         // FOLD: [m][K / 32] block sums of xs
  __shared__ __align__(8) uint64_t full[S], empty[S];
  __shared__ float part[W][32][4];
  __shared__ float red[W];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = gridDim.x, b = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], W);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // the copy warp: every chunk of every stage of this block, in order
    if (lane == 0) {
      int i = 0;
      for (int j = 0; j < chain.count; ++j) {
        const Stage& st = chain.st[j];
        const int rt = (st.n + 15) >> 4, steps = (st.kt + CT - 1) / CT;
        for (int tile = b; tile < rt; tile += G)
          for (int step = 0; step < steps; ++step, ++i) {
            const int s = i % S, c0 = step * CT, tiles = min(CT, st.kt - c0);
            if (i >= S) mbar_wait(&empty[s], (i / S - 1) & 1);
            const long long first = static_cast<long long>(tile) * st.kt + c0;
            mbar_expect(&full[s], tiles * (512 + 64));
            bulk_copy(ring_q + s * CT * 32, st.codes + first * 32, tiles * 512, &full[s]);
            bulk_copy(ring_s + s * CT * 8, st.scales + first * 8, tiles * 64, &full[s]);
          }
      }
    }
    return;
  }
  const int g = lane >> 2, t = lane & 3;
  const uint32_t magic = chain.count >= 0 ? Pair<T>::magic : 0u;  // in a register (q4_mma.cu)
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int i = 0;
  for (int j = 0; j < chain.count; ++j) {
    const Stage& st = chain.st[j];
    if (MODE != 1 && j > 0) grid_barrier<W>(sync, static_cast<unsigned>(j * G));
    if (trace != nullptr && threadIdx.x == 0) trace[(b * MAX_STAGES + j) * 3] = now();
    if (MODE != 1) prologue<T, W>(st, m, xs, rs, red, warp, lane);
    if (trace != nullptr && threadIdx.x == 0) trace[(b * MAX_STAGES + j) * 3 + 1] = now();
    if constexpr (FOLD) block_sums<W>(xs, xsum, m, st.kt * 8, std::is_same_v<T, __nv_bfloat16>);
    const int rt = (st.n + 15) >> 4, steps = (st.kt + CT - 1) / CT, k = st.kt * 64;
    const T* xr = reinterpret_cast<const T*>(xs) + (g < m ? g : 0) * k;
    for (int tile = b; tile < rt; tile += G)
      for (int step = 0; step < steps; ++step, ++i) {
        const int s = i % S, c0 = step * CT + warp * U;
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
          if (c0 + u >= st.kt) break;  // warp-uniform; words past the chunk were never read
          if constexpr (MODE != 0) {
          } else if constexpr (FOLD) {
            float xb[2][2];  // [activation row 2t, 2t + 1][block]
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int blk = 0; blk < 2; ++blk)
                xb[r][blk] = 2 * t + r < m ? xsum[(2 * t + r) * st.kt * 2 + 2 * (c0 + u) + blk] : 0.f;
            tile_mma_fold<T>(q[u], sc[u], direct<T, true>(xr, g < m, c0 + u, t), magic, xb, acc);
          } else {
            tile_mma<T>(q[u], sc[u], direct<T, true>(xr, g < m, c0 + u, t), magic, acc);
          }
        }
        if (step == steps - 1)
          finish_tile<T, W, true>(part, acc, tile, warp, lane, static_cast<const T*>(st.bias), static_cast<T*>(st.y),
                                  st.n, m, st.n);
      }
    if (trace != nullptr && threadIdx.x == 0) trace[(b * MAX_STAGES + j) * 3 + 2] = now();
  }
  warps_sync<W, true>();
  if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == static_cast<unsigned>(G - 1)) {
    sync[0] = 0u;  // every block is past every barrier: ready for the next launch
    sync[1] = 0u;
    __threadfence();
  }
#else
  __trap();  // sm_90 and later only: q4_chain.py offers the chain there alone
#endif
}

template <typename T, int W, int U, int S, bool FOLD = false, int MINB = 1, int MODE = 0>
cudaError_t launch(const Chain& chain, int m, unsigned* sync, unsigned long long* trace, cudaStream_t stream) {
  int kmax = 0, dnorm = 0;
  for (int j = 0; j < chain.count; ++j) {
    kmax = max(kmax, chain.st[j].kt * 64);
    if (chain.st[j].kind == ADD_NORM) dnorm = max(dnorm, chain.st[j].kt * 64);
  }
  const int xs_off = ring_bytes<W, U, S>(), rs_off = xs_off + m * kmax * static_cast<int>(sizeof(T));
  const int sum_off = rs_off + m * dnorm * static_cast<int>(sizeof(T));
  const int smem = sum_off + (FOLD ? m * kmax / 32 * 4 : 0);
  auto kernel = q4_chain<T, W, U, S, FOLD, MINB, MODE>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (W + 1) * 32, smem);
  if (e != cudaSuccess) return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(per_sm * sms);
  cfg.blockDim = dim3((W + 1) * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // all blocks resident, or the launch fails
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, chain, m, xs_off, rs_off, sum_off, sync, trace);
}

template <typename T>
cudaError_t by_config(int cfg, const Chain& c, int m, unsigned* sync, unsigned long long* tr, cudaStream_t s) {
  switch (cfg) {  // (W warps, U column tiles per warp step, S ring slots): q4_chain.CONFIGS
    case 0: return launch<T, 16, 2, 8>(c, m, sync, tr, s);
    case 1: return launch<T, 8, 2, 6, false, 2>(c, m, sync, tr, s);
    case 2: return launch<T, 4, 4, 6, false, 2>(c, m, sync, tr, s);
    case 3: return launch<T, 8, 1, 8, false, 3>(c, m, sync, tr, s);
    case 4: return launch<T, 4, 2, 8, false, 4>(c, m, sync, tr, s);
    case 5: return launch<T, 16, 2, 6>(c, m, sync, tr, s);
    case 6: return launch<T, 16, 2, 6, false, 1, 1>(c, m, sync, tr, s);
    case 7: return launch<T, 16, 2, 6, false, 1, 2>(c, m, sync, tr, s);
    case 8: return launch<T, 4, 2, 6, false, 4, 1>(c, m, sync, tr, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

int q4_chain_configs() { return 9; }
int q4_chain_max_stages() { return MAX_STAGES; }
int q4_chain_stage_bytes() { return static_cast<int>(sizeof(Stage)); }

// dtype: 1 bfloat16, 2 float16; chain: a Chain (q4_chain.py's ctypes mirror); m: activation rows, 1..2;
// sync: two zero uint32 (left zero).
// trace: null, or [grid][MAX_STAGES][3] ns timestamps per block and stage (start, prologue done, GEMV done).
int q4_chain(int device, int dtype, int cfg, const void* chain, int m, unsigned* sync, unsigned long long* trace,
             void* stream) {
  const Chain& c = *static_cast<const Chain*>(chain);
  if (m < 1 || m > MAX_ROWS || c.count < 1 || c.count > MAX_STAGES) return cudaErrorInvalidValue;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 1) return by_config<__nv_bfloat16>(cfg, c, m, sync, trace, s);
  if (dtype == 2) return by_config<__half>(cfg, c, m, sync, trace, s);
  return cudaErrorInvalidValue;
}

const char* q4_chain_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
