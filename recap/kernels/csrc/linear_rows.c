/* Few-row fp32 linear layers (decode steps): y[n, out] = x[n, in] W^T + b (int8 weights: linear_int8.c).
 *
 * At 1-8 rows a linear layer is bound by reading its weight once. A tile of weight rows is read from memory
 * once, multiplied with every input row while it sits in L1, and the next tile is prefetched meanwhile; tiles
 * are split across OpenMP threads (the runtime torch itself loaded: one thread pool for both).
 * Tile shapes: 4 weight rows x up to 4 input rows, so that the accumulators stay in
 * registers (each shape is its own function: gcc keeps a fixed-size accumulator array in registers only when
 * its size and loop bounds are constants).
 * Built by recap/kernels/native.py with -O3 -march=native -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

/* The tile shapes: 1..4 weight rows x 1..4 input rows. */
#define TILES(T)                                                                                               \
    T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(1, 2) T(2, 2) T(3, 2) T(4, 2) T(1, 3) T(2, 3) T(3, 3) T(4, 3) T(1, 4)   \
        T(2, 4) T(3, 4) T(4, 4)
TILES(F32_TILE)

#define F32_CASE(NW, NX) \
    case (NW) * 16 + (NX): f32_tile_##NW##_##NX(w, k, x, y, ldy, b, pf); break;

static void f32_tile(const float *w, int64_t k, const float *x, float *y, int64_t ldy, const float *b, int nw,
                     int nx, int64_t pf) {
    switch (nw * 16 + nx) {
        TILES(F32_CASE)
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
static void f32_panel(const float *wp, int64_t k, const float *x8, float *acc_out, int nr) {
    (void)nr;
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
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 ymm registers): an 8 x 32 tile of accumulators (32 registers) spills, and a group ran at about twice
 * one row's cost whatever its rows (docs/speculative.md). So a group's nr real rows (no padded rows) go over the
 * panel in passes of at most 3 rows: 4R accumulators + a broadcast stay in registers (the weight vectors are
 * FMA memory operands from L1). The first pass streams the panel from memory in order, the others find it in
 * L1/L2 (k x 128 bytes). Each output is one FMA chain over k in order, as in f32_panel_1, so on AVX2 a row's
 * result does not depend on the rows batched with it: a verify step's logits equal a decode step's, bit for
 * bit. Named accumulators: gcc keeps an array of vectors on the stack, storing it every k. */
#define PASS_ROW(r)                                                                                            \
    if (R > r) {                                                                                               \
        const __m256 xb = _mm256_broadcast_ss(x8 + kk * PANEL_ROWS + r);                                       \
        a##r##0 = _mm256_fmadd_ps(_mm256_loadu_ps(w), xb, a##r##0);                                            \
        a##r##1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), xb, a##r##1);                                        \
        a##r##2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16), xb, a##r##2);                                       \
        a##r##3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 24), xb, a##r##3);                                       \
    }
#define PASS_STORE(r)                                                                                          \
    if (R > r) {                                                                                               \
        _mm256_storeu_ps(acc_out + r * PANEL, a##r##0);                                                        \
        _mm256_storeu_ps(acc_out + r * PANEL + 8, a##r##1);                                                    \
        _mm256_storeu_ps(acc_out + r * PANEL + 16, a##r##2);                                                   \
        _mm256_storeu_ps(acc_out + r * PANEL + 24, a##r##3);                                                   \
    }
#define F32_PASS(NR)                                                                                           \
    static void f32_pass_##NR(const float *wp, int64_t k, const float *x8, float *acc_out) {                   \
        const int R = NR;                                                                                      \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,    \
               a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;                                          \
        for (int64_t kk = 0; kk < k; kk++) {                                                                   \
            const float *w = wp + kk * PANEL;                                                                  \
            _mm_prefetch((const char *)w + 1024, _MM_HINT_T0);                                                 \
            _mm_prefetch((const char *)w + 1088, _MM_HINT_T0);                                                 \
            PASS_ROW(0) PASS_ROW(1) PASS_ROW(2)                                                                \
        }                                                                                                      \
        PASS_STORE(0) PASS_STORE(1) PASS_STORE(2)                                                              \
    }
F32_PASS(1)
F32_PASS(2)
F32_PASS(3)

static void f32_panel(const float *wp, int64_t k, const float *x8, float *acc_out, int nr) {
    for (int r0 = 0; r0 < nr; r0 += 3) {
        const int R = nr - r0 < 3 ? nr - r0 : 3;
        const float *x = x8 + r0;
        float *o = acc_out + r0 * PANEL;
        if (R == 3) f32_pass_3(wp, k, x, o);
        else if (R == 2) f32_pass_2(wp, k, x, o);
        else f32_pass_1(wp, k, x, o);
    }
}
#else
/* Without AVX-512 or AVX2: the same outer product over the panel's contiguous 32 columns, which the compiler
 * vectorizes (a column-at-a-time dot product strode the panel and ran scalar: ~100x slower). */
static void f32_panel(const float *wp, int64_t k, const float *x8, float *acc_out, int nr) {
    (void)nr;
    float a[PANEL_ROWS][PANEL];
    for (int r = 0; r < PANEL_ROWS; r++)
        for (int c = 0; c < PANEL; c++) a[r][c] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * PANEL;
        for (int r = 0; r < PANEL_ROWS; r++) {
            const float xv = x8[kk * PANEL_ROWS + r];
#pragma omp simd
            for (int c = 0; c < PANEL; c++) a[r][c] += w[c] * xv;
        }
    }
    for (int r = 0; r < PANEL_ROWS; r++)
        for (int c = 0; c < PANEL; c++) acc_out[r * PANEL + c] = a[r][c];
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
#elif defined(__AVX2__) && defined(__FMA__)
/* One FMA chain per output over k in order, as f32_half_R: bound by reading the panel. */
static void f32_panel_1(const float *wp, int64_t k, const float *x, float *acc_out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * PANEL;
        const __m256 xb = _mm256_broadcast_ss(x + kk);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w), xb, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), xb, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16), xb, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 24), xb, a3);
    }
    _mm256_storeu_ps(acc_out, a0);
    _mm256_storeu_ps(acc_out + 8, a1);
    _mm256_storeu_ps(acc_out + 16, a2);
    _mm256_storeu_ps(acc_out + 24, a3);
}
#else
static void f32_panel_1(const float *wp, int64_t k, const float *x, float *acc_out) {
    float a[PANEL];
    for (int c = 0; c < PANEL; c++) a[c] = 0.0f;
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = wp + kk * PANEL, xv = x[kk];
#pragma omp simd
        for (int c = 0; c < PANEL; c++) a[c] += w[c] * xv;
    }
    for (int c = 0; c < PANEL; c++) acc_out[c] = a[c];
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
                    const int64_t first = (g0 + g) * PANEL_ROWS;
                    const int64_t nr = n - first < PANEL_ROWS ? n - first : PANEL_ROWS;
                    f32_panel(wp + p * k * PANEL, k, x8 + g * k * PANEL_ROWS, acc, (int)nr);
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
