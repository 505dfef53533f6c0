// Pieces shared by the CUDA kernels (q4_gemv.cu, q4_mma.cu, q4_mma_rows.cu).
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

// The next weight's bytes to pull into L2 while a kernel runs (quant/l2_prefetch.py). A decode step reads each
// weight once from DRAM, and at 9-56 MB one kernel keeps DRAM busy for only part of its time (its ramp-up and
// tail, the launch gaps and the small kernels in between); prefetching the next weight fills those gaps. Two
// ranges (a layout's codes and scales); n0 == 0: nothing. at_end: issued once a block's own loads are done.
// Laid out as l2_prefetch.Prefetch (ctypes).
struct Prefetch {
  const char* p0;
  const char* p1;
  unsigned n0;  // bytes, under 2^31
  unsigned n1;
  int at_end;
  int pdl;  // launched as a programmatic dependent (see launch_kernel)
};

// This block's share of [p, p + bytes), in 16-byte multiples, by the bulk-copy engine: fire and forget, a
// hint that neither faults nor orders anything. 32-bit sizes (the caller caps them): a 64-bit division here took
// the GEMM's registers from 199 to 255.
__device__ __forceinline__ void prefetch_range(const char* p, unsigned bytes, unsigned part, unsigned parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned per = ((bytes + parts - 1) / parts + 15) & ~15u;
  const unsigned end = min(bytes, (part + 1) * per) & ~15u;
  for (unsigned lo = part * per; lo < end; lo += 32768) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + lo), "r"(min(32768u, end - lo)) : "memory");
  }
#endif
}

// Thread 0 of every block issues its block's share, at the start (at_end false) or after the block's own loads.
__device__ __noinline__ void prefetch_l2(const Prefetch& pf, bool at_end) {
  if (pf.n0 == 0 || (pf.at_end != 0) != at_end || threadIdx.x != 0) return;
  const unsigned parts = gridDim.x * gridDim.y, part = blockIdx.x + blockIdx.y * gridDim.x;
  prefetch_range(pf.p0, pf.n0, part, parts);
  prefetch_range(pf.p1, pf.n1, part, parts);
}

// A host entry point's optional Prefetch (nullptr: none).
inline Prefetch prefetch_or_none(const void* pf) {
  return pf != nullptr ? *static_cast<const Prefetch*>(pf) : Prefetch{nullptr, nullptr, 0, 0, 0, 0};
}

// Where a kernel starts reading what the previous kernel in the stream wrote: with `pdl` it may have started
// before that kernel ended (programmatic dependent launch), having issued its first weight loads meanwhile.
// Without it, a no-op.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A launch, as a programmatic dependent of the previous kernel in the stream where `pdl` (CUDA graphs keep it).
template <typename... P, typename... A>
cudaError_t launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl, A... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace inferflow_cuda
