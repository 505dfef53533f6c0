/* ggml block formats for the CPU kernels (included by gemv_ggml.c): type ids, block sizes, f16 scales, and a
32-element sub-block decoded to floats with the reference's arithmetic (inferflow/quant/ggml.py: every decoded weight
bit-identical to it), in plain C and, with AVX-512, into two 16-lane registers. Not a standalone header. */
#ifndef INFERFLOW_GGML_BLOCKS_H
#define INFERFLOW_GGML_BLOCKS_H
#include "half.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

static inline float f16(const uint8_t *p) {  /* a block's little-endian f16 scale */
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

static inline int block_bytes(int qt) {
    switch (qt) {
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
    case Q4_K: return 144; case Q6_K: return 210; default: return 0;
    }
}

/* Q4_K / Q5_K 6-bit scale and min j of a block's 12 packed bytes (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Scalar decode of sub-block sb (32 elements) of a row: the reference formulas, used by the fallback and by
   the decode-to-float entry point where AVX-512 is missing. */
static void decode32_scalar(int qt, const uint8_t *row, int64_t sb, float *w) {
    if (qt == Q4_K || qt == Q6_K) {
        const int64_t blk = sb >> 3;
        const int j = (int)(sb & 7);
        if (qt == Q4_K) {
            const uint8_t *b = row + blk * 144, *qs = b + 16 + (j >> 1) * 32;
            int sc, mn;
            scale_min_k4(j, b + 4, &sc, &mn);
            const float d1 = f16(b) * (float)sc, m1 = f16(b + 2) * (float)mn;
            const int sh = (j & 1) * 4;
            for (int l = 0; l < 32; l++) w[l] = d1 * (float)((qs[l] >> sh) & 0xF) - m1;
        } else {
            const uint8_t *b = row + blk * 210;
            const int half = j >> 2, k = j & 3;
            const uint8_t *ql = b + 64 * half + (k & 1) * 32, *qh = b + 128 + 32 * half;
            const int8_t *sc = (const int8_t *)(b + 192 + 8 * half);
            const float d = f16(b + 208), dl0 = d * (float)sc[2 * k], dl1 = d * (float)sc[2 * k + 1];
            const int sl = (k >> 1) * 4, sh = 2 * k;
            for (int l = 0; l < 32; l++) {
                int q = (((ql[l] >> sl) & 0xF) | (((qh[l] >> sh) & 3) << 4)) - 32;
                w[l] = (l < 16 ? dl0 : dl1) * (float)q;
            }
        }
        return;
    }
    const uint8_t *b = row + sb * block_bytes(qt);
    const float d = f16(b);
    switch (qt) {
    case Q8_0:
        for (int l = 0; l < 32; l++) w[l] = (float)(int8_t)b[2 + l] * d;
        break;
    case Q4_0:
        for (int l = 0; l < 16; l++) {
            w[l] = (float)((b[2 + l] & 0xF) - 8) * d;
            w[l + 16] = (float)((b[2 + l] >> 4) - 8) * d;
        }
        break;
    case Q4_1: {
        const float m = f16(b + 2);
        for (int l = 0; l < 16; l++) {
            w[l] = (float)(b[4 + l] & 0xF) * d + m;
            w[l + 16] = (float)(b[4 + l] >> 4) * d + m;
        }
        break;
    }
    case Q5_0: {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        for (int l = 0; l < 16; l++) {
            w[l] = (float)((int)((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16) * d;
            w[l + 16] = (float)((int)((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16) * d;
        }
        break;
    }
    case Q5_1: {
        const float m = f16(b + 2);
        uint32_t qh;
        memcpy(&qh, b + 4, 4);
        for (int l = 0; l < 16; l++) {
            w[l] = (float)((b[8 + l] & 0xF) | (((qh >> l) & 1) << 4)) * d + m;
            w[l + 16] = (float)((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) * d + m;
        }
        break;
    }
    }
}

#ifdef __AVX512F__
#define INLINE static inline __attribute__((always_inline))

/* Sub-block sb of a row -> two 16-lane float vectors, bit-identical to the reference decode (where a fused
   multiply-add replaces the reference's multiply then add, the product is exact: the same single rounding). */
INLINE int legacy(const int qt) { return qt == Q4_0 || qt == Q4_1 || qt == Q5_0 || qt == Q5_1 || qt == Q8_0; }

/* Blocks per chunk whose scales are converted ahead of the inner loop (legacy types) */
#define CH 64

/* The f16 scale d of legacy blocks [s0, s0 + n) of a row, and c (Q4_1 / Q5_1: the min m; Q4_0 / Q5_0: -8 d /
   -16 d, exact), into dc[2 i], dc[2 i + 1], so the inner loop broadcasts them straight from memory (a load, no
   shuffle-port work per block). Each block's first 4 bytes are gathered 16 blocks at a time: d | m as they lie
   (_1 types), or d | d; converted 8 blocks per vcvtph2ps (a scalar gather of the halves cost as much as the decode) */
INLINE void legacy_scales(const int qt, const uint8_t *row, int64_t s0, int n, float *dc) {
    const int bb = block_bytes(qt), two = qt == Q4_1 || qt == Q5_1;
    const uint8_t *b = row + s0 * bb;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bb));
    const float k = qt == Q4_0 ? -8.0f : qt == Q5_0 ? -16.0f : 1.0f;
    const __m512 mul = _mm512_setr_ps(1, k, 1, k, 1, k, 1, k, 1, k, 1, k, 1, k, 1, k);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, b + (int64_t)i * bb, 1);
        if (!two) g = _mm512_or_si512(_mm512_and_si512(g, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(g, 16));
        __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(g)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(g, 1));
        if (k != 1.0f) {
            lo = _mm512_mul_ps(lo, mul);
            hi = _mm512_mul_ps(hi, mul);
        }
        _mm512_storeu_ps(dc + 2 * i, lo);
        _mm512_storeu_ps(dc + 2 * i + 16, hi);
    }
}

/* Per sub-block scales of k-quant sub-blocks [s0, s0 + n) into dc[2 i], dc[2 i + 1]: Q4_K d * sc_j and
   -(dmin * m_j); Q6_K d * sc for its two 16-element halves (the reference's products, exact) */
INLINE void kquant_scales(const int qt, const uint8_t *row, int64_t s0, int n, float *dc) {
    float d = 0.0f, dm = 0.0f;
    for (int i = 0; i < n; i++) {
        const int64_t sb = s0 + i;
        const int j = (int)(sb & 7);
        if (qt == Q4_K) {
            const uint8_t *b = row + (sb >> 3) * 144;
            if (i == 0 || j == 0) {
                d = f16(b);
                dm = f16(b + 2);
            }
            int sc, mn;
            scale_min_k4(j, b + 4, &sc, &mn);
            dc[2 * i] = d * (float)sc;
            dc[2 * i + 1] = -(dm * (float)mn);
        } else {
            const uint8_t *b = row + (sb >> 3) * 210;
            if (i == 0 || j == 0) d = f16(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192 + 8 * (j >> 2));
            const int k = j & 3;
            dc[2 * i] = d * (float)sc[2 * k];
            dc[2 * i + 1] = d * (float)sc[2 * k + 1];
        }
    }
}

/* A 32-weight legacy block's start, scale d and offset c (weight = q d + c): a _0 type's c is -zero d ((q - zero) d
   = q d - zero d: exact), a _1 type stores c as its f16 min after d; dc: both precomputed per block. */
INLINE const uint8_t *block_dc(const uint8_t *row, int64_t sb, int bb, int has_min, float zero, const float *dc,
                               __m512 *d, __m512 *c) {
    const uint8_t *b = row + sb * bb;
    const float df = dc ? dc[0] : f16(b);
    *d = _mm512_set1_ps(df);
    *c = _mm512_set1_ps(dc ? dc[1] : has_min ? f16(b + 2) : -zero * df);
    return b;
}

INLINE void decode32(const int qt, const uint8_t *row, int64_t sb, const float *dc, __m512 *lo, __m512 *hi) {
    const __m512i m4 = _mm512_set1_epi32(0xF);
    if (qt == Q8_0) {
        const uint8_t *b = row + sb * 34;
        const __m512 d = _mm512_set1_ps(dc ? dc[0] : f16(b));
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
    } else if (qt == Q4_0 || qt == Q4_1) {
        __m512 d, c;
        const uint8_t *b = block_dc(row, sb, qt == Q4_0 ? 18 : 20, qt == Q4_1, 8.0f, dc, &d, &c);
        const int off = qt == Q4_0 ? 2 : 4;
        /* the block's 16 possible weights, q d + c for q = 0..15 (exact as above), then a table lookup per lane:
           vpermps reads only an index's low 4 bits, so the low nibble needs no mask (fewer ops than converting) */
        const __m512 tbl = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, c);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + off)));
        *lo = _mm512_permutexvar_ps(v, tbl);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
    } else if (qt == Q5_0 || qt == Q5_1) {
        __m512 d, c;
        const uint8_t *b = block_dc(row, sb, qt == Q5_0 ? 22 : 24, qt == Q5_1, 16.0f, dc, &d, &c);
        const int hoff = qt == Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, b + hoff, 4);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + hoff + 4)));
        const __m512i s16 = _mm512_set1_epi32(16);
        __m512i ql = _mm512_and_si512(v, m4), qhv = _mm512_srli_epi32(v, 4);
        ql = _mm512_mask_or_epi32(ql, (__mmask16)(qh & 0xFFFF), ql, s16);
        qhv = _mm512_mask_or_epi32(qhv, (__mmask16)(qh >> 16), qhv, s16);
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), d, c);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qhv), d, c);
    } else if (qt == Q4_K) {
        const uint8_t *b = row + (sb >> 3) * 144;
        const int j = (int)(sb & 7);
        const uint8_t *qs = b + 16 + (j >> 1) * 32;
        float d1, m1;
        if (dc) {
            d1 = dc[0];
            m1 = dc[1];
        } else {
            int sc, mn;
            scale_min_k4(j, b + 4, &sc, &mn);
            d1 = f16(b) * (float)sc;
            m1 = -(f16(b + 2) * (float)mn);
        }
        /* d1 q exact (<= 21 bits): one rounding, as d1 q - m1; the sub-block's 16 values as a table (see Q4_0) */
        const __m512 tbl = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_ps(d1), _mm512_set1_ps(m1));
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
        if (j & 1) {  /* odd sub-blocks are the high nibbles; the table reads only an index's low 4 bits */
            a = _mm512_srli_epi32(a, 4);
            c = _mm512_srli_epi32(c, 4);
        }
        *lo = _mm512_permutexvar_ps(a, tbl);
        *hi = _mm512_permutexvar_ps(c, tbl);
    } else {  /* Q6_K */
        const uint8_t *b = row + (sb >> 3) * 210;
        const int j = (int)(sb & 7), half = j >> 2, k = j & 3;
        const uint8_t *ql = b + 64 * half + (k & 1) * 32, *qh = b + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * half);
        const float df = dc ? 0.0f : f16(b + 208);
        const __m128i sl = _mm_cvtsi32_si128((k >> 1) * 4), sh = _mm_cvtsi32_si128(2 * k);
        const __m512i m3 = _mm512_set1_epi32(3), s32 = _mm512_set1_epi32(32);
        __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)ql));
        __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + 16)));
        __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
        __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16)));
        l0 = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(l0, sl), m4),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h0, sh), m3), 4));
        l1 = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(l1, sl), m4),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h1, sh), m3), 4));
        const float dl0 = dc ? dc[0] : df * (float)sc[2 * k], dl1 = dc ? dc[1] : df * (float)sc[2 * k + 1];
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l0, s32)), _mm512_set1_ps(dl0));
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l1, s32)), _mm512_set1_ps(dl1));
    }
}

/* decode32 for a run-time type: a constant qt per branch, so each call inlines a specialised decoder */
INLINE void decode32_any(const int qt, const uint8_t *row, int64_t sb, __m512 *lo, __m512 *hi) {
    switch (qt) {
    case Q4_0: decode32(Q4_0, row, sb, 0, lo, hi); break;
    case Q4_1: decode32(Q4_1, row, sb, 0, lo, hi); break;
    case Q5_0: decode32(Q5_0, row, sb, 0, lo, hi); break;
    case Q5_1: decode32(Q5_1, row, sb, 0, lo, hi); break;
    case Q8_0: decode32(Q8_0, row, sb, 0, lo, hi); break;
    case Q4_K: decode32(Q4_K, row, sb, 0, lo, hi); break;
    default: decode32(Q6_K, row, sb, 0, lo, hi); break;
    }
}
#endif /* __AVX512F__ */

#endif
