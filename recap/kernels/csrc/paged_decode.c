/* Decode attention over the paged KV cache: one query per row, fp32, read through the row's block table, with
 * an online softmax (no gathered copy of K/V, no mask tensor). GQA: query head h reads KV head h / group.
 * Visible keys of a row with seq_len s: positions [max(0, s - window), s) (window 0: all of [0, s)).
 *
 * Work is split by (row, KV head): the `group` query heads that share a KV head are scored together, so each
 * key and value is read from memory once, not once per query head (at batch 1 the K/V reads were latency
 * bound: ~100 us for 12 heads x 180 keys). Keys go in groups of KEYS: their scores first (independent dot
 * products), then one rescale of what was summed so far if the group raises a head's maximum, then the
 * weighted values.
 * Reference: recap/kernels/paged_attention.py's _decode_rows (SDPA over a gathered, masked copy); the two
 * agree to fp32 rounding. Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>

#define KEYS 32 /* keys scored together */
#define MAX_GROUP 16 /* query heads per KV head handled in one pass; larger groups take several */

/* q [b, hq, dh]; k_cache, v_cache [blocks, bs, hkv, dh]; tables [b, table_stride] int64; seq_lens [b] int64;
 * out [b, hq, dh]. Returns the number of (row, KV head) pairs whose table named a block outside [0, blocks):
 * those read nothing (their output is zero); the caller raises. */
int64_t recap_paged_decode(const float *q, int64_t b, int64_t hq, int64_t hkv, int64_t dh, const float *k_cache,
                           const float *v_cache, int64_t blocks, int64_t bs, const int64_t *tables,
                           int64_t table_stride, const int64_t *seq_lens, int64_t window, float scale, float *out,
                           int threads) {
    const int64_t group = hq / hkv, passes = (group + MAX_GROUP - 1) / MAX_GROUP;
    int64_t bad = 0;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1) reduction(+ : bad)
    for (int64_t r = 0; r < b; r++)
        for (int64_t u = 0; u < hkv * passes; u++) {
            const int64_t kvh = u / passes, h0 = kvh * group + (u % passes) * MAX_GROUP;
            const int64_t ng = group - (h0 - kvh * group) < MAX_GROUP ? group - (h0 - kvh * group) : MAX_GROUP;
            const int64_t seq = seq_lens[r];
            const int64_t first = window > 0 && seq > window ? seq - window : 0;
            const int64_t *table = tables + r * table_stride;
            float m[MAX_GROUP], l[MAX_GROUP];
            for (int64_t g = 0; g < ng; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                float *o = out + (r * hq + h0 + g) * dh;
                for (int64_t i = 0; i < dh; i++) o[i] = 0.0f;
            }
            int ok = 1;
            for (int64_t p = first; p < seq && ok; p += bs - p % bs) /* each block once */
                ok = table[p / bs] >= 0 && table[p / bs] < blocks;
            if (!ok) {
                bad++;
                continue;
            }
            for (int64_t p0 = first; p0 < seq; p0 += KEYS) {
                const int64_t nk = seq - p0 < KEYS ? seq - p0 : KEYS;
                float sc[MAX_GROUP][KEYS];
                const float *vrow[KEYS];
                for (int64_t j = 0; j < nk; j++) {
                    const int64_t p = p0 + j, slot = table[p / bs] * bs + p % bs;
                    const float *kv = k_cache + (slot * hkv + kvh) * dh;
                    vrow[j] = v_cache + (slot * hkv + kvh) * dh;
                    for (int64_t g = 0; g < ng; g++) {
                        const float *qv = q + (r * hq + h0 + g) * dh;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int64_t i = 0; i < dh; i++) s += qv[i] * kv[i];
                        sc[g][j] = s * scale;
                    }
                }
                for (int64_t g = 0; g < ng; g++) {
                    float *o = out + (r * hq + h0 + g) * dh;
                    float gm = -INFINITY;
                    for (int64_t j = 0; j < nk; j++) gm = sc[g][j] > gm ? sc[g][j] : gm;
                    if (gm > m[g]) { /* rescale what was summed so far */
                        const float c = expf(m[g] - gm);
                        l[g] *= c;
#pragma omp simd
                        for (int64_t i = 0; i < dh; i++) o[i] *= c;
                        m[g] = gm;
                    }
                    for (int64_t j = 0; j < nk; j++) {
                        const float e = expf(sc[g][j] - m[g]);
                        const float *vv = vrow[j];
                        l[g] += e;
#pragma omp simd
                        for (int64_t i = 0; i < dh; i++) o[i] += e * vv[i];
                    }
                }
            }
            for (int64_t g = 0; g < ng; g++) {
                float *o = out + (r * hq + h0 + g) * dh;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int64_t i = 0; i < dh; i++) o[i] *= inv;
            }
        }
    return bad;
}
