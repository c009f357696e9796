/* Few-row linear layers (decode steps): y[n, out] = x[n, in] W^T + b for fp32 weights and for int8 weights
 * with per-row 8-bit activations (the integer product of recap/model/quant.py's int8_linear_ref).
 *
 * At 1-8 rows a linear layer is bound by reading its weight once. A tile of weight rows is read from memory
 * once, multiplied with every input row while it sits in L1, and the next tile is prefetched meanwhile; tiles
 * are split across OpenMP threads (the runtime torch itself loaded: one thread pool for both).
 * Tile shapes: 8 weight rows x 1 input row, or 4 x up to 4 input rows, so that the accumulators stay in
 * registers (each shape is its own function: gcc keeps a fixed-size accumulator array in registers only when
 * its size and loop bounds are constants).
 * Built by recap/kernels/native.py with -O3 -march=native -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------- fp32 */

#if defined(__AVX512F__)
#define F32_TILE(NW, NX)                                                                                       \
    static void f32_tile_##NW##_##NX(const float *w, int64_t k, const float *x, float *y, int64_t ldy,         \
                                     const float *b, int64_t pf) {                                             \
        __m512 acc[NW][NX];                                                                                    \
        for (int i = 0; i < NW; i++)                                                                           \
            for (int j = 0; j < NX; j++) acc[i][j] = _mm512_setzero_ps();                                      \
        int64_t kk = 0;                                                                                        \
        for (; kk + 16 <= k; kk += 16) {                                                                       \
            __m512 xv[NX];                                                                                     \
            for (int j = 0; j < NX; j++) xv[j] = _mm512_loadu_ps(x + j * k + kk);                              \
            for (int i = 0; i < NW; i++) {                                                                     \
                _mm_prefetch((const char *)(w + i * k + kk + pf), _MM_HINT_T0);                                \
                const __m512 wv = _mm512_loadu_ps(w + i * k + kk);                                             \
                for (int j = 0; j < NX; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);                \
            }                                                                                                  \
        }                                                                                                      \
        if (kk < k) {                                                                                          \
            const __mmask16 m = (__mmask16)((1u << (k - kk)) - 1u);                                            \
            __m512 xv[NX];                                                                                     \
            for (int j = 0; j < NX; j++) xv[j] = _mm512_maskz_loadu_ps(m, x + j * k + kk);                     \
            for (int i = 0; i < NW; i++) {                                                                     \
                const __m512 wv = _mm512_maskz_loadu_ps(m, w + i * k + kk);                                    \
                for (int j = 0; j < NX; j++) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);                \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 0; j < NX; j++)                                                                           \
            for (int i = 0; i < NW; i++) {                                                                     \
                const float s = _mm512_reduce_add_ps(acc[i][j]);                                               \
                y[j * ldy + i] = b ? s + b[i] : s;                                                             \
            }                                                                                                  \
    }
#else
#define F32_TILE(NW, NX)                                                                                       \
    static void f32_tile_##NW##_##NX(const float *w, int64_t k, const float *x, float *y, int64_t ldy,         \
                                     const float *b, int64_t pf) {                                             \
        (void)pf;                                                                                              \
        for (int j = 0; j < NX; j++)                                                                           \
            for (int i = 0; i < NW; i++) {                                                                     \
                float s = 0.0f;                                                                                \
                _Pragma("omp simd reduction(+ : s)") for (int64_t kk = 0; kk < k; kk++) s +=                  \
                    w[i * k + kk] * x[j * k + kk];                                                             \
                y[j * ldy + i] = b ? s + b[i] : s;                                                             \
            }                                                                                                  \
    }
#endif

/* ---------------------------------------------------------------- int8 */

/* Packed int8 weight: tiles of 8 output rows (zero rows pad the last tile), each tile as kp / 64 chunks of
 * 8 rows x 64 bytes (zeros pad each row to kp): a tile is one sequential stream. Read in place at one input
 * row, the row-major weight ran at half the memory rate of fp32 (8 short streams per tile). */
