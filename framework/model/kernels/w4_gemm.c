/* W4A8 GEMMs: 4-bit weights in blocks of 32 inputs, int8 activations in blocks of 32
 * (model.quantization = "w4a8", framework/model/w4a8.py).
 *
 * A weight column c's block b (inputs 32 b .. 32 b + 31) is d[c, b] q + m[c, b] with q in 0..15
 * (the GGUF's Q4_1 blocks: the embedded model's weights are exactly these), and an activation row
 * r's block b is xd[r, b] x with x in -127..127. Their product over the block is
 *     xd[r, b] d[c, b] S + m[c, b] xs[r, b],   S = sum q x (exact int),  xs[r, b] = xd[r, b] sum x,
 * and a GEMM sums that over the blocks in fp32, block after block. The point of the 4-bit q: a
 * `vpmaddubsw` pair sum q1 x1 + q2 x2 is at most 2 * 15 * 127 = 3,810, so the 16 pair sums of a
 * block's 32 inputs add up in 16 bits (at most 30,480: exact), and the instructions a block takes
 * are one `vpmaddubsw` and one 16-bit add per 4 inputs of 8 columns, where the int8 GEMM of w8a8
 * on AVX2 (int8_ops.c) takes `vpsignb`, `vpmaddubsw`, `vpmaddwd` and a 32-bit add; the widening
 * to 32 bits, the conversion and the two multiply-adds come once a block.
 *
 * The weight's packed copy (w4a8.py packs it): units of 16 columns, each [k / 4][16][4] q bytes (4
 * consecutive inputs of a column in one 32-bit lane, as vpmaddubsw pairs them) and [k / 32][2][16]
 * fp32 (d of the unit's 16 columns, then their m) a block. A gate-up weight's units alternate: a
 * gate unit, then the up unit of the same 16 columns.
 *
 * Ends: out = y [+ add] in fp32 or bf16 (rounded once, as the other GEMM ends); gate-up: h =
 * silu(gate) * up in fp32 (silu_times, common.h, as int8_ops.c's ends), a block of rows at a time,
 * whose rows are then quantized in blocks of 32 for the down projection (w4_quantize's rule).
 * Built only with AVX2 and FMA (w4_gemm_built() says so); w4a8.py runs the same arithmetic in
 * PyTorch elsewhere. The threads (run_spans in common.h) take runs of units as they come free
 * (run_w4_units). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define W4_BLOCK 32 /* inputs a block: one d, m a column, one scale a row */

/* Quantize n values (a multiple of 32) of one row in blocks of 32: q = round(v / s) to nearest
 * even with s = max|v| / 127 of the block (a block of zeros: s 0, q 0), scale[b] = s, sum[b] =
 * s * (sum of the block's q), as w4a8.quantize_blocks. */
static void quantize_blocks_row(const float *v, int64_t n, int8_t *q, float *scale, float *sum) {
    for (int64_t b = 0; b < n / W4_BLOCK; b++) {
        const float *x = v + b * W4_BLOCK;
        const float amax = max_abs_f32(x, W4_BLOCK);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t total = 0;
        int i = 0;
#ifdef __AVX2__
        __m256i ints[4];
        quantize32_i8(x, _mm256_set1_ps(inv), q + b * W4_BLOCK, ints);
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
        total = _mm_cvtsi128_si32(h);
        i = W4_BLOCK;
#endif
        for (; i < W4_BLOCK; i++) {
            float r = nearbyintf(x[i] * inv); /* (the default rounding: to nearest even) */
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[b * W4_BLOCK + i] = (int8_t)r;
            total += (int32_t)r;
        }
        scale[b] = amax / 127.0f;
        sum[b] = (float)total * scale[b];
    }
}

/* An RMSNorm that rows are put through before they are quantized (w4_rms_norm_quantize): fp32 rows,
 * with a residual ([rows, k] contiguous, or NULL) first x + residual, written to residual_out; the
 * weight w [k]. */
