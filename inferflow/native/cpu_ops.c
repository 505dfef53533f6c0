/* The small non-GEMV ops of a CPU decode step as one C call each (inferflow/native/cpu_ops.py drives them).
 *
 * At batch 1 a layer's RMSNorms, residual adds, RoPE, K/V cache write, paged attention and SiLU*mul are ~40 tiny
 * torch ops of a few microseconds each; here each is one call. Element types: 0 = float32, 1 = bfloat16 (math in
 * float32, rounded to bfloat16 where the torch composition rounds), 2 = float8 e4m3 and 3 = int8 with one float32
 * scale per row (K/V caches only; kv_store.quantize_int8's layout). Every output element is computed by one thread
 * in a fixed order, so results do not depend on the batch size, the other rows or the thread count (a sequence
 * decodes to the same tokens alone or in a batch). Plain C the compiler vectorises, plus AVX-512 intrinsics for
 * attention's dot product (same sums in the same order as its portable version).
 */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define STACK_FLOATS 4096

#include "half.h"

static inline float rnd(float f, int dt) { return dt ? bf16_to_f32(f32_to_bf16(f)) : f; }

static void round_row(float *a, int64_t n) {  /* to bfloat16 and back, in place */
    for (int64_t i = 0; i < n; i++) a[i] = bf16_to_f32(f32_to_bf16(a[i]));
}

/* float8 e4m3 -> float32 for all 256 codes (the vector loads gather from it) */
static float e4m3_lut[256];
__attribute__((constructor)) static void e4m3_lut_init(void) {
    for (int i = 0; i < 256; i++) e4m3_lut[i] = e4m3_to_f32((uint8_t)i);
}

static void load_row(int dt, const void *src, float *dst, int64_t n) {
    if (dt == 0) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == 2) {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = e4m3_lut[s[i]];
    } else if (dt == 3) {  /* the codes; the caller applies the row's scale */
        const int8_t *s = (const int8_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

static void store_row(int dt, const float *src, void *dst, int64_t n) {
    if (dt == 0) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == 2) {
        uint8_t *d = (uint8_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_e4m3(src[i]);
    } else {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    }
}

static inline size_t esize(int dt) { return dt >= 2 ? 1 : dt ? 2 : 4; }

/* sum of a[i] * b[i] in a fixed order: 16 lane partial sums, then the lanes as a halving tree (a few shuffles,
 * not 15 dependent adds: this runs once per key and head in attention) */
static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef __AVX512F__
    /* the same sums in the same order as the portable loop below, in registers (GCC does not vectorise it well) */
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
    }
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
#else
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[i % LANES] += a[i] * b[i];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
#endif
}

/* exp(x) (Cephes' expf: ~1 ulp), branch-free so loops over it vectorise */
static inline float vexp(float x) {
    x = x < -87.3f ? -87.3f : x;  /* ternaries, not fminf/fmaxf: those do not vectorise */
    x = x > 88.3f ? 88.3f : x;
    /* n = rint(x / ln 2) by the 1.5 * 2^23 trick (floorf does not vectorise without -fno-trapping-math) */
    float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float z = r * r;
    float y = ((((1.9875691500E-4f * r + 1.3981999507E-3f) * r + 8.3334519073E-3f) * r + 4.1665795894E-2f) * r
               + 1.6666665459E-1f) * r + 5.0000001201E-1f;
    y = y * z + r + 1.0f;
    int32_t e = ((int32_t)fx + 127) << 23;
    float p;
    memcpy(&p, &e, 4);
    return y * p;
}

#include "rmsnorm.h"  /* cpu_rmsnorm, cpu_add_rmsnorm and their per-row tasks */

/* out = silu(g) * u per row of I (silu rounded to the dtype first, as torch's silu then mul), in tasks of one
 * row's SILU_CH columns: silu_task does task t (of rows * ceil(I / SILU_CH)), each element written once */
#define SILU_CH 1024
static void silu_task(int dt, const void *g, int64_t sg, const void *u, int64_t su, void *out, int64_t I, int64_t t) {
    int64_t nch = (I + SILU_CH - 1) / SILU_CH;
    int64_t r = t / nch, c0 = (t % nch) * SILU_CH, n = I - c0 < SILU_CH ? I - c0 : SILU_CH;
    float a[SILU_CH], b[SILU_CH];
    load_row(dt, (const char *)g + (size_t)(r * sg + c0) * esize(dt), a, n);
    load_row(dt, (const char *)u + (size_t)(r * su + c0) * esize(dt), b, n);
    for (int64_t i = 0; i < n; i++) a[i] = a[i] / (1.0f + vexp(-a[i]));
    if (dt) round_row(a, n);
    for (int64_t i = 0; i < n; i++) a[i] *= b[i];
    store_row(dt, a, (char *)out + (size_t)(r * I + c0) * esize(dt), n);
}

void cpu_silu_mul(int dt, const void *g, int64_t sg, const void *u, int64_t su, void *out, int64_t rows, int64_t I,
                  int nt) {
    int64_t tasks = rows * ((I + SILU_CH - 1) / SILU_CH);
    int par = nt > 1 && rows * I >= 32768;
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
    for (int64_t t = 0; t < tasks; t++) silu_task(dt, g, sg, u, su, out, I, t);
}

