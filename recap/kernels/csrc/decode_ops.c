/* The small one-row operations of a captured decode step (recap/backends/decode_graph.py) that have no kernel
 * of their own: the embedding row and its multiplier, the residual add (scaled or not), the MLP's activation (gated
 * or not), RoPE (partial: the first rot dims of a head) with the K/V write, gated attention's q / gate split and its
 * output gate, and LFM2's gated short conv. Each is the fp32 arithmetic of the torch code it
 * stands in for (references in recap/kernels/decode_ops.py); exp, erf, tanh, cos and sin are libm's, so they
 * agree with torch to fp32 rounding. Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* out[r] = weight[ids[r]] for r < rows; -1 (nothing written) when an id is outside [0, vocab). */
int recap_embed_rows(const float *weight, int64_t vocab, int64_t d, const int64_t *ids, int64_t rows, float *out) {
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return -1;
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * d, weight + ids[r] * d, sizeof(float) * (size_t)d);
    return 0;
}

/* out[r] = q[ids[r]] * scales[ids[r]] for r < rows: int8 rows with one scale each (model/quant.py's
 * quantize_int8_weight), laid out in groups of `group` rows whose values come `chunk` at a time: row v's values
 * [c, c + chunk) at q + (v / group) * group * dp + (c / chunk) * group * chunk + (v % group) * chunk, dp = d rounded
 * up to a whole chunk. A plain [vocab, d] table is group 1, chunk d; a tied head's int8 tiles
 * (linear_rows.pack_int8) are group 8, chunk 64. -1 (nothing written) when an id is outside [0, vocab). */
int recap_embed_rows_i8(const int8_t *q, const float *scales, int64_t vocab, int64_t d, int64_t group, int64_t chunk,
                        const int64_t *ids, int64_t rows, float *out) {
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab) return -1;
    const int64_t dp = (d + chunk - 1) / chunk * chunk;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t v = ids[r];
        const int8_t *base = q + (v / group) * group * dp + (v % group) * chunk;
        const float s = scales[v];
        float *o = out + r * d;
        for (int64_t c = 0; c < d; c += chunk) {
            const int8_t *src = base + (c / chunk) * group * chunk;
            const int64_t n = d - c < chunk ? d - c : chunk;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) o[c + i] = (float)src[i] * s;
        }
    }
    return 0;
}

/* h[n] += x[n] */
void recap_add_f32(float *h, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] += x[i];
}

/* h[n] += x[n] * m: a residual branch scaled as muP models scale it (Granite's residual_multiplier); the product
 * is rounded before the add (the build turns contraction off), as torch's h + x * m rounds it. */
void recap_add_scaled_f32(float *h, const float *x, float m, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] += x[i] * m;
}

/* x[n] *= m (an embedding multiplier) */
void recap_scale_f32(float *x, float m, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] *= m;
}

/* The MLP activations (recap/model/layers/activation.py), each written as torch's CPU kernel writes it so the
 * two agree to fp32 rounding (relu and relu2 exactly): silu(v) = v / (1 + exp(-v)); gelu is the erf form;
 * gelu_tanh is 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))); relu2 is relu(v)^2 (Nemotron-H). */
static inline float act_silu(float v) { return v / (1.0f + expf(-v)); }
static inline float act_gelu(float v) { return v * 0.5f * (1.0f + erff(v * 0.70710678118654752440f)); }
static inline float act_gelu_tanh(float v) {
    const float beta = 0.79788456080286535588f; /* sqrt(2 / pi) */
    return 0.5f * v * (1.0f + tanhf(beta * (v + 0.044715f * (v * v * v))));
}
static inline float act_relu(float v) { return v > 0.0f ? v : 0.0f; }
static inline float act_relu2(float v) {
    const float r = act_relu(v);
    return r * r;
}

/* out[r, i] = act(x[r, i]) * up[r, i] (a gated MLP), or act(x[r, i]) when up is NULL (a non-gated one), for
 * r < rows, i < n; x and up rows are `stride` floats apart (columns of one [gate | up] buffer), out rows n. */
