/* Paged decode attention in (sequence, key chunk, KV head) tasks and a merge per head: the body of cpu_ops.c's
 * cpu_paged_decode and of step.c's attention ops. Included by cpu_ops.c after the helpers it uses (load_row,
 * store_row, esize, dot, vexp, LANES); not a standalone header. */
#ifndef INFERFLOW_PAGED_ATTENTION_H
#define INFERFLOW_PAGED_ATTENTION_H

#ifdef __AVX512F__
/* r[j] = the sum of v[j]'s 16 lanes, j < 16: a transpose-and-add tree (45 shuffles and adds for 16 keys, against
   ~8 per key for a reduction each) */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 w[8], u[4];
    for (int i = 0; i < 8; i++)  /* [key 2i: 8 lane sums | key 2i + 1: 8] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* quad k: key 4i + k, 4 lane sums */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
    /* lane 4 k + m holds key k + 4 m */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* 16 elements of a float32 (dt 0), bfloat16 (dt 1) or float8 e4m3 (dt 2) cache row at element index i, as float32
   (exact) */
static inline __attribute__((always_inline)) __m512 load16(const void *c, int64_t i, const int dt) {
    if (!dt) return _mm512_loadu_ps((const float *)c + i);
    if (dt == 3)  /* int8 codes (the caller applies the row's scale) */
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)c + i))));
    if (dt == 2) {  /* e4m3 moved into half-precision fields (exponent bias 15 for 7, subnormals included) x 2^8 */
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)c + i)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Key k's row (element offset at[k]) into L1, PF_KEYS keys before its use: rows lie Hkv heads apart in scattered
   blocks, a pattern the hardware prefetcher does not follow, and a decode step reads its whole cache from memory */
#define PF_KEYS 16
static inline __attribute__((always_inline)) void prefetch_row(const void *c, const int64_t *at, int64_t L,
                                                              const int DC, const int dt, int64_t k) {
    if (k >= L) return;
    const char *r = (const char *)c + at[k] * (int64_t)esize(dt);
    for (int o = 0; o < 16 * DC * (int)esize(dt); o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
}
/* the same into L2: a V row while its K row is read (the V pass after the softmax then finds the chunk in L2, and
   memory stays busy during the K pass's arithmetic) */
static inline __attribute__((always_inline)) void prefetch_row_l2(const void *c, const int64_t *at, int64_t L,
                                                                 const int DC, const int dt, int64_t k) {
    if (k >= L) return;
    const char *r = (const char *)c + at[k] * (int64_t)esize(dt);
    for (int o = 0; o < 16 * DC * (int)esize(dt); o += 64) _mm_prefetch(r + o, _MM_HINT_T1);
}

/* s[g * ss + t] = scale * (q_g . K[t]) for keys t < L and the R query heads g of one kv head (q_g at q + g * 16 DC),
   float32 or bfloat16 K (dt), D = 16 DC, key t's row at element at[t]: each key's row loaded (and converted) once for
   all R heads, its products in DC fused multiply-adds per head, 16 keys' lanes summed at once (hsum16), the last
   L % 16 keys one by one. A head's chain does not depend on R. */
static inline __attribute__((always_inline)) void qk_group(const int DC, const int dt, const int R, const void *kc,
                                                          const void *vpf, const int64_t *at, int64_t L,
                                                          const float *q, float scale, float *s, int64_t ss) {
    __m512 v[4][16];  /* R x 16 keys' lane sums: mostly on the stack, read back by hsum16 */
    for (int64_t t = 0; t < L; t += 16) {
        const int n = L - t < 16 ? (int)(L - t) : 16;
        for (int j = 0; j < n; j++) {
            const int64_t kr = at[t + j];
            prefetch_row(kc, at, L, DC, dt, t + j + PF_KEYS);
            if (vpf) prefetch_row_l2(vpf, at, L, DC, dt, t + j + PF_KEYS);
            __m512 k[8];
            for (int c = 0; c < DC; c++) k[c] = load16(kc, kr + 16 * c, dt);
            for (int g = 0; g < R; g++) {
                const float *qg = q + g * 16 * DC;
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
                for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], a);
                v[g][j] = a;
            }
        }
        for (int g = 0; g < R; g++) {
            if (n == 16) {
                _mm512_storeu_ps(s + g * ss + t, _mm512_mul_ps(hsum16(v[g]), _mm512_set1_ps(scale)));
            } else {
                for (int j = 0; j < n; j++) s[g * ss + t + j] = _mm512_reduce_add_ps(v[g][j]) * scale;
            }
        }
    }
}

