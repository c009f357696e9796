/* Int8 linear layers at any row count: y[n, out] = x[n, in] W^T + b for a per-output-channel int8 weight W
 * and per-row 8-bit activations, computing exactly the integer product and the epilogue of
 * recap/model/quant.py's int8_linear_ref. Integer sums are exact in any order, so a row's result is the same
 * bit for bit whatever rows it is batched with and whatever path (row count, thread count) computed it.
 *
 * One weight layout serves every row count (linear_rows.pack_int8): tiles of 8 output rows (zero rows pad the
 * last tile), each tile kp / 64 chunks of 8 rows x 64 bytes (zeros pad each row to kp): one sequential
 * stream per tile. Read in place at one input row, the row-major weight ran at half the memory rate of fp32
 * (8 short streams per tile). Beside it only wsum [out] = sum_k w (the activations' zero-point term) and the
 * weight's scales: an int8 layer keeps no other copy of its weight (fbgemm's packed copy is not needed).
 * - One row (decode, bound by reading the weight): i8_row_tiles streams each thread's tiles, 8 dpbusd per
 *   64-byte chunk, the 8 sums reduced and dequantized in one vector.
 * - Two rows and more (batched decode, prefill): a GEMM over the same tiles. The rows are quantized once; a
 *   block of them (up to XBLOCK bytes) stays in L2 while each tile's k-block (KC bytes per weight row) sits in
 *   L1 and the block's rows run over it GEMM_NX at a time (AVX-512: 3 rows x 8 outputs = 24 accumulators of
 *   16 lanes, 11 loads per 24 dpbusd), the next k-block prefetched meanwhile; each (row, output)'s lanes are
 *   reduced once per k-block. At 2-8 rows with the weights from memory it ran 1.1-1.4x the former pairs-of-
 *   rows decode path; at 64-2048 rows at fbgemm's rate or above (docs/performance.md).
 * Tiles are split across OpenMP threads in contiguous shares (the runtime torch itself loaded).
 * Paths: AVX-512 VNNI; AVX2 (one row: i8_row_avx2, a tile per pass; 2+ rows: the GEMM, 2 rows x 4 outputs x 8
 * lanes) with AVX-VNNI's dot product or, without it, vpmaddubsw + vpmaddwd over 7-bit activations (the grid
 * without VNNI; an 8-bit grid there takes the portable loops); otherwise portable scalar loops.
 * Built by recap/kernels/native.py with -O3 -march=native -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PACK_ROWS 8
#define CHUNK 64
#define MAX_K 65536               /* 255 * 127 * k stays within int32 */
#define KC 2048                   /* bytes of a weight row per k-block: a tile's block (16 KiB) stays in L1 */
#define XBLOCK (512 * 1024)       /* bytes of quantized rows kept in L2 while the tiles run over them */
#define MAX_BLOCK_ROWS 256

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define I8_AVX512 1
#define GEMM_NX 3
#define GEMM_MIN_ROWS 2 /* one row: i8_row_tiles */
#elif defined(__AVX2__)
#define I8_AVX2 1
#define GEMM_NX 2
#endif

#if defined(I8_AVX2) && defined(__AVXVNNI__)
#define DPBUSD(acc, x, w) _mm256_dpbusd_avx_epi32(acc, x, w)
#elif defined(I8_AVX2)
/* AVX2 without VNNI: u8 x s8 pairs summed in int16 (vpmaddubsw), then pairs of those in int32. Exact only while
 * a pair cannot saturate int16: activations of at most 7 bits (qmax <= 127, 2 * 127 * 127 < 2^15), the grid
 * quant.py picks without VNNI (reduce_range); recap_linear_i8 runs a wider one through the portable loops. */
#define I8_NARROW 1
#define DPBUSD(acc, x, w) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)))
#endif