#define PACK_ROWS 8
#define CHUNK 64

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_TILE(NW, NX)                                                                                        \
    static void i8_tile_##NW##_##NX(const int8_t *wt, int64_t kp, const uint8_t *xq, int32_t *sums) {          \
        __m512i acc[NW][NX];                                                                                   \
        for (int i = 0; i < NW; i++)                                                                           \
            for (int j = 0; j < NX; j++) acc[i][j] = _mm512_setzero_si512();                                   \
        for (int64_t kk = 0; kk < kp; kk += CHUNK) {                                                           \
            const int8_t *c = wt + kk * PACK_ROWS;                                                             \
            __m512i xv[NX];                                                                                    \
            for (int j = 0; j < NX; j++) xv[j] = _mm512_load_si512((const void *)(xq + j * kp + kk));          \
            for (int i = 0; i < NW; i++) {                                                                     \
                const __m512i wv = _mm512_load_si512((const void *)(c + i * CHUNK));                           \
                for (int j = 0; j < NX; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv[j], wv);            \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 0; j < NX; j++)                                                                           \
            for (int i = 0; i < NW; i++) sums[j * 8 + i] = _mm512_reduce_add_epi32(acc[i][j]);                 \
    }
#else
#define I8_TILE(NW, NX)                                                                                        \
    static void i8_tile_##NW##_##NX(const int8_t *wt, int64_t kp, const uint8_t *xq, int32_t *sums) {          \
        for (int j = 0; j < NX; j++)                                                                           \
            for (int i = 0; i < NW; i++) {                                                                     \
                int32_t s = 0;                                                                                 \
                for (int64_t kk = 0; kk < kp; kk += CHUNK) {                                                   \
                    const int8_t *c = wt + kk * PACK_ROWS + i * CHUNK;                                         \
                    _Pragma("omp simd reduction(+ : s)") for (int u = 0; u < CHUNK; u++) s +=                 \
                        (int32_t)xq[j * kp + kk + u] * (int32_t)c[u];                                          \
                }                                                                                              \
                sums[j * 8 + i] = s;                                                                           \
            }                                                                                                  \
    }
#endif

/* One input row: weight rows one after another with four accumulators along the row, so that the weight is
 * read as one sequential stream (per thread). Measured against 8-row tiles (8 interleaved streams) on the
 * AVX-512 EPYC, 1 thread, weights from memory: 20-25 vs 17.5-21 GB/s; two interleaved rows: 12-16 GB/s. */
static void f32_row(const float *w, int64_t rows, int64_t k, const float *x, float *y, const float *b) {
    for (int64_t o = 0; o < rows; o++) {
        const float *r = w + o * k;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t kk = 0;
        for (; kk + 64 <= k; kk += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + kk), _mm512_loadu_ps(x + kk), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r + kk + 16), _mm512_loadu_ps(x + kk + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(r + kk + 32), _mm512_loadu_ps(x + kk + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(r + kk + 48), _mm512_loadu_ps(x + kk + 48), a3);
        }
        for (; kk + 16 <= k; kk += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + kk), _mm512_loadu_ps(x + kk), a0);
        if (kk < k) {
            const __mmask16 m = (__mmask16)((1u << (k - kk)) - 1u);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, r + kk), _mm512_maskz_loadu_ps(m, x + kk), a1);
        }
        const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t kk = 0; kk < k; kk++) s += r[kk] * x[kk];
#endif
        y[o] = b ? s + b[o] : s;
    }
}

/* The tile shapes: 1..4 weight rows x 1..4 input rows (both), and 5..8 weight rows x 1 input row (int8). */
#define TILES(T)                                                                                               \
    T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(1, 2) T(2, 2) T(3, 2) T(4, 2) T(1, 3) T(2, 3) T(3, 3) T(4, 3) T(1, 4)   \
        T(2, 4) T(3, 4) T(4, 4)
