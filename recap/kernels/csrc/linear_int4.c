/* Group-wise 4-bit weights: y[n, out] = x[n, in] W^T + b, W as 4-bit codes with one fp16 scale (and, asymmetric,
 * one fp16 min) per group of 32 or 64 inputs of an output row, x quantized to int8 with one step per row and block
 * of ACT_BLOCK inputs (the arithmetic of recap/kernels/linear_int4.py's int4_linear_ref, which every path here
 * equals bit for bit).
 *
 * Layout (linear_int4.pack): tiles of 16 output rows, each tile one sequential stream of group blocks; a block is
 * G/8 chunks of 64 bytes (16 rows x 4 bytes: byte b of row j holds code k = 8c + b in its low nibble and k + 4 in
 * its high nibble), then the 16 rows' fp16 scales, then (asymmetric) their fp16 mins.
 * A chunk unpacks with one AND and one shift + AND into two u8 vectors whose 32-bit lanes are 4 consecutive codes
 * of one row; a dot product (VNNI dpbusd, u8 x s8) against 4 activations broadcast to every lane accumulates all
 * 16 rows at once, so a group's integer sums land one per lane and its scaling is one vector op per 16 rows: no
 * horizontal reduction anywhere.
 * Per group g of a row: S = sum q x_q (int32, exact), X = sum x_q; symmetric w = s (q - 8):
 *   blk += float(S - 8 X) * s;  asymmetric w = s q + m: blk += float(S) * s; blk += m * float(X)
 * in fp32, group after group of an activation block, then acc += blk * d (the block's step), then + b: every path
 * does these operations in this order, so they agree exactly. One step per block rather than per group (llama.cpp's
 * Q8_K blocks, not its Q8_0 ones) takes one of the two fp32 multiplies per group and row off the pipes the
 * integer dot products use: a 512-row prefill ~1.1x faster on AVX-512 (benchmarks/bench_kernel_ab.py).
 * Paths (isa argument, checked against the CPU): 3 AVX-512 VNNI, 2 AVX2 + AVX-VNNI, 1 AVX2 (maddubs pairs summed
 * in int16 over 4 chunks, then one madd: exact, see pairs16; one row reads a whole tile per pass, 2+ rows go 4
 * at a time over a whole tile, K_BLOCK inputs at a time: quad16_avx2), 0 portable scalar.
 * Built by recap/kernels/native.py with -O3 -march=native -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define X86 1
#define TGT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define TGT256 __attribute__((target("avx2,f16c,fma")))
/* AVX-VNNI (256-bit dpbusd without AVX-512) needs gcc 11 / clang 12; older compilers keep the AVX2 path */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define HAVE_AVXVNNI 1
#define TGT256V __attribute__((target("avx2,f16c,fma,avxvnni")))
#endif
#endif
#define INLINE static inline __attribute__((always_inline))

#define TILE 16      /* output rows per tile */
#ifndef ROW_BLOCK
#define ROW_BLOCK 64 /* input rows whose activations are kept in L2 while the weight tiles stream by */
#endif
#ifndef K_BLOCK
#define K_BLOCK 1024 /* AVX2 prefill: inputs of a tile's block kept in L1 while a row block passes over it */
#endif
#define ACT_BLOCK 256 /* inputs per activation step: 8 groups of 32 or 4 of 64 */
#ifndef PF_DIST
#define PF_DIST 2048 /* one AVX2 row: bytes prefetched ahead in the weight stream (8.2 -> 9.7 GB/s, 1536 x 8192) */
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX2_VNNI = 2, ISA_AVX512_VNNI = 3 };
enum { FMT_SYM = 0, FMT_ASYM = 1, FMT_SB = 2 }; /* weight formats: linear_int4.py, int4_superblock.py */

/* Whether this CPU runs path `isa`. The paths do not nest: an AVX-512 VNNI CPU may lack AVX-VNNI (Zen 4, Ice
 * Lake: 256-bit VEX dpbusd is a separate extension), so a path below the best one is not always there. */
int recap_int4_isa_supported(int isa) {
    if (isa == ISA_SCALAR) return 1;
#if defined(X86)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
#if defined(HAVE_AVXVNNI)
    if (isa == ISA_AVX2_VNNI) return avx2 && __builtin_cpu_supports("avxvnni");
#endif
    if (isa == ISA_AVX512_VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

int recap_int4_best_isa(void) {
#if defined(X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
#if defined(HAVE_AVXVNNI)
        if (__builtin_cpu_supports("avxvnni")) return ISA_AVX2_VNNI;
#endif
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* The activations of n rows: codes xs [n, kp] (zero past k), per row and block d [n, nb] (the step), per row and
 * group X [n, ng] (the sum of the codes) and xf = float(X); gpb groups a block. */
typedef struct {
    const int8_t *xs;
    const float *d, *xf;
    const int32_t *xsum;
    int64_t kp, ng, nb, gpb;
    const int32_t *xp; /* super-blocks: the group-sum pairs (sb_pairs), else NULL */
} Acts;

/* The step of row r's activation block that group g ends, or NULL where g ends no block (the AVX2 paths' group
 * loops). */
INLINE const float *block_step(const Acts *A, int64_t r, int64_t g) {
    return (g + 1) % A->gpb == 0 || g + 1 == A->ng ? A->d + r * A->nb + g / A->gpb : NULL;
}

/* Groups [*g0, *g1) of activation block b. */
INLINE void block_groups(const Acts *A, int64_t b, int64_t *g0, int64_t *g1) {
    *g0 = b * A->gpb;
    *g1 = *g0 + A->gpb < A->ng ? *g0 + A->gpb : A->ng;
}

/* The packed weight: tiles of ng blocks of `block` bytes; cpg = G / 8 chunks per group. */
typedef struct {
    const uint8_t *w;
    const float *b;
    int64_t ng, block, out;
    int cpg, asym;
} W4;

/* ---------------------------------------------------------------- activations */

/* Per group of the block's codes q (ngb groups of G): their sum X and float(X). */
static void group_sums(const int8_t *q, int64_t G, int64_t ngb, int32_t *xsum, float *xf) {
    for (int64_t g = 0; g < ngb; g++) {
        int32_t s = 0;
        for (int64_t i = 0; i < G; i++) s += q[g * G + i];
        xsum[g] = s;
        xf[g] = (float)s;
    }
}

/* One block of len <= ngb * G values: d = max|x| / 127 (1 where that is not positive), codes rint(x / d) clamped to
 * +-127, zero-padded to ngb whole groups. Division and round-half-even: the fp32 ops of the reference. */
static void quant_block(const float *x, int64_t len, int64_t G, int64_t ngb, int8_t *q, float *d, int32_t *xsum,
                        float *xf) {
    float m = 0.0f;
    for (int64_t i = 0; i < len; i++) m = fmaxf(m, fabsf(x[i]));
    float dd = m / 127.0f;
    if (!(dd > 0.0f)) dd = 1.0f;
    for (int64_t i = 0; i < len; i++) {
        float t = rintf(x[i] / dd);
        t = t < -127.0f ? -127.0f : (t > 127.0f ? 127.0f : t);
        q[i] = (int8_t)t;
    }
    memset(q + len, 0, (size_t)(ngb * G - len));
    *d = dd;
    group_sums(q, G, ngb, xsum, xf);
}

#if defined(X86)
/* quant_block for len = ngb * G values (whole groups) in 16-lane vectors (the same ops: max is exact in any order). */
TGT512 static void quant_block_512(const float *x, int64_t len, int64_t G, int64_t ngb, int8_t *q, float *d,
                                   int32_t *xsum, float *xf) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 mv = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) mv = _mm512_max_ps(mv, _mm512_and_ps(_mm512_loadu_ps(x + i), sign));
    float dd = _mm512_reduce_max_ps(mv) / 127.0f;
    if (!(dd > 0.0f)) dd = 1.0f;
    const __m512 vd = _mm512_set1_ps(dd), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t g = 0; g < ngb; g++) {
        __m512i sv = _mm512_setzero_si512();
        for (int64_t i = g * G; i < (g + 1) * G; i += 16) {
            __m512 t = _mm512_div_ps(_mm512_loadu_ps(x + i), vd);
            t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, lo), hi));
            sv = _mm512_add_epi32(sv, c);
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(c));
        }
        xsum[g] = _mm512_reduce_add_epi32(sv);
        xf[g] = (float)xsum[g];
    }
    *d = dd;
}

/* quant_block_512 in 8-lane vectors. */
TGT256 static void quant_block_256(const float *x, int64_t len, int64_t G, int64_t ngb, int8_t *q, float *d,
                                   int32_t *xsum, float *xf) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mv = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 8) mv = _mm256_max_ps(mv, _mm256_and_ps(_mm256_loadu_ps(x + i), sign));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float dd = _mm_cvtss_f32(m4) / 127.0f;
    if (!(dd > 0.0f)) dd = 1.0f;
    const __m256 vd = _mm256_set1_ps(dd), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t i = 0; i < len; i += 8) {
        const __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vd),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
        /* |c| <= 127: the saturating packs are exact */
        const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(p, p));
    }
    *d = dd;
    group_sums(q, G, ngb, xsum, xf);
}
#endif

static void quantize_acts(const float *x, int64_t n, int64_t k, const Acts *A, int isa, int threads, int8_t *xs,
                          float *d, int32_t *xsum, float *xf) {
    const int64_t G = A->kp / A->ng;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 16)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < A->nb; b++) {
            int64_t g0, g1;
            block_groups(A, b, &g0, &g1);
            const int64_t at = g0 * G, len = k - at < (g1 - g0) * G ? k - at : (g1 - g0) * G;
            const int64_t gi = r * A->ng + g0;
            int8_t *q = xs + r * A->kp + at;
#if defined(X86)
            if (isa == ISA_AVX512_VNNI && len == (g1 - g0) * G) {
                quant_block_512(x + r * k + at, len, G, g1 - g0, q, d + r * A->nb + b, xsum + gi, xf + gi);
                continue;
            }
            if (isa != ISA_SCALAR && len == (g1 - g0) * G) {
                quant_block_256(x + r * k + at, len, G, g1 - g0, q, d + r * A->nb + b, xsum + gi, xf + gi);
                continue;
            }
#endif
            quant_block(x + r * k + at, len, G, g1 - g0, q, d + r * A->nb + b, xsum + gi, xf + gi);
        }
}

/* ---------------------------------------------------------------- symmetric scales */

/* Squared error of w [G] on the grid d (q - 8, q in 0..15). */
static float grid_error(const float *w, int64_t G, float d) {
    float e = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        float q = rintf(w[i] / d) + 8.0f;
        q = q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q);
        const float r = w[i] - (q - 8.0f) * d;
        e += r * r;
    }
    return e;
}

/* Per group of w [groups, G]: the scale of least squared error among the largest-magnitude value m over
 * -8.5 .. -7 in quarters (m / -8 makes m exact and clips the other side at 7/8 of it; larger divisors trade
 * that for a finer grid), the best then refit by least squares on its codes. 0 for an all-zero group. */
