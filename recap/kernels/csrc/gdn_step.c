/* Gated DeltaNet's decode step at one token per row (recap/kernels/gdn_step.py; the module path it stands in for:
 * layers/gdn.py's forward on a decode batch: conv1d.causal_conv1d_update, gdn.normalize_qk_inputs, gdn.gdn_gates,
 * gdn_decode.gated_delta_rule_update, norm.HeadGatedRMSNorm), in the fp32 arithmetic of those torch ops:
 *   [q | k | v] = silu(conv(window ++ qkv))      the window [conv_dim, K-1] of the row's slot rolls by one
 *   q = l2norm(q) Dk^-1/2, k = l2norm(k)           per key head; eps inside the root
 *   g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)      per value head
 *   S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q        per value head, S [Dk, Dv] in the slot's state
 *   out = (w o / rms(o)) silu(z)                   per value head
 * Value head h reads key head h / (Hv / Hk). Only the order of a few sums differs from torch's (BLAS's), so
 * the two agree to fp32 rounding. Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float silu(float v) { return v / (1.0f + expf(-v)); }
static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); } /* torch's threshold 20 */

/* one (row, head) of the delta rule: from slot src into slot dst (the same in a plain step; each element is
 * read before it is written), o [Dv] out. The decayed state is recomputed in the second pass rather than
 * stored in the first: one read pass and one read-write pass over S. */
static void delta_head(const float *S_in, float *S_out, const float *q, const float *k, const float *v, float alpha,
                       float beta, int64_t dk, int64_t dv, float *o) {
    float sk[1024], delta[1024];
    for (int64_t j = 0; j < dv; j++) sk[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *s = S_in + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) sk[j] += ki * (s[j] * alpha);
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (v[j] - sk[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        const float *s = S_in + i * dv;
        float *so = S_out + i * dv;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            const float n = s[j] * alpha + ki * delta[j];
            so[j] = n;
            o[j] += qi * n;
        }
    }
}

/* t rows of one token each. qkv [t, conv_dim] (conv_dim = 2 Hk Dk + Hv Dv: [q | k | v]), z [t, Hv Dv], b and a
 * [t, Hv]; conv_w [conv_dim, K]; conv_state [num_slots, conv_dim, K-1]; state [num_slots, Hv, Dk, Dv];
 * row r reads slot src[r] and writes slot dst[r] (dst NULL: src[r], a plain step, distinct slots, rows in
 * parallel; else rows in order, so a row may continue what the row before it wrote: a verify graph's chain);
 * slot_positions[dst[r]] = positions[r] + 1. work [t, conv_dim + 2 Hv] scratch; out [t, Hv Dv].
 * Returns -1 (nothing written) for a slot outside [0, num_slots), -2 for K outside 2 .. 65, -3 when Hv is not a
 * multiple of Hk or Dv is above 1024. */
int recap_gdn_step(int64_t t, const int64_t *src, const int64_t *dst, const int64_t *positions,
                   int64_t *slot_positions, const float *qkv, const float *z, const float *b, const float *a,
                   int64_t hk, int64_t hv, int64_t dk, int64_t dv, const float *conv_w, int64_t kconv,
                   float *conv_state, float *state, int64_t num_slots, const float *A_log, const float *dt_bias,
                   const float *norm_w, float norm_eps, float l2_eps, float *work, float *out, int threads) {
    if (kconv < 2 || kconv > 65) return -2;
    if (hk <= 0 || hv % hk || dv > 1024) return -3;
    for (int64_t r = 0; r < t; r++)
        if (src[r] < 0 || src[r] >= num_slots || (dst && (dst[r] < 0 || dst[r] >= num_slots))) return -1;
    const int64_t kd = hk * dk, conv_dim = 2 * kd + hv * dv, km1 = kconv - 1, wstride = conv_dim + 2 * hv;
    const int64_t rep = hv / hk, state_size = hv * dk * dv;
    const float scale = 1.0f / sqrtf((float)dk);
    /* the conv window + silu, the q/k norms and the gates, per row */
    for (int64_t r = 0; r < t; r++) {
        const float *x = qkv + r * conv_dim;
        const int64_t to = dst ? dst[r] : src[r];
        const float *cs = conv_state + src[r] * conv_dim * km1;
        float *cd = conv_state + to * conv_dim * km1, *y = work + r * wstride;
        for (int64_t c = 0; c < conv_dim; c++) {
            float prev[64];
            memcpy(prev, cs + c * km1, sizeof(float) * (size_t)km1); /* read before a write into the same slot */
            const float *wc = conv_w + c * kconv;
            float acc = x[c] * wc[km1];                                     /* the newest tap first, */
            for (int64_t j = 0; j < km1; j++) acc = fmaf(prev[j], wc[j], acc); /* then addcmul_'s older ones */
            y[c] = silu(acc);
            memcpy(cd + c * km1, prev + 1, sizeof(float) * (size_t)(km1 - 1));
            cd[c * km1 + km1 - 1] = x[c];
        }
        for (int64_t h = 0; h < 2 * hk; h++) { /* q heads, then k heads */
            float *u = y + h * dk, ss = 0.0f;
            for (int64_t i = 0; i < dk; i++) ss += u[i] * u[i];
            const float inv = 1.0f / sqrtf(ss + l2_eps);
            for (int64_t i = 0; i < dk; i++) u[i] = h < hk ? u[i] * inv * scale : u[i] * inv;
        }
        float *gates = y + conv_dim;
        for (int64_t h = 0; h < hv; h++) {
            const float g = -expf(A_log[h]) * softplus(a[r * hv + h] + dt_bias[h]);
            gates[h] = expf(g);
            gates[hv + h] = sigmoid(b[r * hv + h]);
        }
        slot_positions[to] = positions[r] + 1;
    }
    /* the delta rule, one (row, head) at a time */
    if (dst) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t h = 0; h < hv; h++)
            for (int64_t r = 0; r < t; r++) {
                const float *y = work + r * wstride;
                delta_head(state + (src[r] * hv + h) * dk * dv, state + (dst[r] * hv + h) * dk * dv,
                           y + (h / rep) * dk, y + kd + (h / rep) * dk, y + 2 * kd + h * dv, y[conv_dim + h],
                           y[conv_dim + hv + h], dk, dv, out + r * hv * dv + h * dv);
            }
    } else {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t r = 0; r < t; r++)
            for (int64_t h = 0; h < hv; h++) {
                const float *y = work + r * wstride;
                float *s = state + src[r] * state_size + h * dk * dv;
                delta_head(s, s, y + (h / rep) * dk, y + kd + (h / rep) * dk, y + 2 * kd + h * dv, y[conv_dim + h],
                           y[conv_dim + hv + h], dk, dv, out + r * hv * dv + h * dv);
            }
    }
    /* the gated norm, per value head: (w o / rms(o)) silu(z) */
    for (int64_t r = 0; r < t; r++)
        for (int64_t h = 0; h < hv; h++) {
            float *o = out + r * hv * dv + h * dv, ss = 0.0f;
            const float *zh = z + r * hv * dv + h * dv;
            for (int64_t j = 0; j < dv; j++) ss += o[j] * o[j];
            const float inv = 1.0f / sqrtf(ss / (float)dv + norm_eps);
            for (int64_t j = 0; j < dv; j++) o[j] = (o[j] * inv * norm_w[j]) * silu(zh[j]);
        }
    return 0;
}