typedef struct {
    const float *residual, *w;
    float *residual_out;
    float eps;
} NormRows;

typedef struct {
    const void *x; /* quantize: fp32 or bf16 rows [rows, k], row stride x_stride */
    int bf16;
    const NormRows *norm; /* or NULL */
    int64_t x_stride, rows, k;
    int8_t *q;
    float *scale, *sum; /* [rows, k / 32] each */
    int64_t begin, end;
    int failed;
} QuantizeSpan;

static void *quantize_span(void *arg) {
    QuantizeSpan *s = (QuantizeSpan *)arg;
    const NormRows *norm = s->norm;
    float *row = s->bf16 || norm ? malloc((size_t)s->k * sizeof(float)) : NULL;
    if ((s->bf16 || norm) && row == NULL) {
        s->failed = 1;
        return NULL;
    }
    const int64_t k = s->k, nb = k / W4_BLOCK;
    for (int64_t r = s->begin; r < s->end; r++) {
        const float *v;
        if (norm) { /* (fp32 rows) */
            rms_norm_row_f32((const float *)s->x + r * s->x_stride, norm->residual ? norm->residual + r * k : NULL,
                             norm->residual ? norm->residual_out + r * k : NULL, norm->w, k, norm->eps, row);
            v = row;
        } else if (s->bf16) {
            const uint16_t *x = (const uint16_t *)s->x + r * s->x_stride;
            for (int64_t i = 0; i < k; i++) row[i] = bf16_to_f32(x[i]);
            v = row;
        } else {
            v = (const float *)s->x + r * s->x_stride;
        }
        quantize_blocks_row(v, k, s->q + r * k, s->scale + r * nb, s->sum + r * nb);
    }
    free(row);
    return NULL;
}

/* Rows [rows, k] (fp32, or bf16: bf16 = 1; put through `norm` first where there is one) as int8
 * blocks, the rows split over the threads. Returns 0, -1 (no memory) or -2 (k). */
static int quantize_rows_blocks(const void *x, int bf16, int64_t x_stride, int64_t rows, int64_t k,
                                const NormRows *norm, int8_t *q, float *scale, float *sum, int num_threads) {
    if (k < W4_BLOCK || k % W4_BLOCK) return -2;
    QuantizeSpan spans[MAX_THREADS];
    const int threads = span_threads(num_threads, rows / 16);
    for (int s = 0; s < threads; s++)
        spans[s] = (QuantizeSpan){.x = x, .bf16 = bf16, .norm = norm, .x_stride = x_stride, .rows = rows, .k = k,
                                  .q = q, .scale = scale, .sum = sum, .begin = rows * s / threads,
                                  .end = rows * (s + 1) / threads};
    run_spans(quantize_span, spans, sizeof spans[0], threads);
    for (int s = 0; s < threads; s++)
        if (spans[s].failed) return -1;
    return 0;
}

/* A float32 model's RMSNorm and w4_quantize of its rows in one pass: fp32 rows x [rows, d] (row
 * stride x_stride, d a multiple of 32), with a residual ([rows, d] contiguous, or NULL) first x +
 * residual, written to residual_out; each row normed with weight w [d] (rms_norm_row_f32, the
 * values of fused_ops.c's rms_norm_f32) into a row buffer and quantized from it into q [rows, d],
 * scale and sum [rows, d / 32]: the bits of the two calls, without the normed rows' pass through
 * memory and a second fork of the threads. Returns 0, -1 (no memory) or -2 (d). */
int w4_rms_norm_quantize(const float *x, int64_t x_stride, const float *residual, float *residual_out, const float *w,
                         float eps, int64_t rows, int64_t d, int8_t *q, float *scale, float *sum, int num_threads) {
    const NormRows norm = {.residual = residual, .w = w, .residual_out = residual_out, .eps = eps};
    return quantize_rows_blocks(x, 0, x_stride, rows, d, &norm, q, scale, sum, num_threads);
}

