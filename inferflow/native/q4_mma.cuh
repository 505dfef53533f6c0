// The tensor-core 4-bit decode shared by q4_mma.cu (1-8 activation rows) and q4_mma_rows.cu (up to 64): a Q4_0
// code pair made an exact 16-bit float pair q - 8 for mma.sync m16n8k16, the mma itself, the scale fold and the
// GEMM's staging copies. The weight layout is documented in q4_mma.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace inferflow_cuda {

// The 16-bit pair type of T, the magic that makes a code q the float base + q, and base + 8.
template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t magic = 0x43004300u;  // (128, 128)
  static constexpr float base8 = 136.f;
};
template <> struct Pair<__half> {
  using type = __half2;
  static constexpr uint32_t magic = 0x64006400u;  // (1024, 1024)
  static constexpr float base8 = 1032.f;
};

template <typename T> __device__ __forceinline__ uint32_t minus(uint32_t v) {  // v - (base + 8): q - 8, exact
  using P = typename Pair<T>::type;
  P r = __hsub2(*reinterpret_cast<P*>(&v), P(Pair<T>::base8, Pair<T>::base8));
  return *reinterpret_cast<uint32_t*>(&r);
}

// The A fragment of one k-step from its 32-bit word of 8 codes: one LOP3 (with `magic` in a register) and one
// HSUB2 per pair of weights.
template <typename T> __device__ __forceinline__ void fragment(uint32_t w, uint32_t magic, uint32_t (&a)[4]) {
  a[0] = minus<T>((w & 0x000F000Fu) | magic);
  a[1] = minus<T>((w >> 4 & 0x000F000Fu) | magic);
  a[2] = minus<T>((w >> 8 & 0x000F000Fu) | magic);
  a[3] = minus<T>((w >> 12 & 0x000F000Fu) | magic);
}

#define INFERFLOW_MMA(TYPE)                                                                                 \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
               "{%8,%9}, {%0,%1,%2,%3};"                                                                    \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) INFERFLOW_MMA("f16"); else INFERFLOW_MMA("bf16");
}
#undef INFERFLOW_MMA

// A lane's scales of one 16 x 64 tile as float32: d[0] = (row g: block 0, block 1), d[1] = (row g + 8: ...).
__device__ __forceinline__ void tile_scales(const uint2& sc, float2 (&d)[2]) {
  d[0] = __half22float2(*reinterpret_cast<const __half2*>(&sc.x));
  d[1] = __half22float2(*reinterpret_cast<const __half2*>(&sc.y));
}

// A 16-bit float pair (d, d) of T, as a word.
template <typename T> __device__ __forceinline__ uint32_t scale_pair(float d) {
  typename Pair<T>::type v;
  if constexpr (std::is_same_v<T, __half>) v = __floats2half2_rn(d, d); else v = __floats2bfloat162_rn(d, d);
  return *reinterpret_cast<uint32_t*>(&v);
}

// a * b, per 16-bit half (a block scale folded into an A fragment: rounded to T).
template <typename T> __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  using P = typename Pair<T>::type;
  P r = __hmul2(*reinterpret_cast<P*>(&a), *reinterpret_cast<P*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// The GEMM's staging (q4_mma_rows.cu): 16 bytes global -> shared, zero-filled when !ok (nothing is read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&b)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
               : "r"(s));
}

}  // namespace inferflow_cuda