/* One row: a = max|x| (1 if 0), xq = clamp(rint((x / a) / qscale) + zp, 0, qmax) as uint8, zero-padded to kp
 * bytes. Division, not a multiply by the inverse, and round half to even: the fp32 ops of int8_linear_ref. */
static void quantize_row(const float *xr, int64_t k, int64_t kp, float qscale, int zp, int qmax, uint8_t *q,
                         float *a) {
    float m = 0.0f; /* max|x|: exact in any order */
    for (int64_t i = 0; i < k; i++) m = fmaxf(m, fabsf(xr[i]));
    if (m == 0.0f) m = 1.0f;
    *a = m;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(qscale), vz = _mm512_set1_ps((float)zp);
    const __m512 lo = _mm512_setzero_ps(), hi = _mm512_set1_ps((float)qmax);
    for (; i + 16 <= k; i += 16) {
        __m512 t = _mm512_div_ps(_mm512_div_ps(_mm512_loadu_ps(xr + i), vm), vs);
        t = _mm512_add_ps(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t)));
    }
#elif defined(__AVX2__)
    const __m256 vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(qscale), vz = _mm256_set1_ps((float)zp);
    const __m256 lo = _mm256_setzero_ps(), hi = _mm256_set1_ps((float)qmax);
    for (; i + 8 <= k; i += 8) {
        __m256 t = _mm256_div_ps(_mm256_div_ps(_mm256_loadu_ps(xr + i), vm), vs);
        t = _mm256_add_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
        const __m256i v = _mm256_cvtps_epi32(t); /* 0..qmax: the saturating packs are exact */
        const __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(p, p));
    }
#endif
    for (; i < k; i++) {
        float t = rintf((xr[i] / m) / qscale) + (float)zp;
        t = t < 0.0f ? 0.0f : (t > (float)qmax ? (float)qmax : t);
        q[i] = (uint8_t)t;
    }
    memset(q + k, 0, (size_t)(kp - k));
}

/* The epilogue of one (row, output): y = float(double(sum - zp * wsum) * (qscale * wscale)) * a + b. */
static inline float i8_out(int32_t sum, int32_t wsum, float wscale, float a, double qscale, int zp) {
    const int64_t acc = (int64_t)sum - (int64_t)zp * wsum;
    return (float)((double)acc * (qscale * (double)wscale)) * a;
}

#if defined(I8_AVX512)
/* The 8 accumulators of a tile (16 int32 lanes each) to one vector of their 8 sums: two unpack levels sum
 * within 128-bit lanes, two lane shuffles across them (~14 ops against ~70 for 8 separate reductions). By
 * value and always inlined: an array argument kept the callers' accumulators in memory. */
static inline __attribute__((always_inline)) __m256i reduce8v(__m512i a0, __m512i a1, __m512i a2, __m512i a3,
                                                              __m512i a4, __m512i a5, __m512i a6, __m512i a7) {
    const __m512i acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    __m512i p[4], q[2];
    for (int i = 0; i < 4; i++)
        p[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2 * i], acc[2 * i + 1]),
                                _mm512_unpackhi_epi32(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                                _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
    /* q[0]: rows 0-3 per 128-bit lane, q[1]: rows 4-7 */
    const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], 0x88), _mm512_shuffle_i32x4(q[0], q[1], 0xDD));
    const __m512i r = _mm512_add_epi32(_mm512_shuffle_i32x4(w, w, 0x88), _mm512_shuffle_i32x4(w, w, 0xDD));
    return _mm512_castsi512_si256(r);
}

/* A tile's 8 integer sums of one input row to outputs o..o+7 (masked at the end): i8_out's fp64/fp32
 * operations in the same order, so the result is the same bit for bit. */
