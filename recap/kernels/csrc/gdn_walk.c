/* The gated delta rule's prefill over packed rows in the chunk (WY / UT) form (recap/kernels/gdn_walk.py; the torch
 * op it stands in for: kernels/gdn.py's gated_delta_rule on a step that is not a decode batch). Per value head h,
 * every row's chunks are walked in order, each cut into pieces of at most `piece` tokens from its start, so every
 * chunk end (a checkpoint position or the row end) is a piece end. Per piece of L tokens, with cum = cumsum(g)
 * inside the piece (per key channel where the decay is, KDA) and L[i,j,c] = exp(cum_i[c] - cum_j[c]) for j <= i:
 *   M[i,j] = sum_c (beta_i k_i)[c] k_j[c] L[i,j,c] (j < i),  A[i,j] = sum_c q_i[c] k_j[c] L[i,j,c] (j <= i)
 *   [U | W] = (I + M)^-1 [beta v | beta k exp(cum)]     by forward substitution (M strictly lower)
 *   V' = U - W S0;  o = (q exp(cum)) S0 + A V';  S1 = Diag(exp(cum_last)) S0 + (k exp(cum_last - cum))^T V'
 * (the same arithmetic as the torch op, whose T = (I + M)^-1 is solved against I and then multiplied: the two
 * agree to fp32 rounding). The products with S0 are one [W; q exp(cum)] S0 product and one (k exp(..))^T V'
 * product per piece, register-blocked (AVX-512 where built for it, plain C otherwise). Exponents are floored at
 * EXP_FLOOR (gdn.py's). The state of a chunk end with a destination slot goes to that slot, each row's final
 * state to its running slot; rows with state index -1 output zeros and touch no slot. Value heads run in
 * parallel (OpenMP, torch's pool: the library links libgomp by its soname). Built by recap/kernels/native.py. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define EXP_FLOOR (-60.0f)
#define MAX_PIECE 64
#define MAX_DIM 256
#define RB 8 /* rows of a register block; pieces are padded with zero rows to a multiple */

#include "fast_math.h"
#include "step_slots.h"

static inline float clampf(float x, float lo, float hi) { /* two selects (if-converted, so loops vectorise) */
    const float y = x > hi ? hi : x;
    return y < lo ? lo : y;
}

/* out[c] = exp(clamp(a[c] - b[c], EXP_FLOOR, 0)) mul[c] for c < n (b, mul NULL: 0, 1): KDA's per-channel decays.
 * GCC keeps its scalar copy of this loop even where it vectorises it, hence the AVX-512 one written out. */
static void exp_map(float *out, const float *a, const float *b, const float *mul, int64_t n) {
    int64_t c = 0;
#ifdef __AVX512F__
    const __m512 lo = _mm512_set1_ps(EXP_FLOOR), zero = _mm512_setzero_ps(), log2e = _mm512_set1_ps(1.44269504f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693145752f), ln2_lo = _mm512_set1_ps(1.42860677e-6f);
    const float coef[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    for (; c + 16 <= n; c += 16) {
        __m512 x = _mm512_loadu_ps(a + c);
        if (b) x = _mm512_sub_ps(x, _mm512_loadu_ps(b + c));
        x = _mm512_max_ps(_mm512_min_ps(x, zero), lo);
        const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(nf, ln2_hi)), _mm512_mul_ps(nf, ln2_lo));
        __m512 p = _mm512_set1_ps(coef[0]);
        for (int i = 1; i < 7; i++) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(coef[i]));
        p = _mm512_scalef_ps(p, nf); /* p 2^n */
        if (mul) p = _mm512_mul_ps(p, _mm512_loadu_ps(mul + c));
        _mm512_storeu_ps(out + c, p);
    }
#endif
    for (; c < n; c++) out[c] = exp_neg(clampf(a[c] - (b ? b[c] : 0.0f), EXP_FLOOR, 0.0f)) * (mul ? mul[c] : 1.0f);
}

