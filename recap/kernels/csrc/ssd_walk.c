/* Mamba2 SSD prefill over packed rows as a recurrent walk (recap/kernels/ssd_walk.py; the torch op it stands in for:
 * kernels/ssd.py's ssd on a step that is not a decode batch). Per head h, every row's chunks are walked in order, a
 * window of at most MAX_WINDOW tokens at a time, each chunk end (a checkpoint position or the row end) a window end:
 *   h_t = exp(dA_t) h_{t-1} + Delta_t x_t B_t^T,  y_t = h_t C_t + D x_t     (h [P, N] per head, dA_t = Delta_t a)
 * Inside a window the tokens fall into pieces whose decay spans at most SPAN (log units); in a piece starting
 * after token s, with m_t = dA_{s+2} + .. + dA_t (0 at the piece's first token s + 1),
 *   h_t = exp(m_t) g_t,  g_t = g_{t-1} + (exp(-m_t) Delta_t x_t) B_t^T,  y_t = exp(m_t) (g_t C_t) + D x_t
 * with g = exp(dA_{s+1}) h_s at the piece start. So a token costs two multiply-adds per state element (the plain
 * recurrence costs three), and exp(-m_t) <= exp(SPAN) stays far from overflow while each product keeps its true
 * scale after exp(m_t) (the rounding is that of the plain recurrence). A head whose decay is steep only gets more
 * pieces (one token each at worst: the plain recurrence); a decay below exp(DECAY_FLOOR) is taken as 0.
 * The state sits in scratch as [N, P] (P the vector lanes), a register tile of KN x KP*16 of it walking all the
 * window's tokens at a time (AVX-512 where built for it and P, N fit the tile, plain C otherwise); slots hold
 * [P, N], so a row's initial state and each written state are transposed on the way (16 x 16 blocks; checkpoints
 * with streaming stores, as nothing reads them soon). The state of a chunk end with a destination slot goes to that
 * slot, each row's final state to its running slot; rows with state index -1 output zeros and touch no slot.
 * Heads run in parallel (OpenMP, torch's pool: the library links libgomp by its soname), every head through a block
 * of TIME_BLOCK tokens before the next. Built by recap/kernels/native.py.
 * Why a walk rather than the chunked form in C: its 4 P N flops per token and head (2 FMAs per state element) are
 * fewer than the chunked form's 4 P N + 2 Q P (states, readout, and the Q x Q intra-chunk product, Q = 64), and its
 * tile loop needs no GEMM blocking: it runs at ~80% of this Zen 4's one-thread FMA rate. Tiles measured (T = 512,
 * 48 heads): 8 x 2 and 4 x 4 alike, 8 x 1 5% slower, 16 x 1 50% slower; rescaling at every token without the
 * branch (for steep heads) 30% slower. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "fast_math.h"
#include "step_slots.h"

/* MAX_WINDOW, TIME_BLOCK, KN and KP can be set with -D (native.load_library's extra_flags) to measure other tilings */
#ifndef MAX_WINDOW
#define MAX_WINDOW 64
#endif
#define SPAN 40.0          /* largest decay one piece spans: exp(-m) <= exp(40) ~ 2.4e17 */
#define DECAY_FLOOR (-60.0) /* a decay below exp(-60) ~ 9e-27 is taken as 0 (no subnormal arithmetic) */
#ifndef TIME_BLOCK
#define TIME_BLOCK 256 /* tokens every head walks before the next block */
#endif
#ifndef KN
#define KN 8 /* state rows (n) of a register tile */
#endif
#ifndef KP
#define KP 2 /* 16-lane vectors (p) of a register tile */
#endif

typedef struct {
    const float *x, *delta, *A, *B, *C, *D;
    int64_t x_stride, b_stride, c_stride; /* elements between tokens; heads / groups contiguous inside a token */
    int64_t nh, p, g, n;
    int d_per_channel; /* D [H, P] rather than [H] */
    float *out;        /* [T, H, P] */
} Inputs;