/* fp32 (bf16 = 0) or bf16 rows [rows, k] (row stride x_stride, k a multiple of 32) as int8
 * blocks: q [rows, k], scale and sum [rows, k / 32]. Returns 0, -1 (no memory) or -2 (k). */
int w4_quantize(const void *x, int bf16, int64_t x_stride, int64_t rows, int64_t k, int8_t *q, float *scale,
                float *sum, int num_threads) {
    return quantize_rows_blocks(x, bf16, x_stride, rows, k, NULL, q, scale, sum, num_threads);
}

#if defined(__AVX2__) && defined(__FMA__)
#define W4_ROWS 4 /* rows of x a micro-tile */
#define W4_PANEL_BYTES (384 << 10) /* of x at a time (an AMD Zen 3's L2 is 512 KiB) */
#define W4_GATE_UP_BLOCK 256         /* rows of a gate-up GEMM at a time (its h stays in the caches) */

int w4_gemm_built(void) { return 1; }

typedef struct {
    const int8_t *x;
    const float *xd, *xs; /* [rows, k / 32] */
    const uint8_t *q;     /* the packed weight */
    const float *dm;
    int64_t rows, k, n; /* n: the weight's columns (gate-up: 2 d) */
    int gate_up;
    const void *add; /* optional [rows, n] in the output's dtype, row stride add_stride */
    int64_t add_stride;
    void *out; /* [rows, n] fp32 or bf16 (out_bf16), row stride out_stride; gate-up: h fp32 [rows, n / 2] */
    int out_bf16;
    int64_t out_stride;
} W4Gemm;

typedef struct {
    const W4Gemm *g;
    const UnitRuns *runs; /* (units: gate-up's pairs of units) */
} W4Share;

/* One block (32 inputs) of 4 rows of x (row stride k, from the block's first input) by a unit's 16
 * columns (its 8 steps of 64 q bytes from `w`): the 16-bit sums s[r][h] (columns 8 h .. 8 h + 7, two
 * lanes a column). Written out in asm: from the same intrinsics GCC kept the 8 sums in other
 * registers than it added into, copying each one back every step, and one of them on the stack
 * (36 instructions a step for these 22). On the 2-core AMD EPYC Zen 3, 30 layers' GEMMs alternated
 * in one process, medians: 8,192 rows 216 -> 282 GOP/s, 200 rows 264 -> 318, 32 rows 232 -> 273;
 * one tile in L1 21.4-22.7 -> 18.9-20.4 ns a block (the block alone 14.9: the rest is the block's
 * end in fp32 below). The "memory" clobber stands for the 512 q bytes and 4 x 32 x bytes it reads
 * (listed as inputs instead, the GEMMs ran no faster); "x" keeps its registers within xmm0-15,
 * which the VEX encodings reach on AVX-512 CPUs too. */
#define W4_ROW_PRODUCTS(P, R)                                                                       \
    "vpbroadcastd " #P "*4(%[x" #R "]), %[b]\n\t"                                                   \
    "vpmaddubsw %[b], %[w0], %[t0]\n\t"                                                              \
    "vpmaddubsw %[b], %[w1], %[t1]\n\t"                                                              \
    "vpaddw %[t0], %[s" #R "0], %[s" #R "0]\n\t"                                                     \
    "vpaddw %[t1], %[s" #R "1], %[s" #R "1]\n\t"
#define W4_STEP(P)                                                                                  \
    "vmovdqu " #P "*64(%[w]), %[w0]\n\t"                                                            \
    "vmovdqu " #P "*64+32(%[w]), %[w1]\n\t"                                                         \
    W4_ROW_PRODUCTS(P, 0) W4_ROW_PRODUCTS(P, 1) W4_ROW_PRODUCTS(P, 2) W4_ROW_PRODUCTS(P, 3)