/* (sum_c a[c] x[c], sum_c b[c] x[c]): two dot products over one read of x. GCC leaves its reductions scalar here (a
 * 4-cycle add chain per element), hence the AVX-512 loop written out; the sum's order differs from BLAS's. */
static inline void dot2(const float *a, const float *b, const float *x, int64_t n, float *sa, float *sb) {
    int64_t c = 0;
    float ra = 0.0f, rb = 0.0f;
#ifdef __AVX512F__
    __m512 va = _mm512_setzero_ps(), vb = _mm512_setzero_ps();
    for (; c + 16 <= n; c += 16) {
        const __m512 vx = _mm512_loadu_ps(x + c);
        va = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), vx, va);
        vb = _mm512_fmadd_ps(_mm512_loadu_ps(b + c), vx, vb);
    }
    ra = _mm512_reduce_add_ps(va);
    rb = _mm512_reduce_add_ps(vb);
#endif
    for (; c < n; c++) {
        ra += a[c] * x[c];
        rb += b[c] * x[c];
    }
    *sa = ra;
    *sb = rb;
}

/* C[r, :n] = init_r + sum_p A[r, p] B[p, :n] for r < m (m a multiple of RB), where init_r is 0 (scale NULL) or
 * scale[r] C[r, :] (C read, then written: a state decayed in place). */
static void gemm(int64_t m, int64_t n, int64_t kk, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                 int64_t ldc, const float *scale) {
#ifdef __AVX512F__
    if (n % 32 == 0) {
        for (int64_t j0 = 0; j0 < n; j0 += 32)
            for (int64_t r0 = 0; r0 < m; r0 += RB) {
                __m512 acc[RB][2];
#pragma GCC unroll 8
                for (int r = 0; r < RB; r++) {
                    float *c = C + (r0 + r) * ldc + j0;
                    if (scale) {
                        const __m512 s = _mm512_set1_ps(scale[r0 + r]);
                        acc[r][0] = _mm512_mul_ps(s, _mm512_loadu_ps(c));
                        acc[r][1] = _mm512_mul_ps(s, _mm512_loadu_ps(c + 16));
                    } else {
                        acc[r][0] = _mm512_setzero_ps();
                        acc[r][1] = _mm512_setzero_ps();
                    }
                }
                const float *a = A + r0 * lda;
                for (int64_t p = 0; p < kk; p++) {
                    const __m512 b0 = _mm512_loadu_ps(B + p * ldb + j0), b1 = _mm512_loadu_ps(B + p * ldb + j0 + 16);
#pragma GCC unroll 8
                    for (int r = 0; r < RB; r++) {
                        const __m512 x = _mm512_set1_ps(a[r * lda + p]);
                        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < RB; r++) {
                    float *c = C + (r0 + r) * ldc + j0;
                    _mm512_storeu_ps(c, acc[r][0]);
                    _mm512_storeu_ps(c + 16, acc[r][1]);
                }
            }
        return;
    }
#endif
    for (int64_t r0 = 0; r0 < m; r0 += RB)
        for (int64_t j0 = 0; j0 < n; j0 += 64) {
            const int64_t nj = n - j0 < 64 ? n - j0 : 64;
            float acc[RB][64];
            for (int r = 0; r < RB; r++)
                for (int64_t j = 0; j < nj; j++) acc[r][j] = scale ? scale[r0 + r] * C[(r0 + r) * ldc + j0 + j] : 0.0f;
            for (int64_t p = 0; p < kk; p++) {
                const float *b = B + p * ldb + j0;
                for (int r = 0; r < RB; r++) {
                    const float x = A[(r0 + r) * lda + p];
#pragma omp simd
                    for (int64_t j = 0; j < nj; j++) acc[r][j] = fmaf(x, b[j], acc[r][j]);
                }
            }
            for (int r = 0; r < RB; r++) memcpy(C + (r0 + r) * ldc + j0, acc[r], sizeof(float) * (size_t)nj);
        }
}

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t q_stride, k_stride, v_stride; /* elements between tokens; heads are contiguous inside a token */
    int64_t hk, hv, dk, dv;
    int per_channel, normalize;
    float l2_eps;
    float *out;
} Inputs;