#define RECAP_ACT_OP(name, act)                                                                                  \
    void recap_##name##_f32(const float *x, const float *up, float *out, int64_t rows, int64_t n,              \
                            int64_t stride) {                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                                   \
            const float *xr = x + r * stride;                                                                  \
            float *o = out + r * n;                                                                            \
            if (up == NULL)                                                                                    \
                for (int64_t i = 0; i < n; i++) o[i] = act(xr[i]);                                             \
            else                                                                                               \
                for (int64_t i = 0; i < n; i++) o[i] = act(xr[i]) * up[r * stride + i];                        \
        }                                                                                                      \
    }

#if defined(__AVX512F__)
/* exp(x) in 16 lanes, as Cephes' expf: x = n ln2 + r (ln2 in two parts), |r| <= ln2 / 2, e^r by its degree-6
 * polynomial, then times 2^n (scalef: inf past the top, denormals and 0 below); within 2 ulp of libm's expf. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* exp16's arithmetic in 8 lanes; 2^n (n in -150 .. 128) as two factors 2^(n >> 1) and 2^(n - (n >> 1)), each a
 * normal float, so the product still overflows to inf and underflows through the denormals. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.0f)), _mm256_set1_ps(-104.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
#endif

/* silu 16 lanes at a time where the CPU has AVX-512, 8 with AVX2 + FMA (libm's scalar expf took ~25 us a call over
 * LFM2's 8192 MLP rows, 1.5% of a step; now ~6), the scalar loop elsewhere and for the tail. */
void recap_silu_f32(const float *x, const float *up, float *out, int64_t rows, int64_t n, int64_t stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride, *ur = up ? up + r * stride : NULL;
        float *o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(xr + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
            __m512 a = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            if (ur) a = _mm512_mul_ps(a, _mm512_loadu_ps(ur + i));
            _mm512_storeu_ps(o + i, a);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
            __m256 a = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            if (ur) a = _mm256_mul_ps(a, _mm256_loadu_ps(ur + i));
            _mm256_storeu_ps(o + i, a);
        }
#endif
        for (; i < n; i++) o[i] = ur ? act_silu(xr[i]) * ur[i] : act_silu(xr[i]);
    }
}
/* x [rows, heads, 2 dh], each head [q | gate] -> q [rows, heads, dh] and sigmoid(gate) [rows, heads, dh] (gated
 * attention's q_proj output, Qwen3.5 / Qwen3-Next); sigmoid(v) = 1 / (1 + exp(-v)), as torch.sigmoid, with
 * recap_silu_f32's vector exp. */
void recap_split_gate_f32(const float *x, int64_t rows, int64_t heads, int64_t dh, float *q, float *gate) {
    for (int64_t r = 0; r < rows * heads; r++) {
        const float *xr = x + r * 2 * dh, *xg = xr + dh;
        float *o = gate + r * dh;
        memcpy(q + r * dh, xr, sizeof(float) * (size_t)dh);
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= dh; i += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(xg + i)));
            _mm512_storeu_ps(o + i, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= dh; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(xg + i)));
            _mm256_storeu_ps(o + i, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        }
#endif
        for (; i < dh; i++) o[i] = 1.0f / (1.0f + expf(-xg[i]));
    }
}

RECAP_ACT_OP(gelu, act_gelu)
RECAP_ACT_OP(gelu_tanh, act_gelu_tanh)
RECAP_ACT_OP(relu, act_relu)
RECAP_ACT_OP(relu2, act_relu2)

/* h[n] *= x[n] (attention's output gate) */
void recap_mul_f32(float *h, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] *= x[i];
}

/* For each row r < rows: RoPE ("rotate half" over the first rot dims of each head, angle = positions[r] *
 * inv_freq[i mod rot/2]) applied in place to q [rows, hq, dh] and k [rows, hkv, dh] (rot 0: none), then k and v
 * [rows, hkv, dh] stored at cache slot slots[r] of k_cache / v_cache [num_slots, hkv, dh]. Returns -1 (nothing
 * written) when a slot is outside [0, num_slots), -2 when rot / 2 exceeds 512. */