static inline void i8_epilogue(__m256i sums8, int64_t o, int64_t out, float a, const int32_t *wsum,
                               const float *wscale, const float *b, float *y, double qscale, int zp) {
    const __mmask8 m = out - o >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (out - o)) - 1u);
    const __m512i sums = _mm512_cvtepi32_epi64(sums8);
    const __m512i ws = _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(m, wsum + o));
    const __m512i zw = _mm512_mullo_epi64(_mm512_set1_epi64(zp), ws);
    const __m512d accd = _mm512_cvtepi64_pd(_mm512_sub_epi64(sums, zw));
    const __m512d sc = _mm512_mul_pd(_mm512_set1_pd(qscale), _mm512_cvtps_pd(_mm256_maskz_loadu_ps(m, wscale + o)));
    __m256 v = _mm256_mul_ps(_mm512_cvtpd_ps(_mm512_mul_pd(accd, sc)), _mm256_set1_ps(a));
    if (b) v = _mm256_add_ps(v, _mm256_maskz_loadu_ps(m, b + o));
    _mm256_mask_storeu_ps(y + o, m, v);
}

/* One input row over tiles [t0, t1): each tile is read as one stream (8 dpbusd per 64-byte chunk), its 8 sums
 * reduced together and dequantized in one vector. */
static void i8_row_tiles(const int8_t *wp, int64_t t0, int64_t t1, int64_t kp, const uint8_t *xq, float a,
                         const int32_t *wsum, const float *wscale, int64_t out, const float *b, float *y,
                         double qscale, int zp) {
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *wt = wp + t * PACK_ROWS * kp;
        __m512i acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t kk = 0; kk < kp; kk += CHUNK) {
            const int8_t *c = wt + kk * PACK_ROWS;
            const __m512i xv = _mm512_load_si512((const void *)(xq + kk));
            for (int i = 0; i < 8; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], xv, _mm512_load_si512((const void *)(c + i * CHUNK)));
        }
        const __m256i sums = reduce8v(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
        i8_epilogue(sums, t * PACK_ROWS, out, a, wsum, wscale, b, y, qscale, zp);
    }
}

/* GEMM micro-kernel: NX rows (xq, row stride kp) x one tile's 8 outputs over `chunks` 64-byte chunks from
 * wt; adds the NX x 8 integer sums to sums[NX][8]. Each weight vector is loaded once into a register for
 * the NX rows. The accumulators are named variables: gcc spilled an accumulator array to the stack (and
 * with the micro-kernel inlined into i8_gemm: 300-380 against 500-600 GOP/s). pf (or NULL): the next
 * k-block of weights, pulled into L1 a chunk per chunk while this one runs (its first row group only). */
#define I8_Z _mm512_setzero_si512()
#define I8_DECL(j) __m512i a##j##0 = I8_Z, a##j##1 = I8_Z, a##j##2 = I8_Z, a##j##3 = I8_Z, a##j##4 = I8_Z,         \
                           a##j##5 = I8_Z, a##j##6 = I8_Z, a##j##7 = I8_Z;