typedef struct { /* one thread's scratch */
    float *st;       /* [N, P] the head's state (in the current piece's coordinates inside a window) */
    float *xw;       /* [MAX_WINDOW, P] exp(-m_t) Delta_t x_t */
    float *yacc;     /* [MAX_WINDOW, P] g_t C_t */
    float *scale;    /* [MAX_WINDOW] exp(m_t) */
    float *rescale;  /* [MAX_WINDOW] the factor taking g to the next piece before token t (where cut[t]) */
    uint8_t *cut;    /* [MAX_WINDOW] token t starts a piece */
} Scratch;

static float decay(double x) { /* exp(x) for x <= 0, 0 below DECAY_FLOOR */
    return x < DECAY_FLOOR ? 0.0f : exp_neg((float)x);
}

/* The window's per-token factors and weighted inputs: pieces, exp(m_t), exp(-m_t) Delta_t x_t. */
static void prepare(const Inputs *in, int64_t h, int64_t t0, int64_t len, Scratch *w) {
    const float a = in->A[h];
    const int64_t p = in->p;
    double m = 0.0;
    for (int64_t j = 0; j < len; j++) {
        const float dt = in->delta[(t0 + j) * in->nh + h];
        const float da = dt * a; /* in fp32 as the torch op; summed in fp64 */
        if (j == 0 || m + da < -SPAN) {
            w->cut[j] = 1;
            w->rescale[j] = decay(m + da); /* j == 0: m is 0, the state is the true one */
            m = 0.0;
        } else {
            w->cut[j] = 0;
            m += da;
        }
        const float s = exp_neg((float)m);
        const float wt = dt / s;
        w->scale[j] = s;
        const float *x = in->x + (t0 + j) * in->x_stride + h * p;
        float *xw = w->xw + j * p;
#pragma omp simd
        for (int64_t c = 0; c < p; c++) xw[c] = wt * x[c];
    }
}

/* g walks the window's tokens (yacc[t] = g_t C_t); plain C, any P and N. */
static void walk_plain(int64_t len, const float *b, int64_t bs, const float *c, int64_t cs, int64_t p, int64_t n,
                       Scratch *w) {
    float *st = w->st;
    for (int64_t j = 0; j < len; j++) {
        if (w->cut[j]) {
            const float r = w->rescale[j];
#pragma omp simd
            for (int64_t i = 0; i < n * p; i++) st[i] *= r;
        }
        const float *bj = b + j * bs, *cj = c + j * cs, *xw = w->xw + j * p;
        float *y = w->yacc + j * p;
        for (int64_t k = 0; k < n; k++) {
            float *sk = st + k * p;
            const float bk = bj[k], ck = cj[k];
#pragma omp simd
            for (int64_t i = 0; i < p; i++) {
                sk[i] += bk * xw[i];
                y[i] += ck * sk[i];
            }
        }
    }
}

#ifdef __AVX512F__
/* walk_plain with the state in KN x KP register tiles (p0 outer: a tile column's xw and yacc stay in L1 while its
 * tiles pass over them). P a multiple of 16 KP, N of KN. */