/* acc[g * sa + (0 .. 16 DC)] = sum over keys t (in order) of p[g * sp + t] * V[t] for R heads (rows as qk_group's):
   each row loaded once, DC registers of fused multiply-adds per head (a memory accumulator would wait on its own
   store at every key) */
static inline __attribute__((always_inline)) void pv_group(const int DC, const int dt, const int R, const void *vc,
                                                          const int64_t *at, int64_t L, const float *p, int64_t sp,
                                                          float *acc, int64_t sa) {
    __m512 a[4][8];
    for (int g = 0; g < R; g++)
        for (int c = 0; c < DC; c++) a[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
        prefetch_row(vc, at, L, DC, dt, t + PF_KEYS);
        __m512 v[8];
        for (int c = 0; c < DC; c++) v[c] = load16(vc, at[t] + 16 * c, dt);
        for (int g = 0; g < R; g++) {
            const __m512 pv = _mm512_set1_ps(p[g * sp + t]);
            for (int c = 0; c < DC; c++) a[g][c] = _mm512_fmadd_ps(pv, v[c], a[g][c]);
        }
    }
    for (int g = 0; g < R; g++)
        for (int c = 0; c < DC; c++) _mm512_storeu_ps(acc + g * sa + 16 * c, a[g][c]);
}

/* The register paths' instances: D 64 / 128 (DC 4 / 8), float32 / bfloat16 / float8 / int8 cache, 1-4 heads per kv
   head at once */
#define ATT_R(F, DC, DT, R, ...) \
    (R == 1 ? F(DC, DT, 1, __VA_ARGS__) : R == 2 ? F(DC, DT, 2, __VA_ARGS__) : R == 3 ? F(DC, DT, 3, __VA_ARGS__) \
            : F(DC, DT, 4, __VA_ARGS__))
#define ATT_DT(F, DC, DT, R, ...)                                                                          \
    ((DT) == 3 ? ATT_R(F, DC, 3, R, __VA_ARGS__) : (DT) == 2 ? ATT_R(F, DC, 2, R, __VA_ARGS__)              \
               : (DT) ? ATT_R(F, DC, 1, R, __VA_ARGS__) : ATT_R(F, DC, 0, R, __VA_ARGS__))
#define ATT_CALL(F, D, DT, R, ...) \
    ((D) == 64 ? ATT_DT(F, 4, DT, R, __VA_ARGS__) : ATT_DT(F, 8, DT, R, __VA_ARGS__))
#endif

/* Work units: each sequence's keys (the last win of them with a sliding window) are cut into at most ATT_CHUNKS
   chunks of a multiple of 32 keys, a function of the key count alone (never of threads or the batch: every head's
   bits are the same however the work is split). A task is (sequence, chunk, kv head): its query heads' softmax
   partials over the chunk (max m, sum l of exp(s - m), acc = sum exp(s - m) V) go to part; attn_merge then
   combines a head's chunks in order (flash decoding). Chunks read contiguous cache rows once for all of a kv
   head's query heads, and a batch of one sequence still has chunks x kv heads tasks to spread over the threads. */
#define ATT_CHUNKS 8
#define ATT_MIN_KEYS 64 /* a chunk's first PF_KEYS rows wait on memory: short chunks are mostly that */
static inline int64_t att_keys(int64_t L, int64_t win) { return win > 0 && L > win ? win : L; }
static inline int64_t att_chunk(int64_t n) {
    const int64_t c = ((n + ATT_CHUNKS - 1) / ATT_CHUNKS + 31) / 32 * 32;
    return c < ATT_MIN_KEYS ? ATT_MIN_KEYS : c;
}
static inline int64_t att_nchunks(int64_t n) { return n > 0 ? (n + att_chunk(n) - 1) / att_chunk(n) : 0; }
/* The partial of (sequence b, chunk c, query head h): m, l, acc[D] */
static inline float *att_part(float *part, int64_t b, int64_t c, int64_t h, int64_t H, int64_t D) {
    return part + ((b * ATT_CHUNKS + c) * H + h) * (D + 2);
}

