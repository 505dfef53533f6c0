/* 16-bit float conversions shared by the CPU kernels (scalar, portable; F16C where the build has it): bfloat16 as
torch rounds it (round to nearest even, NaN kept quiet) and IEEE half. */
#ifndef INFERFLOW_HALF_H
#define INFERFLOW_HALF_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else { /* subnormal half: normalize */
        e = 113;
        while (!(m & 0x400)) { m <<= 1; e--; }
        u = s | (e << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}
static inline uint16_t f32_to_f16(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t s = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00);
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00); /* rounds to >= 65520: inf */
    if (a < 0x38800000u) { /* subnormal half (or zero) */
        if (a < 0x33000000u) return (uint16_t)s;
        uint32_t m = (a & 0x7fffff) | 0x800000, sh = 126 - (a >> 23);
        uint32_t r = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(s | r);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(s | (r >> 13));
#endif
}

/* float8 e4m3fn (torch.float8_e4m3fn, an fp8 K/V cache): sign, 4 exponent bits (bias 7), 3 mantissa bits, no
   infinities, 0x7f / 0xff NaN, largest 448 */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t s = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
    uint32_t u;
    float f;
    if ((b & 0x7f) == 0x7f) {
        u = s | 0x7fc00000u;
    } else if (e) {
        u = s | ((e + 120) << 23) | (m << 20);
    } else { /* subnormal: m 2^-9 */
        f = (float)m * (1.0f / 512.0f);
        return s ? -f : f;
    }
    memcpy(&f, &u, 4);
    return f;
}
static inline uint8_t f32_to_e4m3(float f) { /* round to nearest even, saturating at +-448 as torch's cast */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t s = (uint8_t)((u >> 24) & 0x80);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7f;
    if (a >= 0x43e00000u) return s | 0x7e; /* >= 448 (infinity included) */
    if (a < 0x3c800000u) {                 /* below 2^-6: steps of 2^-9 */
        float x;
        memcpy(&x, &a, 4);
        x *= 512.0f; /* exact: a power of two */
        const int fl = (int)x;
        const float fr = x - (float)fl;
        return s | (uint8_t)(fl + (fr > 0.5f || (fr == 0.5f && (fl & 1)))); /* 8: the smallest normal, 0x08 */
    }
    uint32_t e = (a >> 23) - 120, m = (a >> 20) & 7u;
    const uint32_t rem = a & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (m & 1u)))
        if (++m == 8) { m = 0; e++; }
    if (e > 15 || (e == 15 && m == 7)) return s | 0x7e;
    return s | (uint8_t)((e << 3) | m);
}

#endif