static void walk_tiles(int64_t len, const float *b, int64_t bs, const float *c, int64_t cs, int64_t p, int64_t n,
                       Scratch *w) {
    for (int64_t p0 = 0; p0 < p; p0 += 16 * KP)
        for (int64_t n0 = 0; n0 < n; n0 += KN) {
            __m512 s[KN][KP];
#pragma GCC unroll 8
            for (int k = 0; k < KN; k++)
#pragma GCC unroll 4
                for (int v = 0; v < KP; v++) s[k][v] = _mm512_loadu_ps(w->st + (n0 + k) * p + p0 + 16 * v);
            for (int64_t j = 0; j < len; j++) {
                if (w->cut[j]) {
                    const __m512 r = _mm512_set1_ps(w->rescale[j]);
#pragma GCC unroll 8
                    for (int k = 0; k < KN; k++)
#pragma GCC unroll 4
                        for (int v = 0; v < KP; v++) s[k][v] = _mm512_mul_ps(s[k][v], r);
                }
                const float *bj = b + j * bs + n0, *cj = c + j * cs + n0;
                float *y = w->yacc + j * p + p0;
                __m512 xv[KP], yv[KP];
#pragma GCC unroll 4
                for (int v = 0; v < KP; v++) {
                    xv[v] = _mm512_loadu_ps(w->xw + j * p + p0 + 16 * v);
                    yv[v] = _mm512_loadu_ps(y + 16 * v);
                }
#pragma GCC unroll 8
                for (int k = 0; k < KN; k++) {
                    const __m512 bk = _mm512_set1_ps(bj[k]), ck = _mm512_set1_ps(cj[k]);
#pragma GCC unroll 4
                    for (int v = 0; v < KP; v++) {
                        s[k][v] = _mm512_fmadd_ps(bk, xv[v], s[k][v]);
                        yv[v] = _mm512_fmadd_ps(ck, s[k][v], yv[v]);
                    }
                }
#pragma GCC unroll 4
                for (int v = 0; v < KP; v++) _mm512_storeu_ps(y + 16 * v, yv[v]);
            }
#pragma GCC unroll 8
            for (int k = 0; k < KN; k++)
#pragma GCC unroll 4
                for (int v = 0; v < KP; v++) _mm512_storeu_ps(w->st + (n0 + k) * p + p0 + 16 * v, s[k][v]);
        }
}
#endif

/* One window [t0, t0 + len) of head h: the state w->st (true on entry and on return) walks it; y into in->out. */
static void window(const Inputs *in, int64_t h, int64_t t0, int64_t len, Scratch *w) {
    const int64_t p = in->p, n = in->n, grp = h / (in->nh / in->g);
    prepare(in, h, t0, len, w);
    memset(w->yacc, 0, sizeof(float) * (size_t)(len * p));
    const float *b = in->B + t0 * in->b_stride + grp * n, *c = in->C + t0 * in->c_stride + grp * n;
#ifdef __AVX512F__
    if (p % (16 * KP) == 0 && n % KN == 0)
        walk_tiles(len, b, in->b_stride, c, in->c_stride, p, n, w);
    else
#endif
        walk_plain(len, b, in->b_stride, c, in->c_stride, p, n, w);
    const float last = w->scale[len - 1]; /* back to the true state */
#pragma omp simd
    for (int64_t i = 0; i < n * p; i++) w->st[i] *= last;
    for (int64_t j = 0; j < len; j++) {
        const float s = w->scale[j];
        const float *x = in->x + (t0 + j) * in->x_stride + h * p, *y = w->yacc + j * p;
        float *o = in->out + ((t0 + j) * in->nh + h) * p;
        if (in->D) {
            const float *d = in->D + (in->d_per_channel ? h * p : h);
            const int64_t ds = in->d_per_channel;
#pragma omp simd
            for (int64_t i = 0; i < p; i++) o[i] = s * y[i] + d[i * ds] * x[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < p; i++) o[i] = s * y[i];
        }
    }
}

#ifdef __AVX512F__
/* dst[j, i] = src[i, j] for a 16 x 16 block (row strides ds, ss): 32-bit, then 64-bit interleaves of row pairs,
 * then 128-bit lane shuffles. */
