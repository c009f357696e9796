/* One Mamba2 mixer decode step between in_proj and out_proj, for every row of a plain decode step (one token
 * per row, each row continuing its own state slot; recap_mamba2_step) or of a verify step (a sequence's tokens
 * as rows in order, each token's state into its own slot; recap_mamba2_chain): causal conv window update + silu, dt softplus and clamp,
 * the SSD state update h = exp(dt A) h + dt x B^T read and written in one pass with y = h C + D x in the same
 * pass, and the gate (with or without the grouped RMS norm). fp32 throughout.
 *
 * The reference is recap/model/layers/mamba2_decode.py (and behind it Mamba2Mixer.forward_ref); the two agree
 * to fp32 rounding: the state update rounds as the reference's mul_ then addcmul_ (two roundings,
 * -ffp-contract=off), the sums over taps, state and norm groups run in another order.
 * Built by recap/kernels/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* F.softplus with beta 1 and threshold 20 */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* one (row, head) of the state update: h = exp(dt A) h + dt x B^T from slot src[r] into dst[r], y = h C + D x */
static inline void state_head(int64_t r, int64_t h, const int64_t *src, const int64_t *dst, const float *work,
                              int64_t conv_dim, int64_t d_inner, int64_t G, int64_t N, int64_t H, int64_t P,
                              const float *dts, const float *A_log, const float *D, float *ssm_state, float *y) {
    const int64_t hpg = H / G;
    const float *xr = work + r * conv_dim;
    const float *B = xr + d_inner + (h / hpg) * N, *C = xr + d_inner + G * N + (h / hpg) * N;
    const float d = dts[r * H + h];
    const float decay = expf(d * -expf(A_log[h]));
    const float *si = ssm_state + (src[r] * H + h) * P * N;
    float *so = ssm_state + (dst[r] * H + h) * P * N;
    for (int64_t p = 0; p < P; p++) {
        const float xv = xr[h * P + p], dx = xv * d;
        const float *s = si + p * N;
        float *o = so + p * N;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; n++) {
            const float v = s[n] * decay + dx * B[n];
            o[n] = v;
            acc += v * C[n];
        }
        y[r * d_inner + h * P + p] = acc + xv * D[h];
    }
}

enum { GATE_ONLY = 0, NORM_AFTER_GATE = 1, NORM_BEFORE_GATE = 2 };

/* proj [t, proj_stride]: z [d_inner] | xbc [conv_dim] | dt [H] per row (d_inner = H * P,
 *   conv_dim = d_inner + 2 G N);
 * conv_state [slots, conv_dim, kconv - 1], conv_w [conv_dim, kconv], conv_b [conv_dim] or NULL;
 * ssm_state [slots, H, P, N]; dt_bias, A_log, D [H]; norm_w [d_inner] or NULL (GATE_ONLY);
 * src [t], dst [t], positions [t] int64: row r reads the state of slot src[r] and writes its new state into
 *   dst[r] (the same slot in a plain step); slot_positions [slots] int64 (dst's set to position + 1);
 * chained: row r may read what row r - 1 wrote (a verify row's tokens, one sequence): rows run in order;
 *   otherwise the rows' slots are distinct and their state updates run in parallel;
 * work [t, conv_dim] scratch; y [t, d_inner] out. */