#define I8_LOADX(j) const __m512i x##j = _mm512_load_si512((const void *)(xq + (j) * kp + c * CHUNK));
#define I8_DP(j, i) a##j##i = _mm512_dpbusd_epi32(a##j##i, x##j, wv);
#define I8_STORE(j)                                                                                            \
    {                                                                                                          \
        __m256i *s = (__m256i *)(sums + (j) * 8);                                                              \
        _mm256_store_si256(s, _mm256_add_epi32(_mm256_load_si256(s),                                           \
                                               reduce8v(a##j##0, a##j##1, a##j##2, a##j##3, a##j##4, a##j##5,  \
                                                        a##j##6, a##j##7)));                                   \
    }
/* one weight vector (output i) into a register (the empty asm keeps gcc from folding it into each dpbusd) */
#define I8_W(i, ROWS)                                                                                          \
    {                                                                                                          \
        __m512i wv = _mm512_load_si512((const void *)(w + (i) * CHUNK));                                       \
        __asm__("" : "+v"(wv));                                                                                \
        ROWS(I8_DP, i)                                                                                         \
    }
#define I8_PREFETCH(p)                                                                                         \
    for (int l = 0; l < PACK_ROWS; l++) _mm_prefetch((const char *)(p) + l * CHUNK, _MM_HINT_T0)
#define I8_MICRO(NX, ROWS, ROWS1)                                                                              \
    __attribute__((noinline)) static void i8_micro_##NX(const int8_t *wt, const uint8_t *xq, int64_t kp,       \
                                                        int64_t chunks, int32_t *sums, const int8_t *pf) {     \
        ROWS1(I8_DECL)                                                                                         \
        for (int64_t c = 0; c < chunks; c++) {                                                                 \
            const int8_t *w = wt + c * PACK_ROWS * CHUNK;                                                      \
            if (pf) I8_PREFETCH(pf + c * PACK_ROWS * CHUNK);                                                   \
            ROWS1(I8_LOADX)                                                                                    \
            I8_W(0, ROWS) I8_W(1, ROWS) I8_W(2, ROWS) I8_W(3, ROWS) I8_W(4, ROWS) I8_W(5, ROWS) I8_W(6, ROWS)  \
            I8_W(7, ROWS)                                                                                      \
        }                                                                                                      \
        ROWS1(I8_STORE)                                                                                        \
    }
#define I8_ROWS1_1(M) M(0)
#define I8_ROWS1_2(M) M(0) M(1)
#define I8_ROWS1_3(M) M(0) M(1) M(2)
#define I8_ROWS_1(M, i) M(0, i)
#define I8_ROWS_2(M, i) M(0, i) M(1, i)
#define I8_ROWS_3(M, i) M(0, i) M(1, i) M(2, i)
#define EPILOGUE(s8, o, a, yr) i8_epilogue(_mm256_load_si256((const __m256i *)(s8)), o, out, a, wsum, wscale, b, yr, \
                                           qscale, zp)

#elif defined(I8_AVX2)
/* Four accumulators of 8 lanes to their 4 sums. */
static inline __m128i reduce4(const __m256i acc[4]) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* NX rows x one tile as two halves of 4 outputs (16 registers: 4 NX accumulators, NX inputs, one weight);
 * the arguments as the AVX-512 micro-kernel's. */
#define I8_PREFETCH(p)                                                                                         \
    for (int l = 0; l < PACK_ROWS; l++) _mm_prefetch((const char *)(p) + l * CHUNK, _MM_HINT_T0)
#define I8_MICRO(NX)                                                                                           \
    __attribute__((noinline)) static void i8_micro_##NX(const int8_t *wt, const uint8_t *xq, int64_t kp,       \
                                                        int64_t chunks, int32_t *sums, const int8_t *pf) {     \
        for (int h = 0; h < PACK_ROWS; h += 4) {                                                               \
            __m256i acc[NX][4];                                                                                \
            for (int j = 0; j < NX; j++)                                                                       \
                for (int i = 0; i < 4; i++) acc[j][i] = _mm256_setzero_si256();                                \
            for (int64_t c = 0; c < chunks; c++) {                                                             \
                const int8_t *w = wt + c * PACK_ROWS * CHUNK + h * CHUNK;                                      \
                if (pf && h == 0) I8_PREFETCH(pf + c * PACK_ROWS * CHUNK);                                     \
                for (int u = 0; u < CHUNK; u += 32) {                                                          \
                    __m256i xv[NX];                                                                            \
                    for (int j = 0; j < NX; j++)                                                               \
                        xv[j] = _mm256_load_si256((const __m256i *)(xq + j * kp + c * CHUNK + u));             \
                    for (int i = 0; i < 4; i++) {                                                              \
                        const __m256i wv = _mm256_load_si256((const __m256i *)(w + i * CHUNK + u));            \
                        for (int j = 0; j < NX; j++) acc[j][i] = DPBUSD(acc[j][i], xv[j], wv);               \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            for (int j = 0; j < NX; j++) {                                                                     \
                __m128i *s = (__m128i *)(sums + j * 8 + h);                                                    \
                _mm_store_si128(s, _mm_add_epi32(_mm_load_si128(s), reduce4(acc[j])));                         \
            }                                                                                                  \
        }                                                                                                      \
    }

/* i8_out over 8 outputs o..o+7 of one row, 4 at a time (the same operations: bit for bit); |sum - zp * wsum|
 * < 2^31 for k <= MAX_K, so int32 arithmetic is exact. */
static void i8_epilogue8(const int32_t *s8, int64_t o, int64_t out, float a, const int32_t *wsum,
                         const float *wscale, const float *b, float *y, double qscale, int zp) {
    int64_t i = 0;
    for (; i + 4 <= 8 && o + i + 4 <= out; i += 4) {
        const __m128i ws = _mm_loadu_si128((const __m128i *)(wsum + o + i));
        const __m128i acc = _mm_sub_epi32(_mm_load_si128((const __m128i *)(s8 + i)),
                                          _mm_mullo_epi32(_mm_set1_epi32(zp), ws));
        const __m256d sc = _mm256_mul_pd(_mm256_set1_pd(qscale), _mm256_cvtps_pd(_mm_loadu_ps(wscale + o + i)));
        __m128 v = _mm_mul_ps(_mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtepi32_pd(acc), sc)), _mm_set1_ps(a));
        if (b) v = _mm_add_ps(v, _mm_loadu_ps(b + o + i));
        _mm_storeu_ps(y + o + i, v);
    }
    for (; i < 8 && o + i < out; i++) {
        const float v = i8_out(s8[i], wsum[o + i], wscale[o + i], a, qscale, zp);
        y[o + i] = b ? v + b[o + i] : v;
    }
}
#define EPILOGUE(s8, o, a, yr) i8_epilogue8(s8, o, out, a, wsum, wscale, b, yr, qscale, zp)

/* One row (decode): each tile's 8 weight rows in one pass over its stream, 8 accumulators, the stream prefetched
 * I8_PF bytes ahead. The GEMM's micro-kernel reads a tile as two 4-row halves (4 of each 8 cache lines per pass):
 * from memory that ran at 8 GB/s against 12 for a plain read. The same integer sums and epilogue. */
#define I8_PF 2048
static void i8_row_avx2(const int8_t *wp, int64_t t0, int64_t t1, int64_t kp, const uint8_t *xq, float a,
                        const int32_t *wsum, const float *wscale, int64_t out, const float *b, float *y,
                        double qscale, int zp) {
    int32_t s8[8] __attribute__((aligned(32)));
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *wt = wp + t * PACK_ROWS * kp;
        __m256i acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
        for (int64_t kk = 0; kk < kp; kk += CHUNK) {
            const int8_t *c = wt + kk * PACK_ROWS;
            for (int l = 0; l < PACK_ROWS; l++) _mm_prefetch((const char *)c + I8_PF + l * CHUNK, _MM_HINT_T0);
            const __m256i x0 = _mm256_load_si256((const __m256i *)(xq + kk));
            const __m256i x1 = _mm256_load_si256((const __m256i *)(xq + kk + 32));
            for (int i = 0; i < 8; i++) {
                acc[i] = DPBUSD(acc[i], x0, _mm256_load_si256((const __m256i *)(c + i * CHUNK)));
                acc[i] = DPBUSD(acc[i], x1, _mm256_load_si256((const __m256i *)(c + i * CHUNK + 32)));
            }
        }
        _mm_store_si128((__m128i *)s8, reduce4(acc));
        _mm_store_si128((__m128i *)(s8 + 4), reduce4(acc + 4));
        EPILOGUE(s8, t * PACK_ROWS, a, y);
    }
}
#endif

