/* GEMV / small-M GEMM straight from ggml blocks: y[M,N] = x[M,K] @ dequant(W)[N,K]^T (+ bias), float32 x and y.

Weights are the GGUF bytes as stored (each row whole blocks; f16 scales), decoded in registers 32 elements at a
time with the reference's arithmetic (inferflow/quant/ggml.py: every decoded weight is bit-identical to it), then
multiplied into float32 accumulators. Each output element (m, n) is one fixed chain: for every 32-element
sub-block in order, acc += w[0:16] * x[0:16]; acc += w[16:32] * x[16:32] (16 lanes), then one fixed horizontal
sum. No step depends on M, on how rows are tiled or on the thread count, so batched and single-row calls give
the same bits. A tile of 4 weight rows is decoded once per group of up to 4 activation rows while it sits in L1,
so memory streams the weight once per call for every M.

Types: Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q6_K (14) (ggml ids). The portable fallback
(no AVX-512) decodes each sub-block to floats with the same formulas and sums with the same 16-lane chain. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "split.h"
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "ggml_blocks.h"

#ifdef __AVX512F__
/* The bytes [at, at + n) of a 4-row tile's stream (rows are adjacent: a thread's groups are one sequential read),
   PF_AHEAD bytes ahead, into L1: a decode step's weights come from memory, and the hardware prefetcher alone left
   the decode waiting on them (tools/bench_native_stream.py: cached vs streamed weights). Prefetches past the
   matrix's end are harmless hints. */
#define PF_AHEAD 4096
INLINE void prefetch_ahead(const uint8_t *w, int64_t at, int n) {
    for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)w + PF_AHEAD + at + o, _MM_HINT_T0);
}

