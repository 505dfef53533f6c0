/* ggml_gemv_q8x: llama.cpp's arithmetic for Q4_0 / Q4_1 / Q8_0 GEMVs (included by gemv_ggml.c).

x is quantized per 32-block to int8 with a float scale (quantize_row_q8_0's rounding: d = max|x| / 127, round to
nearest), then the weight's codes meet those bytes in integer dot products (vpdpbusd: unsigned codes x signed x),
scaled by d_w * d_x per block. Q8_0 codes are made unsigned by +128 (xor 0x80) and Q4_0's -8 offset is taken out
with the block's sum of x codes (both folded into the block sum's initial value); Q4_1's min adds m_w * d_x * sum
x codes to a second accumulator. Approximate (about 5e-3 relative), not the exact decode of gemv_ggml.c.

Each output element (m, n) is one fixed chain: per block in order, the block's exact int32 sum, then
acc = fma(float(sum), d_w * d_x, acc) (and the min term's own fma chain); then acc (+ min acc) (+ bias). Integer
sums are exact in any order, so tiling, M and the thread count never change a bit.

Why 16 rows at once: a block's codes for 16 weight rows are transposed in registers (4-byte groups: lane r holds
row r's codes 4j..4j+3), so each vpdpbusd against x's 4 bytes j, broadcast, adds into all 16 rows' sums, and the
16 scales come in with one gather. The rows' sums land one per lane: no horizontal sum per block, about a sixth
of the instructions of a row-at-a-time dot (which left the Q4_0 decode compute-bound). */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1

/* Blocks [i0, i1) of x (block i: row i / (K / 32), block i % (K / 32)) -> int8 codes, per-block scales and code
   sums (llama.cpp's quantize_row_q8_0 rounding) */
static void quantize_x_part(const float *x, int64_t ldx, int64_t K, int8_t *xq, float *dx, int32_t *sx, int64_t i0,
                            int64_t i1) {
    const int64_t nsb = K / 32;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t m = i / nsb, b = i % nsb;
        const float *xs = x + m * ldx + b * 32;
        const __m512 a = _mm512_loadu_ps(xs), c = _mm512_loadu_ps(xs + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 iv = _mm512_set1_ps(id);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv)), qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, iv));
        _mm_storeu_si128((__m128i *)(xq + i * 32), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + i * 32 + 16), _mm512_cvtepi32_epi8(qc));
        dx[i] = d;
        sx[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    }
}

static void quantize_x(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *sx) {
    quantize_x_part(x, ldx, K, xq, dx, sx, 0, M * (K / 32));
}

/* The block sum's start: -8 sum(x codes) undoes Q4_0's offset, -128 sum undoes Q8_0's xor */
INLINE int32_t q8x_init(const int qt, int32_t sxm) { return qt == Q8_0 ? -128 * sxm : qt == Q4_0 ? -8 * sxm : 0; }

/* 16 rows' 16 bytes at p + r * rb, transposed by 4-byte groups: out[j] lane r = row r's bytes 4j..4j+3. Rows
   k, k + 4, k + 8, k + 12 share a register, so after the 4x4 transpose within each 128-bit lane, lane 4c + k is
   row 4c + k. */
INLINE void transpose16(const uint8_t *p, int64_t rb, __m512i out[4]) {
    __m512i a[4];
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + k * rb)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (k + 4) * rb)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (k + 8) * rb)), 2);
        a[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (k + 12) * rb)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Block b's codes of 16 rows as unsigned bytes: c[j] pairs with x codes 4j..4j+3 */
INLINE void codes16(const int qt, const uint8_t *b, int64_t rb, __m512i c[8]) {
    if (qt == Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        transpose16(b + 2, rb, c);
        transpose16(b + 18, rb, c + 4);
        for (int j = 0; j < 8; j++) c[j] = _mm512_xor_si512(c[j], flip);
    } else {  /* byte i holds element i (low nibble) and i + 16 (high) */
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        __m512i t[4];
        transpose16(b + (qt == Q4_0 ? 2 : 4), rb, t);
        for (int j = 0; j < 4; j++) {
            c[j] = _mm512_and_si512(t[j], m4);
            c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(t[j], 4), m4);
        }
    }
}