#if defined(I8_AVX512)
I8_MICRO(1, I8_ROWS_1, I8_ROWS1_1)
I8_MICRO(2, I8_ROWS_2, I8_ROWS1_2)
I8_MICRO(3, I8_ROWS_3, I8_ROWS1_3)
#elif defined(I8_AVX2)
I8_MICRO(1)
I8_MICRO(2)
#endif
#if defined(I8_AVX512) || defined(I8_AVX2)

/* NX rows (1 <= NX <= GEMM_NX) of the micro-kernel. */
static void i8_micro(int nx, const int8_t *wt, const uint8_t *xq, int64_t kp, int64_t chunks, int32_t *sums,
                     const int8_t *pf) {
    switch (nx) {
        case 1: i8_micro_1(wt, xq, kp, chunks, sums, pf); break;
        case 2: i8_micro_2(wt, xq, kp, chunks, sums, pf); break;
#if GEMM_NX > 2
        case 3: i8_micro_3(wt, xq, kp, chunks, sums, pf); break;
#endif
        default: abort();
    }
}

/* The GEMM path: n quantized rows over tiles [t0, t1). Per block of rows (XBLOCK bytes of them, in L2) each
 * tile runs its k-blocks (8 x KC bytes, in L1) over the block's rows GEMM_NX at a time, the block's integer
 * sums [rows][8] (in L1) gathered over the k-blocks, then dequantized. */