/* s[0..n) -> exp(s - m) in place; returns m, *l = the sum (softmax_row's order, not normalised) */
static float softmax_part(float *restrict s, int64_t n, float *l) {
    float mx[LANES], acc[LANES] = {0};
    for (int j = 0; j < LANES; j++) mx[j] = -INFINITY;
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int j = 0; j < LANES; j++) mx[j] = s[t + j] > mx[j] ? s[t + j] : mx[j];
    for (; t < n; t++) mx[0] = s[t] > mx[0] ? s[t] : mx[0];
    float m = mx[0];
    for (int j = 1; j < LANES; j++) m = mx[j] > m ? mx[j] : m;
    for (t = 0; t < n; t++) s[t] = vexp(s[t] - m);
    for (t = 0; t + LANES <= n; t += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += s[t + j];
    for (; t < n; t++) acc[t % LANES] += s[t];
    float sum = 0.f;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    *l = sum;
    return m;
}

/* Task (b, c, kh): query heads kh * rep .. (kh + 1) * rep - 1 (rep = H / Hkv) of sequence b (queries at
 * q + b * sq, dtype dt) over chunk c of its keys (caches of dtype cdt: float32, bfloat16, float8 e4m3, or int8 with
 * the rows' scales in ks/vs [S, Hkv]); key t at slot tables[b * tstride + t / bs] * bs + t % bs of the flat caches
 * kc/vc [S, Hkv, D]; scores in float32, sums in key order. Returns -1 when out of memory. */
static int attn_chunk(int dt, int cdt, const void *q, int64_t sq, const void *kc, const void *vc, const float *ks,
                      const float *vs, const int64_t *tables,
                      int64_t tstride, const int64_t *lens, int64_t b, int64_t c, int64_t kh, int64_t H, int64_t Hkv,
                      int64_t D, int64_t bs, float scale, int64_t win, float *part) {
    const size_t es = esize(dt), ces = esize(cdt);
    const int64_t L = lens[b], n = att_keys(L, win), ch = att_chunk(n), rep = H / Hkv, h0 = kh * rep;
    const int64_t k0 = L - n + c * ch, k1 = k0 + ch < L ? k0 + ch : L, nk = k1 - k0;
    const int64_t *tab = tables + b * tstride;
    /* a chunk's scratch fits the stack for common shapes (a malloc per task: ~5% of the op at bf16 batch 8,
       tools/profile_cpu.py --batch 8, attention vs gate/up time 0.49 -> 0.47) */
    float local[4096] __attribute__((aligned(64)));
    const int64_t nsc = ks ? nk : 0;  /* int8: the keys' K and V row scales, gathered once */
    const size_t need = (size_t)(rep * D + rep * nk + D + 2 * nsc) * 4 + (size_t)nk * 8;
    float *qf = need <= sizeof local ? local : malloc(need);
    if (!qf) return -1;
    float *sc = qf + rep * D, *kv = sc + rep * nk, *kss = kv + D, *vss = kss + nsc;
    int64_t *at = (int64_t *)(vss + nsc);  /* each key's row, as an element offset into the caches */
    for (int64_t t = k0, i = 0; t < k1;) {
        const int64_t base = tab[t / bs] * bs, o0 = t % bs, m = bs - o0 < k1 - t ? bs - o0 : k1 - t;
        for (int64_t o = 0; o < m; o++, i++) {
            const int64_t row = (base + o0 + o) * Hkv + kh;
            at[i] = row * D;
            if (ks) { kss[i] = ks[row]; vss[i] = vs[row]; }
        }
        t += m;
    }
#ifdef __AVX512F__
    /* the first rows' K and V now (the loops prefetch PF_KEYS ahead of themselves from there on) */
    for (int64_t t = 0; t < PF_KEYS && t < nk; t++) {
        prefetch_row(kc, at, nk, (int)(D / 16), cdt, t);
        prefetch_row(vc, at, nk, (int)(D / 16), cdt, t);
    }
#endif
    load_row(dt, (const char *)q + (size_t)(b * sq + h0 * D) * es, qf, rep * D);
#ifdef __AVX512F__
    const int fast = D == 64 || D == 128;  /* common head sizes: sums in registers */
    if (fast) {
        for (int64_t g = 0; g < rep; g += 4) {
            const int r = rep - g < 4 ? (int)(rep - g) : 4;
            ATT_CALL(qk_group, D, cdt, r, kc, g ? NULL : vc, at, nk, qf + g * D, scale, sc + g * nk, nk);
        }
    } else
#endif
    for (int64_t t = 0; t < nk; t++) {  /* key by key, in order */
        const char *kp = (const char *)kc + (size_t)at[t] * ces;
        const float *kr = (const float *)kp;
        if (cdt) { load_row(cdt, kp, kv, D); kr = kv; }
        for (int64_t g = 0; g < rep; g++) sc[g * nk + t] = dot(qf + g * D, kr, D) * scale;
    }
    if (ks)  /* int8 K: each key's dot product times its row's scale */
        for (int64_t g = 0; g < rep; g++)
            for (int64_t t = 0; t < nk; t++) sc[g * nk + t] *= kss[t];
    for (int64_t g = 0; g < rep; g++) {
        float *pp = att_part(part, b, c, h0 + g, H, D);
        pp[0] = softmax_part(sc + g * nk, nk, &pp[1]);
        memset(pp + 2, 0, (size_t)D * 4);
    }
    if (vs)  /* int8 V: each key's weight times its row's scale (the sums l above are of the weights alone) */
        for (int64_t g = 0; g < rep; g++)
            for (int64_t t = 0; t < nk; t++) sc[g * nk + t] *= vss[t];
#ifdef __AVX512F__
    if (fast) {  /* the sums in registers (fused multiply-adds, key order) */
        for (int64_t g = 0; g < rep; g += 4) {
            const int r = rep - g < 4 ? (int)(rep - g) : 4;
            ATT_CALL(pv_group, D, cdt, r, vc, at, nk, sc + g * nk, nk, att_part(part, b, c, h0 + g, H, D) + 2, D + 2);
        }
    } else
#endif
    for (int64_t t = 0; t < nk; t++) {
        const char *vp = (const char *)vc + (size_t)at[t] * ces;
        const float *vr = (const float *)vp;
        if (cdt) { load_row(cdt, vp, kv, D); vr = kv; }
        for (int64_t g = 0; g < rep; g++) {
            float p = sc[g * nk + t], *a = att_part(part, b, c, h0 + g, H, D) + 2;
            for (int64_t i = 0; i < D; i++) a[i] += p * vr[i];
        }
    }
    if (qf != local) free(qf);
    return 0;
}