void recap_int4_sym_scales(const float *w, int64_t groups, int64_t G, float *scales, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        const float *x = w + g * G;
        float m = 0.0f;
        for (int64_t i = 0; i < G; i++)
            if (fabsf(x[i]) > fabsf(m)) m = x[i];
        if (m == 0.0f) {
            scales[g] = 0.0f;
            continue;
        }
        float best = m / -8.0f, best_e = grid_error(x, G, best);
        for (int j = 0; j < 7; j++) {
            const float d = m / (-8.5f + 0.25f * (float)j), e = grid_error(x, G, d);
            if (e < best_e) best = d, best_e = e;
        }
        float qw = 0.0f, qq = 0.0f;
        for (int64_t i = 0; i < G; i++) {
            float q = rintf(x[i] / best) + 8.0f;
            q = (q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q)) - 8.0f;
            qw += q * x[i];
            qq += q * q;
        }
        const float d = qq > 0.0f ? qw / qq : 0.0f;
        scales[g] = d != 0.0f && grid_error(x, G, d) < best_e ? d : best;
    }
}

/* The weighted symmetric fit (kernels/linear_int4.sym_fit_ref, equal to it bit for bit): per group, weights
 * c_i = rms(w) + |w_i| (those of the super-block fit below, llama.cpp's Q4_K without an importance matrix);
 * candidates d = m / x, m the largest-magnitude value (the first of equals), x = SYM_FIT_X0 + SYM_FIT_DX t, codes
 * q = clamp(rint(w x / m), -8, 7); each candidate's codes refit by weighted least squares, d = sum c q w / sum c q q,
 * whose weighted error is sum c w^2 - (sum c q w)^2 / sum c q q: the candidate of the largest
 * (sum c q w)^2 / sum c q q is kept (the first of equals). 0 for an all-zero group. imp (NULL: none): per value
 * an importance multiplier (an importance matrix's channel weight, model/importance.py), c_i = (rms + |w_i|) imp_i. */
#define SYM_FIT_STEPS 29 /* x = -9.5 .. -6 in eighths */
#define SYM_FIT_X0 -9.5f
#define SYM_FIT_DX 0.125f

static float sym_fit_group(const float *x, const float *imp, int64_t G) {
    float m = 0.0f, s2 = 0.0f, c[64];
    for (int64_t i = 0; i < G; i++) {
        if (fabsf(x[i]) > fabsf(m)) m = x[i];
        s2 = s2 + x[i] * x[i];
    }
    if (m == 0.0f) return 0.0f;
    const float rms = sqrtf(s2 / (float)G);
    for (int64_t i = 0; i < G; i++) c[i] = imp ? (rms + fabsf(x[i])) * imp[i] : rms + fabsf(x[i]);
    float best = m / -8.0f, best_score = -1.0f;
    for (int t = 0; t < SYM_FIT_STEPS; t++) {
        const float id = (SYM_FIT_X0 + SYM_FIT_DX * (float)t) / m;
        float sqw = 0.0f, sqq = 0.0f;
        for (int64_t i = 0; i < G; i++) {
            float q = rintf(x[i] * id);
            q = q < -8.0f ? -8.0f : (q > 7.0f ? 7.0f : q);
            const float cq = c[i] * q;
            sqw = sqw + cq * x[i];
            sqq = sqq + cq * q;
        }
        if (!(sqq > 0.0f)) continue;
        const float score = sqw * sqw / sqq;
        if (score > best_score) best = sqw / sqq, best_score = score;
    }
    return best;
}

/* Groups g0 .. g0 + lanes - 1 of w (and of imp, when not NULL) transposed into wt (and it) [G][lanes]: one group a
 * lane for the vector fits. */
static void transpose_groups(const float *w, const float *imp, int64_t g0, int64_t lanes, int64_t G, float *wt,
                             float *it) {
    for (int64_t j = 0; j < lanes; j++)
        for (int64_t i = 0; i < G; i++) {
            wt[lanes * i + j] = w[(g0 + j) * G + i];
            if (imp) it[lanes * i + j] = imp[(g0 + j) * G + i];
        }
}

#if defined(X86)
/* sym_fit_group for 16 groups at once, one per lane (wt: their values transposed, [G][16]; it: their importances
 * so, or NULL; ct: room for their weights): the same operations lane by lane; the clamp as max / min with the
 * value second (a NaN stays, as in the scalar ternaries and torch's clamp). */
TGT512 static void sym_fit16_512(const float *wt, const float *it, float *ct, int64_t G, float *out) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 lo = _mm512_set1_ps(-8.0f), hi = _mm512_set1_ps(7.0f);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 m = zero, s2 = zero;
    for (int64_t i = 0; i < G; i++) {
        const __m512 v = _mm512_loadu_ps(wt + 16 * i);
        const __mmask16 gt = _mm512_cmp_ps_mask(_mm512_and_ps(v, absmask), _mm512_and_ps(m, absmask), _CMP_GT_OQ);
        m = _mm512_mask_blend_ps(gt, m, v);
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(v, v));
    }
    const __m512 rms = _mm512_sqrt_ps(_mm512_div_ps(s2, _mm512_set1_ps((float)G)));
    for (int64_t i = 0; i < G; i++) {
        const __m512 c = _mm512_add_ps(rms, _mm512_and_ps(_mm512_loadu_ps(wt + 16 * i), absmask));
        _mm512_storeu_ps(ct + 16 * i, it ? _mm512_mul_ps(c, _mm512_loadu_ps(it + 16 * i)) : c);
    }
    __m512 best = _mm512_div_ps(m, _mm512_set1_ps(-8.0f)), best_score = _mm512_set1_ps(-1.0f);
    for (int t = 0; t < SYM_FIT_STEPS; t++) {
        const __m512 id = _mm512_div_ps(_mm512_set1_ps(SYM_FIT_X0 + SYM_FIT_DX * (float)t), m);
        __m512 sqw = zero, sqq = zero;
        for (int64_t i = 0; i < G; i++) {
            const __m512 v = _mm512_loadu_ps(wt + 16 * i);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
            const __m512 cq = _mm512_mul_ps(_mm512_loadu_ps(ct + 16 * i), q);
            sqw = _mm512_add_ps(sqw, _mm512_mul_ps(cq, v));
            sqq = _mm512_add_ps(sqq, _mm512_mul_ps(cq, q));
        }
        const __mmask16 ok = _mm512_cmp_ps_mask(sqq, zero, _CMP_GT_OQ);
        const __m512 dd = _mm512_mask_blend_ps(ok, one, sqq);
        const __m512 score = _mm512_div_ps(_mm512_mul_ps(sqw, sqw), dd);
        const __mmask16 keep = ok & _mm512_cmp_ps_mask(score, best_score, _CMP_GT_OQ);
        best = _mm512_mask_blend_ps(keep, best, _mm512_div_ps(sqw, dd));
        best_score = _mm512_mask_blend_ps(keep, best_score, score);
    }
    _mm512_storeu_ps(out, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero, _CMP_EQ_OQ), best, zero));
}

/* sym_fit16_512 with 8 lanes on AVX2 (wt [G][8]): the same operations lane by lane, masks as blends. */
TGT256 static void sym_fit8_256(const float *wt, const float *it, float *ct, int64_t G, float *out) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = zero, s2 = zero;
    for (int64_t i = 0; i < G; i++) {
        const __m256 v = _mm256_loadu_ps(wt + 8 * i);
        const __m256 gt = _mm256_cmp_ps(_mm256_and_ps(v, absmask), _mm256_and_ps(m, absmask), _CMP_GT_OQ);
        m = _mm256_blendv_ps(m, v, gt);
        s2 = _mm256_add_ps(s2, _mm256_mul_ps(v, v));
    }
    const __m256 rms = _mm256_sqrt_ps(_mm256_div_ps(s2, _mm256_set1_ps((float)G)));
    for (int64_t i = 0; i < G; i++) {
        const __m256 c = _mm256_add_ps(rms, _mm256_and_ps(_mm256_loadu_ps(wt + 8 * i), absmask));
        _mm256_storeu_ps(ct + 8 * i, it ? _mm256_mul_ps(c, _mm256_loadu_ps(it + 8 * i)) : c);
    }
    __m256 best = _mm256_div_ps(m, _mm256_set1_ps(-8.0f)), best_score = _mm256_set1_ps(-1.0f);
    for (int t = 0; t < SYM_FIT_STEPS; t++) {
        const __m256 id = _mm256_div_ps(_mm256_set1_ps(SYM_FIT_X0 + SYM_FIT_DX * (float)t), m);
        __m256 sqw = zero, sqq = zero;
        for (int64_t i = 0; i < G; i++) {
            const __m256 v = _mm256_loadu_ps(wt + 8 * i);
            __m256 q = _mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_min_ps(hi, _mm256_max_ps(lo, q));
            const __m256 cq = _mm256_mul_ps(_mm256_loadu_ps(ct + 8 * i), q);
            sqw = _mm256_add_ps(sqw, _mm256_mul_ps(cq, v));
            sqq = _mm256_add_ps(sqq, _mm256_mul_ps(cq, q));
        }
        const __m256 ok = _mm256_cmp_ps(sqq, zero, _CMP_GT_OQ);
        const __m256 dd = _mm256_blendv_ps(one, sqq, ok);
        const __m256 score = _mm256_div_ps(_mm256_mul_ps(sqw, sqw), dd);
        const __m256 keep = _mm256_and_ps(ok, _mm256_cmp_ps(score, best_score, _CMP_GT_OQ));
        best = _mm256_blendv_ps(best, _mm256_div_ps(sqw, dd), keep);
        best_score = _mm256_blendv_ps(best_score, score, keep);
    }
    _mm256_storeu_ps(out, _mm256_blendv_ps(best, zero, _mm256_cmp_ps(m, zero, _CMP_EQ_OQ)));
}
#endif

/* The weighted symmetric fit of w [groups, G] (G <= 64) into scales [groups]: 16 groups a vector on AVX-512, 8 on
 * AVX2, the rest one by one. */
/* recap_int4_sym_fit on a given path (isa: ISA_*; tests run each; all give the same scales); imp: NULL, or per
 * value importances [groups, G] (sym_fit_group). */
void recap_int4_sym_fit_isa(const float *w, const float *imp, int64_t groups, int64_t G, float *scales, int threads,
                            int isa) {
    const int64_t blocks = groups / 16;
#if defined(X86)
    const int vec = isa == ISA_AVX512_VNNI && recap_int4_isa_supported(ISA_AVX512_VNNI) && G <= 64;
    const int avx2 = !vec && isa != ISA_SCALAR && recap_int4_isa_supported(ISA_AVX2) && G <= 64;
#else
    const int vec = 0;
    (void)isa;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t bi = 0; bi < blocks + (groups % 16 ? 1 : 0); bi++) {
        const int64_t g0 = bi * 16;
#if defined(X86)
        if (vec && bi < blocks) {
            float wt[64 * 16], it[64 * 16], ct[64 * 16];
            transpose_groups(w, imp, g0, 16, G, wt, it);
            sym_fit16_512(wt, imp ? it : NULL, ct, G, scales + g0);
            continue;
        }
        if (avx2 && bi < blocks) {
            float wt[64 * 8], it[64 * 8], ct[64 * 8];
            for (int64_t h = 0; h < 16; h += 8) {
                transpose_groups(w, imp, g0 + h, 8, G, wt, it);
                sym_fit8_256(wt, imp ? it : NULL, ct, G, scales + g0 + h);
            }
            continue;
        }
#endif
        for (int64_t g = g0; g < g0 + 16 && g < groups; g++)
            scales[g] = sym_fit_group(w + g * G, imp ? imp + g * G : NULL, G);
    }
}

void recap_int4_sym_fit(const float *w, const float *imp, int64_t groups, int64_t G, float *scales, int threads) {
    recap_int4_sym_fit_isa(w, imp, groups, G, scales, threads, recap_int4_best_isa());
}

/* ---------------------------------------------------------------- super-block fit (format 2) */

#define FIT_STEPS 17 /* candidate inverse steps (14 + t / 8) / range: kernels/int4_superblock.py */

