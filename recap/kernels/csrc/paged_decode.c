/* Decode attention over the paged KV cache: one query per row, fp32, read through the row's block table, with
 * an online softmax (no gathered copy of K/V, no mask tensor). GQA: query head h reads KV head h / group.
 * Visible keys of a row with seq_len s: positions [max(0, s - window), s) (window 0: all of [0, s)).
 * Reference: recap/kernels/paged_attention.py's _decode_rows (SDPA over a gathered, masked copy); the two
 * agree to fp32 rounding. Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>

/* q [b, hq, dh]; k_cache, v_cache [blocks, bs, hkv, dh]; tables [b, table_stride] int64; seq_lens [b] int64;
 * out [b, hq, dh]. Returns the number of (row, head) pairs whose table named a block outside [0, blocks): those
 * read nothing (their output is zero); the caller raises. */
int64_t recap_paged_decode(const float *q, int64_t b, int64_t hq, int64_t hkv, int64_t dh, const float *k_cache,
                           const float *v_cache, int64_t blocks, int64_t bs, const int64_t *tables,
                           int64_t table_stride, const int64_t *seq_lens, int64_t window, float scale, float *out,
                           int threads) {
    const int64_t group = hq / hkv;
    int64_t bad = 0;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1) reduction(+ : bad)
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < hq; h++) {
            const float *qv = q + (r * hq + h) * dh;
            float *o = out + (r * hq + h) * dh;
            const int64_t seq = seq_lens[r], kvh = h / group;
            const int64_t first = window > 0 && seq > window ? seq - window : 0;
            const int64_t *table = tables + r * table_stride;
            float m = -INFINITY, l = 0.0f;
            for (int64_t i = 0; i < dh; i++) o[i] = 0.0f;
            int ok = 1;
            for (int64_t p = first; p < seq && ok; p += bs - p % bs) /* each block once */
                ok = table[p / bs] >= 0 && table[p / bs] < blocks;
            if (!ok) {
                bad++;
                continue;
            }
            for (int64_t p = first; p < seq; p++) {
                const int64_t slot = table[p / bs] * bs + p % bs;
                const float *kv = k_cache + (slot * hkv + kvh) * dh, *vv = v_cache + (slot * hkv + kvh) * dh;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < dh; i++) s += qv[i] * kv[i];
                s *= scale;
                if (s > m) { /* rescale what was summed so far */
                    const float c = expf(m - s);
                    l *= c;
                    for (int64_t i = 0; i < dh; i++) o[i] *= c;
                    m = s;
                }
                const float e = expf(s - m);
                l += e;
#pragma omp simd
                for (int64_t i = 0; i < dh; i++) o[i] += e * vv[i];
            }
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int64_t i = 0; i < dh; i++) o[i] *= inv;
        }
    return bad;
}