#define WIDE_TILES(T) T(5, 1) T(6, 1) T(7, 1) T(8, 1)
TILES(F32_TILE)
TILES(I8_TILE)
WIDE_TILES(I8_TILE)

#define F32_CASE(NW, NX) \
    case (NW) * 16 + (NX): f32_tile_##NW##_##NX(w, k, x, y, ldy, b, pf); break;
#define I8_CASE(NW, NX) \
    case (NW) * 16 + (NX): i8_tile_##NW##_##NX(wt, kp, xq, sums); break;

static void f32_tile(const float *w, int64_t k, const float *x, float *y, int64_t ldy, const float *b, int nw,
                     int nx, int64_t pf) {
    switch (nw * 16 + nx) {
        TILES(F32_CASE)
        default: abort();
    }
}

static void i8_tile(const int8_t *wt, int64_t kp, const uint8_t *xq, int32_t *sums, int nw, int nx) {
    switch (nw * 16 + nx) {
        TILES(I8_CASE)
        WIDE_TILES(I8_CASE)
        default: abort();
    }
}

/* x [n, k], w [out, k], b [out] or NULL, y [n, out]; all contiguous. One row: f32_row over each thread's
 * contiguous share of the weight rows; several: tiles of 4 weight rows x up to 4 input rows. */
void recap_linear_f32(const float *x, int64_t n, const float *w, int64_t out, int64_t k, const float *b, float *y,
                      int threads) {
    if (n == 1) {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t lo = out * id / nt, hi = out * (id + 1) / nt;
            f32_row(w + lo * k, hi - lo, k, x, y + lo, b ? b + lo : NULL);
        }
        return;
    }
    const int wr = 4;
    const int64_t tiles = (out + wr - 1) / wr;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o = t * wr;
        const int nw = out - o < wr ? (int)(out - o) : wr;
        for (int64_t r = 0; r < n; r += 4) {
            const int nx = n - r < 4 ? (int)(n - r) : 4;
            /* prefetch the same row of the next tile, during the first input-row group only */
            f32_tile(w + o * k, k, x + r * k, y + r * out + o, out, b ? b + o : NULL, nw, nx, r == 0 ? wr * k : 0);
        }
    }
}

/* ---------------------------------------------------------------- fp32, panel layout (any row count) */

/* Weight panels: [ceil(out / 32), k, 32], panel p holding output columns 32p..32p+31 (zero columns pad the
 * last), one sequential stream per panel. For each k an 8-row x 32-column outer product: two weight vectors,
 * eight broadcast inputs, sixteen FMAs, no horizontal sums. Measured from memory on the AVX-512 EPYC (8 rows,
 * weights on huge pages): 91-100 GF/s at 1 thread and 140-160 at 2, against 50-59 and 74-93 for oneDNN on its
 * packed copy and 35-48 / 58-81 for dot-product tiles over the row-major weight. */
#define PANEL 32
#define PANEL_ROWS 8