/* One K or V head row (D elements) from dtype dt into a cache row of dtype cdt: a copy, or rounded as torch's .to()
 * (round to nearest even; float8 saturating), or int8 as kv_store.quantize_int8 (scale = absmax * (1 / 127), 1 for a zero
 * row, into *scale; codes round(x / scale), half to even) */
static void kv_row(int dt, int cdt, const void *src, void *dst, int64_t D, float *scale) {
    if (dt == cdt) {
        memcpy(dst, src, (size_t)D * esize(dt));
    } else if (cdt >= 2) {
        float row[STACK_FLOATS];
        if (D > STACK_FLOATS) return;  /* callers' heads are far smaller; checked in cpu_ops.py */
        load_row(dt, src, row, D);
        if (cdt == 2) {
            store_row(2, row, dst, D);
            return;
        }
        float mx = 0.0f;
        for (int64_t i = 0; i < D; i++) mx = fmaxf(mx, fabsf(row[i]));
        float s = mx * (1.0f / 127.0f);
        if (!(s > 0.0f)) s = 1.0f;
        int8_t *d = (int8_t *)dst;
        for (int64_t i = 0; i < D; i++) {
            const float r = nearbyintf(row[i] / s);
            d[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
        *scale = s;
    } else {
        const float *s = (const float *)src;  /* dt float32, cdt bfloat16: the one mixed pair callers pass */
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < D; i++) d[i] = f32_to_bf16(s[i]);
    }
}

/* Head h of sequence b: its chunks' partials combined in chunk order (rescaled to the largest max), normalised,
 * into out [B, H, D]. Overwrites the first chunk's partial. */
static void attn_merge(int dt, const int64_t *lens, int64_t win, int64_t b, int64_t h, int64_t H, int64_t D,
                       float *part, void *out) {
    const int64_t C = att_nchunks(att_keys(lens[b], win));
    float *acc = att_part(part, b, 0, h, H, D) + 2, mx = -INFINITY, den = 0.0f;
    if (C == 0) memset(acc, 0, (size_t)D * 4);
    for (int64_t c = 0; c < C; c++) mx = fmaxf(mx, att_part(part, b, c, h, H, D)[0]);
    for (int64_t c = 0; c < C; c++) {
        const float *pp = att_part(part, b, c, h, H, D), e = vexp(pp[0] - mx);
        den += pp[1] * e;
        if (c == 0) {
            for (int64_t i = 0; i < D; i++) acc[i] *= e;
        } else {
            for (int64_t i = 0; i < D; i++) acc[i] += e * pp[2 + i];
        }
    }
    const float inv = C ? 1.0f / den : 0.0f;
    for (int64_t i = 0; i < D; i++) acc[i] *= inv;
    store_row(dt, acc, (char *)out + (size_t)((b * H + h) * D) * esize(dt), D);
}

#endif
