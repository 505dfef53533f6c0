// Q4_0 GEMM for 1-256 activation rows on Hopper's warpgroup MMA (wgmma, sm_90a): batched decode and the short
// prefills and mixed steps replayed as CUDA graphs. The weight layout and its exact decode are the tensor-core
// GEMV's (q4_mma.cu, q4_mma.cuh); the block scale is folded into the decoded weights as q4_mma_rows.cu's FOLD
// configs do (d (q - 8) rounded to the activations' type, as Marlin and a dequantized weight).
//
// Why another kernel: q4_mma_rows.cu's mma.sync loop reads every B fragment (the activations) from shared memory
// into each warp's registers with ldmatrix, one ldmatrix per two mmas at 64 rows: its issue slots and shared
// memory set the pace, and at 64 rows it was no faster than cuBLAS on the bf16 weight (docs/benchmarks.md). Here a
// warpgroup (4 warps, 4 row tiles: 64 weight rows) is the M side of one m64nNk16 wgmma per 16 columns, N = the
// activation rows padded to 16, 32, 64, 128 or 256: each warp decodes its own 16 rows into the A registers, and the
// tensor cores read the activations (B) straight from shared memory through a descriptor, once per warpgroup.
//
// Pipeline: a block of WG warpgroups (64 WG weight rows, one row group) walks its column tiles (64 columns each).
// Each tile's activations (8 NT rows x 128 bytes, 128-byte swizzled: chunk c of row r at r * 8 + (c ^ (r & 7)),
// the layout the descriptor names) and its warps' codes and scales go to a ring of STAGES slots with cp.async,
// STAGES - 2 tiles ahead. A tile's wgmmas run while the next tile is decoded (two sets of A registers; the wgmma of
// tile c - 2 is waited for before its slot is refilled). Split K and the last step are q4_mma_rows.cu's
// (q4_rows_finish.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "q4_mma.cuh"
#include "q4_rows_finish.cuh"
#include "q4_wgmma_ops.cuh"

namespace {

using inferflow_cuda::cp_async16;
using inferflow_cuda::cp_async_commit;
using inferflow_cuda::cp_async_wait;
using inferflow_cuda::each;
using inferflow_cuda::finish_rows;
using inferflow_cuda::fragment;
using inferflow_cuda::mul2;
using inferflow_cuda::Pair;
using inferflow_cuda::scale_pair;
using inferflow_cuda::tile_scales;
using inferflow_cuda::Wgmma;
using inferflow_cuda::word;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The descriptor of a K-major operand: rows of 64 16-bit values (128 bytes) in 8-row atoms 1024 bytes apart
// (stride byte offset 1024 >> 4), 128-byte swizzle (mode 1 in bits 62-63); the leading byte offset is unused.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Copies by other threads (cp.async: the generic proxy) made visible to the wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// One ring slot: KS column tiles' activations first (each 1024-byte aligned for the swizzle), then their codes
// and scales, per column tile and row tile.
constexpr int slot_bytes(int nt, int tiles, int ks) { return (ks * (nt * 8 * 128 + tiles * 576) + 1023) / 1024 * 1024; }
template <int NT, int TILES, int KS> struct Slot {
  static constexpr int X = NT * 8 * 128, CODES = TILES * 512;  // then TILES * 64 bytes of scales
  static constexpr int BYTES = slot_bytes(NT, TILES, KS);
  static constexpr int CODES_AT = KS * X, SCALES_AT = KS * (X + CODES);
};

// RW row sets per warpgroup: RW wgmmas share each B tile read (64 RW weight rows per warpgroup). Warp w gives
// row set r its row tile tile0 + r, tile0 = (4 group WG + warp) RW: so a warp's RW tiles are consecutive, as
// q4_rows_finish.cuh stores them. KS column tiles per ring slot: one barrier and one wait per KS tiles (past the
// split's end: zero codes, scales and activations, which add nothing). DOUBLE: two sets of A registers, the next
// slot decoded while this one's wgmmas run; where they do not fit beside the accumulators, one set, and each
// slot's wgmmas are waited for before the next is decoded.
template <typename T, int NT, int WG, int RW, int KS, int STAGES, bool DOUBLE>
__global__ void __launch_bounds__(WG * 128, 1) q4_wgmma(const T* __restrict__ x, const uint4* __restrict__ codes,
                                                     const uint2* __restrict__ scales, const T* __restrict__ bias,
                                                     T* __restrict__ y, float* __restrict__ ws,
                                                     int* __restrict__ counters, int n, int kt, int m,
                                                     long long sxm, long long sym) {
  static_assert(STAGES >= 3, "the ring refills the slot of step i - 2");
  constexpr int TILES = WG * 4 * RW;
  using S = Slot<NT, TILES, KS>;
  constexpr int THREADS = WG * 128, XCH = NT * 64, PER = (XCH + THREADS - 1) / THREADS;
  extern __shared__ uint8_t dyn[];
  __shared__ int last;
  uint8_t* ring = dyn + ((1024 - (smem_addr(dyn) & 1023)) & 1023);  // the launch adds 1024 bytes for this
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2;
  const int rt = (n + 15) >> 4, np = rt * 16;
  const int group = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int c0 = static_cast<int>(static_cast<long long>(kt) * split / splits);
  const int c1 = static_cast<int>(static_cast<long long>(kt) * (split + 1) / splits);
  const int steps = (c1 - c0 + KS - 1) / KS;
  const int tile0 = (group * WG * 4 + warp) * RW;
  const uint32_t magic = kt >= 0 ? Pair<T>::magic : 0u;  // in a register: one LOP3 per pair (see q4_mma.cu)

  // a thread's copies: activation rows xrow0 + p THREADS / 8, 16-byte chunk ch; its warp's codes and scales
  const int xrow0 = tid >> 3, ch = tid & 7;
  const uint4* csrc[RW];
  const uint4* ssrc[RW];
  bool cok[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    cok[r] = tile0 + r < rt;
    const long long at = static_cast<long long>(cok[r] ? tile0 + r : 0) * kt;
    csrc[r] = codes + at * 32 + lane;
    ssrc[r] = reinterpret_cast<const uint4*>(scales + at * 8) + (lane & 3);
  }
  auto stage = [&](int i, int slot) {
    uint8_t* s = ring + slot * S::BYTES;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int c = c0 + i * KS + kk;
      const bool in = c < c1;
      const int cc = in ? c : c0;  // past the end: zeros (any address: nothing is read)
      uint4* sx = reinterpret_cast<uint4*>(s + kk * S::X);
#pragma unroll
      for (int p = 0; p < PER; ++p) {
        const int row = xrow0 + p * (THREADS / 8);
        if (XCH % THREADS == 0 || row < NT * 8) {
          const bool ok = in && row < m;
          cp_async16(&sx[row * 8 + (ch ^ (row & 7))], x + (ok ? row * sxm : 0) + ch * 8 + cc * 64, ok);
        }
      }
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int at = kk * TILES + warp * RW + r;
        cp_async16(reinterpret_cast<uint4*>(s + S::CODES_AT) + at * 32 + lane, csrc[r] + cc * 32, in && cok[r]);
        if (lane < 4)
          cp_async16(reinterpret_cast<uint4*>(s + S::SCALES_AT) + at * 4 + lane, ssrc[r] + cc * 4, in && cok[r]);
      }
    }
  };

  float acc[RW][NT][4];
  each<RW, NT>([&](int r, int j, int i) { acc[r][j][i] = 0.f; });