/* Rotate-half RoPE of heads x[n, h, :D] (row stride sxn, head stride sxh, elements) into contiguous out [N, H, D]:
 * out = x * cos + roll(x, D/2) * ssin with ssin = [-sin | sin] (components/rope.py's table form), each product and
 * the sum rounded to the dtype as torch's mul/mul/add. cos/ssin rows [N, D] at stride sc. rope_head: one head. */
static void rope_head(int dt, const void *x, const void *cs, const void *ss, int64_t D, void *out) {
    int64_t half = D / 2;
    float xb[STACK_FLOATS], cb[STACK_FLOATS], sb[STACK_FLOATS], ob[STACK_FLOATS];
    load_row(dt, cs, cb, D);
    load_row(dt, ss, sb, D);
    load_row(dt, x, xb, D);
    for (int64_t i = 0; i < half; i++) {
        ob[i] = rnd(rnd(xb[i] * cb[i], dt) + rnd(xb[i + half] * sb[i], dt), dt);
        ob[i + half] = rnd(rnd(xb[i + half] * cb[i + half], dt) + rnd(xb[i] * sb[i + half], dt), dt);
    }
    store_row(dt, ob, out, D);
}

void cpu_rope(int dt, const void *x, int64_t sxn, int64_t sxh, int64_t N, int64_t H, int64_t D, const void *cs,
              const void *ss, int64_t sc, void *out) {
    if (D > STACK_FLOATS) return;
    size_t es = esize(dt);
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++)
            rope_head(dt, (const char *)x + (size_t)(n * sxn + h * sxh) * es, (const char *)cs + (size_t)(n * sc) * es,
                      (const char *)ss + (size_t)(n * sc) * es, D, (char *)out + (size_t)((n * H + h) * D) * es);
}

#include "paged_attention.h"  /* attn_chunk / attn_merge: the decode attention below in tasks */

/* One decode step of attention for B sequences over the paged cache, in place.
 * q [B, H, D] (row stride sq, heads contiguous); knew/vnew [B, Hkv, D] (row strides skn/svn, heads contiguous) are
 * first stored at slots[b] of the flat caches kc/vc [S, Hkv, D] (S = blocks * bs; knew NULL: already stored; an
 * int8 cache (cdt 3) also keeps each row's scale in ks/vs [S, Hkv], NULL otherwise); then
 * query b attends to its first lens[b] keys, or with win > 0 the last win of them (paged_task). GQA: q head h reads kv head h / (H / Hkv). One task per
 * (sequence, kv head). */
int cpu_paged_decode(int dt, int cdt, const void *q, int64_t sq, const void *knew, int64_t skn, const void *vnew,
                     int64_t svn, void *kc, void *vc, float *ks, float *vs, const int64_t *slots,
                     const int64_t *tables, int64_t tstride,
                     const int64_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                     int64_t win, void *out, int nt) {
    const size_t es = esize(dt), ces = esize(cdt);
    if (knew != NULL) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t kh = 0; kh < Hkv; kh++) {
                const size_t at = (size_t)((slots[b] * Hkv + kh) * D) * ces;
                const int64_t row = slots[b] * Hkv + kh;
                kv_row(dt, cdt, (const char *)knew + (size_t)(b * skn + kh * D) * es, (char *)kc + at, D,
                       ks ? ks + row : NULL);
                kv_row(dt, cdt, (const char *)vnew + (size_t)(b * svn + kh * D) * es, (char *)vc + at, D,
                       vs ? vs + row : NULL);
            }
    }
    int64_t work = 0, tasks = 0;
    for (int64_t b = 0; b < B; b++) {
        work += lens[b];
        tasks += att_nchunks(att_keys(lens[b], win)) * Hkv;
    }
    /* the partials: a buffer per calling thread, grown as needed (a fresh one per call would fault its pages in) */
    static __thread float *mine;
    static __thread size_t cap;
    const size_t need = (size_t)(B * ATT_CHUNKS * H * (D + 2));
    if (need > cap) {
        free(mine);
        mine = malloc(need * 4);
        cap = mine ? need : 0;
        if (!mine) return -1;
    }
    float *part = mine;  /* the OpenMP threads below share the caller's (a thread-local read there is their own) */
    int64_t *task = malloc((size_t)tasks * 2 * sizeof(int64_t));  /* (sequence, chunk) of each task / Hkv */
    if (!task) return -1;
    for (int64_t b = 0, i = 0; b < B; b++)
        for (int64_t c = 0, C = att_nchunks(att_keys(lens[b], win)); c < C; c++, i++) {
            task[2 * i] = b;
            task[2 * i + 1] = c;
        }
    /* threads unless the call is tiny: a fork/join costs microseconds (milliseconds on an oversubscribed machine), a
       quarter-million key elements on one thread ~100 us (tools/ab_native_attention.py: batch 8 x 192 keys 36%
       faster than from 1 << 20; no change at 16-64 keys) */
    const int par = nt > 1 && tasks > 1 && work * H * D >= (1 << 16);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (par)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t i = t / Hkv;
            if (attn_chunk(dt, cdt, q, sq, kc, vc, ks, vs, tables, tstride, lens, task[2 * i], task[2 * i + 1], t % Hkv, H, Hkv,
                           D, bs, scale, win, part)) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < B * H; u++)
            if (!failed) attn_merge(dt, lens, win, u / H, u % H, H, D, part, out);
    }
    free(task);
    return failed ? -1 : 0;
}

#include "argmax.h"
