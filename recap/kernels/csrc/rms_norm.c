/* RMS norm of fp32 rows: y = x / sqrt(mean(x^2) + eps) * w, the order of operations of
 * recap/model/layers/norm.py's RMSNorm (x times the inverse RMS, then times the weight); the sum of squares
 * runs in another order, so the two agree to fp32 rounding. At one row torch spent ~13 us on its 7 ops.
 * Every row count runs the same per-row code (rows split across threads, never within one), so a row's bits do
 * not depend on the rows beside it: a prefill row equals the decode step's (caching on = off, see
 * recap/kernels/rms_norm.py). Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN (1 << 18) /* elements: below this a thread team costs more than it saves */

/* x [rows, d], w [d], y [rows, d] (may be x); all contiguous. The weight's factor is offset + w (0 + w is w). */
static void rms_rows(const float *x, int64_t rows, int64_t d, const float *w, float eps, float offset, float *y) {
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        float *yr = y + r * d;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) yr[i] = xr[i] * inv * (offset + w[i]);
    }
}

void recap_rms_norm_f32(const float *x, int64_t rows, int64_t d, const float *w, float eps, float *y) {
    rms_rows(x, rows, d, w, eps, 0.0f, y);
}

/* The zero-centred norm (Qwen3.5 / Qwen3-Next's OffsetRMSNorm): y = x / sqrt(mean(x^2) + eps) * (1 + w), the
 * factor 1 + w rounded in fp32 as the module's 1.0 + weight.float(); otherwise recap_rms_norm_f32's arithmetic. */
void recap_rms_norm_offset_f32(const float *x, int64_t rows, int64_t d, const float *w, float eps, float *y) {
    rms_rows(x, rows, d, w, eps, 1.0f, y);
}
