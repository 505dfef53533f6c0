/* A whole CPU decode step in one parallel region: the executor of the programs inferflow/native/step.py builds.

Why: a decode step of a small model is ~10 kernels per layer of a few to a few hundred microseconds each. Run one
call at a time from Python, each pays the interpreter, torch's dispatch and an OpenMP fork/join that wakes the other
threads (often from sleep, when Python took long enough between two calls); the step then takes 2-4x its kernels'
time. Here the threads enter once per step, run every op of the program (their share of it) and meet at a spinning
barrier between ops, as llama.cpp's graph executor does.

The ops are the same kernels as the single calls (gemv_float.c, gemv_ggml.c, cpu_ops.c, included below), split by
the same rules, so a step gives the same bits as the op-by-op path. Arguments are plain structs mirrored in step.py;
the per-step values (rows, positions, KV slots, key counts, block tables) live in one StepState the ops all read.
*/
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__SSE2__)
#include <immintrin.h>
#endif
/* the kernels' own symbols stay private to this library (system headers first: their declarations stay default) */
#pragma GCC visibility push(hidden)
#include "gemv_float.c"
#undef TILE
#undef TILE_DP
#include "gemv_ggml.c"
#undef TILE
#undef CH
#include "cpu_ops.c"
#pragma GCC visibility pop

typedef struct {
    int64_t M;                                            /* rows (sequences) this step */
    const int64_t *ids, *pos, *slots, *lens, *tables;     /* [M] each; tables [M, tstride] */
    int64_t tstride;
    int64_t err;                                          /* set by an op that failed (out of memory) */
} StepState;

typedef void (*op_fn)(const void *args, StepState *st, int tid, int nth);
typedef struct { op_fn fn; const void *args; } StepOp;

/* y[m] = row ids[m] of a token-embedding table [V, D]: float rows (qt < 0, already of the output type dt) copied,
   ggml blocks (type qt, rows rb bytes apart) decoded as the reference dequantizer and rounded to dt */
typedef struct { const void *w; void *y; int64_t qt, rb, D, dt; } Embed;
static void op_embed(const void *p, StepState *st, int tid, int nth) {
    const Embed *a = (const Embed *)p;
    const size_t es = esize((int)a->dt);
    for (int64_t m = share(st->M, tid, nth); m < share(st->M, tid + 1, nth); m++) {
        const uint8_t *row = (const uint8_t *)a->w + st->ids[m] * a->rb;
        char *y = (char *)a->y + (size_t)(m * a->D) * es;
        if (a->qt < 0) {
            memcpy(y, row, (size_t)a->D * es);
            continue;
        }
        float buf[32];
        for (int64_t sb = 0; sb < a->D / 32; sb++) {
#ifdef __AVX512F__
            __m512 lo, hi;
            decode32_any((int)a->qt, row, sb, &lo, &hi);
            _mm512_storeu_ps(buf, lo);
            _mm512_storeu_ps(buf + 16, hi);
#else
            decode32_scalar((int)a->qt, row, sb, buf);
#endif
            store_row((int)a->dt, buf, y + (size_t)(sb * 32) * es, 32);
        }
    }
}

/* y[M, N] = x[M, K] W^T (+ bias): float weights of type t (0 float32, 1 bfloat16, 2 float16), y contiguous */
typedef struct { const void *x, *w, *bias; void *y; int64_t ldx, N, K, t; } GemvF;
static void op_gemv_f(const void *p, StepState *st, int tid, int nth) {
    const GemvF *a = (const GemvF *)p;
    if (float_part(a->x, a->ldx, a->w, a->bias, a->y, st->M, a->N, a->K, (int)a->t, tid, nth)) st->err = 1;
}

/* the same from ggml blocks (type qt, rows rb bytes apart), float32 x and y */
typedef struct { const void *w, *x, *bias; void *y; int64_t qt, rb, ldx, ldy, N, K; } GemvQ;
static void op_gemv_q(const void *p, StepState *st, int tid, int nth) {
    const GemvQ *a = (const GemvQ *)p;
    ggml_part((int)a->qt, (const uint8_t *)a->w, a->rb, (const float *)a->x, a->ldx, (float *)a->y, a->ldy,
              (const float *)a->bias, st->M, a->N, a->K, 1, tid, nth);
}