#if defined(__AVX512F__)
static void f32_panel(const float *wp, int64_t k, const float *x8, float *acc_out) {
    __m512 a[PANEL_ROWS][2];
    for (int r = 0; r < PANEL_ROWS; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * PANEL;
        _mm_prefetch((const char *)w + 512, _MM_HINT_T0);
        _mm_prefetch((const char *)w + 576, _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        for (int r = 0; r < PANEL_ROWS; r++) {
            const __m512 xb = _mm512_set1_ps(x8[kk * PANEL_ROWS + r]);
            a[r][0] = _mm512_fmadd_ps(w0, xb, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(w1, xb, a[r][1]);
        }
    }
    for (int r = 0; r < PANEL_ROWS; r++) {
        _mm512_storeu_ps(acc_out + r * PANEL, a[r][0]);
        _mm512_storeu_ps(acc_out + r * PANEL + 16, a[r][1]);
    }
}
#else
static void f32_panel(const float *wp, int64_t k, const float *x8, float *acc_out) {
    for (int r = 0; r < PANEL_ROWS; r++)
        for (int c = 0; c < PANEL; c++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) s += wp[kk * PANEL + c] * x8[kk * PANEL_ROWS + r];
            acc_out[r * PANEL + c] = s;
        }
}
#endif

#if defined(__AVX512F__)
/* One input row over a panel: two accumulators per 32 columns, four k at a time so the FMA chains overlap;
 * bound by reading the panel (the 8-row tile above would spend 8x the FMAs on a padded group). */
static void f32_panel_1(const float *wp, int64_t k, const float *x, float *acc_out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t kk = 0;
    for (; kk + 2 <= k; kk += 2) {
        const float *w = wp + kk * PANEL;
        _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)w + 1088, _MM_HINT_T0);
        const __m512 x0 = _mm512_set1_ps(x[kk]), x1 = _mm512_set1_ps(x[kk + 1]);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w), x0, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), x0, a1);
        b0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32), x1, b0);
        b1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 48), x1, b1);
    }
    if (kk < k) {
        const float *w = wp + kk * PANEL;
        const __m512 x0 = _mm512_set1_ps(x[kk]);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w), x0, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), x0, a1);
    }
    _mm512_storeu_ps(acc_out, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(acc_out + 16, _mm512_add_ps(a1, b1));
}
#else
static void f32_panel_1(const float *wp, int64_t k, const float *x, float *acc_out) {
    for (int c = 0; c < PANEL; c++) {
        float s = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) s += wp[kk * PANEL + c] * x[kk];
        acc_out[c] = s;
    }
}
#endif

/* x [n, k] (n >= 1), wp the panels of w [out, k], b [out] or NULL, y [n, out]. One row: f32_panel_1 over each
 * panel. Several: the rows go in groups of 8 (the last zero-padded) and blocks of BLOCK_GROUPS groups; for each
 * block every thread takes whole panels and runs the block's groups over a panel while it sits in L2, so the
 * weight is read from memory once per block (64 rows: ~32 FLOP per weight byte, compute-bound) and the block's
 * transposed input stays in cache. Returns 0, or -1 for n < 1 or no memory for the transposed input. */
#define BLOCK_GROUPS 8
int recap_linear_f32_panels(const float *x, int64_t n, const float *wp, int64_t out, int64_t k, const float *b,
                            float *y, int threads) {
    if (n < 1) return -1;
    const int64_t panels = (out + PANEL - 1) / PANEL;
    if (n == 1) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t p = 0; p < panels; p++) {
            float acc[PANEL];
            const int64_t o = p * PANEL, nc = out - o < PANEL ? out - o : PANEL;
            f32_panel_1(wp + p * k * PANEL, k, x, acc);
            for (int64_t c = 0; c < nc; c++) y[o + c] = b ? acc[c] + b[o + c] : acc[c];
        }
        return 0;
    }
    const int64_t groups = (n + PANEL_ROWS - 1) / PANEL_ROWS;
    const int64_t block = groups < BLOCK_GROUPS ? groups : BLOCK_GROUPS;
    /* one block of x transposed per group to [k, 8] (rows past n zero): the 8 inputs of one k are adjacent */
    float *x8 = (float *)aligned_alloc(64, sizeof(float) * (size_t)(((block * k * PANEL_ROWS + 15) / 16) * 16));
    if (!x8) return -1;
    for (int64_t g0 = 0; g0 < groups; g0 += block) {
        const int64_t nb = groups - g0 < block ? groups - g0 : block;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nb; g++)
                for (int64_t kk = 0; kk < k; kk++)
                    for (int r = 0; r < PANEL_ROWS; r++) {
                        const int64_t row = (g0 + g) * PANEL_ROWS + r;
                        x8[(g * k + kk) * PANEL_ROWS + r] = row < n ? x[row * k + kk] : 0.0f;
                    }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                float acc[PANEL_ROWS * PANEL];
                const int64_t o = p * PANEL, nc = out - o < PANEL ? out - o : PANEL;
                for (int64_t g = 0; g < nb; g++) {
                    f32_panel(wp + p * k * PANEL, k, x8 + g * k * PANEL_ROWS, acc);
                    const int64_t first = (g0 + g) * PANEL_ROWS;
                    const int64_t nr = n - first < PANEL_ROWS ? n - first : PANEL_ROWS;
                    for (int64_t r = 0; r < nr; r++) {
                        float *yr = y + (first + r) * out + o;
                        for (int64_t c = 0; c < nc; c++) yr[c] = b ? acc[r * PANEL + c] + b[o + c] : acc[r * PANEL + c];
                    }
                }
            }
        }
    }
    free(x8);
    return 0;
}

