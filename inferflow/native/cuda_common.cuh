// Pieces shared by the CUDA kernels (q4_gemv.cu, q4_mma.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace inferflow_cuda {

// Streamed once per call: bypass L1 so that the activations and scales stay there.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Blocks of `Kernel` (launched with `threads` threads, always the same for one kernel) resident at once on the
// device: measured once per kernel (a racing second caller measures the same number).
template <auto Kernel>
int resident_blocks(int threads) {
  static int resident = 0;
  if (resident == 0) {
    int dev = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, 0);
    resident = (per_sm > 0 ? per_sm : 1) * sms;
  }
  return resident;
}

// The grid of a persistent kernel over `work` units, `per` units per block at a time: the fewest blocks that
// take an equal number of turns (at most the resident ones). With one block per resident slot, some blocks would
// do one turn more than the rest and leave the SMs idle meanwhile (ncu: 28% of a GEMV's time).
template <auto Kernel>
int balanced_blocks(int threads, int work, int per) {
  const int slots = resident_blocks<Kernel>(threads) * per;
  const int turns = (work + slots - 1) / slots;
  const int blocks = (work + turns * per - 1) / (turns * per);
  return blocks > 0 ? blocks : 1;
}

// The same grid for a kernel launched with `smem` bytes of dynamic shared memory (one unit per block at a time).
template <typename Kernel>
int balanced_blocks_for(Kernel kernel, int threads, int smem, int work) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  const int slots = (per_sm > 0 ? per_sm : 1) * sms;
  const int turns = (work + slots - 1) / slots;
  const int blocks = (work + turns - 1) / turns;
  return blocks > 0 ? blocks : 1;
}

}  // namespace inferflow_cuda