/* 16 weight rows x MT activation rows, all K */
INLINE void vtile16(const int qt, const int MT, const uint8_t *w, int64_t rb, const int8_t *xq, int64_t K,
                    const float *dx, const int32_t *sx, float *y, int64_t ldy, const float *bias, int64_t nsb) {
    const int bb = block_bytes(qt);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)rb));
    __m512 acc[MT], accm[MT];  /* MT 32: on the stack, one load and store per block (the codes' transpose is shared) */
    for (int m = 0; m < MT; m++) acc[m] = accm[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = w + sb * bb;
        /* the next group's same block, into L2: the group after this one is this thread's next read, and a
           decode step's weights come from memory (a row-wise prefetch ahead within the group measured slower) */
        for (int r = 0; r < 16; r++) _mm_prefetch((const char *)b + (16 + r) * rb, _MM_HINT_T1);
        __m512i c[8];
        codes16(qt, b, rb, c);
        const __m512i g = _mm512_i32gather_epi32(idx, b, 1);  /* d | m (Q4_1) or d | first codes */
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        const __m512 mn = qt == Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : d;
        for (int m = 0; m < MT; m++) {
            const int32_t *xd = (const int32_t *)(xq + m * K + sb * 32);
            const float dxm = dx[m * nsb + sb];
            const int32_t sxm = sx[m * nsb + sb];
            __m512i s0 = _mm512_set1_epi32(q8x_init(qt, sxm)), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, c[j], _mm512_set1_epi32(xd[j]));
                s1 = _mm512_dpbusd_epi32(s1, c[j + 1], _mm512_set1_epi32(xd[j + 1]));
            }
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dxm)), acc[m]);
            if (qt == Q4_1) accm[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxm * (float)sxm), accm[m]);
        }
    }
    for (int m = 0; m < MT; m++) {
        __m512 v = qt == Q4_1 ? _mm512_add_ps(acc[m], accm[m]) : acc[m];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(y + m * ldy, v);
    }
}

/* One weight row (the last N % 16 rows): the same chain per element, the block sum reduced from 8 lanes */
INLINE void vrow(const int qt, const uint8_t *w, const int8_t *xq, int64_t K, const float *dx, const int32_t *sx,
                 float *y, int64_t ldy, const float *bias, int64_t M, int64_t nsb) {
    const int bb = block_bytes(qt);
    for (int64_t m = 0; m < M; m++) {
        float acc = 0.0f, accm = 0.0f;
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *b = w + sb * bb;
            __m256i q;
            if (qt == Q8_0) {
                q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
            } else {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (qt == Q4_0 ? 2 : 4))), m4 = _mm_set1_epi8(0x0F);
                q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
            }
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + sb * 32));
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv);
            const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            const int32_t s = _mm_extract_epi32(h, 0) + _mm_extract_epi32(h, 1) + _mm_extract_epi32(h, 2) +
                              _mm_extract_epi32(h, 3) + q8x_init(qt, sx[m * nsb + sb]);
            const float dxm = dx[m * nsb + sb];
            acc = fmaf((float)s, f16(b) * dxm, acc);
            if (qt == Q4_1) accm = fmaf(f16(b + 2), dxm * (float)sx[m * nsb + sb], accm);
        }
        if (qt == Q4_1) acc += accm;
        y[m * ldy] = bias ? acc + bias[0] : acc;
    }
}

typedef void (*vtile_fn)(const uint8_t *, int64_t, const int8_t *, int64_t, const float *, const int32_t *, float *,
                         int64_t, const float *, int64_t);
#define VTILE(QT, MT)                                                                                          \
    static void vtile_##QT##_##MT(const uint8_t *w, int64_t rb, const int8_t *xq, int64_t K, const float *dx,   \
                                  const int32_t *sx, float *y, int64_t ldy, const float *bias, int64_t nsb) { \
        vtile16(QT, MT, w, rb, xq, K, dx, sx, y, ldy, bias, nsb);                                            \
    }