/* NR weight rows x MT activation rows, all K: the accumulators stay in registers. */
INLINE void tile(const int qt, const int NR, const int MT, const uint8_t *w, int64_t rb, const float *x, int64_t ldx,
                 float *y, int64_t ldy, const float *bias, int64_t nsb) {
    __m512 acc[4][4];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    float dc[4][2 * CH] __attribute__((aligned(64)));
    for (int64_t s0 = 0; s0 < nsb; s0 += CH) {
        const int n = nsb - s0 < CH ? (int)(nsb - s0) : CH;
        for (int r = 0; r < NR; r++) {
            if (legacy(qt))
                legacy_scales(qt, w + r * rb, s0, n, dc[r]);
            else
                kquant_scales(qt, w + r * rb, s0, n, dc[r]);
        }
        for (int i = 0; i < n; i++) {
            const int64_t sb = s0 + i;
            prefetch_ahead(w, sb * 4 * block_bytes(qt), 4 * block_bytes(qt));
            __m512 lo[4], hi[4];
            for (int r = 0; r < NR; r++) decode32(qt, w + r * rb, sb, &dc[r][2 * i], &lo[r], &hi[r]);
            for (int m = 0; m < MT; m++) {
                const __m512 x0 = _mm512_loadu_ps(x + m * ldx + sb * 32);
                const __m512 x1 = _mm512_loadu_ps(x + m * ldx + sb * 32 + 16);
                for (int r = 0; r < NR; r++) {
                    acc[r][m] = _mm512_fmadd_ps(lo[r], x0, acc[r][m]);
                    acc[r][m] = _mm512_fmadd_ps(hi[r], x1, acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < MT; m++) {
            float s = _mm512_reduce_add_ps(acc[r][m]);
            y[m * ldy + r] = bias ? s + bias[r] : s;
        }
}

typedef void (*tile_fn)(const uint8_t *, int64_t, const float *, int64_t, float *, int64_t, const float *, int64_t);
#define TILE(QT, NR, MT)                                                                                        \
    static void tile_##QT##_##NR##_##MT(const uint8_t *w, int64_t rb, const float *x, int64_t ldx, float *y,    \
                                        int64_t ldy, const float *bias, int64_t nsb) {                          \
        tile(QT, NR, MT, w, rb, x, ldx, y, ldy, bias, nsb);                                                     \
    }
#define TILES(QT) TILE(QT, 4, 1) TILE(QT, 4, 2) TILE(QT, 4, 4) TILE(QT, 1, 1) TILE(QT, 1, 2) TILE(QT, 1, 4)
TILES(Q4_0) TILES(Q4_1) TILES(Q5_0) TILES(Q5_1) TILES(Q8_0) TILES(Q4_K) TILES(Q6_K)
#define ROW(QT) {tile_##QT##_4_1, tile_##QT##_4_2, tile_##QT##_4_4, tile_##QT##_1_1, tile_##QT##_1_2, tile_##QT##_1_4}

static int tiles_for(int qt, tile_fn out[6]) {
    static const tile_fn t[7][6] = {ROW(Q4_0), ROW(Q4_1), ROW(Q5_0), ROW(Q5_1), ROW(Q8_0), ROW(Q4_K), ROW(Q6_K)};
    int i;
    switch (qt) {
    case Q4_0: i = 0; break; case Q4_1: i = 1; break; case Q5_0: i = 2; break; case Q5_1: i = 3; break;
    case Q8_0: i = 4; break; case Q4_K: i = 5; break; case Q6_K: i = 6; break; default: return -1;
    }
    memcpy(out, t[i], sizeof(t[i]));
    return 0;
}
#endif /* __AVX512F__ */


/* The fallback tile: the same per-element chain (16 lane sums, then the same pairwise horizontal order as
   _mm512_reduce_add_ps is not promised; only M- and thread-invariance within one build are). */
static void tile_scalar(int qt, int nr, int mt, const uint8_t *w, int64_t rb, const float *x, int64_t ldx,
                        float *y, int64_t ldy, const float *bias, int64_t nsb) {
    for (int r = 0; r < nr; r++) {
        for (int m = 0; m < mt; m++) {
            float lane[16] = {0};
            float wv[32];
            for (int64_t sb = 0; sb < nsb; sb++) {
                decode32_scalar(qt, w + r * rb, sb, wv);
                const float *xs = x + m * ldx + sb * 32;
                for (int l = 0; l < 16; l++) lane[l] = fmaf(wv[l], xs[l], lane[l]);
                for (int l = 0; l < 16; l++) lane[l] = fmaf(wv[16 + l], xs[16 + l], lane[l]);
            }
            for (int s = 8; s >= 1; s >>= 1)
                for (int l = 0; l < s; l++) lane[l] += lane[l + s];
            y[m * ldy + r] = bias ? lane[0] + bias[r] : lane[0];
        }
    }
}

/* Weights per extra thread below which a call runs on one thread: a fork/join costs microseconds on an idle
   machine (up to a scheduler time slice when the other core is busy). 2^16 splits every projection of a
   135M-parameter model (576 x 576 and up) over 2 threads: a q4_0 decode step 26-40 -> 23-25 ms on an idle 2-core
   machine (2^19 kept all but gate/up and the head on one thread). Settable (tests, benchmarks). */
static int64_t grain = (int64_t)1 << 16;

void ggml_set_grain(int64_t g) { grain = g < 1 ? 1 : g; }

static inline int threads_for(int nt, int64_t N, int64_t K) {
    const int64_t most = N * K / grain;
    return most < 1 ? 1 : most < nt ? (int)most : nt;
}

int ggml_supported(int qt) { return block_bytes(qt) != 0; }

int ggml_has_simd(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Thread tid of nth's share of ggml_gemv: a contiguous range of 4-row groups of W, all M rows each. */
static void ggml_part(int qt, const uint8_t *w, int64_t rb, const float *x, int64_t ldx, float *y, int64_t ldy,
                      const float *bias, int64_t M, int64_t N, int64_t K, int simd, int tid, int nth) {
    const int64_t nsb = K / 32, groups = (N + 3) / 4;
#ifdef __AVX512F__
    tile_fn t[6];
    tiles_for(qt, t);
#else
    simd = 0;
#endif
    for (int64_t g = share(groups, tid, nth); g < share(groups, tid + 1, nth); g++) {
        const int64_t n0 = g * 4, nr = N - n0 < 4 ? N - n0 : 4;
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0, mt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const float *xm = x + m0 * ldx;
            float *ym = y + m0 * ldy + n0;
            const float *bn = bias ? bias + n0 : 0;
            if (simd) {
#ifdef __AVX512F__
                const int mi = mt == 4 ? 2 : mt == 2 ? 1 : 0;
                if (nr == 4) {
                    t[mi](w + n0 * rb, rb, xm, ldx, ym, ldy, bn, nsb);
                } else {
                    for (int64_t r = 0; r < nr; r++)
                        t[3 + mi](w + (n0 + r) * rb, rb, xm, ldx, ym + r, ldy, bn ? bn + r : 0, nsb);
                }
#endif
            } else {
                tile_scalar(qt, (int)nr, (int)mt, w + n0 * rb, rb, xm, ldx, ym, ldy, bn, nsb);
            }
            m0 += mt;
        }
    }
}

static int gemv_ok(int qt, int64_t M, int64_t N, int64_t K) {
    const int64_t qk = (qt == Q4_K || qt == Q6_K) ? 256 : 32;
    return block_bytes(qt) && K % qk == 0 && M >= 1 && N >= 1;
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * W[n, k] (+ bias[n]); W row n at w + n * rb. Returns 0, or -1 for an
   unsupported type or K. */
int ggml_gemv(int qt, const uint8_t *w, int64_t rb, const float *x, int64_t ldx, float *y, int64_t ldy,
              const float *bias, int64_t M, int64_t N, int64_t K, int nt, int simd) {
    if (!gemv_ok(qt, M, N, K)) return -1;
    nt = threads_for(nt, N, K);
#pragma omp parallel num_threads(nt) if (nt > 1)
    ggml_part(qt, w, rb, x, ldx, y, ldy, bias, M, N, K, simd, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

/* W rows [0, N) decoded as ggml_dequant, then rounded to bf16 (round to nearest even) into out[N, K]: the large-
   batch path's bf16 GEMM operand. Returns -1 where the build lacks AVX512-BF16 (the caller converts instead). */
int ggml_dequant_bf16(int qt, const uint8_t *w, int64_t rb, uint16_t *out, int64_t N, int64_t K, int nt) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int64_t qk = (qt == Q4_K || qt == Q6_K) ? 256 : 32;
    if (!block_bytes(qt) || K % qk) return -1;
    const int64_t nsb = K / 32;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * rb;
        uint16_t *o = out + n * K;
        for (int64_t sb = 0; sb < nsb; sb++) {
            __m512 lo, hi;
            decode32_any(qt, row, sb, &lo, &hi);
            _mm256_storeu_si256((__m256i *)(o + sb * 32), (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_storeu_si256((__m256i *)(o + sb * 32 + 16), (__m256i)_mm512_cvtneps_pbh(hi));
        }
    }
    return 0;
#else
    (void)qt; (void)w; (void)rb; (void)out; (void)N; (void)K; (void)nt;
    return -1;
#endif
}

/* W rows [0, N) decoded into out[N, K] float32 (bit-identical to the reference), for large-M calls: decode once,
   then one GEMM. */
int ggml_dequant(int qt, const uint8_t *w, int64_t rb, float *out, int64_t N, int64_t K, int nt, int simd) {
    const int64_t qk = (qt == Q4_K || qt == Q6_K) ? 256 : 32;
    if (!block_bytes(qt) || K % qk) return -1;
    const int64_t nsb = K / 32;
#ifndef __AVX512F__
    simd = 0;
#endif
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * rb;
        float *o = out + n * K;
        for (int64_t sb = 0; sb < nsb; sb++) {
            if (simd) {
#ifdef __AVX512F__
                __m512 lo, hi;
                decode32_any(qt, row, sb, &lo, &hi);
                _mm512_storeu_ps(o + sb * 32, lo);
                _mm512_storeu_ps(o + sb * 32 + 16, hi);
#endif
            } else {
                decode32_scalar(qt, row, sb, o + sb * 32);
            }
        }
    }
    return 0;
}

#include "gemv_q8x.h"