typedef struct { /* one thread's scratch, sized for MAX_PIECE tokens */
    float *cum, *qn, *kn, *wq, *kdT, *u, *p, *m, *a, *scale;
} Scratch;

static int scratch_init(Scratch *w, int64_t dk, int64_t dv) {
    const int64_t lp = MAX_PIECE;
    const size_t sizes[10] = {lp * dk, lp * dk, lp * dk, 2 * lp * dk, dk * lp, lp * dv, 2 * lp * dv, lp * lp,
                              lp * lp, dk};
    float **ptrs[10] = {&w->cum, &w->qn, &w->kn, &w->wq, &w->kdT, &w->u, &w->p, &w->m, &w->a, &w->scale};
    size_t total = 0;
    for (int i = 0; i < 10; i++) total += (sizes[i] + 15) / 16 * 16;
    float *base = aligned_alloc(64, total * sizeof(float));
    if (!base) return -1;
    for (int i = 0; i < 10; i++) {
        *ptrs[i] = base;
        base += (sizes[i] + 15) / 16 * 16;
    }
    return 0;
}

/* q, k of one piece's tokens for value head h (its key head), L2-normalised (q also scaled by Dk^-1/2) where
 * asked, as gdn.normalize_qk_inputs: x * rsqrt(sum x^2 + eps). */
static void load_qk(const Inputs *in, int64_t h, int64_t t0, int64_t len, Scratch *w) {
    const int64_t kh = h / (in->hv / in->hk), dk = in->dk;
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t i = 0; i < len; i++) {
        const float *q = in->q + (t0 + i) * in->q_stride + kh * dk, *k = in->k + (t0 + i) * in->k_stride + kh * dk;
        float *qo = w->qn + i * dk, *ko = w->kn + i * dk;
        if (!in->normalize) {
            memcpy(qo, q, sizeof(float) * (size_t)dk);
            memcpy(ko, k, sizeof(float) * (size_t)dk);
            continue;
        }
        float sq, sk, unused;
        dot2(q, k, q, dk, &sq, &unused);
        dot2(k, q, k, dk, &sk, &unused);
        const float iq = 1.0f / sqrtf(sq + in->l2_eps), ik = 1.0f / sqrtf(sk + in->l2_eps);
#pragma omp simd
        for (int64_t c = 0; c < dk; c++) {
            qo[c] = q[c] * iq * scale;
            ko[c] = k[c] * ik;
        }
    }
}