static inline __attribute__((always_inline)) void w4_block4(const uint8_t *w, const int8_t *x, int64_t k,
                                                            __m256i s[W4_ROWS][2]) {
    __m256i s00, s01, s10, s11, s20, s21, s30, s31, w0, w1, b, t0, t1;
    __asm__("vpxor %[s00], %[s00], %[s00]\n\t"
            "vpxor %[s01], %[s01], %[s01]\n\t"
            "vpxor %[s10], %[s10], %[s10]\n\t"
            "vpxor %[s11], %[s11], %[s11]\n\t"
            "vpxor %[s20], %[s20], %[s20]\n\t"
            "vpxor %[s21], %[s21], %[s21]\n\t"
            "vpxor %[s30], %[s30], %[s30]\n\t"
            "vpxor %[s31], %[s31], %[s31]\n\t"
            W4_STEP(0) W4_STEP(1) W4_STEP(2) W4_STEP(3) W4_STEP(4) W4_STEP(5) W4_STEP(6) W4_STEP(7)
            : [s00] "=&x"(s00), [s01] "=&x"(s01), [s10] "=&x"(s10), [s11] "=&x"(s11), [s20] "=&x"(s20),
              [s21] "=&x"(s21), [s30] "=&x"(s30), [s31] "=&x"(s31), [w0] "=&x"(w0), [w1] "=&x"(w1), [b] "=&x"(b),
              [t0] "=&x"(t0), [t1] "=&x"(t1)
            : [w] "r"(w), [x0] "r"(x), [x1] "r"(x + k), [x2] "r"(x + 2 * k), [x3] "r"(x + 3 * k)
            : "memory");
    s[0][0] = s00, s[0][1] = s01, s[1][0] = s10, s[1][1] = s11;
    s[2][0] = s20, s[2][1] = s21, s[3][0] = s30, s[3][1] = s31;
}

/* y[r][16] for rows m0..m0+R of x by the unit at (q, dm): block by block, the 16-bit sums of a
 * block in registers (w4_block4 for 4 rows), then its two multiply-adds into the fp32 sums in y
 * (in L1: with them in registers too, 3 rows a tile, the GEMMs ran no faster). */
static inline __attribute__((always_inline)) void w4_tile(const W4Gemm *g, int64_t m0, const int R,
                                                          const uint8_t *q, const float *dm, float y[][16]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t k = g->k, nb = k / W4_BLOCK;
    const int8_t *x = g->x + m0 * k;
    const float *xd = g->xd + m0 * nb, *xs = g->xs + m0 * nb;
    for (int r = 0; r < R; r++) memset(y[r], 0, 16 * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[W4_ROWS][2];
        if (R == W4_ROWS) {
            w4_block4(q + b * (W4_BLOCK / 4) * 64, x + b * W4_BLOCK, k, s);
        } else { /* (the last rows of a panel) */
            for (int r = 0; r < R; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 1") for (int p = 0; p < W4_BLOCK / 4; p++) {
                const uint8_t *w = q + (b * (W4_BLOCK / 4) + p) * 64;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, x + r * k + b * W4_BLOCK + 4 * p, 4);
                    const __m256i xb = _mm256_set1_epi32(four);
                    s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, xb));
                    s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, xb));
                }
            }
        }
        const float *db = dm + b * 32;
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_loadu_ps(db + 8 * h), mn = _mm256_loadu_ps(db + 16 + 8 * h);
            for (int r = 0; r < R; r++) {
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][h], ones));
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + b]));
                const __m256 part = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r * nb + b]), _mm256_loadu_ps(y[r] + 8 * h));
                _mm256_storeu_ps(y[r] + 8 * h, _mm256_fmadd_ps(sum, scale, part));
            }
        }
    }
}