#ifdef HAVE_VNNI
/* llama.cpp's arithmetic (gemv_ggml.c, ggml_gemv_q8x): x quantized once into scratch, then the int8 products */
typedef struct { const void *x; void *scratch; int64_t ldx, K; } QuantX;
/* The scratch's parts: x's int8 codes [M, K], per-block scales and code sums [M, K / 32] */
typedef struct { int8_t *xq; float *dx; int32_t *sx; } Q8XBuf;
static Q8XBuf q8x_buf(void *scratch, int64_t M, int64_t K) {
    Q8XBuf b;
    b.xq = (int8_t *)scratch;
    b.dx = (float *)(b.xq + M * K);
    b.sx = (int32_t *)(b.dx + M * (K / 32));
    return b;
}
static void op_quant_x(const void *p, StepState *st, int tid, int nth) {
    const QuantX *a = (const QuantX *)p;
    const Q8XBuf b = q8x_buf(a->scratch, st->M, a->K);
    const int64_t n = st->M * (a->K / 32);
    quantize_x_part((const float *)a->x, a->ldx, a->K, b.xq, b.dx, b.sx, share(n, tid, nth), share(n, tid + 1, nth));
}
typedef struct { const void *w, *bias; void *scratch, *y; int64_t qt, rb, ldy, N, K; } GemvQ8X;
static void op_gemv_q8x(const void *p, StepState *st, int tid, int nth) {
    const GemvQ8X *a = (const GemvQ8X *)p;
    const Q8XBuf b = q8x_buf(a->scratch, st->M, a->K);
    gemv_q8x_part((int)a->qt, (const uint8_t *)a->w, a->rb, b.xq, b.dx, b.sx, (float *)a->y, a->ldy,
                  (const float *)a->bias, st->M, a->N, a->K, tid, nth);
}
#endif

/* y = rmsnorm(x) per row (cpu_rmsnorm's arithmetic); and s = a + b, y = rmsnorm(s) (cpu_add_rmsnorm's) */
typedef struct { const void *a, *b, *w; void *s, *y; int64_t sx, D, dt, wdt, wif, lanes; double eps, offset; } Norm;
static void op_rmsnorm(const void *p, StepState *st, int tid, int nth) {
    const Norm *a = (const Norm *)p;
    for (int64_t r = share(st->M, tid, nth); r < share(st->M, tid + 1, nth); r++)
        rmsnorm_row((int)a->dt, a->a, a->sx, a->w, (int)a->wdt, a->y, r, a->D, (float)a->eps, (float)a->offset,
                    (int)a->wif, (int)a->lanes);
}
static void op_add_rmsnorm(const void *p, StepState *st, int tid, int nth) {
    const Norm *a = (const Norm *)p;
    for (int64_t r = share(st->M, tid, nth); r < share(st->M, tid + 1, nth); r++)
        add_rmsnorm_row((int)a->dt, a->a, a->b, a->w, (int)a->wdt, a->s, a->y, r, a->D, (float)a->eps,
                        (float)a->offset, (int)a->wif, (int)a->lanes);
}

/* Per-head RMSNorm (q/k norms): head h < per of token m at x + m * sx + h * D (elements) -> y + m * sy + h * D */
typedef struct { const void *x, *w; void *y; int64_t sx, sy, per, D, dt, wdt, wif, lanes; double eps, offset; } HeadNorm;
static void op_head_rmsnorm(const void *p, StepState *st, int tid, int nth) {
    const HeadNorm *a = (const HeadNorm *)p;
    const size_t es = esize((int)a->dt);
    for (int64_t r = share(st->M * a->per, tid, nth); r < share(st->M * a->per, tid + 1, nth); r++) {
        const int64_t m = r / a->per, h = r % a->per;
        rmsnorm_row((int)a->dt, (const char *)a->x + (size_t)(m * a->sx + h * a->D) * es, 0, a->w, (int)a->wdt,
                    (char *)a->y + (size_t)(m * a->sy + h * a->D) * es, 0, a->D, (float)a->eps, (float)a->offset,
                    (int)a->wif, (int)a->lanes);
    }
}

