/* The small one-row operations of a captured decode step (recap/model/decode_graph.py) that have no kernel of
 * their own: the embedding row, the residual add, the gated activation and RoPE with the K/V write. Each is
 * the fp32 arithmetic of the torch code it stands in for (references in recap/kernels/decode_ops.py); silu,
 * cos and sin are libm's, so they agree with torch to fp32 rounding. Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out[d] = weight[id] for the id at *ids; -1 (nothing written) when the id is outside [0, vocab). */
int recap_embed_row(const float *weight, int64_t vocab, int64_t d, const int64_t *ids, float *out) {
    const int64_t id = ids[0];
    if (id < 0 || id >= vocab) return -1;
    memcpy(out, weight + id * d, sizeof(float) * (size_t)d);
    return 0;
}

/* h[n] += x[n] */
void recap_add_f32(float *h, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) h[i] += x[i];
}

/* out[n] = silu(gate[n]) * up[n], silu(v) = v / (1 + exp(-v)) */
void recap_silu_mul_f32(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

/* RoPE ("rotate half" over the first rot dims of each head, angle = position * inv_freq[i mod rot/2]) applied
 * in place to q [hq, dh] and k [hkv, dh] (rot 0: none), then k and v [hkv, dh] stored at the cache slot
 * *slot of k_cache / v_cache [slots, hkv, dh]. Returns -1 (nothing written) for a slot outside [0, slots). */
int recap_rope_write_kv(float *q, float *k, const float *v, int64_t hq, int64_t hkv, int64_t dh,
                        const int64_t *positions, const float *inv_freq, int64_t rot, float *k_cache,
                        float *v_cache, int64_t slots, const int64_t *slot) {
    const int64_t s = slot[0];
    if (s < 0 || s >= slots) return -1;
    if (rot > 0) {
        const int64_t half = rot / 2;
        float c[512], sn[512];
        if (half > 512) return -2;
        const float pos = (float)positions[0];
        for (int64_t i = 0; i < half; i++) {
            const float f = pos * inv_freq[i];
            c[i] = cosf(f);
            sn[i] = sinf(f);
        }
        for (int64_t h = 0; h < hq + hkv; h++) {
            float *x = h < hq ? q + h * dh : k + (h - hq) * dh;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * sn[i];
                x[i + half] = b * c[i] + a * sn[i];
            }
        }
    }
    memcpy(k_cache + s * hkv * dh, k, sizeof(float) * (size_t)(hkv * dh));
    memcpy(v_cache + s * hkv * dh, v, sizeof(float) * (size_t)(hkv * dh));
    return 0;
}