/* One candidate's least-squares (s, m) on the codes rint((w - lo) * iscale), weighted c, and its weighted squared
 * error; 0 where the fit is degenerate. The operations of int4_superblock.asym_fit_ref, in its order. */
static int fit_candidate(const float *w, const float *c, int64_t G, float lo, float iscale, float cs, float cw,
                         float *s_out, float *m_out, float *e_out) {
    float q[64];
    float sl = 0.0f, sll = 0.0f, slw = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        float t = rintf((w[i] - lo) * iscale);
        t = t < 0.0f ? 0.0f : (t > 15.0f ? 15.0f : t);
        q[i] = t;
        const float cq = c[i] * t;
        sl = sl + cq;
        sll = sll + cq * t;
        slw = slw + cq * w[i];
    }
    const float den = cs * sll - sl * sl;
    if (!(den > 0.0f)) return 0;
    float s = (cs * slw - sl * cw) / den, m = (sll * cw - sl * slw) / den;
    if (m > 0.0f) {
        s = slw / (sll > 0.0f ? sll : 1.0f);
        m = 0.0f;
    }
    s = s < 0.0f ? 0.0f : s;
    float e = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        const float r = s * q[i] + m - w[i];
        e = e + c[i] * (r * r);
    }
    *s_out = s, *m_out = m, *e_out = e;
    return 1;
}

/* asym_fit_ref for one group of G <= 64 values: weights c_i = rms(w) + |w_i|, times imp_i where imp is not NULL. */
static void fit_group(const float *w, const float *imp, int64_t G, float *s_out, float *m_out) {
    float lo = 0.0f, hi = w[0], s2 = 0.0f, c[64];
    for (int64_t i = 0; i < G; i++) {
        lo = fminf(lo, w[i]);
        hi = fmaxf(hi, w[i]);
        s2 = s2 + w[i] * w[i];
    }
    const float rms = sqrtf(s2 / (float)G);
    float cs = 0.0f, cw = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        c[i] = imp ? (rms + fabsf(w[i])) * imp[i] : rms + fabsf(w[i]);
        cs = cs + c[i];
        cw = cw + c[i] * w[i];
    }
    const float rng = hi - lo;
    if (rng == 0.0f) {
        *s_out = 0.0f, *m_out = lo;
        return;
    }
    float bs = rng / 15.0f, bm = lo, be = INFINITY;
    for (int t = 0; t < FIT_STEPS; t++) {
        float s, m, e;
        if (fit_candidate(w, c, G, lo, (14.0f + 0.125f * (float)t) / rng, cs, cw, &s, &m, &e) && e < be)
            bs = s, bm = m, be = e;
    }
    *s_out = bs, *m_out = bm;
}

#if defined(X86)
/* fit_group for 16 groups at once, one per lane (wt: their values transposed, [G][16]; it: their importances so, or
 * NULL; ct: room for their weights):
 * the same operations lane by lane; comparisons as masks, max / min with the candidate second (a NaN stays, as in
 * torch's clamp). */
TGT512 static void fit16_512(const float *wt, const float *it, float *ct, int64_t G, float *s_out, float *m_out) {
    const __m512 zero = _mm512_setzero_ps(), fifteen = _mm512_set1_ps(15.0f), one = _mm512_set1_ps(1.0f);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 lo = zero, hi = _mm512_loadu_ps(wt), s2 = zero;
    for (int64_t i = 0; i < G; i++) {
        const __m512 v = _mm512_loadu_ps(wt + 16 * i);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(v, v));
    }
    const __m512 rms = _mm512_sqrt_ps(_mm512_div_ps(s2, _mm512_set1_ps((float)G)));
    __m512 cs = zero, cw = zero;
    for (int64_t i = 0; i < G; i++) {
        const __m512 v = _mm512_loadu_ps(wt + 16 * i), c0 = _mm512_add_ps(rms, _mm512_and_ps(v, absmask));
        const __m512 c = it ? _mm512_mul_ps(c0, _mm512_loadu_ps(it + 16 * i)) : c0;
        _mm512_storeu_ps(ct + 16 * i, c);
        cs = _mm512_add_ps(cs, c);
        cw = _mm512_add_ps(cw, _mm512_mul_ps(c, v));
    }
    const __m512 rng = _mm512_sub_ps(hi, lo);
    __m512 bs = _mm512_div_ps(rng, fifteen), bm = lo, be = _mm512_set1_ps(INFINITY);
    for (int t = 0; t < FIT_STEPS; t++) {
        const __m512 iscale = _mm512_div_ps(_mm512_set1_ps(14.0f + 0.125f * (float)t), rng);
        __m512 sl = zero, sll = zero, slw = zero;
        for (int64_t i = 0; i < G; i++) {
            const __m512 v = _mm512_loadu_ps(wt + 16 * i);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, lo), iscale),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(fifteen, _mm512_max_ps(zero, q));
            const __m512 cq = _mm512_mul_ps(_mm512_loadu_ps(ct + 16 * i), q);
            sl = _mm512_add_ps(sl, cq);
            sll = _mm512_add_ps(sll, _mm512_mul_ps(cq, q));
            slw = _mm512_add_ps(slw, _mm512_mul_ps(cq, v));
        }
        const __m512 den = _mm512_sub_ps(_mm512_mul_ps(cs, sll), _mm512_mul_ps(sl, sl));
        const __mmask16 ok = _mm512_cmp_ps_mask(den, zero, _CMP_GT_OQ);
        const __m512 dd = _mm512_mask_blend_ps(ok, one, den);
        __m512 s = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(cs, slw), _mm512_mul_ps(sl, cw)), dd);
        __m512 m = _mm512_div_ps(_mm512_sub_ps(_mm512_mul_ps(sll, cw), _mm512_mul_ps(sl, slw)), dd);
        const __mmask16 pos = _mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ);
        const __mmask16 sllpos = _mm512_cmp_ps_mask(sll, zero, _CMP_GT_OQ);
        s = _mm512_mask_blend_ps(pos, s, _mm512_div_ps(slw, _mm512_mask_blend_ps(sllpos, one, sll)));
        m = _mm512_mask_blend_ps(pos, m, zero);
        s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, zero, _CMP_LT_OQ), s, zero);
        __m512 e = zero;
        for (int64_t i = 0; i < G; i++) {
            const __m512 v = _mm512_loadu_ps(wt + 16 * i);
            __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, lo), iscale),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(fifteen, _mm512_max_ps(zero, q));
            const __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(s, q), m), v);
            e = _mm512_add_ps(e, _mm512_mul_ps(_mm512_loadu_ps(ct + 16 * i), _mm512_mul_ps(r, r)));
        }
        const __mmask16 keep = ok & _mm512_cmp_ps_mask(e, be, _CMP_LT_OQ);
        bs = _mm512_mask_blend_ps(keep, bs, s);
        bm = _mm512_mask_blend_ps(keep, bm, m);
        be = _mm512_mask_blend_ps(keep, be, e);
    }
    const __mmask16 flat = _mm512_cmp_ps_mask(rng, zero, _CMP_EQ_OQ);
    _mm512_storeu_ps(s_out, _mm512_mask_blend_ps(flat, bs, zero));
    _mm512_storeu_ps(m_out, _mm512_mask_blend_ps(flat, bm, lo));
}
#endif

/* Per group of w [groups, G] (G <= 64): the weighted least-squares (s, m) of w ~ s q + m, s >= 0, m <= 0, of
 * int4_superblock.asym_fit_ref, equal to it bit for bit (16 groups a vector on AVX-512, the rest one by one); imp:
 * NULL, or per value importances [groups, G] (fit_group). */
void recap_int4_asym_fit(const float *w, const float *imp, int64_t groups, int64_t G, float *s, float *m,
                         int threads) {
    const int64_t blocks = groups / 16;
#if defined(X86)
    const int vec = recap_int4_isa_supported(ISA_AVX512_VNNI) && G <= 64;
#else
    const int vec = 0;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t bi = 0; bi < blocks + (groups % 16 ? 1 : 0); bi++) {
        const int64_t g0 = bi * 16;
#if defined(X86)
        if (vec && bi < blocks) {
            float wt[64 * 16], it[64 * 16], ct[64 * 16];
            transpose_groups(w, imp, g0, 16, G, wt, it);
            fit16_512(wt, imp ? it : NULL, ct, G, s + g0, m + g0);
            continue;
        }
#endif
        for (int64_t g = g0; g < g0 + 16 && g < groups; g++)
            fit_group(w + g * G, imp ? imp + g * G : NULL, G, s + g, m + g);
    }
}