/* One piece [t0, t0 + len) of value head h from the state S [Dk, Dv] (updated in place); o into in->out. */
static void piece(const Inputs *in, int64_t h, int64_t t0, int64_t len, float *S, Scratch *w) {
    const int64_t dk = in->dk, dv = in->dv, hv = in->hv, lp = (len + RB - 1) / RB * RB;
    const int64_t cw = in->per_channel ? dk : 1; /* decay channels */
    load_qk(in, h, t0, len, w);
    float *cum = w->cum, *qn = w->qn, *kn = w->kn, *wq = w->wq, *kdT = w->kdT, *u = w->u, *m = w->m, *a = w->a;
    /* cum = cumsum(g) inside the piece */
    for (int64_t i = 0; i < len; i++) {
        const float *g = in->g + ((t0 + i) * hv + h) * cw;
        for (int64_t c = 0; c < cw; c++) cum[i * cw + c] = (i ? cum[(i - 1) * cw + c] : 0.0f) + g[c];
    }
    const float *last = cum + (len - 1) * cw;
    /* right-hand sides: U = beta v, W = beta k exp(cum) (rows 0..lp), q exp(cum) (rows lp..2 lp), (k exp(last -
     * cum))^T, and the state's decay per key channel; the pad rows zero */
    memset(u + len * dv, 0, sizeof(float) * (size_t)((lp - len) * dv));
    memset(wq + len * dk, 0, sizeof(float) * (size_t)((lp - len) * dk));
    memset(wq + (lp + len) * dk, 0, sizeof(float) * (size_t)((lp - len) * dk));
    for (int64_t i = 0; i < len; i++) {
        const float b = in->beta[(t0 + i) * hv + h];
        const float *v = in->v + (t0 + i) * in->v_stride + h * dv;
        float *ui = u + i * dv, *wi = wq + i * dk, *qi = wq + (lp + i) * dk;
        const float *ki = kn + i * dk, *qs = qn + i * dk, *ci = cum + i * cw;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) ui[j] = v[j] * b;
        if (in->per_channel) {
            float e[MAX_DIM], f[MAX_DIM];
            exp_map(e, ci, NULL, NULL, dk);
            exp_map(f, last, ci, ki, dk);
#pragma omp simd
            for (int64_t c = 0; c < dk; c++) {
                wi[c] = (ki[c] * b) * e[c];
                qi[c] = qs[c] * e[c];
            }
            for (int64_t c = 0; c < dk; c++) kdT[c * lp + i] = f[c];
        } else {
            const float e = exp_neg(clampf(ci[0], EXP_FLOOR, 0.0f));
            const float f = exp_neg(clampf(last[0] - ci[0], EXP_FLOOR, 0.0f));
#pragma omp simd
            for (int64_t c = 0; c < dk; c++) {
                wi[c] = (ki[c] * b) * e;
                qi[c] = qs[c] * e;
                kdT[c * lp + i] = ki[c] * f;
            }
        }
    }
    for (int64_t c = 0; c < dk; c++) {
        for (int64_t i = len; i < lp; i++) kdT[c * lp + i] = 0.0f;
        w->scale[c] = exp_neg(clampf(last[in->per_channel ? c : 0], EXP_FLOOR, 0.0f));
    }
    /* M and A: (beta k) k^T and q k^T (k_j read once for both) times the decay mask */
    for (int64_t i = 0; i < len; i++) {
        const float b = in->beta[(t0 + i) * hv + h];
        const float *ki = kn + i * dk, *qi = qn + i * dk, *ci = cum + i * cw;
        for (int64_t j = 0; j <= i; j++) {
            const float *kj = kn + j * dk, *cj = cum + j * cw;
            float mk = 0.0f, aq = 0.0f;
            if (in->per_channel) {
                float l[MAX_DIM]; /* L[i, j, c] k_j[c] */
                exp_map(l, ci, cj, kj, dk);
                dot2(ki, qi, l, dk, &mk, &aq);
                m[i * lp + j] = mk * b;
            } else {
                dot2(ki, qi, kj, dk, &mk, &aq); /* k_j read once for (beta k) k^T and q k^T */
                const float l = exp_neg(clampf(ci[0] - cj[0], EXP_FLOOR, 0.0f));
                m[i * lp + j] = (mk * b) * l;
                aq *= l;
            }
            a[i * lp + j] = aq;
        }
    }
    /* [U | W] = (I + strictly_lower(M))^-1 [U | W], row by row */
    for (int64_t i = 1; i < len; i++) {
        float *ui = u + i * dv, *wi = wq + i * dk;
        for (int64_t j = 0; j < i; j++) {
            const float x = m[i * lp + j];
            const float *uj = u + j * dv, *wj = wq + j * dk;
#pragma omp simd
            for (int64_t c = 0; c < dv; c++) ui[c] -= x * uj[c];
#pragma omp simd
            for (int64_t c = 0; c < dk; c++) wi[c] -= x * wj[c];
        }
    }
    /* P = [W; q exp(cum)] S0 (2 lp rows); V' = U - P[:lp] (in u); o = P[lp:] + A V' */
    float *p = w->p;
    gemm(2 * lp, dv, dk, wq, dk, S, dv, p, dv, NULL);
    for (int64_t i = 0; i < lp; i++) {
        float *ui = u + i * dv;
        const float *pi = p + i * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; c++) ui[c] -= pi[c];
    }
    for (int64_t i = 0; i < len; i++) {
        float *o = in->out + ((t0 + i) * hv + h) * dv;
        memcpy(o, p + (lp + i) * dv, sizeof(float) * (size_t)dv);
        for (int64_t j = 0; j <= i; j++) {
            const float x = a[i * lp + j];
            const float *uj = u + j * dv;
#pragma omp simd
            for (int64_t c = 0; c < dv; c++) o[c] += x * uj[c];
        }
    }
    /* S1 = Diag(exp(last)) S0 + (k exp(last - cum))^T V' */
    gemm(dk, dv, lp, kdT, lp, u, dv, S, dv, w->scale);
}