/* y = a + b over [M, D] contiguous rows, rounded to the dtype as torch's add */
typedef struct { const void *a, *b; void *y; int64_t D, dt; } Add;
static void op_add(const void *p, StepState *st, int tid, int nth) {
    const Add *a = (const Add *)p;
    const int64_t n = st->M * a->D, i0 = share(n / 16, tid, nth) * 16, i1 = tid == nth - 1 ? n : share(n / 16, tid + 1, nth) * 16;
    if (a->dt == 0) {
        const float *x = (const float *)a->a, *y = (const float *)a->b;
        float *o = (float *)a->y;
        for (int64_t i = i0; i < i1; i++) o[i] = x[i] + y[i];
    } else {
        const uint16_t *x = (const uint16_t *)a->a, *y = (const uint16_t *)a->b;
        uint16_t *o = (uint16_t *)a->y;
        for (int64_t i = i0; i < i1; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    }
}

/* out[M, I] = silu(g) * u (cpu_silu_mul's tasks) */
typedef struct { const void *g, *u; void *out; int64_t sg, su, I, dt; } SiluMul;
static void op_silu_mul(const void *p, StepState *st, int tid, int nth) {
    const SiluMul *a = (const SiluMul *)p;
    const int64_t tasks = st->M * ((a->I + SILU_CH - 1) / SILU_CH);
    for (int64_t t = share(tasks, tid, nth); t < share(tasks, tid + 1, nth); t++)
        silu_task((int)a->dt, a->g, a->sg, a->u, a->su, a->out, a->I, t);
}

/* out[M, H, D] = rotate-half RoPE of heads x[n, h] (strides sxn, sxh), cos/ssin rows of the [P, D] tables at the
   rows' positions (components/rope.py's table) */
typedef struct { const void *x, *cos, *sin; void *out; int64_t sxn, sxh, H, D, dt; } Rope;
static void op_rope(const void *p, StepState *st, int tid, int nth) {
    const Rope *a = (const Rope *)p;
    const size_t es = esize((int)a->dt);
    for (int64_t u = share(st->M * a->H, tid, nth); u < share(st->M * a->H, tid + 1, nth); u++) {
        const int64_t n = u / a->H, h = u % a->H, row = st->pos[n] * a->D;
        rope_head((int)a->dt, (const char *)a->x + (size_t)(n * a->sxn + h * a->sxh) * es,
                  (const char *)a->cos + (size_t)row * es, (const char *)a->sin + (size_t)row * es, a->D,
                  (char *)a->out + (size_t)(u * a->D) * es);
    }
}

/* Attention of each row over the paged cache (cpu_paged_decode's arithmetic): kv_write stores the rows' new K/V
   heads at their slots, attention runs the (row, key chunk, kv head) tasks into part (M * ATT_CHUNKS * H * (D + 2)
   floats), attn_merge combines each (row, head)'s chunks. */
typedef struct { const void *q, *knew, *vnew; void *kc, *vc, *out, *part; float *ks, *vs; int64_t sq, skn, svn, H,
                 Hkv, D, bs, dt, cdt, win; double scale; } Attn;
static void op_kv_write(const void *p, StepState *st, int tid, int nth) {
    const Attn *a = (const Attn *)p;
    const int dt = (int)a->dt, cdt = (int)a->cdt;
    const size_t es = esize(dt), ces = esize(cdt);
    for (int64_t t = share(st->M * a->Hkv, tid, nth); t < share(st->M * a->Hkv, tid + 1, nth); t++) {
        const int64_t b = t / a->Hkv, kh = t % a->Hkv;
        const size_t at = (size_t)((st->slots[b] * a->Hkv + kh) * a->D) * ces;
        const int64_t row = st->slots[b] * a->Hkv + kh;
        kv_row(dt, cdt, (const char *)a->knew + (size_t)(b * a->skn + kh * a->D) * es, (char *)a->kc + at, a->D,
               a->ks ? a->ks + row : NULL);
        kv_row(dt, cdt, (const char *)a->vnew + (size_t)(b * a->svn + kh * a->D) * es, (char *)a->vc + at, a->D,
               a->vs ? a->vs + row : NULL);
    }
}
static void op_attention(const void *p, StepState *st, int tid, int nth) {
    const Attn *a = (const Attn *)p;
    int64_t tasks = 0;
    for (int64_t b = 0; b < st->M; b++) tasks += att_nchunks(att_keys(st->lens[b], a->win));
    tasks *= a->Hkv;
    const int64_t lo = share(tasks, tid, nth), hi = share(tasks, tid + 1, nth);
    for (int64_t b = 0, t = 0; b < st->M && t < hi; b++) {
        const int64_t n = att_nchunks(att_keys(st->lens[b], a->win)) * a->Hkv;
        for (int64_t i = t > lo ? 0 : lo - t; i < n && t + i < hi; i++)
            if (attn_chunk((int)a->dt, (int)a->cdt, a->q, a->sq, a->kc, a->vc, a->ks, a->vs, st->tables, st->tstride, st->lens, b, i / a->Hkv,
                           i % a->Hkv, a->H, a->Hkv, a->D, a->bs, (float)a->scale, a->win, (float *)a->part))
                st->err = 1;
        t += n;
    }
}
static void op_attn_merge(const void *p, StepState *st, int tid, int nth) {
    const Attn *a = (const Attn *)p;
    for (int64_t u = share(st->M * a->H, tid, nth); u < share(st->M * a->H, tid + 1, nth); u++)
        attn_merge((int)a->dt, st->lens, a->win, u / a->H, u % a->H, a->H, a->D, (float *)a->part, a->out);
}

/* A sense-reversing barrier: spins (threads are hot between ops), yielding now and then in case a thread was
   preempted on an oversubscribed machine */
typedef struct { _Atomic int count, sense; } Barrier;
static void barrier_wait(Barrier *b, int nth, int *local) {
    const int s = !*local;
    *local = s;
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, s, memory_order_release);
        return;
    }
    for (unsigned spins = 1; atomic_load_explicit(&b->sense, memory_order_acquire) != s; spins++) {
#ifdef __SSE2__
        _mm_pause();
#endif
        if ((spins & 0xFFFF) == 0) sched_yield();
    }
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The entry point: run ops[0..n) on nt threads; 0, or -1 if an op failed. times (or NULL): seconds from the start to
   the end of each op (its barrier passed), added to times[i] (profiling: tools/profile_cpu.py). */