static void mamba2_rows(int64_t t, const int64_t *src, const int64_t *dst, int chained, const int64_t *positions,
                        int64_t *slot_positions, const float *proj, int64_t proj_stride, float *conv_state,
                        const float *conv_w, const float *conv_b, int64_t kconv, float *ssm_state, int64_t H,
                        int64_t P, int64_t G, int64_t N, const float *dt_bias, const float *A_log, const float *D,
                        float dt_lo, float dt_hi, const float *norm_w, int gate_mode, int64_t group_size, float eps,
                        float *work, float *dts, float *y, int threads) {
    const int64_t d_inner = H * P, conv_dim = d_inner + 2 * G * N, km1 = kconv - 1;
    /* conv window + silu, and dt, per row */
    for (int64_t r = 0; r < t; r++) {
        const float *xbc = proj + r * proj_stride + d_inner;
        const float *cs = conv_state + src[r] * conv_dim * km1;
        float *cd = conv_state + dst[r] * conv_dim * km1;
        float *out = work + r * conv_dim;
        for (int64_t c = 0; c < conv_dim; c++) {
            const float *win = cs + c * km1;
            float *wout = cd + c * km1; /* == win in a plain step: each tap is read before it is written */
            const float *wc = conv_w + c * kconv;
            float acc = 0.0f;
            for (int64_t k = 0; k < km1; k++) acc += win[k] * wc[k];
            acc += xbc[c] * wc[km1];
            if (conv_b) acc += conv_b[c];
            for (int64_t k = 0; k + 1 < km1; k++) wout[k] = win[k + 1];
            if (km1 > 0) wout[km1 - 1] = xbc[c];
            out[c] = silu(acc);
        }
        const float *dt = proj + r * proj_stride + d_inner + conv_dim;
        for (int64_t h = 0; h < H; h++) {
            float d = softplus(dt[h] + dt_bias[h]);
            d = d < dt_lo ? dt_lo : (d > dt_hi ? dt_hi : d);
            dts[r * H + h] = d;
        }
        slot_positions[dst[r]] = positions[r] + 1;
    }
    /* the state update, one (row, head) at a time: read and write the state once */
    if (chained) {
        /* heads are independent: each head goes through the tokens in order, so token r reads the head's state
         * that token r - 1 has just written (P x N floats, in L1) rather than after every other head's (a
         * token-major loop read each per-position state back from L3: ~4x a decode step's update per token) */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t h = 0; h < H; h++)
            for (int64_t r = 0; r < t; r++)
                state_head(r, h, src, dst, work, conv_dim, d_inner, G, N, H, P, dts, A_log, D, ssm_state, y);
    } else {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t r = 0; r < t; r++)
            for (int64_t h = 0; h < H; h++)
                state_head(r, h, src, dst, work, conv_dim, d_inner, G, N, H, P, dts, A_log, D, ssm_state, y);
    }
    /* the gate */
    for (int64_t r = 0; r < t; r++) {
        const float *z = proj + r * proj_stride;
        float *yr = y + r * d_inner;
        if (gate_mode == NORM_AFTER_GATE)
            for (int64_t i = 0; i < d_inner; i++) yr[i] = silu(z[i]) * yr[i];
        if (gate_mode != GATE_ONLY)
            for (int64_t g0 = 0; g0 < d_inner; g0 += group_size) {
                float ss = 0.0f;
                for (int64_t i = g0; i < g0 + group_size; i++) ss += yr[i] * yr[i];
                const float inv = 1.0f / sqrtf(ss / (float)group_size + eps);
                for (int64_t i = g0; i < g0 + group_size; i++) yr[i] = yr[i] * inv * norm_w[i];
            }
        if (gate_mode != NORM_AFTER_GATE)
            for (int64_t i = 0; i < d_inner; i++) yr[i] = yr[i] * silu(z[i]);
    }
}

/* A plain decode step: every row continues its own slot (distinct slots), in place. */
void recap_mamba2_step(int64_t t, const int64_t *slots, const int64_t *positions, int64_t *slot_positions,
                       const float *proj, int64_t proj_stride, float *conv_state, const float *conv_w,
                       const float *conv_b, int64_t kconv, float *ssm_state, int64_t H, int64_t P, int64_t G,
                       int64_t N, const float *dt_bias, const float *A_log, const float *D, float dt_lo,
                       float dt_hi, const float *norm_w, int gate_mode, int64_t group_size, float eps, float *work,
                       float *dts, float *y, int threads) {
    mamba2_rows(t, slots, slots, 0, positions, slot_positions, proj, proj_stride, conv_state, conv_w, conv_b, kconv,
                ssm_state, H, P, G, N, dt_bias, A_log, D, dt_lo, dt_hi, norm_w, gate_mode, group_size, eps, work,
                dts, y, threads);
}

/* A verify step's rows (docs/speculative.md): tokens of one or more sequences, row r going from slot src[r] to
 * dst[r] in order, so the state after every token can land in its own slot (src[r] == dst[r - 1] within a
 * sequence) without a copy. */
void recap_mamba2_chain(int64_t t, const int64_t *src, const int64_t *dst, const int64_t *positions,
                        int64_t *slot_positions, const float *proj, int64_t proj_stride, float *conv_state,
                        const float *conv_w, const float *conv_b, int64_t kconv, float *ssm_state, int64_t H,
                        int64_t P, int64_t G, int64_t N, const float *dt_bias, const float *A_log, const float *D,
                        float dt_lo, float dt_hi, const float *norm_w, int gate_mode, int64_t group_size, float eps,
                        float *work, float *dts, float *y, int threads) {
    mamba2_rows(t, src, dst, 1, positions, slot_positions, proj, proj_stride, conv_state, conv_w, conv_b, kconv,
                ssm_state, H, P, G, N, dt_bias, A_log, D, dt_lo, dt_hi, norm_w, gate_mode, group_size, eps, work,
                dts, y, threads);
}