/* The end of a tile: y [+ add] stored at column c0 of rows m0..m0+R. */
static inline void w4_store(const W4Gemm *g, int64_t m0, int R, int64_t c0, float y[][16]) {
    for (int r = 0; r < R; r++) {
        const int64_t m = m0 + r;
        for (int h = 0; h < 16; h += 8) {
            __m256 v = _mm256_loadu_ps(y[r] + h);
            const int64_t at = m * g->add_stride + c0 + h, to = m * g->out_stride + c0 + h;
            if (g->out_bf16) {
                if (g->add) v = _mm256_add_ps(v, load8_bf16((const uint16_t *)g->add + at));
                _mm_storeu_si128((__m128i *)((uint16_t *)g->out + to), to_bf16x8(v));
            } else {
                if (g->add) v = _mm256_add_ps(v, _mm256_loadu_ps((const float *)g->add + at));
                _mm256_storeu_ps((float *)g->out + to, v);
            }
        }
    }
}

/* Rows m0..m0+R of one unit (or, gate-up, one pair of units) and their end. */
static inline __attribute__((always_inline)) void w4_rows(const W4Gemm *g, int64_t unit, int64_t m0, const int R) {
    const int64_t k = g->k, unit_q = 16 * k, unit_dm = (k / W4_BLOCK) * 32;
    float y[W4_ROWS][16], u[W4_ROWS][16];
    if (!g->gate_up) {
        w4_tile(g, m0, R, g->q + unit * unit_q, g->dm + unit * unit_dm, y);
        w4_store(g, m0, R, 16 * unit, y);
        return;
    }
    w4_tile(g, m0, R, g->q + 2 * unit * unit_q, g->dm + 2 * unit * unit_dm, y);
    w4_tile(g, m0, R, g->q + (2 * unit + 1) * unit_q, g->dm + (2 * unit + 1) * unit_dm, u);
    const int64_t d = g->n / 2;
    for (int r = 0; r < R; r++) {
        float *h = (float *)g->out + (m0 + r) * d + 16 * unit;
        for (int i = 0; i < 16; i++) h[i] = silu_times(y[r][i], u[r][i]);
    }
}

/* Units (gate-up: pairs of units) x panels of rows, in runs of units taken by whichever thread is
 * free (take_units in common.h), panel by panel. With a fixed span of units for each thread
 * instead, the core that ran faster (the two vCPUs of a shared host do not keep one pace) waited
 * for the other at every GEMM's end: 30 layers' GEMMs on a 2-core AMD EPYC Zen 3, alternated in
 * one process, median GOP/s over three runs: 200 rows 205 -> 218, 210 -> 231, 174 -> 192; 2,048
 * rows 208 -> 229; 8,192 rows 173 -> 224, 170 -> 192. (One unit at a time did about as well at
 * 8,192 rows, less at 200.) */
static void *run_w4_units(void *arg) {
    const W4Share *s = (const W4Share *)arg;
    const W4Gemm *g = s->g;
    for (int64_t first, last, u0, u1; take_units(s->runs, &first, &last, &u0, &u1);) {
        for (int64_t unit = u0; unit < u1; unit++) {
            int64_t m = first;
            for (; m + W4_ROWS <= last; m += W4_ROWS) w4_rows(g, unit, m, W4_ROWS);
            switch (last - m) {
            case 3: w4_rows(g, unit, m, 3); break;
            case 2: w4_rows(g, unit, m, 2); break;
            case 1: w4_rows(g, unit, m, 1); break;
            }
        }
    }
    return NULL;
}

static int run_w4(const W4Gemm *g, int num_threads) {
    if (g->rows < 1) return 0;
    const int64_t units = g->gate_up ? g->n / 32 : g->n / 16;
    const int threads = span_threads(num_threads, units);
    int64_t next = 0;
    const UnitRuns runs = unit_runs(g->rows, W4_PANEL_BYTES / g->k, units, threads, W4_ROWS, &next);
    W4Share shares[MAX_THREADS];
    for (int s = 0; s < threads; s++) shares[s] = (W4Share){.g = g, .runs = &runs};
    run_spans(run_w4_units, shares, sizeof shares[0], threads);
    return 0;
}

