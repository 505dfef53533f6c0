/* bfloat16 GEMVs on AMX tiles for gemv_float.c (included there, after its tile helpers): the OS permission,
the tile configuration and the 16-row blocks. Not a standalone header. */
#ifndef INFERFLOW_GEMV_AMX_H
#define INFERFLOW_GEMV_AMX_H

#ifdef HAVE_AMX
/* bfloat16 with AMX tiles: C[16 W rows][M] += A[16 W rows][32 k] . B[16 k pairs][M pairs]. A is read straight from
   W (a 64-byte piece of 16 rows), B is x re-laid once per call in pairs ("VNNI"), so 16 output rows take one
   TDPBF16PS per 32 k. Each element is summed by the hardware in k order, independent of M. */
static int amx_state = -1; /* -1 unknown, 0 off, 1 on */
#ifndef PF_AMX
#define PF_AMX 1
#endif
#define BARRIER() __asm__ __volatile__("" ::: "memory")

static int amx_usable(void) {
    if (amx_state < 0) { /* Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
        const char *env = getenv("INFERFLOW_AMX");
        amx_state = (env && env[0] == '0') ? 0 : syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void amx_config(int64_t M) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) c.rows[t] = 16;
    c.colsb[0] = c.colsb[1] = c.colsb[4] = (uint16_t)(M * 4); /* C0, C1 (float32 x M), B (M bf16 pairs) */
    c.colsb[2] = c.colsb[3] = 64;                             /* A0, A1: 32 bf16 of 16 W rows */
    _tile_loadconfig(&c);
}

/* 16 * nb (1 or 2) W rows from n0 */
static void amx_block(const uint16_t *xp, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int64_t n0, int nb) {
    const int64_t full = K / 32, bstride = 16 * M * 2;
    const uint16_t *w0 = w + n0 * K, *w1 = w0 + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    /* the next block's rows (contiguous: 16 * nb * K * 2 bytes) prefetched across this block's k steps */
    const char *pf = PF_AMX && nb == 2 && n0 + 64 <= N ? (const char *)(w0 + 32 * K) : NULL;
    const int64_t lines = K, per = full ? (lines + full - 1) / full : 0; /* 64-byte lines */
    for (int64_t kb = 0; kb < full; kb++) {
        if (pf)
            for (int64_t i = kb * per; i < (kb + 1) * per && i < lines; i++) _mm_prefetch(pf + i * 64, _MM_HINT_T1);
        _tile_loadd(4, xp + kb * bstride, M * 4);
        _tile_loadd(2, w0 + kb * 32, K * 2);
        _tile_dpbf16ps(0, 2, 4);
        if (nb == 2) {
            _tile_loadd(3, w1 + kb * 32, K * 2);
            _tile_dpbf16ps(1, 3, 4);
        }
    }
    if (K % 32) { /* the last k piece, zero-padded (past a row's end lies the next row, or unmapped memory) */
        uint16_t tail[32][32];
        memset(tail, 0, sizeof tail);
        for (int r = 0; r < 16 * nb; r++) memcpy(tail[r], w0 + r * K + full * 32, (size_t)(K % 32) * 2);
        BARRIER(); /* the tile intrinsics are asm without a memory operand: keep the stores above */
        _tile_loadd(4, xp + full * bstride, M * 4);
        _tile_loadd(2, tail[0], 64);
        _tile_dpbf16ps(0, 2, 4);
        if (nb == 2) {
            _tile_loadd(3, tail[16], 64);
            _tile_dpbf16ps(1, 3, 4);
        }
    }
    float c[32][16];
    _tile_stored(0, c[0], 64);
    if (nb == 2) _tile_stored(1, c[16], 64);
    BARRIER();
    for (int r = 0; r < 16 * nb; r++) {
        float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
        for (int64_t m = 0; m < M; m++) y[m * N + n0 + r] = f32_to_bf16(c[r][m] + b);
    }
}

/* This thread's share (pairs [p0, p1) of 16-row blocks) on AMX tiles, with its own re-laid copy of x */
static int amx_part(const uint16_t *x, int64_t ldx, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                    int64_t N, int64_t K, int64_t p0, int64_t p1) {
    const int64_t nkb = (K + 31) / 32, blocks = N / 16;
    if (p0 >= p1) return 0;
    uint16_t *xp = (uint16_t *)calloc((size_t)(nkb * 32 * M), 2);
    if (!xp) return -1;
    for (int64_t m = 0; m < M; m++) /* xp[kb][k pair][m][2] */
        for (int64_t k = 0; k < K; k++)
            xp[(k / 32) * 32 * M + ((k % 32) / 2) * M * 2 + m * 2 + (k & 1)] = x[m * ldx + k];
    amx_config(M);
    for (int64_t p = p0; p < p1; p++) amx_block(xp, w, bias, y, M, N, K, p * 32, 2 * p + 1 < blocks ? 2 : 1);
    _tile_release();
    free(xp);
    return 0;
}
#endif

#endif
