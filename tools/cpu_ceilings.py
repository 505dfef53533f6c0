"""This CPU's ceilings for decode kernels: streaming-read bandwidth and float32 FMA rate.

    python tools/cpu_ceilings.py [--threads 2] [--mib 512] [--rounds 8]

Compiles a small C program with the system compiler (``cc -O2 -march=native -fopenmp``), then prints two things:
- the best of 7 sequential reads of ``--mib`` MiB by ``--threads`` threads, in GB/s. It runs with 4 KiB pages or
  transparent huge pages (``madvise``), and with or without software prefetch 1 or 4 KiB ahead;
- one core's multiply-adds per second, 16 independent chains, 512-bit and 256-bit FMAs interleaved over
  ``--rounds`` rounds (this VM changes speed by tens of percent within seconds).
A decode step at batch 1 is bound by the first, at 8+ float32 rows by both (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

SRC = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static volatile float sink;
static double stream(char *p, size_t n, int pf, int nt) {
    double best = 1e9;
    for (int r = 0; r < 7; r++) {
        double t0 = now();
#pragma omp parallel num_threads(nt)
        {
            int id = omp_get_thread_num(), th = omp_get_num_threads();
            size_t a = n / th * id, b = n / th * (id + 1);
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
            for (size_t i = a; i < b; i += 256) {
                if (pf) for (int l = 0; l < 256; l += 64) _mm_prefetch(p + i + pf + l, _MM_HINT_T1);
                s0 = _mm512_add_ps(s0, _mm512_load_ps((float *)(p + i)));
                s1 = _mm512_add_ps(s1, _mm512_load_ps((float *)(p + i + 64)));
                s2 = _mm512_add_ps(s2, _mm512_load_ps((float *)(p + i + 128)));
                s3 = _mm512_add_ps(s3, _mm512_load_ps((float *)(p + i + 192)));
            }
            sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    return n / best / 1e9;
}
/* 16 independent multiply-add chains of vector type V (LANES floats) for n rounds: multiply-adds per second */
#define FMA_RATE(NAME, V, LANES, SET1, FMA, FIRST)                                                          \
    __attribute__((noinline)) static double NAME(long n) {                                                  \
        V a[16];                                                                                            \
        for (int i = 0; i < 16; i++) a[i] = SET1(i * 1e-3f);                                                \
        V b = SET1(0.999f), c = SET1(1e-4f);                                                                \
        double t0 = now();                                                                                  \
        for (long i = 0; i < n; i++) {                                                                      \
            _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) a[j] = FMA(a[j], b, c);                  \
            __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]),   \
                             "+v"(a[6]), "+v"(a[7]));                                                       \
        }                                                                                                   \
        double t = now() - t0;                                                                              \
        float s = 0;                                                                                        \
        for (int i = 0; i < 16; i++) s += FIRST(a[i]);                                                      \
        sink = s;                                                                                           \
        return n * 16.0 * LANES / t / 1e9;                                                                  \
    }
FMA_RATE(fma512, __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_cvtss_f32)
FMA_RATE(fma256, __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_cvtss_f32)
int main(int argc, char **argv) {
    int nt = atoi(argv[1]), rounds = atoi(argv[3]);
    size_t n = (size_t)atol(argv[2]) << 20, huge = 2 << 20;
    char *raw = mmap(NULL, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *p = (char *)(((size_t)raw + huge - 1) & ~(huge - 1));
    for (int thp = 0; thp < 2; thp++) {
        madvise(p, n, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        memset(p, 1, n);
        int pfs[3] = {0, 1024, 4096};
        for (int i = 0; i < 3; i++)
            printf("read %zu MiB, %d threads, %s pages, prefetch %4d B ahead: %5.1f GB/s\n", n >> 20, nt,
                   thp ? "huge" : "4 KiB", pfs[i], stream(p, n, pfs[i], nt));
        madvise(p, n, MADV_DONTNEED);
    }
    for (int r = 0; r < rounds; r++)
        printf("one core, round %d: 512-bit FMA %5.1f, 256-bit FMA %5.1f G multiply-adds/s\n", r + 1,
               fma512(20000000), fma256(20000000));
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "ceilings.c"), os.path.join(d, "ceilings")
        with open(src, "w") as f:
            f.write(SRC)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-fopenmp", "-o", exe, src], check=True)
        subprocess.run([exe, str(a.threads), str(a.mib), str(a.rounds)], check=True)


if __name__ == "__main__":
    main()