/* x @ W^T [+ add]: x the int8 blocks of w4_quantize (q [rows, k] contiguous, xd and xs), the
 * weight packed as above (n columns, a multiple of 16; k a multiple of 32), `add` and `out` fp32
 * (out_bf16 = 0) or bf16 with unit stride along their rows. Returns 0 or -2 (a shape not taken). */
int w4_gemm(const int8_t *x, const float *xd, const float *xs, const uint8_t *q, const float *dm, int64_t rows,
            int64_t k, int64_t n, const void *add, int64_t add_stride, void *out, int64_t out_stride, int out_bf16,
            int num_threads) {
    if (n < 16 || n % 16 || k < W4_BLOCK || k % W4_BLOCK) return -2;
    W4Gemm g = {.x = x, .xd = xd, .xs = xs, .q = q, .dm = dm, .rows = rows, .k = k, .n = n, .add = add,
                .add_stride = add_stride, .out = out, .out_bf16 = out_bf16, .out_stride = out_stride};
    return run_w4(&g, num_threads);
}

/* The rows a gate-up GEMM takes at a time (the rows its scratch h needs). */
int64_t w4_gate_up_block(void) { return W4_GATE_UP_BLOCK; }

/* The int8 blocks of silu(gate) * up: x as w4_gemm's, the [gate | up] weight packed with
 * alternating units (2 d columns, d a multiple of 32); `h` fp32 scratch [min(rows,
 * w4_gate_up_block()), d]; the result into q [rows, d], scale and sum [rows, d / 32]. Returns 0,
 * -1 (no memory) or -2 (a shape not taken). */
int w4_gemm_gate_up(const int8_t *x, const float *xd, const float *xs, const uint8_t *q, const float *dm, int64_t rows,
                    int64_t k, int64_t d, float *h, int8_t *out_q, float *out_scale, float *out_sum,
                    int num_threads) {
    if (d < W4_BLOCK || d % W4_BLOCK || k < W4_BLOCK || k % W4_BLOCK) return -2;
    const int64_t nb = k / W4_BLOCK, out_nb = d / W4_BLOCK;
    for (int64_t r0 = 0; r0 < rows; r0 += W4_GATE_UP_BLOCK) {
        const int64_t count = rows - r0 < W4_GATE_UP_BLOCK ? rows - r0 : W4_GATE_UP_BLOCK;
        W4Gemm g = {.x = x + r0 * k, .xd = xd + r0 * nb, .xs = xs + r0 * nb, .q = q, .dm = dm, .rows = count,
                    .k = k, .n = 2 * d, .gate_up = 1, .out = h};
        int rc = run_w4(&g, num_threads);
        if (rc == 0)
            rc = quantize_rows_blocks(h, 0, d, count, d, NULL, out_q + r0 * d, out_scale + r0 * out_nb,
                                      out_sum + r0 * out_nb, num_threads);
        if (rc) return rc;
    }
    return 0;
}
#else
int w4_gemm_built(void) { return 0; }
int64_t w4_gate_up_block(void) { return 0; }
int w4_gemm(const int8_t *x, const float *xd, const float *xs, const uint8_t *q, const float *dm, int64_t rows,
            int64_t k, int64_t n, const void *add, int64_t add_stride, void *out, int64_t out_stride, int out_bf16,
            int num_threads) {
    (void)x, (void)xd, (void)xs, (void)q, (void)dm, (void)rows, (void)k, (void)n, (void)add, (void)add_stride;
    (void)out, (void)out_stride, (void)out_bf16, (void)num_threads;
    return -2;
}
int w4_gemm_gate_up(const int8_t *x, const float *xd, const float *xs, const uint8_t *q, const float *dm, int64_t rows,
                    int64_t k, int64_t d, float *h, int8_t *out_q, float *out_scale, float *out_sum,
                    int num_threads) {
    (void)x, (void)xd, (void)xs, (void)q, (void)dm, (void)rows, (void)k, (void)d, (void)h, (void)out_q;
    (void)out_scale, (void)out_sum, (void)num_threads;
    return -2;
}
#endif