#pragma unroll
  for (int i = 0; i < STAGES - 2; ++i) {
    if (i < steps) stage(i, i);
    cp_async_commit();
  }
  auto step = [&](int i, uint32_t (&a)[KS][RW][4][4]) {
    const int slot = i % STAGES;
    cp_async_wait<STAGES - 3>();
    fence_async_smem();
    __syncthreads();  // step i is in; every warpgroup is done with step i - 2, whose slot is refilled next
    {
      const int ni = i + STAGES - 2;
      if (ni < steps) stage(ni, ni % STAGES);
      cp_async_commit();
    }
    const uint8_t* s = ring + slot * S::BYTES;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const int at = kk * TILES + warp * RW + r;
        const uint4 q = reinterpret_cast<const uint4*>(s + S::CODES_AT)[at * 32 + lane];
        float2 d[2];
        tile_scales(reinterpret_cast<const uint2*>(s + S::SCALES_AT)[at * 8 + g], d);
#pragma unroll
        for (int blk = 0; blk < 2; ++blk) {  // the two 32-column blocks: k-steps 2 blk, 2 blk + 1
          const uint32_t dg = scale_pair<T>(blk == 0 ? d[0].x : d[0].y);  // rows g (a0, a2), g + 8 (a1, a3)
          const uint32_t dg8 = scale_pair<T>(blk == 0 ? d[1].x : d[1].y);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t(&f)[4] = a[kk][r][2 * blk + h];
            fragment<T>(word(q, 2 * blk + h), magic, f);
            f[0] = mul2<T>(f[0], dg);
            f[1] = mul2<T>(f[1], dg8);
            f[2] = mul2<T>(f[2], dg);
            f[3] = mul2<T>(f[3], dg8);
          }
        }
      }
    wg_fence();
    const uint32_t base = smem_addr(s);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int r = 0; r < RW; ++r)
          Wgmma<NT>::template run<T>(acc[r], a[kk][r][ks], sw128_desc(base + kk * S::X + 32 * ks));
    wg_commit();
    // DOUBLE: step i - 1's wgmmas are done (its A registers and, next step, its slot are free); else this step's
    if constexpr (DOUBLE) wg_wait<1>(); else wg_wait<0>();
  };
  uint32_t a0[KS][RW][4][4];
  int i = 0;
  if constexpr (DOUBLE) {
    uint32_t a1[KS][RW][4][4];
    for (; i + 1 < steps; i += 2) {
      step(i, a0);
      step(i + 1, a1);
    }
  }
  for (; i < steps; ++i) step(i, a0);
  wg_wait<0>();
  cp_async_wait<0>();

  finish_rows<T, RW, NT>(acc, tile0, lane, bias, y, ws, counters, &last, group, split, splits, n, np, m, sym);
}