/* ---------------------------------------------------------------- scalar */

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (ex == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (ex != 0) {
        bits = sign | ((ex + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: exact in fp32 */
        float f = (float)man * 5.9604644775390625e-8f; /* 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Rows [r0, r0 + nr) of the activations times tile tw (outputs o..o+15) -> y. */
static void tile_scalar(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int nr, int64_t o, float *y) {
    const int64_t G = (int64_t)W->cpg * 8;
    for (int r = 0; r < nr; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < A->nb; b++) {
            float blk[TILE] = {0};
            int64_t g0, g1;
            block_groups(A, b, &g0, &g1);
            for (int64_t g = g0; g < g1; g++) {
                const uint8_t *bg = tw + g * W->block;
                const int8_t *xg = A->xs + (r0 + r) * A->kp + g * G;
                const int64_t gi = (r0 + r) * A->ng + g;
                for (int j = 0; j < TILE; j++) {
                    int32_t s = 0;
                    for (int c = 0; c < W->cpg; c++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t v = bg[c * 64 + j * 4 + i];
                            s += (int32_t)(v & 15) * xg[8 * c + i] + (int32_t)(v >> 4) * xg[8 * c + 4 + i];
                        }
                    uint16_t h;
                    memcpy(&h, bg + W->cpg * 64 + 2 * j, 2);
                    const float sc = half_to_float(h);
                    if (!W->asym) {
                        blk[j] = blk[j] + (float)(s - 8 * A->xsum[gi]) * sc;
                    } else {
                        memcpy(&h, bg + W->cpg * 64 + 32 + 2 * j, 2);
                        blk[j] = blk[j] + (float)s * sc;
                        blk[j] = blk[j] + half_to_float(h) * A->xf[gi];
                    }
                }
            }
            for (int j = 0; j < TILE; j++) acc[j] = acc[j] + blk[j] * A->d[(r0 + r) * A->nb + b];
        }
        for (int j = 0; j < TILE && o + j < W->out; j++)
            y[(r0 + r) * W->out + o + j] = W->b ? acc[j] + W->b[o + j] : acc[j];
    }
}

/* ---------------------------------------------------------------- super-blocks (format 2) */

/* kernels/int4_superblock.py's layout: per tile, super-blocks of SB_META header bytes (uint32 A[16], B[16],
 * N[16], fp16 d[16], dmin[16]) then their groups' code blocks (those of symmetric g32: 4 chunks of 64 bytes).
 * sc_g: bits 0-5 of byte g & 3 of A (g < 4) or B; mn_(2i+e): low nibble at bit 4i + 16e of N, high 2 bits at
 * 8 (i & 1) + 6 + 16e of A (i < 2) or B (so a pair of mins unpacks as two int16 in 5 ops). Per row and super-block: blk += float(S_g) * (d sc_g) group after group, then
 * blk += float(M) * (-dmin) with M = sum_g mn_g X_g (exact int32: the activations' pairs xp hold (X_2i, X_2i+1)
 * as two int16 per word), then acc += blk * x_step. */
#define SB_META 256
#define SB_GROUPS 8
#define SB_BYTES (SB_META + SB_GROUPS * 256) /* a whole super-block */
#ifndef SB_PAIR_ROWS /* AVX-512 from this many rows: two tiles x 4 rows a pass (sb_pair4); below, 8 rows a
                       * pass over one tile, weight prefetched (8 rows 0.81-1.03x sym g32, the pairs 1.06-1.17x) */
#define SB_PAIR_ROWS 32
#endif
#ifndef SB_CACHE_ROWS
#define SB_CACHE_ROWS 16 /* rows from which prefill unpacks a tile pair's headers once per row block */
#endif

/* Shifts of group g's fields: sc in its word (A or B), mn's low nibble in N, mn's high bits in its word. */
INLINE int sb_sc_shift(int g) { return 8 * (g & 3); }
INLINE int sb_mn_lo_shift(int g) { return 4 * (g >> 1) + 16 * (g & 1); }
INLINE int sb_mn_hi_shift(int g) { return 8 * ((g >> 1) & 1) + 6 + 16 * (g & 1); }

/* Groups in super-block b of a weight of ng groups. */
INLINE int sb_groups(int64_t ng, int64_t b) { return ng - SB_GROUPS * b < SB_GROUPS ? (int)(ng - SB_GROUPS * b) : SB_GROUPS; }

/* The activations' group-sum pairs: xp [n, nb, 4], word i of block b = X_{8b+2i} | X_{8b+2i+1} << 16 (int16 each:
 * |X| <= 32 x 127), 0 past the last group. */
static void sb_pairs(const Acts *A, int64_t n, int32_t *xp) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < A->nb; b++)
            for (int i = 0; i < 4; i++) {
                const int64_t g = SB_GROUPS * b + 2 * i;
                const int32_t x0 = g < A->ng ? A->xsum[r * A->ng + g] : 0;
                const int32_t x1 = g + 1 < A->ng ? A->xsum[r * A->ng + g + 1] : 0;
                xp[(r * A->nb + b) * 4 + i] = (int32_t)(((uint32_t)x0 & 0xFFFFu) | ((uint32_t)x1 << 16));
            }
}

static void sb_tile_scalar(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int nr, int64_t o, float *y) {
    for (int r = 0; r < nr; r++) {
        float acc[TILE] = {0};
        const int64_t row = r0 + r;
        for (int64_t b = 0; b < A->nb; b++) {
            const uint8_t *meta = tw + b * SB_BYTES;
            const int gs = sb_groups(A->ng, b);
            float blk[TILE] = {0};
            for (int j = 0; j < TILE; j++) {
                uint32_t Aw, Bw, N;
                uint16_t hd, hm;
                memcpy(&Aw, meta + 4 * j, 4);
                memcpy(&Bw, meta + 64 + 4 * j, 4);
                memcpy(&N, meta + 128 + 4 * j, 4);
                memcpy(&hd, meta + 192 + 2 * j, 2);
                memcpy(&hm, meta + 224 + 2 * j, 2);
                const float d = half_to_float(hd), ndmin = -half_to_float(hm);
                int32_t M = 0;
                for (int g = 0; g < gs; g++) {
                    const uint8_t *bg = meta + SB_META + 256 * g;
                    const int8_t *xg = A->xs + row * A->kp + (SB_GROUPS * b + g) * 32;
                    int32_t s = 0;
                    for (int c = 0; c < 4; c++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t v = bg[c * 64 + j * 4 + i];
                            s += (int32_t)(v & 15) * xg[8 * c + i] + (int32_t)(v >> 4) * xg[8 * c + 4 + i];
                        }
                    const uint32_t word = g < 4 ? Aw : Bw;
                    const int sc = (int)((word >> sb_sc_shift(g)) & 63);
                    const int mn = (int)(((N >> sb_mn_lo_shift(g)) & 15) | (((word >> sb_mn_hi_shift(g)) & 3) << 4));
                    blk[j] = blk[j] + (float)s * (d * (float)sc);
                    M += mn * A->xsum[row * A->ng + SB_GROUPS * b + g];
                }
                blk[j] = blk[j] + (float)M * ndmin;
            }
            for (int j = 0; j < TILE; j++) acc[j] = acc[j] + blk[j] * A->d[row * A->nb + b];
        }
        for (int j = 0; j < TILE && o + j < W->out; j++) y[row * W->out + o + j] = W->b ? acc[j] + W->b[o + j] : acc[j];
    }
}

/* ---------------------------------------------------------------- AVX-512 VNNI */

#if defined(X86)
/* The 16 outputs from o (masked at the end of the weight). */
INLINE TGT512 __mmask16 tile_mask(const W4 *W, int64_t o) {
    return W->out - o >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (W->out - o)) - 1u);
}

/* A row's integer sum for group g starts at -8 X in the symmetric format (the codes' offset: the sum ends at S - 8 X
 * with no subtraction per tile), at 0 in the asymmetric one. */
INLINE TGT512 __m512i acc_init512(const W4 *W, const Acts *A, int64_t row, int64_t g) {
    return W->asym ? _mm512_setzero_si512() : _mm512_set1_epi32(-8 * A->xsum[row * A->ng + g]);
}

/* One group's fp32 step of NR rows' integer sums acc onto their block accumulators blk (scales at sc, mins at
 * sc + 32). */
INLINE TGT512 void group_end512(const uint8_t *sc, const W4 *W, const Acts *A, int64_t r0, int64_t g, const int NR,
                                const __m512i *acc, __m512 *blk) {
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
    if (!W->asym) { /* acc holds S - 8 X (acc_init512) */
        for (int r = 0; r < NR; r++) blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), ws));
        return;
    }
    const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
    for (int r = 0; r < NR; r++) {
        blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), ws));
        blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(wm, _mm512_set1_ps(A->xf[(r0 + r) * A->ng + g])));
    }
}

/* y = fa (+ bias) for NR rows x the 16 outputs from o (masked at the end of the weight). */
INLINE TGT512 void store512(const W4 *W, int64_t r0, const int NR, int64_t o, const float *fa, float *y) {
    const __mmask16 m = tile_mask(W, o);
    const __m512 bv = W->b ? _mm512_maskz_loadu_ps(m, W->b + o) : _mm512_setzero_ps();
    for (int r = 0; r < NR; r++) {
        const __m512 f = _mm512_load_ps(fa + r * TILE);
        _mm512_mask_storeu_ps(y + (r0 + r) * W->out + o, m, W->b ? _mm512_add_ps(f, bv) : f);
    }
}

/* The end of activation block b for NR rows: fa = (b ? fa : 0) + blk * d, the fp32 sums in fa (16 a row, an L1
 * buffer: in y, rows 32 KB apart shared L1 sets with the weight stream), the block's in registers; blk to zero. */
INLINE TGT512 void block_end512(const Acts *A, int64_t r0, int64_t b, const int NR, __m512 *blk, float *fa) {
    for (int r = 0; r < NR; r++) {
        const __m512 acc = b ? _mm512_load_ps(fa + r * TILE) : _mm512_setzero_ps();
        const __m512 v = _mm512_mul_ps(blk[r], _mm512_set1_ps(A->d[(r0 + r) * A->nb + b]));
        _mm512_store_ps(fa + r * TILE, _mm512_add_ps(acc, v));
        blk[r] = _mm512_setzero_ps();
    }
}

/* NR (constant) input rows x one tile of 16 outputs: NR int32 accumulators per group, NR fp32 ones per block
 * (block_end512 adds them up in fa). */
INLINE TGT512 void tile512(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, const int NR, int64_t o,
                           float *y) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int64_t G = (int64_t)W->cpg * 8;
    __attribute__((aligned(64))) float fa[8 * TILE]; /* every block_end512 writes it: k >= 1, so nb >= 1 */
    __m512 blk[8];
    for (int r = 0; r < NR; r++) blk[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < A->nb; b++) {
        int64_t g0, g1;
        block_groups(A, b, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *bg = tw + g * W->block;
            const int8_t *xg = A->xs + r0 * A->kp + g * G;
            __m512i acc[8];
            for (int r = 0; r < NR; r++) acc[r] = acc_init512(W, A, r0 + r, g);
            for (int c = 0; c < W->cpg; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(bg + 64 * c));
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int r = 0; r < NR; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xg + r * A->kp + 8 * c, 4);
                    memcpy(&x1, xg + r * A->kp + 8 * c + 4, 4);
                    acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(x0));
                    acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(x1));
                }
            }
            group_end512(bg + 64 * W->cpg, W, A, r0, g, NR, acc, blk);
        }
        block_end512(A, r0, b, NR, blk, fa);
    }
    store512(W, r0, NR, o, fa, y);
}

#define TILE512(NR)                                                                                           \
    TGT512 static void tile512_##NR(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o,     \
                                    float *y) {                                                               \
        tile512(tw, W, A, r0, NR, o, y);                                                                      \
    }
TILE512(1) TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6) TILE512(7) TILE512(8)
typedef void (*TileFn)(const uint8_t *, const W4 *, const Acts *, int64_t, int64_t, float *);
static const TileFn TILES512[9] = {0, tile512_1, tile512_2, tile512_3, tile512_4,
                                   tile512_5, tile512_6, tile512_7, tile512_8};

/* Prefill: 4 input rows x two tiles at once, each broadcast activation word used by both tiles (half the
 * broadcasts per product of tile512; the same operations per output). The 16 block accumulators stay in
 * registers (with the fp32 sums too, 24, they spilled), CPG and ASYM are constants (the chunk loop unrolls). */
INLINE TGT512 void pair4(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y,
                         const int CPG, const int ASYM) {
    enum { NR = 4 };
    const int64_t stride = W->ng * W->block, kp = A->kp, block = W->block;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const W4 Wc = {W->w, W->b, W->ng, block, W->out, CPG, ASYM};
    const int8_t *xs = A->xs + r0 * kp;
    __attribute__((aligned(64))) float fa[2 * NR * TILE];
    __m512 k0[NR], k1[NR];
    for (int r = 0; r < NR; r++) k0[r] = k1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < A->nb; b++) {
        int64_t g0, g1;
        block_groups(A, b, &g0, &g1);
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *b0 = tw + g * block, *b1 = b0 + stride;
            const int8_t *xg = xs + g * 8 * CPG;
            __m512i a0[NR], a1[NR];
            for (int r = 0; r < NR; r++) a0[r] = a1[r] = acc_init512(&Wc, A, r0 + r, g);
            for (int c = 0; c < CPG; c++) {
                const __m512i v0 = _mm512_loadu_si512((const void *)(b0 + 64 * c));
                const __m512i v1 = _mm512_loadu_si512((const void *)(b1 + 64 * c));
                const __m512i lo0 = _mm512_and_si512(v0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
                const __m512i lo1 = _mm512_and_si512(v1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
                for (int r = 0; r < NR; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xg + r * kp + 8 * c, 4);
                    memcpy(&x1, xg + r * kp + 8 * c + 4, 4);
                    const __m512i s0 = _mm512_set1_epi32(x0), s1 = _mm512_set1_epi32(x1);
                    a0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a0[r], lo0, s0), hi0, s1);
                    a1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a1[r], lo1, s0), hi1, s1);
                }
            }
            group_end512(b0 + 64 * CPG, &Wc, A, r0, g, NR, a0, k0);
            group_end512(b1 + 64 * CPG, &Wc, A, r0, g, NR, a1, k1);
        }
        block_end512(A, r0, b, NR, k0, fa);
        block_end512(A, r0, b, NR, k1, fa + NR * TILE);
    }
    store512(W, r0, NR, o, fa, y);
    store512(W, r0, NR, o + TILE, fa + NR * TILE, y);
}