/* every MT from 1 to 8: a speculative verification (k + 1 rows) or a batch of 5-7 decodes is one pass over the
   weight's codes, not 4 + 1 (each row's chain is the same for every MT, so the results are too) */
#define VTILES(QT) VTILE(QT, 1) VTILE(QT, 2) VTILE(QT, 3) VTILE(QT, 4) VTILE(QT, 5) VTILE(QT, 6) VTILE(QT, 7) \
    VTILE(QT, 8) VTILE(QT, 32)
VTILES(Q4_0) VTILES(Q4_1) VTILES(Q8_0)
#define VROW(QT) {vtile_##QT##_1, vtile_##QT##_2, vtile_##QT##_3, vtile_##QT##_4, vtile_##QT##_5, vtile_##QT##_6, \
                  vtile_##QT##_7, vtile_##QT##_8, vtile_##QT##_32}

/* Thread tid of nth's share of ggml_gemv_q8x's product, x already quantized (quantize_x): 16-row groups of W */
static void gemv_q8x_part(int qt, const uint8_t *w, int64_t rb, const int8_t *xq, const float *dx, const int32_t *sx,
                          float *y, int64_t ldy, const float *bias, int64_t M, int64_t N, int64_t K, int tid, int nth) {
    static const vtile_fn t3[3][9] = {VROW(Q4_0), VROW(Q4_1), VROW(Q8_0)};
    const vtile_fn *t = t3[qt == Q4_0 ? 0 : qt == Q4_1 ? 1 : 2];
    const int64_t nsb = K / 32, groups = (N + 15) / 16;
    for (int64_t g = share(groups, tid, nth); g < share(groups, tid + 1, nth); g++) {
        const int64_t n0 = g * 16;
        const float *bn = bias ? bias + n0 : 0;
        if (N - n0 < 16) {
            for (int64_t r = n0; r < N; r++)
                vrow(qt, w + r * rb, xq, K, dx, sx, y + r, ldy, bias ? bias + r : 0, M, nsb);
            continue;
        }
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0, mt = left >= 32 ? 32 : left >= 8 ? 8 : left;
            t[mt == 32 ? 8 : mt - 1](w + n0 * rb, rb, xq + m0 * K, K, dx + m0 * nsb, sx + m0 * nsb, y + m0 * ldy + n0,
                                     ldy, bn, nsb);
            m0 += mt;
        }
    }
}
#endif

int ggml_has_vnni(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

/* ggml_gemv with x quantized to int8 per 32-block (llama.cpp's arithmetic: approximate); Q4_0 / Q4_1 / Q8_0 only.
   scratch: M * K + 8 * M * (K / 32) bytes. Returns -1 where unsupported (no VNNI build, other types). */
int ggml_gemv_q8x(int qt, const uint8_t *w, int64_t rb, const float *x, int64_t ldx, float *y, int64_t ldy,
                  const float *bias, int64_t M, int64_t N, int64_t K, int nt, void *scratch) {
#ifdef HAVE_VNNI
    if ((qt != Q4_0 && qt != Q4_1 && qt != Q8_0) || K % 32 || M < 1 || N < 1) return -1;
    const int64_t nsb = K / 32;
    nt = threads_for(nt, N, K);
    int8_t *xq = (int8_t *)scratch;
    float *dx = (float *)(xq + M * K);
    int32_t *sx = (int32_t *)(dx + M * nsb);
    quantize_x(x, ldx, M, K, xq, dx, sx);
#pragma omp parallel num_threads(nt) if (nt > 1)
    gemv_q8x_part(qt, w, rb, xq, dx, sx, y, ldy, bias, M, N, K, omp_get_thread_num(), omp_get_num_threads());
    return 0;
#else
    (void)qt; (void)w; (void)rb; (void)x; (void)ldx; (void)y; (void)ldy; (void)bias; (void)M; (void)N; (void)K;
    (void)nt; (void)scratch;
    return -1;
#endif
}