/* Per row: a = max|x| (1 if 0), xq = clamp(rint((x / a) / qscale) + zp, 0, qmax) as uint8, zero-padded to kp
 * bytes. Division, not a multiply by the inverse, and round half to even: the fp32 ops of int8_linear_ref. */
static void quantize_rows(const float *x, int64_t n, int64_t k, int64_t kp, float qscale, int zp, int qmax,
                          uint8_t *xq, float *a) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * k;
        float m = 0.0f; /* max|x|: exact in any order */
        for (int64_t i = 0; i < k; i++) m = fmaxf(m, fabsf(xr[i]));
        if (m == 0.0f) m = 1.0f;
        a[r] = m;
        uint8_t *q = xq + r * kp;
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
#endif
        for (; i < k; i++) {
            float t = rintf((xr[i] / m) / qscale) + (float)zp;
            t = t < 0.0f ? 0.0f : (t > (float)qmax ? (float)qmax : t);
            q[i] = (uint8_t)t;
        }
        memset(q + k, 0, (size_t)(kp - k));
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define I8_ROW_FAST 1
/* The 8 accumulators of a tile (16 int32 lanes each) to one vector of their 8 sums: two unpack levels sum
 * within 128-bit lanes, two lane shuffles across them (~14 ops against ~70 for 8 separate reductions). */
static inline __m256i reduce8(const __m512i acc[8]) {
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

/* A tile's 8 integer sums of one input row to outputs o..o+7 (masked at the end), in the fp64/fp32
 * operations (and order) of the scalar epilogue below, so the result is the same bit for bit. */
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
        i8_epilogue(reduce8(acc), t * PACK_ROWS, out, a, wsum, wscale, b, y, qscale, zp);
    }
}

/* Input rows r and r + 1 over tiles [t0, t1): each 64-byte weight chunk loaded once for both rows (16
 * accumulators), the same reduction and epilogue per row as one row (several rows: ~2x the one-row path's
 * time at 8 rows where 4x4 tiles with scalar epilogues took ~3x). */
static void i8_row_pair_tiles(const int8_t *wp, int64_t t0, int64_t t1, int64_t kp, const uint8_t *xq,
                              const float *a, const int32_t *wsum, const float *wscale, int64_t out, const float *b,
                              float *y, double qscale, int zp) {
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *wt = wp + t * PACK_ROWS * kp;
        __m512i acc0[8], acc1[8];
        for (int i = 0; i < 8; i++) acc0[i] = acc1[i] = _mm512_setzero_si512();
        for (int64_t kk = 0; kk < kp; kk += CHUNK) {
            const int8_t *c = wt + kk * PACK_ROWS;
            const __m512i x0 = _mm512_load_si512((const void *)(xq + kk));
            const __m512i x1 = _mm512_load_si512((const void *)(xq + kp + kk));
            for (int i = 0; i < 8; i++) {
                const __m512i wv = _mm512_load_si512((const void *)(c + i * CHUNK));
                acc0[i] = _mm512_dpbusd_epi32(acc0[i], x0, wv);
                acc1[i] = _mm512_dpbusd_epi32(acc1[i], x1, wv);
            }
        }
        i8_epilogue(reduce8(acc0), t * PACK_ROWS, out, a[0], wsum, wscale, b, y, qscale, zp);
        i8_epilogue(reduce8(acc1), t * PACK_ROWS, out, a[1], wsum, wscale, b, y + out, qscale, zp);
    }
}
#endif