/* The step's chunks: cu [C+1] token offsets, chunk_row [C], dest [C] (checkpoint slot or -1), end_pos [C]; rows:
 * slots [B] (running slot or -1), has_init [B] (bool bytes), last_chunk [B]. q [T, Hk, Dk] and k (row strides
 * q_stride, k_stride), v [T, Hv, Dv] (row stride v_stride), g [T, Hv] or [T, Hv, Dk] (per_channel), beta [T, Hv],
 * fp32; state [num_slots, Hv, Dk, Dv]; slot_positions [num_slots] or NULL; out [T, Hv, Dv].
 * Returns -1 (nothing written) for a slot outside [0, num_slots), -2 for a piece outside 1 .. MAX_PIECE, -3 for
 * Hv not a multiple of Hk or a head wider than MAX_DIM or a Dk not a multiple of RB, -4 when out of memory. */
int recap_gdn_prefill(int64_t num_chunks, const int64_t *cu, const int64_t *chunk_row, const int64_t *dest,
                      const int64_t *end_pos, int64_t num_rows, const int64_t *slots, const uint8_t *has_init,
                      const int64_t *last_chunk, const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                      const float *v, int64_t v_stride, const float *g, const float *beta, int64_t hk, int64_t hv,
                      int64_t dk, int64_t dv, int per_channel, int normalize, float l2_eps, float *state,
                      int64_t num_slots, int64_t *slot_positions, int64_t piece_len, float *out, int threads) {
    if (piece_len < 1 || piece_len > MAX_PIECE) return -2;
    if (hk <= 0 || hv % hk || dk > MAX_DIM || dv > MAX_DIM || dk % RB) return -3;
    if (check_step_slots(num_chunks, dest, num_rows, slots, num_slots)) return -1;
    const Inputs in = {q, k, v, g, beta, q_stride, k_stride, v_stride, hk, hv, dk, dv, per_channel, normalize,
                       l2_eps, out};
    const int64_t hsize = dk * dv;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Scratch w;
        float *S = aligned_alloc(64, sizeof(float) * (size_t)hsize);
        const int ok = S && scratch_init(&w, dk, dv) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < hv; h++) {
            if (!ok) continue;
            for (int64_t c = 0; c < num_chunks; c++) {
                const int64_t row = chunk_row[c], slot = slots[row];
                if (slot < 0) { /* a padding row: zeros out, no slot touched */
                    for (int64_t t = cu[c]; t < cu[c + 1]; t++) memset(out + (t * hv + h) * dv, 0, sizeof(float) * dv);
                    continue;
                }
                if (c == 0 || chunk_row[c - 1] != row) { /* the row's first chunk: its initial state */
                    if (has_init[row])
                        memcpy(S, state + (slot * hv + h) * hsize, sizeof(float) * (size_t)hsize);
                    else
                        memset(S, 0, sizeof(float) * (size_t)hsize);
                }
                for (int64_t t = cu[c]; t < cu[c + 1]; t += piece_len)
                    piece(&in, h, t, cu[c + 1] - t < piece_len ? cu[c + 1] - t : piece_len, S, &w);
                if (dest[c] >= 0) memcpy(state + (dest[c] * hv + h) * hsize, S, sizeof(float) * (size_t)hsize);
                if (c == last_chunk[row]) memcpy(state + (slot * hv + h) * hsize, S, sizeof(float) * (size_t)hsize);
            }
        }
        free(S);
        if (ok) free(w.cum);
    }
    if (failed) return -4;
    if (slot_positions)
        record_step_positions(slot_positions, num_chunks, chunk_row, dest, end_pos, num_rows, slots, last_chunk);
    return 0;
}
