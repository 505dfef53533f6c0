/* Float linears for a few rows (decode steps): y[M,N] = x[M,K] @ W[N,K]^T (+ bias), W row-major as HF stores it.

Why: a decode step is mostly GEMVs bound by the weights' memory traffic; torch's CPU GEMM for 2-16 rows and its
16-bit GEMVs fall well short of it, and change their summation with the row count. Here every W tile (NR output
rows x all of K) is read from memory once and applied to all M rows (the x rows stay in L1/L2); OpenMP splits the
output rows between threads.

Determinism: each output element y[m,n] has its own 16-lane float32 accumulator, walks K in the same steps
(16 floats / 32 bfloat16 per step, a masked last step) and is reduced in one fixed order, whatever M, the tile shape
or the thread count: row m of an M-row call is bitwise the M=1 call on that row.

Types: float32 (x, W, y float32), bfloat16 (bf16 x/W/y, float32 sums: AMX tiles where the CPU and the OS allow
them, 16 W rows per instruction, which keeps 8-16 rows memory-bound; else AVX512_BF16 dot products; the rows of N
past a multiple of 16 always take the latter), float16 (f16 x/W/y, float32 sums). Portable C fallback without
AVX-512. Bias has W's type.
Entry points return 0, or -1 for an unsupported shape (Python then keeps its torch path).
*/
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "split.h"
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAXM 16
#define AI static inline __attribute__((always_inline))

#include "half.h"  /* scalar conversions: x staging, outputs and biases */

enum { T_F32 = 0, T_BF16 = 1, T_F16 = 2 };

static inline float load_elem(const void *p, int64_t i, int t) {
    if (t == T_F32) return ((const float *)p)[i];
    if (t == T_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}
static inline void store_elem(void *p, int64_t i, float v, int t) {
    if (t == T_F32) ((float *)p)[i] = v;
    else if (t == T_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((uint16_t *)p)[i] = f32_to_f16(v);
}

/* the finished dot products of one tile -> y (+ bias), converted to the output type */
AI void store_tile(const float *sums, int MR, int NR, const void *bias, void *y, int64_t ldy, int64_t m0, int64_t n0,
                   int t) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float v = sums[i * NR + j];
            if (bias) v += load_elem(bias, n0 + j, t);
            store_elem(y, (m0 + i) * ldy + n0 + j, v, t);
        }
}

#include "gemv_tiles.h"  /* tile16, tile_dp, tile_c */

/* ---- one N tile: all M rows, in row blocks of up to MB -------------------------------------------------------- */
#define TILE(MR_, NR_)                                                                                            \
    do {                                                                                                          \
        if (dp) TILE_DP(MR_, NR_);                                                                                \
        else tile16(xf + m0 * ldxf, ldxf, wt, K, MR_, NR_, t, sums, pf, K * es, pfn);                             \
    } while (0)
#ifdef __AVX512BF16__
#define TILE_DP(MR_, NR_) \
    tile_dp((const uint16_t *)xraw + m0 * ldx, ldx, (const uint16_t *)wt, K, MR_, NR_, sums, pf, K * 2)
#else
#define TILE_DP(MR_, NR_) (void)0
#endif

static void run_tile(const float *xf, int64_t ldxf, const void *xraw, int64_t ldx, const void *w, const void *bias,
                     void *y, int64_t M, int64_t N, int64_t K, int64_t n0, int NR, int t, int dp) {
    const int es = t == T_F32 ? 4 : 2;
    const void *wt = (const char *)w + n0 * K * es;
    float sums[4 * 8];
#ifdef __AVX512F__
    const int MB = NR == 8 ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        int MR = (int)(M - m0 < MB ? M - m0 : MB);
        /* the first row block streams W from memory, the others read it from L1: the next tile's rows are
           prefetched into L2 meanwhile, shared out between the row blocks so that memory stays busy throughout
           (the x rows fill L1) */
        const int64_t passes = (M + MB - 1) / MB, p = m0 / MB;
        const int j0 = (int)(p * NR / passes), pfn = (int)((p + 1) * NR / passes) - j0;
        const char *pf = (n0 + 2 * NR <= N && pfn > 0) ? (const char *)wt + (NR + j0) * K * es : NULL;
        if (NR == 8) {
            if (MR == 1) TILE(1, 8); else TILE(2, 8);
        } else if (NR == 4) {
            switch (MR) {
            case 1: TILE(1, 4); break;
            case 2: TILE(2, 4); break;
            case 3: TILE(3, 4); break;
            default: TILE(4, 4); break;
            }
        } else {
            switch (MR) {
            case 1: TILE(1, 1); break;
            case 2: TILE(2, 1); break;
            case 3: TILE(3, 1); break;
            default: TILE(4, 1); break;
            }
        }
        store_tile(sums, MR, NR, bias, y, N, m0, n0, t);
    }