/* x [n, k] fp32, wp: w [out, k] int8 packed as above (linear_rows.pack_int8), wsum [out] = sum_k w, wscale [out], b [out] or
 * NULL, y [n, out] fp32. y = float(double(sum (xq - zp) * w) * (qscale * wscale)) * a + b, as int8_linear_ref.
 * Tiles of 8 weight rows: with AVX-512 VNNI each tile once per input row pair (16 accumulators), vector
 * epilogues; otherwise as two halves of 4 rows x up to 4 input rows with scalar epilogues.
 * Returns 0, or -1 if the scratch buffer could not be allocated. */
int recap_linear_i8(const float *x, int64_t n, const int8_t *wp, const int32_t *wsum, const float *wscale,
                    int64_t out, int64_t k, const float *b, float *y, float qscale, int zp, int qmax, int threads) {
    const int64_t kp = (k + CHUNK - 1) / CHUNK * CHUNK;
    uint8_t *xq = (uint8_t *)aligned_alloc(64, (size_t)(n * kp));
    float *a = (float *)malloc(sizeof(float) * (size_t)n);
    if (!xq || !a) {
        free(xq);
        free(a);
        return -1;
    }
    quantize_rows(x, n, k, kp, qscale, zp, qmax, xq, a);
    const int64_t tiles = (out + PACK_ROWS - 1) / PACK_ROWS;
#if defined(I8_ROW_FAST)
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t t0 = tiles * id / nt, t1 = tiles * (id + 1) / nt;
        if (n == 1) {
            i8_row_tiles(wp, t0, t1, kp, xq, a[0], wsum, wscale, out, b, y, (double)qscale, zp);
        } else {
            for (int64_t t = t0; t < t1; t++) {  /* a tile read from memory once, from L1 for the other rows */
                int64_t r = 0;
                for (; r + 2 <= n; r += 2)
                    i8_row_pair_tiles(wp, t, t + 1, kp, xq + r * kp, a + r, wsum, wscale, out, b, y + r * out,
                                      (double)qscale, zp);
                if (r < n)
                    i8_row_tiles(wp, t, t + 1, kp, xq + r * kp, a[r], wsum, wscale, out, b, y + r * out,
                                 (double)qscale, zp);
            }
        }
    }
    free(xq);
    free(a);
    return 0;
#endif
    const int half = n == 1 ? PACK_ROWS : PACK_ROWS / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        for (int h = 0; h < PACK_ROWS; h += half) {
            const int64_t o = t * PACK_ROWS + h;
            if (o >= out) break;
            const int nw = out - o < half ? (int)(out - o) : half;
            for (int64_t r = 0; r < n; r += 4) {
                const int nx = n - r < 4 ? (int)(n - r) : 4;
                int32_t sums[4 * 8];
                i8_tile(wp + t * PACK_ROWS * kp + h * CHUNK, kp, xq + r * kp, sums, nw, nx);
                for (int j = 0; j < nx; j++)
                    for (int i = 0; i < nw; i++) {
                        const int64_t acc = (int64_t)sums[j * 8 + i] - (int64_t)zp * wsum[o + i];
                        const float v =
                            (float)((double)acc * ((double)qscale * (double)wscale[o + i])) * a[r + j];
                        y[(r + j) * out + o + i] = b ? v + b[o + i] : v;
                    }
            }
        }
    }
    free(xq);
    free(a);
    return 0;
}