int step_run(const StepOp *ops, int64_t n, StepState *st, int nt, double *times) {
    Barrier bar = {0, 0};
    st->err = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int sense = 0;
        double t0 = times && tid == 0 ? now_s() : 0.0;
        for (int64_t i = 0; i < n; i++) {
            ops[i].fn(ops[i].args, st, tid, nth);
            if (nth > 1) barrier_wait(&bar, nth, &sense);
            if (times && tid == 0) {
                const double t = now_s();
                times[i] += t - t0;
                t0 = t;
            }
        }
    }
    return st->err ? -1 : 0;
}

/* The op functions by name (step.py builds programs from these addresses); NULL for one this build lacks */
void *step_op(const char *name) {
    static const struct { const char *name; op_fn fn; } ops[] = {
        {"embed", op_embed}, {"gemv_f", op_gemv_f}, {"gemv_q", op_gemv_q}, {"rmsnorm", op_rmsnorm}, {"add_rmsnorm", op_add_rmsnorm},
        {"head_rmsnorm", op_head_rmsnorm},
        {"add", op_add}, {"silu_mul", op_silu_mul}, {"rope", op_rope}, {"kv_write", op_kv_write},
        {"attention", op_attention}, {"attn_merge", op_attn_merge},
#ifdef HAVE_VNNI
        {"quant_x", op_quant_x}, {"gemv_q8x", op_gemv_q8x},
#endif
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (!strcmp(ops[i].name, name)) return (void *)ops[i].fn;
    return NULL;
}