TGT512 static void tile512_pair4(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y) {
    if (W->cpg == 4 && !W->asym) pair4(tw, W, A, r0, o, y, 4, 0);
    else if (W->cpg == 4) pair4(tw, W, A, r0, o, y, 4, 1);
    else if (!W->asym) pair4(tw, W, A, r0, o, y, 8, 0);
    else pair4(tw, W, A, r0, o, y, 8, 1);
}

#if defined(X86)
/* A tile's super-block header unpacked for 16 rows: group g's d sc, the mn pairs, -dmin. */
typedef struct {
    __m512 dsc[SB_GROUPS], ndmin;
    __m512i mp[4];
} SbMeta512;

INLINE TGT512 void sb_meta512(const uint8_t *meta, int gs, SbMeta512 *S) {
    const __m512i Aw = _mm512_loadu_si512((const void *)meta), Bw = _mm512_loadu_si512((const void *)(meta + 64));
    const __m512i N = _mm512_loadu_si512((const void *)(meta + 128));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(meta + 192)));
    S->ndmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(meta + 224))));
    const __m512i m63 = _mm512_set1_epi32(63);
    for (int g = 0; g < gs; g++) {
        const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(g < 4 ? Aw : Bw, (unsigned)sb_sc_shift(g)), m63);
        S->dsc[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    }
    const __m512i mlo = _mm512_set1_epi32(0x000F000F), mhi = _mm512_set1_epi32(0x00300030);
    for (int i = 0; i < 4; i++)
        S->mp[i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(N, (unsigned)(4 * i)), mlo),
                                   _mm512_and_si512(_mm512_srli_epi32(i < 2 ? Aw : Bw, (unsigned)(8 * (i & 1) + 2)), mhi));
}

/* The mins of NR rows for super-block b onto their block accumulators (after the groups). */
INLINE TGT512 void sb_mins512(const SbMeta512 *S, const Acts *A, int64_t r0, int64_t b, const int NR, __m512 *blk) {
    for (int r = 0; r < NR; r++) {
        const int32_t *xp = A->xp + ((r0 + r) * A->nb + b) * 4;
        __m512i M = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) M = _mm512_dpwssd_epi32(M, S->mp[i], _mm512_set1_epi32(xp[i]));
        blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(_mm512_cvtepi32_ps(M), S->ndmin));
    }
}

/* A tile's super-block header unpacked once for a row block's passes (sb_pair4): SbMeta512 in memory. */
typedef struct {
    float dsc[SB_GROUPS][TILE], ndmin[TILE];
    int32_t mp[4][TILE];
} SbMetaMem;

INLINE TGT512 void sb_meta_store512(const SbMeta512 *S, int gs, SbMetaMem *out) {
    for (int g = 0; g < gs; g++) _mm512_store_ps(out->dsc[g], S->dsc[g]);
    _mm512_store_ps(out->ndmin, S->ndmin);
    for (int i = 0; i < 4; i++) _mm512_store_si512((void *)out->mp[i], S->mp[i]);
}

/* sb_mins512 from a cached header. */
INLINE TGT512 void sb_mins512_mem(const SbMetaMem *S, const Acts *A, int64_t r0, int64_t b, const int NR,
                                  __m512 *blk) {
    for (int r = 0; r < NR; r++) {
        const int32_t *xp = A->xp + ((r0 + r) * A->nb + b) * 4;
        __m512i M = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++)
            M = _mm512_dpwssd_epi32(M, _mm512_load_si512((const void *)S->mp[i]), _mm512_set1_epi32(xp[i]));
        blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(_mm512_cvtepi32_ps(M), _mm512_load_ps(S->ndmin)));
    }
}

/* NR (constant) input rows x one tile of 16 outputs (tile512's loop for super-blocks). */
INLINE TGT512 void sb_tile512(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, const int NR, int64_t o,
                              float *y) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __attribute__((aligned(64))) float fa[8 * TILE];
    __m512 blk[8];
    for (int r = 0; r < NR; r++) blk[r] = _mm512_setzero_ps();
    const int8_t *xs = A->xs + r0 * A->kp;
    for (int64_t b = 0; b < A->nb; b++) {
        const uint8_t *meta = tw + b * SB_BYTES;
        const int gs = sb_groups(A->ng, b);
        SbMeta512 S;
        sb_meta512(meta, gs, &S);
        for (int l = 0; l < SB_META; l += 64) _mm_prefetch((const char *)meta + PF_DIST + l, _MM_HINT_T0);
        for (int g = 0; g < gs; g++) {
            const uint8_t *bg = meta + SB_META + 256 * g;
            const int8_t *xg = xs + (SB_GROUPS * b + g) * 32;
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)bg + PF_DIST + l, _MM_HINT_T0);
            __m512i acc[8];
            for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(bg + 64 * c));
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int r = 0; r < NR; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xg + r * A->kp + 8 * c, 4);
                    memcpy(&x1, xg + r * A->kp + 8 * c + 4, 4);
                    acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(x0));
                    acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(x1));
                }
            }
            for (int r = 0; r < NR; r++) blk[r] = _mm512_add_ps(blk[r], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), S.dsc[g]));
        }
        sb_mins512(&S, A, r0, b, NR, blk);
        block_end512(A, r0, b, NR, blk, fa);
    }
    store512(W, r0, NR, o, fa, y);
}

#define SB_TILE512(NR)                                                                                        \
    TGT512 static void sb_tile512_##NR(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o,  \
                                       float *y) {                                                            \
        sb_tile512(tw, W, A, r0, NR, o, y);                                                                   \
    }
SB_TILE512(1) SB_TILE512(2) SB_TILE512(3) SB_TILE512(4) SB_TILE512(5) SB_TILE512(6) SB_TILE512(7) SB_TILE512(8)
static const TileFn SB_TILES512[9] = {0, sb_tile512_1, sb_tile512_2, sb_tile512_3, sb_tile512_4,
                                      sb_tile512_5, sb_tile512_6, sb_tile512_7, sb_tile512_8};

/* SB_PAIR_ROWS+ rows: 4 rows x two tiles a pass (pair4's loop for super-blocks). BUILD: the headers are unpacked here (into
 * registers, as the passes of fewer than SB_CACHE_ROWS rows do) and, with c0, c1, stored there (nb each) for the
 * row block's later passes, which (BUILD 0) read them instead: 1/16 of the unpacking at 64 rows a block. (A
 * separate pass over the headers first cost more in memory latency than it saved at 8-16 rows; passes going
 * super-block after super-block over a row block, codes in L1, fp32 sums in memory, were slower: 1.16-1.35x.) */
INLINE TGT512 void sb_pair4(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y,
                            SbMetaMem *c0, SbMetaMem *c1, const int BUILD) {
    enum { NR = 4 };
    const int64_t stride = W->block, kp = A->kp;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int8_t *xs = A->xs + r0 * kp;
    __attribute__((aligned(64))) float fa[2 * NR * TILE];
    __m512 k0[NR], k1[NR];
    for (int r = 0; r < NR; r++) k0[r] = k1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < A->nb; b++) {
        const uint8_t *meta0 = tw + b * SB_BYTES, *meta1 = meta0 + stride;
        const int gs = sb_groups(A->ng, b);
        SbMeta512 S0, S1;
        if (BUILD) {
            sb_meta512(meta0, gs, &S0);
            sb_meta512(meta1, gs, &S1);
            if (c0) {
                sb_meta_store512(&S0, gs, c0 + b);
                sb_meta_store512(&S1, gs, c1 + b);
            }
        }
        for (int g = 0; g < gs; g++) {
            const uint8_t *b0 = meta0 + SB_META + 256 * g, *b1 = meta1 + SB_META + 256 * g;
            const int8_t *xg = xs + (SB_GROUPS * b + g) * 32;
            __m512i a0[NR], a1[NR];
            for (int r = 0; r < NR; r++) a0[r] = a1[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const __m512i v0 = _mm512_loadu_si512((const void *)(b0 + 64 * c));
                const __m512i v1 = _mm512_loadu_si512((const void *)(b1 + 64 * c));
                const __m512i lo0 = _mm512_and_si512(v0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
                const __m512i lo1 = _mm512_and_si512(v1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
                for (int r = 0; r < NR; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, xg + r * kp + 8 * c, 4);
                    memcpy(&x1, xg + r * kp + 8 * c + 4, 4);
                    const __m512i s0 = _mm512_set1_epi32(x0), s1 = _mm512_set1_epi32(x1);
                    a0[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a0[r], lo0, s0), hi0, s1);
                    a1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a1[r], lo1, s0), hi1, s1);
                }
            }
            const __m512 d0 = BUILD ? S0.dsc[g] : _mm512_load_ps(c0[b].dsc[g]);
            const __m512 d1 = BUILD ? S1.dsc[g] : _mm512_load_ps(c1[b].dsc[g]);
            for (int r = 0; r < NR; r++) {
                k0[r] = _mm512_add_ps(k0[r], _mm512_mul_ps(_mm512_cvtepi32_ps(a0[r]), d0));
                k1[r] = _mm512_add_ps(k1[r], _mm512_mul_ps(_mm512_cvtepi32_ps(a1[r]), d1));
            }
        }
        if (BUILD) {
            sb_mins512(&S0, A, r0, b, NR, k0);
            sb_mins512(&S1, A, r0, b, NR, k1);
        } else {
            sb_mins512_mem(c0 + b, A, r0, b, NR, k0);
            sb_mins512_mem(c1 + b, A, r0, b, NR, k1);
        }
        block_end512(A, r0, b, NR, k0, fa);
        block_end512(A, r0, b, NR, k1, fa + NR * TILE);
    }
    store512(W, r0, NR, o, fa, y);
    store512(W, r0, NR, o + TILE, fa + NR * TILE, y);
}

TGT512 static void sb_pair4_build(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y,
                                  SbMetaMem *c0, SbMetaMem *c1) {
    sb_pair4(tw, W, A, r0, o, y, c0, c1, 1);
}

TGT512 static void sb_pair4_cached(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y,
                                   SbMetaMem *c0, SbMetaMem *c1) {
    sb_pair4(tw, W, A, r0, o, y, c0, c1, 0);
}
#endif

/* ---------------------------------------------------------------- AVX2 (8 lanes: a tile as two halves) */