static void i8_gemm(const int8_t *wp, int64_t t0, int64_t t1, int64_t kp, const uint8_t *xq, int64_t n,
                    const float *a, const int32_t *wsum, const float *wscale, int64_t out, const float *b, float *y,
                    double qscale, int zp) {
    int64_t mb = XBLOCK / kp / GEMM_NX * GEMM_NX;
    mb = mb < GEMM_NX ? GEMM_NX : (mb > MAX_BLOCK_ROWS ? MAX_BLOCK_ROWS : mb);
    int32_t sums[MAX_BLOCK_ROWS * PACK_ROWS] __attribute__((aligned(64)));
    const int8_t *end = wp + t1 * PACK_ROWS * kp; /* this thread's weights end here */
    for (int64_t r0 = 0; r0 < n; r0 += mb) {
        const int64_t rn = n - r0 < mb ? n - r0 : mb;
        for (int64_t t = t0; t < t1; t++) {
            memset(sums, 0, sizeof(int32_t) * PACK_ROWS * (size_t)rn);
            for (int64_t k0 = 0; k0 < kp; k0 += KC) {
                const int64_t chunks = (kp - k0 < KC ? kp - k0 : KC) / CHUNK;
                const int8_t *wt = wp + t * PACK_ROWS * kp + k0 * PACK_ROWS;
                /* the tiles are one stream: the next k-block (this tile's or the next tile's) follows this one */
                const int8_t *next = wt + chunks * PACK_ROWS * CHUNK;
                for (int64_t r = 0; r < rn; r += GEMM_NX) {
                    const int nx = rn - r < GEMM_NX ? (int)(rn - r) : GEMM_NX;
                    const int8_t *pf = r == 0 && next + chunks * PACK_ROWS * CHUNK <= end ? next : NULL;
                    i8_micro(nx, wt, xq + (r0 + r) * kp + k0, kp, chunks, sums + r * PACK_ROWS, pf);
                }
            }
            for (int64_t r = 0; r < rn; r++)
                EPILOGUE(sums + r * PACK_ROWS, t * PACK_ROWS, a[r0 + r], y + (r0 + r) * out);
        }
    }
}
#endif