#else
    (void)xraw; (void)ldx; (void)dp;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int MR = (int)(M - m0 < 4 ? M - m0 : 4);
        tile_c(xf + m0 * ldxf, ldxf, wt, K, MR, NR, t, sums);
        store_tile(sums, MR, NR, bias, y, N, m0, n0, t);
    }
#endif
}

#include "gemv_amx.h"

static int use_amx(int t, int64_t N) {
#ifdef HAVE_AMX
    return t == T_BF16 && N >= 16 && amx_usable();
#else
    (void)t; (void)N;
    return 0;
#endif
}

/* Thread tid of nth's share of y = x W^T (+ bias): contiguous ranges of whole tiles, the rows past the last tile on
   the last thread. Every output element is computed the same way whatever the split. */
static int float_part(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                     int64_t K, int t, int tid, int nth) {
    int64_t n_done = 0; /* rows [0, n_done) computed by AMX */
#ifdef HAVE_AMX
    if (use_amx(t, N)) {
        const int64_t pairs = (N / 16 + 1) / 2;
        if (amx_part((const uint16_t *)x, ldx, (const uint16_t *)w, (const uint16_t *)bias, (uint16_t *)y, M, N, K,
                     share(pairs, tid, nth), share(pairs, tid + 1, nth)) != 0)
            return -1;
        n_done = N / 16 * 16;
    }
#endif
    int dp = 0;
#ifdef __AVX512BF16__
    dp = t == T_BF16;
#endif
    const float *xf = (const float *)x;
    int64_t ldxf = ldx;
    float *stage = NULL;
    const int NR = M <= 2 ? 8 : 4;
    const int64_t tiles = n_done ? 0 : N / NR, rest = N - (n_done ? n_done : tiles * NR);
    const int64_t b0 = share(tiles, tid, nth), b1 = share(tiles, tid + 1, nth), last = tid == nth - 1;
    if (t != T_F32 && !dp && (b1 > b0 || (last && rest))) { /* 16-bit x: convert the few rows to float32 once */
        stage = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (!stage) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) stage[m * K + k] = load_elem(x, m * ldx + k, t);
        xf = stage;
        ldxf = K;
    }
    for (int64_t b = b0; b < b1; b++) run_tile(xf, ldxf, x, ldx, w, bias, y, M, N, K, b * NR, NR, t, dp);
    if (last)
        for (int64_t n = N - rest; n < N; n++) run_tile(xf, ldxf, x, ldx, w, bias, y, M, N, K, n, 1, t, dp);
    free(stage);
    return 0;
}

static int gemv(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                int64_t K, int nt, int t) {
    if (M < 1 || M > MAXM || N < 1 || K < 1 || ldx < K) return -1;
    /* tiny N: no point waking threads (AMX: 32-row pairs; else NR-row tiles, two per thread at least) */
    const int64_t units = use_amx(t, N) ? (N / 16 + 1) / 2 : N / (M <= 2 ? 8 : 4) / 2;
    if (nt < 1) nt = 1;
    if (units < nt) nt = units > 1 ? (int)units : 1;
    int err = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : err)
    err |= float_part(x, ldx, w, bias, y, M, N, K, t, omp_get_thread_num(), omp_get_num_threads());
    return err ? -1 : 0;
}

int inferflow_gemv_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int nt) {
    return gemv(x, ldx, w, bias, y, M, N, K, nt, T_F32);
}

int inferflow_gemv_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                        int64_t M, int64_t N, int64_t K, int nt) {
    return gemv(x, ldx, w, bias, y, M, N, K, nt, T_BF16);
}

int inferflow_gemv_f16(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t M, int64_t N, int64_t K, int nt) {
    return gemv(x, ldx, w, bias, y, M, N, K, nt, T_F16);
}

int inferflow_gemv_max_rows(void) { return MAXM; }

/* bfloat16 through AMX tiles: 1 on, 0 off; set: 0/1 switches it (tests), -1 only asks */
int inferflow_gemv_amx(int set) {
#ifdef HAVE_AMX
    if (set >= 0) amx_state = set ? -1 : 0;
    return amx_usable();
#else
    (void)set;
    return 0;
#endif
}

/* 1 where the bfloat16 path uses vdpbf16ps (its products differ from float32 FMAs in the last bits) */
int inferflow_gemv_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
