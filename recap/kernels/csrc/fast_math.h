/* Small math shared by the native kernels (included by their sources; native.py keys each library's build on
 * every header here as well as its source). */
#ifndef RECAP_FAST_MATH_H
#define RECAP_FAST_MATH_H

#include <stdint.h>

/* exp(x) for x in [-60, 0] (callers clamp): 2^n e^r with |r| <= ln2 / 2 and a degree-6 polynomial (a few ulp), in
 * plain arithmetic that the compiler vectorises (libm's expf is a call per element). */
static inline float exp_neg(float x) {
    const int32_t ni = (int32_t)(x * 1.44269504f - 0.5f); /* rounds to nearest: the product is <= 0 (floorf would
                                                            be a libm call, which does not vectorise) */
    const float n = (float)ni;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        int32_t i;
        float f;
    } s = {.i = (ni + 127) << 23}; /* 2^n */
    return p * s.f;
}

#endif