/* NR <= 4 input rows x half h (outputs o + 8h .. o + 8h + 7) of one tile with AVX-VNNI's dpbusd. */
#define HALF256(NAME, TGT, DOT)                                                                               \
    INLINE TGT void NAME(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, const int NR, int h,      \
                         int64_t o, float *y) {                                                               \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                            \
        const int64_t G = (int64_t)W->cpg * 8;                                                                \
        __m256 facc[4], fb[4];                                                                                \
        for (int r = 0; r < NR; r++) facc[r] = fb[r] = _mm256_setzero_ps();                                  \
        for (int64_t g = 0; g < W->ng; g++) {                                                                 \
            const uint8_t *blk = tw + g * W->block;                                                           \
            const int8_t *xg = A->xs + r0 * A->kp + g * G;                                                    \
            __m256i acc[4];                                                                                   \
            for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_si256();                                     \
            for (int c = 0; c < W->cpg; c++) {                                                                \
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h));               \
                const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4); \
                for (int r = 0; r < NR; r++) {                                                                \
                    int32_t x0, x1;                                                                           \
                    memcpy(&x0, xg + r * A->kp + 8 * c, 4);                                                   \
                    memcpy(&x1, xg + r * A->kp + 8 * c + 4, 4);                                               \
                    acc[r] = DOT(acc[r], lo, _mm256_set1_epi32(x0));                                          \
                    acc[r] = DOT(acc[r], hi, _mm256_set1_epi32(x1));                                          \
                }                                                                                             \
            }                                                                                                 \
            const uint8_t *sc = blk + 64 * W->cpg + 16 * h;                                                   \
            const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));                          \
            const __m256 wm = W->asym ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)))         \
                                      : _mm256_setzero_ps();                                                  \
            for (int r = 0; r < NR; r++) {                                                                    \
                const int64_t gi = (r0 + r) * A->ng + g;                                                      \
                if (!W->asym) {                                                                               \
                    const __m256i s = _mm256_sub_epi32(acc[r], _mm256_set1_epi32(8 * A->xsum[gi]));           \
                    fb[r] = _mm256_add_ps(fb[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s), ws));                   \
                } else {                                                                                      \
                    fb[r] = _mm256_add_ps(fb[r], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r]), ws));              \
                    fb[r] = _mm256_add_ps(fb[r], _mm256_mul_ps(wm, _mm256_set1_ps(A->xf[gi])));               \
                }                                                                                             \
            }                                                                                                 \
            if (block_step(A, r0, g))                                                                         \
                for (int r = 0; r < NR; r++) {                                                                \
                    const __m256 d = _mm256_set1_ps(*block_step(A, r0 + r, g));                               \
                    facc[r] = _mm256_add_ps(facc[r], _mm256_mul_ps(fb[r], d));                                \
                    fb[r] = _mm256_setzero_ps();                                                              \
                }                                                                                             \
        }                                                                                                     \
        const int64_t oh = o + 8 * h;                                                                         \
        for (int r = 0; r < NR; r++) {                                                                        \
            float v[8];                                                                                       \
            _mm256_storeu_ps(v, facc[r]);                                                                     \
            for (int j = 0; j < 8 && oh + j < W->out; j++)                                                    \
                y[(r0 + r) * W->out + oh + j] = W->b ? v[j] + W->b[oh + j] : v[j];                            \
        }                                                                                                     \
    }
#if defined(HAVE_AVXVNNI)
HALF256(half_vnni, TGT256V, _mm256_dpbusd_avx_epi32)
#endif

#define TILE256(NAME, TGT, HALF, NR)                                                                          \
    TGT static void NAME##_##NR(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o,         \
                                float *y) {                                                                   \
        HALF(tw, W, A, r0, NR, 0, o, y);                                                                      \
        if (o + 8 < W->out) HALF(tw, W, A, r0, NR, 1, o, y);                                                  \
    }

/* AVX2 without VNNI: vpmaddubsw's pairs (|pair| <= 2 * 15 * 127 = 3810) summed in int16 over 4 chunks (8 pairs,
 * |sum| <= 30480 < 2^15: exact), then widened by one vpmaddwd with ones: a quarter of the widening multiplies of
 * one vpmaddwd per vpmaddubsw (the former path; the multiply pipes bound it). The integer sums and every fp32
 * step are those of the other paths, so the results are the same bit for bit. */
INLINE TGT256 __m256i pairs16(__m256i s, __m256i v, const int8_t *x, __m256i m4) {
    int32_t x0, x1;
    memcpy(&x0, x, 4);
    memcpy(&x1, x + 4, 4);
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
    s = _mm256_add_epi16(s, p);
    __asm__("" : "+x"(s)); /* a chain: gcc reassociated the unrolled sums into a tree of live products (spills) */
    return s;
}

INLINE TGT256 __m256i widen16(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }

/* One group's fp32 step for 8 outputs onto their block accumulator fb (scales at sc, mins at sc + 32): the
 * operations of group_end512. */
INLINE TGT256 __m256 group_f32(__m256 fb, __m256i s, const uint8_t *sc, const W4 *W, const Acts *A, int64_t gi) {
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
    if (!W->asym) {
        const __m256i t = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * A->xsum[gi]));
        return _mm256_add_ps(fb, _mm256_mul_ps(_mm256_cvtepi32_ps(t), ws));
    }
    fb = _mm256_add_ps(fb, _mm256_mul_ps(_mm256_cvtepi32_ps(s), ws));
    const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));
    return _mm256_add_ps(fb, _mm256_mul_ps(wm, _mm256_set1_ps(A->xf[gi])));
}

/* 8 outputs o..o+7 of row r (masked at the end of the weight), + bias. */
INLINE TGT256 void store8(__m256 f, const W4 *W, int64_t r, int64_t o, float *y) {
    if (o + 8 <= W->out) {
        _mm256_storeu_ps(y + r * W->out + o, W->b ? _mm256_add_ps(f, _mm256_loadu_ps(W->b + o)) : f);
        return;
    }
    float v[8];
    _mm256_storeu_ps(v, f);
    for (int j = 0; j < 8 && o + j < W->out; j++) y[r * W->out + o + j] = W->b ? v[j] + W->b[o + j] : v[j];
}

/* One input row x a whole tile (16 outputs) in one pass over its stream: two 8-output halves per 64-byte chunk
 * sharing the broadcast activations. CPG (chunks per group, 4 or 8) a constant. */
INLINE TGT256 void row_avx2(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r, int64_t o, float *y,
                            const int CPG) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps(), b0 = f0, b1 = f0;
    for (int64_t g = 0; g < W->ng; g++) {
        const uint8_t *blk = tw + g * W->block;
        const int8_t *xg = A->xs + r * A->kp + g * 8 * CPG;
        for (int l = 0; l < W->block; l += 64) _mm_prefetch((const char *)blk + PF_DIST + l, _MM_HINT_T0);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int q = 0; q < CPG; q += 4) {
            __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
            for (int c = q; c < q + 4; c++) {
                p0 = pairs16(p0, _mm256_loadu_si256((const __m256i *)(blk + 64 * c)), xg + 8 * c, m4);
                p1 = pairs16(p1, _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32)), xg + 8 * c, m4);
            }
            s0 = _mm256_add_epi32(s0, widen16(p0));
            s1 = _mm256_add_epi32(s1, widen16(p1));
        }
        const int64_t gi = r * A->ng + g;
        b0 = group_f32(b0, s0, blk + 64 * CPG, W, A, gi);
        b1 = group_f32(b1, s1, blk + 64 * CPG + 16, W, A, gi);
        const float *step = block_step(A, r, g);
        if (step) {
            const __m256 d = _mm256_set1_ps(*step);
            f0 = _mm256_add_ps(f0, _mm256_mul_ps(b0, d));
            f1 = _mm256_add_ps(f1, _mm256_mul_ps(b1, d));
            b0 = b1 = _mm256_setzero_ps();
        }
    }
    store8(f0, W, r, o, y);
    if (o + 8 < W->out) store8(f1, W, r, o + 8, y);
}

/* 4 activation codes at x in every 32-bit lane: one broadcast load (gcc turned memcpy + set1 into a scalar load,
 * a move and a register broadcast). */
INLINE TGT256 __m256i bcast4(const int8_t *x) { return _mm256_castps_si256(_mm256_broadcast_ss((const float *)x)); }

/* p += maddubs(w, x), kept a chain (see pairs16); first: p = the product (no add to zero). */
INLINE TGT256 __m256i mac16(__m256i p, __m256i w, __m256i x, int first) {
    const __m256i t = _mm256_maddubs_epi16(w, x);
    if (first) return t;
    p = _mm256_add_epi16(p, t);
    __asm__("" : "+x"(p));
    return p;
}

/* One group's fp32 step for a row's 16 outputs (two halves: sums s0, s1, scales w0, w1, mins m0, m1) on its block
 * accumulators fb[0..15] in memory, the row's code sum xsum and xf = float(xsum): group_f32's operations. */
INLINE TGT256 void group16_f32(float *restrict fb, __m256i s0, __m256i s1, __m256 w0, __m256 w1, __m256 m0,
                               __m256 m1, const int32_t *xsum, const float *xf, const int ASYM) {
    if (!ASYM) {
        const __m256i x8 = _mm256_slli_epi32(_mm256_castps_si256(_mm256_broadcast_ss((const float *)xsum)), 3);
        s0 = _mm256_sub_epi32(s0, x8);
        s1 = _mm256_sub_epi32(s1, x8);
    }
    __m256 f0 = _mm256_add_ps(_mm256_load_ps(fb), _mm256_mul_ps(_mm256_cvtepi32_ps(s0), w0));
    __m256 f1 = _mm256_add_ps(_mm256_load_ps(fb + 8), _mm256_mul_ps(_mm256_cvtepi32_ps(s1), w1));
    if (ASYM) {
        const __m256 xv = _mm256_broadcast_ss(xf);
        f0 = _mm256_add_ps(f0, _mm256_mul_ps(m0, xv));
        f1 = _mm256_add_ps(f1, _mm256_mul_ps(m1, xv));
    }
    _mm256_store_ps(fb, f0);
    _mm256_store_ps(fb + 8, f1);
}

/* fa += fb * d for a row's 16 outputs; fb back to zero. */
INLINE TGT256 void block16_f32(float *restrict fa, float *restrict fb, const float *d) {
    const __m256 dv = _mm256_broadcast_ss(d);
    _mm256_store_ps(fa, _mm256_add_ps(_mm256_load_ps(fa), _mm256_mul_ps(_mm256_load_ps(fb), dv)));
    _mm256_store_ps(fa + 8, _mm256_add_ps(_mm256_load_ps(fa + 8), _mm256_mul_ps(_mm256_load_ps(fb + 8), dv)));
    _mm256_store_ps(fb, _mm256_setzero_ps());
    _mm256_store_ps(fb + 8, _mm256_setzero_ps());
}

INLINE TGT256 __m256 half8_ps(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* NR (<= 4) input rows x a whole tile (16 outputs), groups [g0, g1), onto their fp32 accumulators fa and block
 * accumulators fb (16 a row each, in L1). Each chunk's two 32-byte halves are unpacked once for the NR rows and each broadcast activation word
 * serves both halves: a third fewer instructions per product than the former half tile a pass (these loops
 * issue ~5 instructions a cycle: their count is what bounds them, not one pipe). The 2 NR int16 sums and the 4
 * unpacked vectors fill the 16 registers, hence the accumulators in memory. The integer sums (the bounds of
 * pairs16) and every fp32 step are those of the other paths, in the same order: equal results bit for bit. */
INLINE TGT256 void quad16_avx2(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, const int NR, int64_t g0,
                               int64_t g1, float *restrict fa, float *restrict fb, const int CPG, const int ASYM) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t kp = A->kp, ng = A->ng, block = W->block;
    const int8_t *xs = A->xs + r0 * kp;
    const float *xf = A->xf + r0 * ng;
    const int32_t *xsum = A->xsum + r0 * ng;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *blk = tw + g * block;
        const int8_t *xg = xs + g * 8 * CPG;
        __m256i s0[4], s1[4];
#pragma GCC unroll 2
        for (int q = 0; q < CPG; q += 4) {
            __m256i p0[4], p1[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const uint8_t *wc = blk + 64 * (q + c);
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)wc);
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wc + 32));
                const __m256i lo0 = _mm256_and_si256(v0, m4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
                const __m256i lo1 = _mm256_and_si256(v1, m4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const int8_t *xr = xg + r * kp + 8 * (q + c);
                    const __m256i b0 = bcast4(xr);
                    p0[r] = mac16(p0[r], lo0, b0, c == 0);
                    p1[r] = mac16(p1[r], lo1, b0, c == 0);
                    const __m256i b1 = bcast4(xr + 4);
                    p0[r] = mac16(p0[r], hi0, b1, 0);
                    p1[r] = mac16(p1[r], hi1, b1, 0);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                s0[r] = q ? _mm256_add_epi32(s0[r], widen16(p0[r])) : widen16(p0[r]);
                s1[r] = q ? _mm256_add_epi32(s1[r], widen16(p1[r])) : widen16(p1[r]);
            }
        }
        const uint8_t *sc = blk + 64 * CPG;
        const __m256 w0 = half8_ps(sc), w1 = half8_ps(sc + 16);
        const __m256 m0 = ASYM ? half8_ps(sc + 32) : w0, m1 = ASYM ? half8_ps(sc + 48) : w1;
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            group16_f32(fb + 16 * r, s0[r], s1[r], w0, w1, m0, m1, xsum + r * ng + g, xf + r * ng + g, ASYM);
        if (block_step(A, r0, g))
            for (int r = 0; r < NR; r++) block16_f32(fa + 16 * r, fb + 16 * r, block_step(A, r0 + r, g));
    }
}