int recap_rope_write_kv(float *q, float *k, const float *v, int64_t rows, int64_t hq, int64_t hkv, int64_t dh,
                        const int64_t *positions, const float *inv_freq, int64_t rot, float *k_cache,
                        float *v_cache, int64_t num_slots, const int64_t *slots) {
    const int64_t half = rot / 2;
    if (half > 512) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; r++) {
        float *qr = q + r * hq * dh, *kr = k + r * hkv * dh;
        if (rot > 0) {
            float c[512], sn[512];
            const float pos = (float)positions[r];
            for (int64_t i = 0; i < half; i++) {
                const float f = pos * inv_freq[i];
                c[i] = (float)cos((double)f); /* fp64, rounded: as RotaryEmbedding.cos_sin, bit for bit */
                sn[i] = (float)sin((double)f);
            }
            for (int64_t h = 0; h < hq + hkv; h++) {
                float *x = h < hq ? qr + h * dh : kr + (h - hq) * dh;
                for (int64_t i = 0; i < half; i++) {
                    const float a = x[i], b = x[i + half];
                    x[i] = a * c[i] + (-b) * sn[i];
                    x[i + half] = b * c[i] + a * sn[i];
                }
            }
        }
        memcpy(k_cache + slots[r] * hkv * dh, kr, sizeof(float) * (size_t)(hkv * dh));
        memcpy(v_cache + slots[r] * hkv * dh, v + r * hkv * dh, sizeof(float) * (size_t)(hkv * dh));
    }
    return 0;
}

/* LFM2's gated short conv at one token per row (layers/short_conv.py's decode step, kernels/conv1d.py's
 * causal_conv1d_update on the fp32 windows): proj [rows, 3d] = [B | C | x]; per row r and channel i, bx = B x,
 * y = bx w[i, k-1], then y += window[j] w[i, j] for the older taps j = 0 .. k-2 (oldest first), then + bias[i]
 * (NULL: none); out[r, i] = C y. The window [d, k-1] of state slot src[r] (state [num_slots, d, k-1]) rolls by
 * one, bx the newest, into slot dst[r] (dst NULL: src[r]), and slot_positions[dst[r]] = positions[r] + 1. Rows
 * go in order, so a row may continue the window the row before it wrote (a verify graph's chain).
 * Returns -1 (nothing written) when a slot is outside [0, num_slots), -2 when k is not 2 .. 65. */
int recap_short_conv_step(const float *proj, int64_t rows, int64_t d, const float *w, const float *bias, int64_t k,
                          float *state, int64_t num_slots, const int64_t *src, const int64_t *dst,
                          const int64_t *positions, int64_t *slot_positions, float *out) {
    if (k < 2 || k > 65) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (src[r] < 0 || src[r] >= num_slots || (dst && (dst[r] < 0 || dst[r] >= num_slots))) return -1;
    const int64_t km = k - 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *b = proj + r * 3 * d, *c = b + d, *x = b + 2 * d;
        const float *win = state + src[r] * d * km;
        const int64_t to = dst ? dst[r] : src[r];
        float *next = state + to * d * km;
        for (int64_t i = 0; i < d; i++) {
            float prev[64];
            memcpy(prev, win + i * km, sizeof(float) * (size_t)km); /* read before a write into the same slot */
            const float bx = b[i] * x[i];
            float y = bx * w[i * k + km];
            for (int64_t j = 0; j < km; j++) y = fmaf(prev[j], w[i * k + j], y); /* torch addcmul_ fuses it */
            if (bias) y = y + bias[i];
            out[r * d + i] = c[i] * y;
            memcpy(next + i * km, prev + 1, sizeof(float) * (size_t)(km - 1));
            next[i * km + km - 1] = bx;
        }
        slot_positions[to] = positions[r] + 1;
    }
    return 0;
}