// The grid: one block per row group of 64 WG RW weight rows, times the splits of the column tiles that fill the
// resident slots (q4_rows_finish.cuh). STAGES is capped to what 200 KB of shared memory holds, KS to 1 where 3
// slots would not fit, RW to 1 where its accumulators would pass 128 registers (N = 256).
template <typename T, int NT, int WG, int RW_WANTED, int KS_WANTED, int STAGES_WANTED>
cudaError_t start(const void* x, const void* codes, const void* scales, const void* bias, void* y, float* ws,
                  long long ws_floats, int* counters, int counter_slots, int n, int kt, int m, long long sxm,
                  long long sym, cudaStream_t stream) {
  constexpr int RW = NT * RW_WANTED * 4 > 128 ? 1 : RW_WANTED;
  constexpr int KS = 3 * slot_bytes(NT, WG * 4 * RW, KS_WANTED) > 200 * 1024 - 1024 ? 1 : KS_WANTED;
  using S = Slot<NT, WG * 4 * RW, KS>;
  constexpr int FIT = (200 * 1024 - 1024) / S::BYTES;
  constexpr int STAGES = STAGES_WANTED < FIT ? STAGES_WANTED : FIT;
  constexpr bool DOUBLE = RW * NT * 4 + 2 * KS * RW * 16 <= 128;  // accumulators + two sets of A registers
  constexpr auto kernel = q4_wgmma<T, NT, WG, RW, KS, STAGES, DOUBLE>;
  constexpr int smem = STAGES * S::BYTES + 1024;
  static int slots = 0;  // per instantiation; a racing second caller sets the same
  if (slots == 0) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    int dev = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, WG * 128, smem);
    slots = (per_sm > 0 ? per_sm : 1) * sms;
  }
  const int rt = (n + 15) / 16, groups = (rt + WG * 4 * RW - 1) / (WG * 4 * RW);
  const int splits = inferflow_cuda::rows_splits(slots, groups, kt, static_cast<long long>(m) * rt * 16, ws_floats,
                                                 counter_slots);
  kernel<<<dim3(groups, splits), WG * 128, smem, stream>>>(
      static_cast<const T*>(x), static_cast<const uint4*>(codes), static_cast<const uint2*>(scales),
      static_cast<const T*>(bias), static_cast<T*>(y), ws, counters, n, kt, m, sxm, sym);
  return cudaGetLastError();
}

template <typename T, int WG, int RW, int KS, int STAGES>
cudaError_t by_rows(const void* x, const void* codes, const void* scales, const void* bias, void* y, float* ws,
                    long long wsf, int* cnt, int slots, int n, int kt, int m, long long sxm, long long sym,
                    cudaStream_t s) {
#define INFERFLOW_START(NT) \
  start<T, NT, WG, RW, KS, STAGES>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s)
  if (m <= 16) return INFERFLOW_START(2);
  if (m <= 32) return INFERFLOW_START(4);
  if (m <= 64) return INFERFLOW_START(8);
  if (m <= 128) return INFERFLOW_START(16);
  return INFERFLOW_START(32);
#undef INFERFLOW_START
}

template <typename T>
cudaError_t by_config(int cfg, const void* x, const void* codes, const void* scales, const void* bias, void* y,
                      float* ws, long long wsf, int* cnt, int slots, int n, int kt, int m, long long sxm,
                      long long sym, cudaStream_t s) {
#define INFERFLOW_CONFIG(WG, RW, KS, STAGES) \
  by_rows<T, WG, RW, KS, STAGES>(x, codes, scales, bias, y, ws, wsf, cnt, slots, n, kt, m, sxm, sym, s)
  switch (cfg) {  // (WG warpgroups per block, RW row sets per warpgroup, KS column tiles per slot, STAGES slots):
                  // cuda_q4_mma.WG_CONFIGS, in order
    case 0: return INFERFLOW_CONFIG(1, 1, 1, 6);
    case 1: return INFERFLOW_CONFIG(1, 2, 1, 6);
    case 2: return INFERFLOW_CONFIG(2, 1, 1, 4);
    case 3: return INFERFLOW_CONFIG(1, 1, 2, 4);
    case 4: return INFERFLOW_CONFIG(1, 1, 2, 3);
    case 5: return INFERFLOW_CONFIG(1, 2, 2, 3);
    case 6: return INFERFLOW_CONFIG(2, 1, 2, 3);
    default: return cudaErrorInvalidValue;
  }
#undef INFERFLOW_CONFIG
}

}  // namespace

extern "C" {

int q4_wgmma_configs() { return 7; }

// As q4_mma_rows() (q4_mma_rows.cu), for m = 1..256 activation rows.
int q4_wgmma(int device, int dtype, int cfg, const void* x, const void* codes, const void* scales, const void* bias,
             void* y, float* ws, long long ws_floats, int* counters, int counter_slots, int n, int kt, int m,
             long long sxm, long long sym, void* stream) {
  if (m < 1 || m > 256) return cudaErrorInvalidValue;
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

const char* q4_wgmma_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