static void transpose16(float *dst, int64_t ds, const float *src, int64_t ss, int stream) {
    __m512 r[16], t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ss);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) { /* lane-wise (a0 b0 a1 b1), (a2 b2 a3 b3) */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* r[4i + k] lane L: column 4L + k of rows 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) { /* column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        const __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
        const __m512 o[4] = {_mm512_shuffle_f32x4(u0, u2, 0x88), _mm512_shuffle_f32x4(u0, u2, 0xDD),
                             _mm512_shuffle_f32x4(u1, u3, 0x88), _mm512_shuffle_f32x4(u1, u3, 0xDD)};
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            if (stream)
                _mm512_stream_ps(dst + (4 * q + k) * ds, o[q]);
            else
                _mm512_storeu_ps(dst + (4 * q + k) * ds, o[q]);
        }
    }
}
#endif

/* dst [cols, rows] = src [rows, cols]^T: the state between scratch [N, P] and a slot's head [P, N] (a checkpoint
 * written every block makes this a cost worth the 16 x 16 blocks). */
static void transpose(float *dst, const float *src, int64_t rows, int64_t cols, int stream) {
    (void)stream; /* the plain build stores as usual */
#ifdef __AVX512F__
    if (rows % 16 == 0 && cols % 16 == 0) {
        stream = stream && (uintptr_t)dst % 64 == 0;
        for (int64_t i = 0; i < rows; i += 16)
            for (int64_t j = 0; j < cols; j += 16)
                transpose16(dst + j * rows + i, rows, src + i * cols + j, cols, stream);
        return;
    }
#endif
    for (int64_t i0 = 0; i0 < rows; i0 += 8) /* 8 x 8 blocks: short strides on both sides */
        for (int64_t j0 = 0; j0 < cols; j0 += 8)
            for (int64_t i = i0; i < rows && i < i0 + 8; i++)
                for (int64_t j = j0; j < cols && j < j0 + 8; j++) dst[j * rows + i] = src[i * cols + j];
}

static int scratch_init(Scratch *w, int64_t p) {
    const size_t floats = (size_t)(2 * MAX_WINDOW * p + 2 * MAX_WINDOW + 64);
    float *base = aligned_alloc(64, (floats * sizeof(float) + MAX_WINDOW + 63) / 64 * 64);
    if (!base) return -1;
    w->xw = base;
    w->yacc = w->xw + MAX_WINDOW * p;
    w->scale = w->yacc + MAX_WINDOW * p;
    w->rescale = w->scale + MAX_WINDOW;
    w->cut = (uint8_t *)(w->rescale + MAX_WINDOW + 64);
    return 0;
}

/* Tokens [a, b) of chunk c for head h: its row's initial state where a is the row's start, the chunk end's states
 * where b is the chunk's end; a padding row's tokens get zeros and no slot is touched. */
static void chunk_part(const Inputs *in, int64_t c, int64_t a, int64_t b, int64_t h, Scratch *w, const int64_t *cu,
                       const int64_t *chunk_row, const int64_t *dest, const int64_t *slots, const uint8_t *has_init,
                       const int64_t *last_chunk, float *state) {
    const int64_t nh = in->nh, p = in->p, n = in->n, hsize = p * n;
    const int64_t row = chunk_row[c], slot = slots[row];
    if (slot < 0) {
        for (int64_t t = a; t < b; t++) memset(in->out + (t * nh + h) * p, 0, sizeof(float) * (size_t)p);
        return;
    }
    if (a == cu[c] && (c == 0 || chunk_row[c - 1] != row)) { /* the row's first token: its initial state */
        if (has_init[row])
            transpose(w->st, state + (slot * nh + h) * hsize, p, n, 0);
        else
            memset(w->st, 0, sizeof(float) * (size_t)hsize);
    }
    for (int64_t t = a; t < b; t += MAX_WINDOW) window(in, h, t, b - t < MAX_WINDOW ? b - t : MAX_WINDOW, w);
    if (b < cu[c + 1]) return;
    if (dest[c] >= 0) transpose(state + (dest[c] * nh + h) * hsize, w->st, n, p, 1);
    if (c == last_chunk[row]) transpose(state + (slot * nh + h) * hsize, w->st, n, p, 0);
}

/* The step's chunks: cu [C+1] token offsets, chunk_row [C], dest [C] (checkpoint slot or -1), end_pos [C]; rows:
 * slots [B] (running slot or -1), has_init [B] (bool bytes), last_chunk [B]. x [T, H, P] (row stride x_stride),
 * delta [T, H] (Delta: dt after bias, softplus and limit), A [H], B and C [T, G, N] (row strides b_stride,
 * c_stride), D [H] or [H, P] (d_per_channel) or NULL, fp32; state [num_slots, H, P, N]; slot_positions
 * [num_slots] or NULL; out [T, H, P].
 * Returns (nothing written) -1 for a slot outside [0, num_slots), -3 for H not a multiple of G, -4 when out of
 * memory (state and out may be partly written then), -5 for a decay that grows (Delta A > 0 on some token of a
 * row that is not padding: the caller runs the torch op). */
int recap_ssd_prefill(int64_t num_chunks, const int64_t *cu, const int64_t *chunk_row, const int64_t *dest,
                      const int64_t *end_pos, int64_t num_rows, const int64_t *slots, const uint8_t *has_init,
                      const int64_t *last_chunk, const float *x, int64_t x_stride, const float *delta, const float *A,
                      const float *B, int64_t b_stride, const float *C, int64_t c_stride, const float *D,
                      int d_per_channel, int64_t nh, int64_t p, int64_t g, int64_t n, float *state, int64_t num_slots,
                      int64_t *slot_positions, float *out, int threads) {
    if (g <= 0 || nh % g) return -3;
    if (check_step_slots(num_chunks, dest, num_rows, slots, num_slots)) return -1;
    for (int64_t c = 0; c < num_chunks; c++) {
        if (slots[chunk_row[c]] < 0) continue;
        for (int64_t t = cu[c]; t < cu[c + 1]; t++)
            for (int64_t h = 0; h < nh; h++)
                if (!(delta[t * nh + h] * A[h] <= 0.0f)) return -5; /* NaN too: the torch op says what it makes */
    }
    const Inputs in = {x, delta, A, B, C, D, x_stride, b_stride, c_stride, nh, p, g, n, d_per_channel, out};
    const int64_t hsize = p * n, total = cu[num_chunks];
    float *states = aligned_alloc(64, sizeof(float) * (size_t)(nh * hsize)); /* each head's state, [N, P] */
    if (!states) return -4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Scratch w;
        const int ok = scratch_init(&w, p) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* token blocks in packed order, every head through one before the next: the block's B, C (shared by the
         * heads of a group) stay in L2 and its x and out rows in the TLB (at T = 2048, one pass per head over
         * all tokens ran ~15-30% slower per token than at T = 512) */
        for (int64_t t0 = 0, c0 = 0; t0 < total; t0 += TIME_BLOCK) {
            const int64_t t1 = t0 + TIME_BLOCK < total ? t0 + TIME_BLOCK : total;
            while (cu[c0 + 1] <= t0) c0++; /* the first chunk with tokens in the block */
#pragma omp for schedule(static)
            for (int64_t h = 0; h < nh; h++) {
                if (!ok) continue;
                w.st = states + h * hsize;
                for (int64_t c = c0; c < num_chunks && cu[c] < t1; c++)
                    chunk_part(&in, c, t0 > cu[c] ? t0 : cu[c], t1 < cu[c + 1] ? t1 : cu[c + 1], h, &w, cu, chunk_row,
                               dest, slots, has_init, last_chunk, state);
            }
        }
        if (ok) free(w.xw);
#ifdef __AVX512F__
        _mm_sfence(); /* the checkpoints' streaming stores, before the step's end makes them readable */
#endif
    }
    free(states);
    if (failed) return -4;
    if (slot_positions)
        record_step_positions(slot_positions, num_chunks, chunk_row, dest, end_pos, num_rows, slots, last_chunk);
    return 0;
}