#define QUAD_AVX2(NR)                                                                                         \
    TGT256 static void quad_avx2_##NR(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t g0,  \
                                      int64_t g1, float *fa, float *fb) {                                     \
        if (W->cpg == 4 && !W->asym) quad16_avx2(tw, W, A, r0, NR, g0, g1, fa, fb, 4, 0);                     \
        else if (W->cpg == 4) quad16_avx2(tw, W, A, r0, NR, g0, g1, fa, fb, 4, 1);                            \
        else if (!W->asym) quad16_avx2(tw, W, A, r0, NR, g0, g1, fa, fb, 8, 0);                               \
        else quad16_avx2(tw, W, A, r0, NR, g0, g1, fa, fb, 8, 1);                                             \
    }
QUAD_AVX2(1) QUAD_AVX2(2) QUAD_AVX2(3) QUAD_AVX2(4)
typedef void (*QuadFn)(const uint8_t *, const W4 *, const Acts *, int64_t, int64_t, int64_t, float *, float *);
static const QuadFn QUADS_AVX2[5] = {0, quad_avx2_1, quad_avx2_2, quad_avx2_3, quad_avx2_4};

/* Rows [rb, re) (re - rb <= ROW_BLOCK) x tile t on AVX2 without VNNI: the groups in blocks of K_BLOCK inputs (the
 * tile's block stays in L1 while every 4 rows of the row block pass over it), the rows' accumulators in fa, fb. */
TGT256 static void rows_tile_avx2(int64_t t, const W4 *W, const Acts *A, int64_t rb, int64_t re, float *y) {
    __attribute__((aligned(32))) float fa[ROW_BLOCK * 16], fb[ROW_BLOCK * 16];
    memset(fa, 0, sizeof(float) * 16 * (size_t)(re - rb));
    memset(fb, 0, sizeof(float) * 16 * (size_t)(re - rb));
    const uint8_t *tw = W->w + t * W->ng * W->block;
    const int64_t gb = K_BLOCK / (8 * W->cpg) > 0 ? K_BLOCK / (8 * W->cpg) : 1;
    for (int64_t g0 = 0; g0 < W->ng; g0 += gb) {
        const int64_t g1 = g0 + gb < W->ng ? g0 + gb : W->ng;
        for (int64_t r = rb; r < re; r += 4)
            QUADS_AVX2[re - r < 4 ? re - r : 4](tw, W, A, r, g0, g1, fa + 16 * (r - rb), fb + 16 * (r - rb));
    }
    for (int64_t r = rb; r < re; r++) {
        store8(_mm256_load_ps(fa + 16 * (r - rb)), W, r, t * TILE, y);
        if (t * TILE + 8 < W->out) store8(_mm256_load_ps(fa + 16 * (r - rb) + 8), W, r, t * TILE + 8, y);
    }
}

TGT256 static void tile_avx2_1(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y) {
    if (W->cpg == 4) row_avx2(tw, W, A, r0, o, y, 4);
    else row_avx2(tw, W, A, r0, o, y, 8);
}
#if defined(HAVE_AVXVNNI)
TILE256(tile_vnni, TGT256V, half_vnni, 1) TILE256(tile_vnni, TGT256V, half_vnni, 2)
TILE256(tile_vnni, TGT256V, half_vnni, 3) TILE256(tile_vnni, TGT256V, half_vnni, 4)
static const TileFn TILES_VNNI[5] = {0, tile_vnni_1, tile_vnni_2, tile_vnni_3, tile_vnni_4};
#endif
#endif

#if defined(X86)
/* Super-blocks on 8 lanes: NR <= 4 rows x half h of a tile (outputs o + 8h ..), DOT the group's integer sums of 8
 * rows (AVX-VNNI dpbusd, or AVX2's pairs16: 4 chunks of maddubs pairs summed in int16, exact, then widened). */
#define SB_HALF256(NAME, TGT, GROUPDOT)                                                                       \
    INLINE TGT void NAME(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, const int NR, int h,      \
                         int64_t o, float *y) {                                                               \
        __m256 facc[4], fb[4];                                                                                \
        for (int r = 0; r < NR; r++) facc[r] = fb[r] = _mm256_setzero_ps();                                  \
        const __m256i m63 = _mm256_set1_epi32(63);                                                            \
        const __m256i mlo = _mm256_set1_epi32(0x000F000F), mhi = _mm256_set1_epi32(0x00300030);               \
        for (int64_t b = 0; b < A->nb; b++) {                                                                 \
            const uint8_t *meta = tw + b * SB_BYTES;                                                          \
            const int gs = sb_groups(A->ng, b);                                                               \
            const __m256i Aw = _mm256_loadu_si256((const __m256i *)(meta + 32 * h));                          \
            const __m256i Bw = _mm256_loadu_si256((const __m256i *)(meta + 64 + 32 * h));                     \
            const __m256i N = _mm256_loadu_si256((const __m256i *)(meta + 128 + 32 * h));                     \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 192 + 16 * h)));       \
            const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(),                                           \
                                               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 224 + 16 * h)))); \
            for (int g = 0; g < gs; g++) {                                                                    \
                const uint8_t *bg = meta + SB_META + 256 * g + 32 * h;                                        \
                const int8_t *xg = A->xs + r0 * A->kp + (SB_GROUPS * b + g) * 32;                             \
                const __m256i sc = _mm256_and_si256(_mm256_srl_epi32(g < 4 ? Aw : Bw,                         \
                                                                     _mm_cvtsi32_si128(sb_sc_shift(g))), m63);   \
                const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));                                  \
                for (int r = 0; r < NR; r++) {                                                                \
                    const __m256i s = GROUPDOT(bg, xg + r * A->kp);                                           \
                    fb[r] = _mm256_add_ps(fb[r], _mm256_mul_ps(_mm256_cvtepi32_ps(s), dsc));                  \
                }                                                                                             \
            }                                                                                                 \
            __m256i mp[4];                                                                                    \
            for (int i = 0; i < 4; i++) {                                                                     \
                const __m128i a = _mm_cvtsi32_si128(4 * i), c = _mm_cvtsi32_si128(8 * (i & 1) + 2);           \
                mp[i] = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(N, a), mlo),                        \
                                        _mm256_and_si256(_mm256_srl_epi32(i < 2 ? Aw : Bw, c), mhi));         \
            }                                                                                                 \
            for (int r = 0; r < NR; r++) {                                                                    \
                const int32_t *xp = A->xp + ((r0 + r) * A->nb + b) * 4;                                       \
                __m256i M = _mm256_setzero_si256();                                                           \
                for (int i = 0; i < 4; i++)                                                                   \
                    M = _mm256_add_epi32(M, _mm256_madd_epi16(mp[i], _mm256_set1_epi32(xp[i])));             \
                fb[r] = _mm256_add_ps(fb[r], _mm256_mul_ps(_mm256_cvtepi32_ps(M), ndmin));                    \
                const __m256 dv = _mm256_set1_ps(A->d[(r0 + r) * A->nb + b]);                                 \
                facc[r] = _mm256_add_ps(facc[r], _mm256_mul_ps(fb[r], dv));                                   \
                fb[r] = _mm256_setzero_ps();                                                                  \
            }                                                                                                 \
        }                                                                                                     \
        for (int r = 0; r < NR; r++) store8(facc[r], W, r0 + r, o + 8 * h, y);                                \
    }

/* One input row x a whole tile (16 outputs: both halves) in one pass over its stream (SB_HALF256 per half read it
 * twice: one row 1.3-1.6x sym g32's row_avx2), the weight prefetched PF_DIST ahead as row_avx2 does. */
#define SB_ROW256(NAME, TGT, GROUPDOT)                                                                        \
    TGT static void NAME(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o, float *y) {    \
        __m256 facc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};                                          \
        const __m256i m63 = _mm256_set1_epi32(63);                                                            \
        const __m256i mlo = _mm256_set1_epi32(0x000F000F), mhi = _mm256_set1_epi32(0x00300030);               \
        const int8_t *xr = A->xs + r0 * A->kp;                                                                \
        for (int64_t b = 0; b < A->nb; b++) {                                                                 \
            const uint8_t *meta = tw + b * SB_BYTES;                                                          \
            const int gs = sb_groups(A->ng, b);                                                               \
            for (int l = 0; l < SB_META + 256 * gs; l += 64)                                                  \
                _mm_prefetch((const char *)meta + PF_DIST + l, _MM_HINT_T0);                                  \
            const int32_t *xp = A->xp + (r0 * A->nb + b) * 4;                                                 \
            const __m256 dv = _mm256_set1_ps(A->d[r0 * A->nb + b]);                                           \
            for (int h = 0; h < 2; h++) {                                                                     \
                const __m256i Aw = _mm256_loadu_si256((const __m256i *)(meta + 32 * h));                      \
                const __m256i Bw = _mm256_loadu_si256((const __m256i *)(meta + 64 + 32 * h));                 \
                const __m256i N = _mm256_loadu_si256((const __m256i *)(meta + 128 + 32 * h));                 \
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 192 + 16 * h)));   \
                const __m256 ndmin = _mm256_sub_ps(                                                           \
                    _mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(meta + 224 + 16 * h)))); \
                __m256 fb = _mm256_setzero_ps();                                                              \
                for (int g = 0; g < gs; g++) {                                                                \
                    const __m256i sc = _mm256_and_si256(                                                      \
                        _mm256_srl_epi32(g < 4 ? Aw : Bw, _mm_cvtsi32_si128(sb_sc_shift(g))), m63);           \
                    const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));                              \
                    const __m256i sv = GROUPDOT(meta + SB_META + 256 * g + 32 * h, xr + (SB_GROUPS * b + g) * 32); \
                    fb = _mm256_add_ps(fb, _mm256_mul_ps(_mm256_cvtepi32_ps(sv), dsc));                       \
                }                                                                                             \
                __m256i M = _mm256_setzero_si256();                                                           \
                for (int i = 0; i < 4; i++) {                                                                 \
                    const __m128i a = _mm_cvtsi32_si128(4 * i), c = _mm_cvtsi32_si128(8 * (i & 1) + 2);       \
                    const __m256i mp = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi32(N, a), mlo),         \
                                                       _mm256_and_si256(_mm256_srl_epi32(i < 2 ? Aw : Bw, c), mhi)); \
                    M = _mm256_add_epi32(M, _mm256_madd_epi16(mp, _mm256_set1_epi32(xp[i])));                 \
                }                                                                                             \
                fb = _mm256_add_ps(fb, _mm256_mul_ps(_mm256_cvtepi32_ps(M), ndmin));                          \
                facc[h] = _mm256_add_ps(facc[h], _mm256_mul_ps(fb, dv));                                      \
            }                                                                                                 \
        }                                                                                                     \
        store8(facc[0], W, r0, o, y);                                                                         \
        if (o + 8 < W->out) store8(facc[1], W, r0, o + 8, y);                                                 \
    }

