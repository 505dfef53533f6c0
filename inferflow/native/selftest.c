/* Smoke kernel for the build machinery (tests/test_native_build.py): a threaded dot product. */
#include <omp.h>
#include <stdint.h>

float inferflow_dot(const float *a, const float *b, int64_t n, int nthreads) {
    double acc = 0.0;
#pragma omp parallel for num_threads(nthreads) reduction(+ : acc) schedule(static)
    for (int64_t i = 0; i < n; i++) acc += (double)a[i] * b[i];
    return (float)acc;
}

int inferflow_omp_threads(int nthreads) {
    int seen = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        seen = omp_get_num_threads();
    }
    return seen;
}

/* The address this library resolved omp_get_num_threads to: the test compares it with torch's libgomp. */
void *inferflow_omp_symbol(void) { return (void *)&omp_get_num_threads; }
