/* The float GEMV's register tiles for gemv_float.c (included there, after its element helpers): MR activation
   rows x NR weight rows over all of K, float32 FMAs (16 lanes a step) or vdpbf16ps (32 bfloat16 a step), a
   portable C version of the same schedule. Each output's 16-lane accumulator walks K in the same steps whatever MR
   and NR, and is reduced in one order. Not a standalone header. */
#ifndef INFERFLOW_GEMV_TILES_H
#define INFERFLOW_GEMV_TILES_H

#ifdef __AVX512F__
/* W 16 elements -> float32 lanes (masked: zeros past K) */
AI __m512 wload(const void *w, int64_t k, int t, __mmask16 mk, int masked) {
    if (t == T_F32)
        return masked ? _mm512_maskz_loadu_ps(mk, (const float *)w + k) : _mm512_loadu_ps((const float *)w + k);
    __m256i h = masked ? _mm256_maskz_loadu_epi16(mk, (const uint16_t *)w + k)
                       : _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    if (t == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows first (each W row's K in one run, the rows one after another) for 1-2 activation rows and rows of up to
   1024 elements: the tile is then one sequential stream, where the K-outer order reads NR streams of a few cache
   lines each, which the hardware prefetcher follows poorly. Each output's accumulator walks K in the same steps
   either way: the same sums. Measured on a 2-core AMD EPYC (no AMX; tools/bench_native_gemv.py shapes, M = 1):
   15-24% faster at K = 576, equal at K = 1536; slower from 4 activation rows, whose x rows are re-read per W row. */
#define ROWS_FIRST(MR, K) ((MR) <= 2 && (K) <= 1024)

/* One tile: MR x rows (float32, row stride ldx) times NR W rows (type t, stride K); 16 lanes per step. */
AI void tile16(const float *x, int64_t ldx, const void *w, int64_t K, int MR, int NR, int t, float *sums,
               const char *pf, int64_t pfstride, int pfn) {
    __m512 acc[4][8];
    const int es = t == T_F32 ? 4 : 2;
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    if (ROWS_FIRST(MR, K)) {
        for (int j = 0; j < NR; j++) {
            const char *wj = (const char *)w + j * K * es;
            for (k = 0; k + 16 <= K; k += 16) {
                __m512 wv = wload(wj, k, t, 0, 0);
                if (pf && j < pfn) _mm_prefetch(pf + j * pfstride + k * es, _MM_HINT_T1);
                for (int i = 0; i < MR; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), wv, acc[i][j]);
            }
            if (k < K) {
                __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
                __m512 wv = wload(wj, k, t, mk, 1);
                for (int i = 0; i < MR; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + i * ldx + k), wv, acc[i][j]);
            }
        }
        k = K;
    }
    for (; k + 16 <= K; k += 16) {
        __m512 wv[8];
        for (int j = 0; j < NR; j++) wv[j] = wload((const char *)w + j * K * es, k, t, 0, 0);
        if (pf) {
            if (pfn == NR) /* one row block: all NR rows (the loop unrolled) */
                for (int j = 0; j < NR; j++) _mm_prefetch(pf + j * pfstride + k * es, _MM_HINT_T1);
            else
                for (int j = 0; j < pfn; j++) _mm_prefetch(pf + j * pfstride + k * es, _MM_HINT_T1);
        }
        for (int i = 0; i < MR; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[8];
        for (int j = 0; j < NR; j++) wv[j] = wload((const char *)w + j * K * es, k, t, mk, 1);
        for (int i = 0; i < MR; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) sums[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#ifdef __AVX512BF16__

/* bfloat16 x and W: 32 products per step by vdpbf16ps (pairs summed in float32), masked last step. */
AI void tile_dp(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K, int MR, int NR, float *sums,
                const char *pf, int64_t pfstride) {
    __m512 acc[4][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kf = K / 32 * 32;
    const __mmask32 mk = (__mmask32)((1ull << (K - kf)) - 1);
    if (ROWS_FIRST(MR, K)) {
        for (int j = 0; j < NR; j++) {
            const uint16_t *wj = w + j * K;
            for (int64_t k = 0; k < kf; k += 32) {
                __m512i wv = _mm512_loadu_si512(wj + k);
                if (pf) _mm_prefetch(pf + j * pfstride + k * 2, _MM_HINT_T1);
                for (int i = 0; i < MR; i++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(x + i * ldx + k),
                                                 (__m512bh)wv);
            }
            if (kf < K) {
                __m512i wv = _mm512_maskz_loadu_epi16(mk, wj + kf);
                for (int i = 0; i < MR; i++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_maskz_loadu_epi16(mk, x + i * ldx + kf),
                                                 (__m512bh)wv);
            }
        }
    } else {
        for (int64_t k = 0; k < kf; k += 32) {
            __m512i wv[8];
            for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_si512(w + j * K + k);
            if (pf)
                for (int j = 0; j < NR; j++) _mm_prefetch(pf + j * pfstride + k * 2, _MM_HINT_T1);
            for (int i = 0; i < MR; i++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
            }
        }
        if (kf < K) {
            __m512i wv[8];
            for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * K + kf);
            for (int i = 0; i < MR; i++) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + i * ldx + kf);
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) sums[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif
#endif

#ifndef __AVX512F__
/* Portable: the same 16-lane schedule in plain C (the compiler vectorizes the lane loop). */
static void tile_c(const float *x, int64_t ldx, const void *w, int64_t K, int MR, int NR, int t, float *sums) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float lane[16] = {0};
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16; l++)
                    if (k + l < K) lane[l] += x[i * ldx + k + l] * load_elem(w, j * K + k + l, t);
            float s = 0.f;
            for (int l = 0; l < 16; l++) s += lane[l];
            sums[i * NR + j] = s;
        }
}
#endif

#endif
