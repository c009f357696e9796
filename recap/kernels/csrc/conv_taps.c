/* The causal depthwise conv taps over packed rows (recap/kernels/conv_taps.py; the torch op it stands in for:
 * kernels/conv1d.py's causal_conv1d on a step that is not a decode batch, before its activation):
 *   y[t, d] = x[t, d] w[d, K-1] + sum_{j < K-1} in(t - (K-1) + j)[d] w[d, j] (+ bias[d])
 * in that order (the torch op's: the newest tap, then the older ones, then the bias), where in(r) is the row's
 * input r tokens from its start, and for r < 0 its initial window (the running slot's [D, K-1] where the row has
 * initial state, zeros otherwise). The window after every chunk end with a destination slot (the K-1 inputs
 * ending there, oldest first) goes to that slot, the window after the row's last chunk to its running slot: plain
 * copies of inputs. With `activation` 1, y = silu(y) in the same pass (torch's F.silu to a few ulp: one pass over y
 * the less). Rows with state index -1 output zeros and touch no slot. Tokens run in parallel (OpenMP, torch's
 * pool). Built by recap/kernels/native.py. */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "fast_math.h"
#include "step_slots.h"

/* y[c] = silu(y[c]) = y sigmoid(y) for c < n, the exponent always <= 0: e = exp(-|y|), sigmoid = 1 / (1 + e) or
 * e / (1 + e). GCC leaves the plain loop scalar (its selects), hence the AVX-512 one written out. */
static void silu(float *y, int64_t n) {
    int64_t c = 0;
#ifdef __AVX512F__
    const float coef[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; c + 16 <= n; c += 16) {
        const __m512 x = _mm512_loadu_ps(y + c);
        const __m512 a = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)), _mm512_set1_ps(-60.0f));
        const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_sub_ps(_mm512_sub_ps(a, _mm512_mul_ps(nf, _mm512_set1_ps(0.693145752f))),
                                       _mm512_mul_ps(nf, _mm512_set1_ps(1.42860677e-6f)));
        __m512 p = _mm512_set1_ps(coef[0]);
        for (int i = 1; i < 7; i++) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(coef[i]));
        const __m512 e = _mm512_scalef_ps(p, nf);
        const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), one, e);
        _mm512_storeu_ps(y + c, _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, e))));
    }
#endif
    for (; c < n; c++) {
        const float x = y[c], a = x < 0.0f ? (x < -60.0f ? -60.0f : x) : (x > 60.0f ? -60.0f : -x);
        const float e = exp_neg(a);
        y[c] = x * ((x < 0.0f ? e : 1.0f) / (1.0f + e));
    }
}

/* Rows: qsl [B+1] token offsets, slots [B] (running slot or -1), has_init [B] (bool bytes); chunks: cu [C+1],
 * chunk_row [C], dest [C] (checkpoint slot or -1), end_pos [C], last_chunk [B]. x [T, D], w [D, K], bias [D] or
 * NULL, conv_state [num_slots, D, K-1], slot_positions [num_slots] or NULL; activation 0 (none) or 1 (silu);
 * work [K D + B (K-1) D] scratch; y [T, D]. Returns -1 (nothing written) for a slot outside [0, num_slots), -2 for K outside 1 .. 65. */
int recap_conv_taps(int64_t num_rows, const int64_t *qsl, const int64_t *slots, const uint8_t *has_init,
                    int64_t num_chunks, const int64_t *cu, const int64_t *chunk_row, const int64_t *dest,
                    const int64_t *end_pos, const int64_t *last_chunk, int64_t t, int64_t d, int64_t kconv,
                    const float *x, const float *w, const float *bias, float *conv_state, int64_t num_slots,
                    int64_t *slot_positions, int activation, float *work, float *y, int threads) {
    if (kconv < 1 || kconv > 65) return -2;
    if (check_step_slots(num_chunks, dest, num_rows, slots, num_slots)) return -1;
    const int64_t km1 = kconv - 1;
    float *wt = work, *init = work + kconv * d; /* wt [K, D]: each tap contiguous; init [B, K-1, D] */
    for (int64_t c = 0; c < d; c++)
        for (int64_t j = 0; j < kconv; j++) wt[j * d + c] = w[c * kconv + j];
    for (int64_t r = 0; r < num_rows; r++) { /* every initial window read before any slot is written */
        float *ir = init + r * km1 * d;
        if (slots[r] < 0 || !has_init[r]) {
            memset(ir, 0, sizeof(float) * (size_t)(km1 * d));
            continue;
        }
        const float *cs = conv_state + slots[r] * d * km1;
        for (int64_t c = 0; c < d; c++)
            for (int64_t i = 0; i < km1; i++) ir[i * d + c] = cs[c * km1 + i];
    }
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t start = qsl[r], len = qsl[r + 1] - start;
        const float *ir = init + r * km1 * d;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && len >= 64)
        for (int64_t i = 0; i < len; i++) {
            float *yo = y + (start + i) * d;
            if (slots[r] < 0) {
                memset(yo, 0, sizeof(float) * (size_t)d);
                continue;
            }
            const float *src[64]; /* each older tap's input row, from the row start */
            for (int64_t j = 0; j < km1; j++) {
                const int64_t rel = i - km1 + j;
                src[j] = rel < 0 ? ir + (km1 + rel) * d : x + (start + rel) * d;
            }
            const float *xi = x + (start + i) * d, *wl = wt + km1 * d;
            for (int64_t c0 = 0; c0 < d; c0 += 256) { /* 256 channels at a time: their sums stay in L1 */
                const int64_t n = d - c0 < 256 ? d - c0 : 256;
                float acc[256];
#pragma omp simd
                for (int64_t c = 0; c < n; c++) acc[c] = xi[c0 + c] * wl[c0 + c];
                for (int64_t j = 0; j < km1; j++) {
                    const float *sj = src[j] + c0, *wj = wt + j * d + c0;
#pragma omp simd
                    for (int64_t c = 0; c < n; c++) acc[c] = acc[c] + sj[c] * wj[c];
                }
                if (bias) {
#pragma omp simd
                    for (int64_t c = 0; c < n; c++) acc[c] = acc[c] + bias[c0 + c];
                }
                if (activation == 1) silu(acc, n);
                memcpy(yo + c0, acc, sizeof(float) * (size_t)n);
            }
        }
    }
    if (km1 == 0) return 0;
    /* windows: the K-1 inputs ending at each chunk end, into its checkpoint slot and (the last) the running slot */
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t r = chunk_row[c], slot = slots[r];
        if (slot < 0) continue;
        const int64_t to[2] = {dest[c], c == last_chunk[r] ? slot : -1};
        const int64_t e = cu[c + 1] - qsl[r];
        const float *ir = init + r * km1 * d;
        for (int k = 0; k < 2; k++) {
            if (to[k] < 0) continue;
            float *cs = conv_state + to[k] * d * km1;
            for (int64_t i = 0; i < km1; i++) {
                const int64_t rel = e - km1 + i;
                const float *src = rel < 0 ? ir + (km1 + rel) * d : x + (qsl[r] + rel) * d;
                for (int64_t ch = 0; ch < d; ch++) cs[ch * km1 + i] = src[ch];
            }
            if (slot_positions) slot_positions[to[k]] = end_pos[c];
        }
    }
    return 0;
}
