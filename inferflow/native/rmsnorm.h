/* RMSNorm and residual add + RMSNorm for cpu_ops.c (included there, after its row helpers), bit for bit torch's:
   the sum of squares in torch's own order (torch_sumsq). Not a standalone header. */
#ifndef INFERFLOW_RMSNORM_H
#define INFERFLOW_RMSNORM_H

static int ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* sum of x[i]^2 in exactly the order of torch's CPU sum (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum over
 * a contiguous row, W float lanes per vector: 8 on x86, whose sum runs its AVX2 build even under AVX-512; 1 when
 * the row is shorter than a vector): four interleaved vector accumulators summed in cascade levels of 16 steps, the
 * four combined, then the scalar tail and the lanes left to right. Matching it makes the norm bit for bit torch's
 * x.pow(2).mean(). */
static float torch_sumsq(const float *x, int64_t n, int W) {
    enum { ILP = 4, LEVELS = 4, MAXW = 16 };
    if (n < W) W = 1;
    int64_t nvec = n / W, rows = nvec / ILP;
    int lp = ceil_log2(rows) / LEVELS;
    if (lp < 4) lp = 4;
    int64_t step = (int64_t)1 << lp, lmask = step - 1;
    float acc[LEVELS][ILP][MAXW];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++) {
                const float *v = x + (i * ILP + k) * W;
                for (int l = 0; l < W; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < W; l++) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; }
            if (i & (lmask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < ILP; k++) {
            const float *v = x + (i * ILP + k) * W;
            for (int l = 0; l < W; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < W; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t r = rows * ILP; r < nvec; r++)  /* vectors left over from the four-way split */
        for (int l = 0; l < W; l++) acc[0][0][l] += x[r * W + l] * x[r * W + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < W; l++) acc[0][0][l] += acc[0][k][l];
    float s = 0.f;
    for (int64_t t = nvec * W; t < n; t++) s += x[t] * x[t];
    for (int l = 0; l < W; l++) s += acc[0][0][l];
    return s;
}

/* y = rmsnorm(x) * (w + offset) per row of D, as components/norms.py: weight_in_float multiplies in float32,
 * else the normalized row and the weight are both rounded to the dtype first (HF llama). x rows at stride sx
 * (elements); y contiguous; w of type wdt; lanes: torch's float vector width (torch_sumsq). rmsnorm_row: row r. */
static void rmsnorm_row(int dt, const void *x, int64_t sx, const void *w, int wdt, void *y, int64_t r, int64_t D,
                        float eps, float offset, int weight_in_float, int lanes) {
    float sbuf[STACK_FLOATS], wbuf[STACK_FLOATS];
    float *h = D <= STACK_FLOATS ? sbuf : malloc((size_t)D * 4);
    float *wf = D <= STACK_FLOATS ? wbuf : malloc((size_t)D * 4);
    load_row(dt, (const char *)x + (size_t)(r * sx) * esize(dt), h, D);
    load_row(wdt, w, wf, D);
    float inv = 1.0f / sqrtf(torch_sumsq(h, D, lanes) / (float)D + eps);  /* torch: sum, div_(D), + eps, rsqrt */
    if (weight_in_float || dt == 0) {
        for (int64_t i = 0; i < D; i++) h[i] = h[i] * inv * (wf[i] + offset);
    } else {
        for (int64_t i = 0; i < D; i++) h[i] = rnd(wf[i] + offset, dt) * rnd(h[i] * inv, dt);
    }
    store_row(dt, h, (char *)y + (size_t)(r * D) * esize(dt), D);
    if (h != sbuf) { free(h); free(wf); }
}

void cpu_rmsnorm(int dt, const void *x, int64_t sx, const void *w, int wdt, void *y, int64_t rows, int64_t D,
                 float eps, float offset, int weight_in_float, int lanes, int nt) {
    int par = nt > 1 && rows * D >= 65536;
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
    for (int64_t r = 0; r < rows; r++) rmsnorm_row(dt, x, sx, w, wdt, y, r, D, eps, offset, weight_in_float, lanes);
}

/* s = a + b (rounded to the dtype, as torch's add) and y = rmsnorm(s) as cpu_rmsnorm, per contiguous row of D:
 * a pre-norm layer's residual add and the next norm in one call (model/fuse_add_norm.py). add_rmsnorm_row: row r. */
static void add_rmsnorm_row(int dt, const void *a, const void *b, const void *w, int wdt, void *s, void *y, int64_t r,
                            int64_t D, float eps, float offset, int weight_in_float, int lanes) {
    float hb[STACK_FLOATS], bb[STACK_FLOATS], wb[STACK_FLOATS];
    int big = D > STACK_FLOATS;
    float *h = big ? malloc((size_t)D * 4) : hb, *u = big ? malloc((size_t)D * 4) : bb;
    float *wf = big ? malloc((size_t)D * 4) : wb;
    size_t off = (size_t)(r * D) * esize(dt);
    load_row(dt, (const char *)a + off, h, D);
    load_row(dt, (const char *)b + off, u, D);
    for (int64_t i = 0; i < D; i++) h[i] += u[i];
    if (dt) round_row(h, D);
    store_row(dt, h, (char *)s + off, D);
    load_row(wdt, w, wf, D);
    float inv = 1.0f / sqrtf(torch_sumsq(h, D, lanes) / (float)D + eps);
    if (weight_in_float || dt == 0) {
        for (int64_t i = 0; i < D; i++) h[i] = h[i] * inv * (wf[i] + offset);
    } else {
        for (int64_t i = 0; i < D; i++) h[i] = rnd(wf[i] + offset, dt) * rnd(h[i] * inv, dt);
    }
    store_row(dt, h, (char *)y + off, D);
    if (big) { free(h); free(u); free(wf); }
}

void cpu_add_rmsnorm(int dt, const void *a, const void *b, const void *w, int wdt, void *s, void *y, int64_t rows,
                     int64_t D, float eps, float offset, int weight_in_float, int lanes, int nt) {
    int par = nt > 1 && rows * D >= 65536;
#pragma omp parallel for num_threads(nt) schedule(static) if (par)
    for (int64_t r = 0; r < rows; r++) add_rmsnorm_row(dt, a, b, w, wdt, s, y, r, D, eps, offset, weight_in_float, lanes);
}

#endif
