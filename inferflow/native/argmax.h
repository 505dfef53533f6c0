/* Greedy sampling's argmax for cpu_ops.c (included there). Not a standalone header. */
#ifndef INFERFLOW_ARGMAX_H
#define INFERFLOW_ARGMAX_H

/* out[r] = the index of the first maximum of row r of x [rows, n] (float32, row stride sx), as torch.argmax: a NaN
 * counts as the maximum (the first NaN wins). torch's CPU argmax takes ~125 us over a 49152-entry vocabulary row;
 * this is one max pass and one search for it. */
void cpu_argmax(const float *x, int64_t sx, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * sx;
        float m = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 bad = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 a = _mm512_loadu_ps(v + i);
            bad |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, a);
        }
        m = _mm512_reduce_max_ps(mv);
        nan = bad != 0;
#endif
        for (; i < n; i++) {
            nan |= v[i] != v[i];
            m = v[i] > m ? v[i] : m;
        }
        i = 0;
#ifdef __AVX512F__
        const __m512 mb = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            const __m512 a = _mm512_loadu_ps(v + i);
            const __mmask16 hit = nan ? _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(a, mb, _CMP_EQ_OQ);
            if (hit) break;
        }
#endif
        for (; i < n; i++)
            if (nan ? v[i] != v[i] : v[i] == m) break;
        out[r] = i < n ? i : 0;
    }
}

#endif