/* A group's sums for 8 rows (32 bytes of each of its 4 chunks at bg, 64 apart) with AVX2's pairs16. */
INLINE TGT256 __m256i sb_dot_avx2(const uint8_t *bg, const int8_t *xg) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i p = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) p = pairs16(p, _mm256_loadu_si256((const __m256i *)(bg + 64 * c)), xg + 8 * c, m4);
    return widen16(p);
}
SB_HALF256(sb_half_avx2, TGT256, sb_dot_avx2)
SB_ROW256(sb_row_avx2, TGT256, sb_dot_avx2)

#define SB_TILE256(NAME, TGT, HALF, NR)                                                                       \
    TGT static void NAME##_##NR(const uint8_t *tw, const W4 *W, const Acts *A, int64_t r0, int64_t o,         \
                                float *y) {                                                                   \
        HALF(tw, W, A, r0, NR, 0, o, y);                                                                      \
        if (o + 8 < W->out) HALF(tw, W, A, r0, NR, 1, o, y);                                                  \
    }
SB_TILE256(sb_tile_avx2, TGT256, sb_half_avx2, 2)
SB_TILE256(sb_tile_avx2, TGT256, sb_half_avx2, 3) SB_TILE256(sb_tile_avx2, TGT256, sb_half_avx2, 4)
static const TileFn SB_TILES_AVX2[5] = {0, sb_row_avx2, sb_tile_avx2_2, sb_tile_avx2_3, sb_tile_avx2_4};

#if defined(HAVE_AVXVNNI)
INLINE TGT256V __m256i sb_dot_vnni(const uint8_t *bg, const int8_t *xg) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(bg + 64 * c));
        int32_t x0, x1;
        memcpy(&x0, xg + 8 * c, 4);
        memcpy(&x1, xg + 8 * c + 4, 4);
        s = _mm256_dpbusd_avx_epi32(s, _mm256_and_si256(v, m4), _mm256_set1_epi32(x0));
        s = _mm256_dpbusd_avx_epi32(s, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), _mm256_set1_epi32(x1));
    }
    return s;
}
SB_HALF256(sb_half_vnni, TGT256V, sb_dot_vnni)
SB_ROW256(sb_row_vnni, TGT256V, sb_dot_vnni)
SB_TILE256(sb_tile_vnni, TGT256V, sb_half_vnni, 2)
SB_TILE256(sb_tile_vnni, TGT256V, sb_half_vnni, 3) SB_TILE256(sb_tile_vnni, TGT256V, sb_half_vnni, 4)
static const TileFn SB_TILES_VNNI[5] = {0, sb_row_vnni, sb_tile_vnni_2, sb_tile_vnni_3, sb_tile_vnni_4};
#endif
#endif

/* Rows [r0, r0 + nr) (nr <= 8) times super-block tile t on the chosen path. */
static void sb_run_tile(int isa, int64_t t, const W4 *W, const Acts *A, int64_t r0, int nr, float *y) {
    const uint8_t *tw = W->w + t * W->block;
    const int64_t o = t * TILE;
#if defined(X86)
    if (isa == ISA_AVX512_VNNI) {
        SB_TILES512[nr](tw, W, A, r0, o, y);
        return;
    }
    if (isa == ISA_AVX2) {
        for (int r = 0; r < nr; r += 4) SB_TILES_AVX2[nr - r < 4 ? nr - r : 4](tw, W, A, r0 + r, o, y);
        return;
    }
#if defined(HAVE_AVXVNNI)
    if (isa == ISA_AVX2_VNNI) {
        for (int r = 0; r < nr; r += 4) SB_TILES_VNNI[nr - r < 4 ? nr - r : 4](tw, W, A, r0 + r, o, y);
        return;
    }
#endif
#endif
    sb_tile_scalar(tw, W, A, r0, nr, o, y);
}

/* Rows [r0, r0 + nr) (nr <= 8) times tile t on the chosen path. */
static void run_tile(int isa, int64_t t, const W4 *W, const Acts *A, int64_t r0, int nr, float *y) {
    const uint8_t *tw = W->w + t * W->ng * W->block;
    const int64_t o = t * TILE;
#if defined(X86)
    if (isa == ISA_AVX512_VNNI) {
        TILES512[nr](tw, W, A, r0, o, y);
        return;
    }
    if (isa == ISA_AVX2) {
        if (nr == 1) tile_avx2_1(tw, W, A, r0, o, y);
        else rows_tile_avx2(t, W, A, r0, r0 + nr, y);
        return;
    }
#if defined(HAVE_AVXVNNI)
    if (isa == ISA_AVX2_VNNI) {
        for (int r = 0; r < nr; r += 4) TILES_VNNI[nr - r < 4 ? nr - r : 4](tw, W, A, r0 + r, o, y);
        return;
    }
#endif
#endif
    tile_scalar(tw, W, A, r0, nr, o, y);
}

/* Rows [rb, re) of the activations times tiles [t0, t1) of a super-block weight: SB_PAIR_ROWS+ rows with AVX-512
 * two tiles x 4 rows a pass (sb_pair4), else up to 8 rows a pass over one tile. */
static void sb_rows(int isa, const W4 *W, const Acts *A, int64_t n, int64_t rb, int64_t re, int64_t t0, int64_t t1,
                    float *y) {
    int64_t t = t0;
#if defined(X86)
    SbMetaMem *cache = isa == ISA_AVX512_VNNI && n >= SB_CACHE_ROWS
                           ? (SbMetaMem *)aligned_alloc(64, sizeof(SbMetaMem) * (size_t)(2 * A->nb))
                           : NULL; /* NULL (fewer rows, or no memory): every pass unpacks the headers */
    if (isa == ISA_AVX512_VNNI && n >= SB_PAIR_ROWS)
        for (; t + 2 <= t1; t += 2) {
            const uint8_t *tw = W->w + t * W->block;
            SbMetaMem *c1 = cache ? cache + A->nb : NULL;
            int64_t r = rb;
            for (; r + 4 <= re; r += 4)
                if (r == rb || !cache) sb_pair4_build(tw, W, A, r, t * TILE, y, cache, c1);
                else sb_pair4_cached(tw, W, A, r, t * TILE, y, cache, c1);
            for (; r < re; r += 4) {
                const int nr = re - r < 4 ? (int)(re - r) : 4;
                sb_run_tile(isa, t, W, A, r, nr, y);
                sb_run_tile(isa, t + 1, W, A, r, nr, y);
            }
        }
    free(cache);
#endif
    for (; t < t1; t++)
        for (int64_t r = rb; r < re; r += 8) sb_run_tile(isa, t, W, A, r, re - r < 8 ? (int)(re - r) : 8, y);
}

/* x [n, k] fp32 times the packed weight w (out outputs, groups of `group` inputs; fmt 0 symmetric, 1 asymmetric
 * with mins, 2 super-blocks: groups of 32 only), b [out] or NULL -> y [n, out] fp32. Threads split the tiles; rows
 * go in blocks of ROW_BLOCK (their codes stay in L2 while the thread's tiles stream by), each block 8 rows per pass
 * over a tile (read from L1 for the others), or with AVX-512 from 8 rows on, 4 rows per pass over two tiles
 * (tile512_pair4, sb_pair4), or with AVX2 (no VNNI, formats 0 and 1) from 2 rows on, 4 rows per pass over
 * K_BLOCK inputs of a tile (rows_tile_avx2).
 * Returns 0; -1 without memory for the activation codes; -2 for a group other than 32 or 64 (32 for fmt 2); -3
 * for a path this CPU lacks; -4 for k < 1; -5 for an unknown fmt. */
int recap_linear_int4(const float *x, int64_t n, int64_t k, const uint8_t *w, int64_t out, int64_t group, int fmt,
                      const float *b, float *y, int threads, int isa) {
    if (fmt < FMT_SYM || fmt > FMT_SB) return -5;
    if ((group != 32 && group != 64) || (fmt == FMT_SB && group != 32)) return -2;
    if (!recap_int4_isa_supported(isa)) return -3;
    if (n <= 0 || out <= 0) return 0;
    if (k <= 0) return -4; /* no inputs: no packed weight has none (quantize_int4 refuses an empty one) */
    const int64_t ng = (k + group - 1) / group, kp = ng * group, tiles = (out + TILE - 1) / TILE;
    const int64_t gpb = ACT_BLOCK / group, nb = (ng + gpb - 1) / gpb;
    int8_t *xs = (int8_t *)aligned_alloc(64, (size_t)((n * kp + 63) / 64 * 64));
    float *d = (float *)malloc(sizeof(float) * (size_t)(n * nb + 1));
    float *xf = (float *)malloc(sizeof(float) * (size_t)(n * ng + 1));
    int32_t *xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n * ng + 1));
    int32_t *xp = fmt == FMT_SB ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(n * nb * 4)) : NULL;
    if (!xs || !d || !xf || !xsum || (fmt == FMT_SB && !xp)) {
        free(xs), free(d), free(xf), free(xsum), free(xp);
        return -1;
    }
    const Acts A = {xs, d, xf, xsum, kp, ng, nb, gpb, xp};
    quantize_acts(x, n, k, &A, isa, threads, xs, d, xsum, xf);
    if (fmt == FMT_SB) sb_pairs(&A, n, xp);
    const int asym = fmt == FMT_ASYM;
    const int64_t block = fmt == FMT_SB ? ng * 256 + nb * SB_META : 8 * group + (asym ? 64 : 32);
    const W4 W = {w, b, ng, block, out, (int)(group / 8), asym};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = tiles * id / nt, t1 = tiles * (id + 1) / nt;
        for (int64_t rb = 0; rb < n; rb += ROW_BLOCK) {
            const int64_t re = rb + ROW_BLOCK < n ? rb + ROW_BLOCK : n;
            int64_t t = t0;
            if (fmt == FMT_SB) {
                sb_rows(isa, &W, &A, n, rb, re, t0, t1, y);
                continue;
            }
#if defined(X86)
            if (isa == ISA_AVX512_VNNI && n >= 8) /* 8+ rows: two tiles per pass, 4 rows at a time */
                for (; t + 2 <= t1; t += 2) {
                    int64_t r = rb;
                    for (; r + 4 <= re; r += 4) tile512_pair4(W.w + t * W.ng * W.block, &W, &A, r, t * TILE, y);
                    for (; r < re; r += 4) {
                        const int nr = re - r < 4 ? (int)(re - r) : 4;
                        run_tile(isa, t, &W, &A, r, nr, y);
                        run_tile(isa, t + 1, &W, &A, r, nr, y);
                    }
                }
            if (isa == ISA_AVX2 && n >= 2) /* 2+ rows: 4 rows x 16 outputs a pass over a K block */
                for (; t < t1; t++) rows_tile_avx2(t, &W, &A, rb, re, y);
#endif
            for (; t < t1; t++)
                for (int64_t r = rb; r < re; r += 8) run_tile(isa, t, &W, &A, r, re - r < 8 ? (int)(re - r) : 8, y);
        }
    }
    free(xs), free(d), free(xf), free(xsum), free(xp);
    return 0;
}
