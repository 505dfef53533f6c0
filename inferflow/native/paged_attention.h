/* Paged decode attention, one (sequence, KV head, query heads) task: the body of cpu_ops.c's cpu_paged_decode and of
 * step.c's attention op. Included by cpu_ops.c after the helpers it uses (load_row, store_row, esize, dot,
 * softmax_row); not a standalone header. */
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

/* 16 elements of a float32 (dt 0) or bfloat16 (dt 1) cache row at element index i, as float32 (exact) */
static inline __attribute__((always_inline)) __m512 load16(const void *c, int64_t i, const int dt) {
    if (!dt) return _mm512_loadu_ps((const float *)c + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Key k's row (element offset at[k]) into L1, PF_KEYS keys before its use: rows lie Hkv heads apart in scattered
   blocks, a pattern the hardware prefetcher does not follow, and a decode step reads its whole cache from memory */
#define PF_KEYS 16
static inline __attribute__((always_inline)) void prefetch_row(const void *c, const int64_t *at, int64_t L,
                                                              const int DC, const int dt, int64_t k) {
    if (k >= L) return;
    const char *r = (const char *)c + at[k] * (dt ? 2 : 4);
    for (int o = 0; o < (dt ? 32 : 64) * DC; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);
}

/* s[t] = scale * (q . K[t]) for keys t < L of one head, float32 or bfloat16 K (dt), D = 16 DC, key t's row at element
   at[t]: each key's products in DC registers of fused multiply-adds, 16 keys' lanes summed at once (hsum16), the
   last L % 16 keys one by one */
static inline __attribute__((always_inline)) void qk_head(const int DC, const int dt, const void *kc,
                                                         const int64_t *at, int64_t L, const float *q, float scale,
                                                         float *s) {
    __m512 qv[8], v[16];
    for (int c = 0; c < DC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t t = 0; t < L; t += 16) {
        const int n = L - t < 16 ? (int)(L - t) : 16;
        for (int j = 0; j < n; j++) {
            const int64_t kr = at[t + j];
            prefetch_row(kc, at, L, DC, dt, t + j + PF_KEYS);
            __m512 a = _mm512_mul_ps(qv[0], load16(kc, kr, dt));
            for (int c = 1; c < DC; c++) a = _mm512_fmadd_ps(qv[c], load16(kc, kr + 16 * c, dt), a);
            v[j] = a;
        }
        if (n == 16) {
            _mm512_storeu_ps(s + t, _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale)));
        } else {
            for (int j = 0; j < n; j++) s[t + j] = _mm512_reduce_add_ps(v[j]) * scale;
        }
    }
}

/* acc[0 .. 16 DC) = sum over keys t (in order) of p[t] * V[t] for one head (rows as qk_head's): DC registers of
   fused multiply-adds (a memory accumulator would wait on its own store at every key) */
static inline __attribute__((always_inline)) void pv_head(const int DC, const int dt, const void *vc,
                                                         const int64_t *at, int64_t L, const float *p, float *acc) {
    __m512 a[8];
    for (int c = 0; c < DC; c++) a[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
        prefetch_row(vc, at, L, DC, dt, t + PF_KEYS);
        const __m512 pv = _mm512_set1_ps(p[t]);
        for (int c = 0; c < DC; c++) a[c] = _mm512_fmadd_ps(pv, load16(vc, at[t] + 16 * c, dt), a[c]);
    }
    for (int c = 0; c < DC; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}
#endif

/* Decode attention of sequence b's query heads kh * rep + [g0, g1) (rep = H / Hkv: those of kv head kh) over the
 * paged cache: queries from q + b * sq; keys 0 .. lens[b] - 1 (win > 0: only the last win of them) at slots tables[b * tstride + t / bs] * bs + t % bs
 * of the flat caches kc/vc [S, Hkv, D]; scores and softmax in float32, summed in key order; out [B, H, D]. */
static void paged_task(int dt, const void *q, int64_t sq, const void *kc, const void *vc, const int64_t *tables,
                       int64_t tstride, const int64_t *lens, int64_t b, int64_t kh, int64_t g0, int64_t g1, int64_t H,
                       int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t win, void *out) {
    size_t es = esize(dt);
    int64_t rep = g1 - g0, L = lens[b], h0 = kh * (H / Hkv) + g0;
    const int64_t s0 = win > 0 && L > win ? L - win : 0, n = L - s0;  /* a sliding window: the last win keys */
    const int64_t *tab = tables + b * tstride;
    float *qf = malloc((size_t)(rep * D + rep * n + rep * D + D) * 4 + (size_t)n * 8);
    float *sc = qf + rep * D, *acc = sc + rep * n, *kv = acc + rep * D;
    int64_t *at = (int64_t *)(kv + D);  /* each key's row, as an element offset into the caches */
    for (int64_t t = s0, i = 0; t < L;) {
        const int64_t base = tab[t / bs] * bs, o0 = t % bs, m = bs - o0 < L - t ? bs - o0 : L - t;
        for (int64_t o = 0; o < m; o++) at[i++] = ((base + o0 + o) * Hkv + kh) * D;
        t += m;
    }
    load_row(dt, (const char *)q + (size_t)(b * sq + h0 * D) * es, qf, rep * D);
#ifdef __AVX512F__
    const int fast = D == 64 || D == 128;  /* common head sizes: sums in registers */
    if (fast) {
        for (int64_t g = 0; g < rep; g++) {
            float *sg = sc + g * n;
            const float *qg = qf + g * D;
            if (D == 64) dt ? qk_head(4, 1, kc, at, n, qg, scale, sg) : qk_head(4, 0, kc, at, n, qg, scale, sg);
            else dt ? qk_head(8, 1, kc, at, n, qg, scale, sg) : qk_head(8, 0, kc, at, n, qg, scale, sg);
        }
    } else
#endif
    for (int64_t t = 0; t < n; t++) {  /* key by key, in order */
        const char *kp = (const char *)kc + (size_t)at[t] * es;
        const float *kr = (const float *)kp;
        if (dt) { load_row(dt, kp, kv, D); kr = kv; }
        for (int64_t g = 0; g < rep; g++) sc[g * n + t] = dot(qf + g * D, kr, D) * scale;
    }
    for (int64_t g = 0; g < rep; g++) softmax_row(sc + g * n, n);
    memset(acc, 0, (size_t)(rep * D) * 4);
#ifdef __AVX512F__
    if (fast) {  /* the sums in registers (fused multiply-adds, key order) */
        for (int64_t g = 0; g < rep; g++) {
            const float *pg = sc + g * n;
            float *ag = acc + g * D;
            if (D == 64) dt ? pv_head(4, 1, vc, at, n, pg, ag) : pv_head(4, 0, vc, at, n, pg, ag);
            else dt ? pv_head(8, 1, vc, at, n, pg, ag) : pv_head(8, 0, vc, at, n, pg, ag);
        }
    } else
#endif
    for (int64_t t = 0; t < n; t++) {
        const char *vp = (const char *)vc + (size_t)at[t] * es;
        const float *vr = (const float *)vp;
        if (dt) { load_row(dt, vp, kv, D); vr = kv; }
        for (int64_t g = 0; g < rep; g++) {
            float p = sc[g * n + t], *a = acc + g * D;
            for (int64_t i = 0; i < D; i++) a[i] += p * vr[i];
        }
    }
    store_row(dt, acc, (char *)out + (size_t)((b * H + h0) * D) * es, rep * D);
    free(qf);
}

#endif