/* Portable: one (row, output) at a time, each a sum over the tile's chunks. */
static void i8_portable(const int8_t *wp, int64_t t0, int64_t t1, int64_t kp, const uint8_t *xq, int64_t n,
                        const float *a, const int32_t *wsum, const float *wscale, int64_t out, const float *b,
                        float *y, double qscale, int zp) {
    for (int64_t t = t0; t < t1; t++)
        for (int64_t r = 0; r < n; r++)
            for (int i = 0; i < PACK_ROWS && t * PACK_ROWS + i < out; i++) {
                const int64_t o = t * PACK_ROWS + i;
                int32_t s = 0;
                for (int64_t kk = 0; kk < kp; kk += CHUNK) {
                    const int8_t *c = wp + t * PACK_ROWS * kp + kk * PACK_ROWS + i * CHUNK;
                    const uint8_t *xr = xq + r * kp + kk;
#pragma omp simd reduction(+ : s)
                    for (int u = 0; u < CHUNK; u++) s += (int32_t)xr[u] * (int32_t)c[u];
                }
                const float v = i8_out(s, wsum[o], wscale[o], a[r], qscale, zp);
                y[r * out + o] = b ? v + b[o] : v;
            }
}

/* x [n, k] fp32, wp: w [out, k] int8 packed as above (linear_rows.pack_int8), wsum [out] = sum_k w, wscale [out],
 * b [out] or NULL, y [n, out] fp32. y = float(double(sum (xq - zp) * w) * (qscale * wscale)) * a + b, as
 * int8_linear_ref, for any n >= 0. Returns 0, -1 if the scratch buffer could not be allocated, -2 for
 * k > MAX_K. */
int recap_linear_i8(const float *x, int64_t n, const int8_t *wp, const int32_t *wsum, const float *wscale,
                    int64_t out, int64_t k, const float *b, float *y, float qscale, int zp, int qmax, int threads) {
    if (k > MAX_K) return -2;
    if (n <= 0) return 0;
#if defined(I8_NARROW)
    const int simd = qmax <= 127; /* 8-bit activations would saturate AVX2's int16 pairs: the portable loops */
#else
    const int simd = 1;
#endif
    const int64_t kp = (k + CHUNK - 1) / CHUNK * CHUNK, tiles = (out + PACK_ROWS - 1) / PACK_ROWS;
    uint8_t *xq = (uint8_t *)aligned_alloc(64, (size_t)(n * kp));
    float *a = (float *)malloc(sizeof(float) * (size_t)n);
    if (!xq || !a) {
        free(xq);
        free(a);
        return -1;
    }
#if defined(I8_AVX512)
    const int row_path = n < GEMM_MIN_ROWS; /* i8_row_tiles */
#else
    const int row_path = 0;
#endif
    if (row_path) /* one row: quantizing it costs less than waking the threads for it */
        for (int64_t r = 0; r < n; r++) quantize_row(x + r * k, k, kp, qscale, zp, qmax, xq + r * kp, a + r);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (!row_path) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) quantize_row(x + r * k, k, kp, qscale, zp, qmax, xq + r * kp, a + r);
        }
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = tiles * id / nt, t1 = tiles * (id + 1) / nt;
#if defined(I8_AVX512)
        if (row_path)
            i8_row_tiles(wp, t0, t1, kp, xq, a[0], wsum, wscale, out, b, y, (double)qscale, zp);
        else
            i8_gemm(wp, t0, t1, kp, xq, n, a, wsum, wscale, out, b, y, (double)qscale, zp);
#elif defined(I8_AVX2)
        if (simd && n == 1)
            i8_row_avx2(wp, t0, t1, kp, xq, a[0], wsum, wscale, out, b, y, (double)qscale, zp);
        else if (simd)
            i8_gemm(wp, t0, t1, kp, xq, n, a, wsum, wscale, out, b, y, (double)qscale, zp);
        else
            i8_portable(wp, t0, t1, kp, xq, n, a, wsum, wscale, out, b, y, (double)qscale, zp);
#else
        (void)simd;
        i8_portable(wp, t0, t1, kp, xq, n, a, wsum, wscale, out, b, y, (double)qscale, zp);
#endif
    }
    free(xq);
    free(a);
    return 0;
}
