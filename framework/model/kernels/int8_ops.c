/* The element-wise ends of int8 GEMMs (model.quantization = "w8a8", framework/model/int8.py).
 *
 * A W8A8 linear layer multiplies int8 activations, one scale per row (token), by int8 weights,
 * one scale per output column: y[r, c] = acc[r, c] * x_scale[r] * w_scale[c], acc the int32 sum
 * torch._int_mm computes. These functions make the int8 rows from what the layer before gives
 * (bf16 rows, an RMSNorm, the gate and up products; fp32 rows for models in float32) and turn the
 * int32 sums back into bf16 (or fp32), each in one pass with the op around it, so no bf16 or fp32
 * copy of an activation is written between.
 *
 * A row's scale is max|x| / 127 and its values round(x / scale) (to nearest even), so they lie in
 * [-127, 127]; a row of zeros has scale 0 and all values 0. A row may first be multiplied by a
 * vector (`mul`, one factor a column): the smoothing of int8.py, whose weights hold the inverse.
 * Rows split over `num_threads` threads (run_spans in common.h). Built and loaded by framework/model/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { QUANTIZE = 0, RMS_QUANTIZE = 1, DEQUANTIZE = 2, SILU_MUL_QUANTIZE = 3, QUANTIZE_F32 = 4 };

typedef struct {
    int op;
    int64_t rows, d; /* d: the width of an input row (the gate's width for SILU_MUL_QUANTIZE) */
    const uint16_t *x; /* QUANTIZE, RMS_QUANTIZE: bf16 [rows, d] with row stride x_stride */
    const float *xf;   /* QUANTIZE: fp32 rows in place of x (same stride), when set */
    int64_t x_stride;
    const uint16_t *residual; /* RMS_QUANTIZE: optional bf16 [rows, d], added first */
    uint16_t *residual_out;  /* and bf16(x + residual) written here */
    const uint16_t *w;        /* RMS_QUANTIZE: the norm's bf16 weight [d] */
    float eps;
    int8_t *q;       /* the int8 rows made, [rows, d] */
    float *q_scale;  /* and their scales [rows] */
    const float *mul; /* optional [d]: each row times it before it is quantized (the smoothing) */
    const int32_t *acc; /* DEQUANTIZE, SILU_MUL_QUANTIZE: the int32 sums [rows, n] */
    const float *x_scale, *w_scale; /* [rows], [n] */
    const uint16_t *add; /* DEQUANTIZE: optional bf16 [rows, d] added before the rounding */
    int64_t add_stride;
    uint16_t *out; /* DEQUANTIZE: bf16 [rows, d] with row stride out_stride */
    int64_t out_stride;
    float *h; /* QUANTIZE_F32: fp32 [rows, d], quantized in place of a copy (mul applied in it) */
} Job;

typedef struct {
    const Job *job;
    int64_t begin, end;
    int failed; /* the span's row buffer could not be allocated */
} Rows;

/* row [d] (fp32; first times mul [d] where there is one, in place) as int8 values and their scale. */
static void quantize_row(float *row, int64_t d, const float *mul, int8_t *q, float *scale) {
    int64_t i = 0;
    if (mul) {
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(mul + i)));
#elif defined(__AVX2__)
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(mul + i)));
#endif
        for (; i < d; i++) row[i] *= mul[i];
    }
    const float amax = max_abs_f32(row, d);
    *scale = amax / 127.0f;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    i = 0;
#ifdef __AVX512F__
    __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= d; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv)); /* (to nearest even) */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
#elif defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 32 <= d; i += 32) quantize32_i8(row + i, vinv, q + i, NULL);
#endif
    for (; i < d; i++) {
        float v = nearbyintf(row[i] * inv); /* (to nearest even, as the vector conversion) */
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
}

static void quantize_rows(const Job *j, int64_t begin, int64_t end, float *row) {
    int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
        if (j->xf) {
            memcpy(row, j->xf + r * j->x_stride, (size_t)d * sizeof(float));
            quantize_row(row, d, j->mul, j->q + r * d, j->q_scale + r);
            continue;
        }
        const uint16_t *x = j->x + r * j->x_stride;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16) _mm512_storeu_ps(row + i, load16(x + i, KV_BF16));
#endif
        for (; i < d; i++) row[i] = bf16_to_f32(x[i]);
        quantize_row(row, d, j->mul, j->q + r * d, j->q_scale + r);
    }
}

/* RMSNorm as fused_ops.c's (rms_norm_input: x first bf16(x + residual) when there is a residual,
 * which is also written to residual_out), the normed row times the weight kept in fp32 and
 * quantized. */
static void rms_quantize_rows(const Job *j, int64_t begin, int64_t end, float *row) {
    int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
        float scale = rms_norm_input(j->x + r * j->x_stride, j->residual, j->residual_out, r, d, j->eps, row);
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 vs = _mm512_set1_ps(scale);
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(row + i,
                             _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + i), vs), load16(j->w + i, KV_BF16)));
#endif
        for (; i < d; i++) row[i] = row[i] * scale * bf16_to_f32(j->w[i]);
        quantize_row(row, d, j->mul, j->q + r * d, j->q_scale + r);
    }
}

#ifdef __AVX512F__
/* 16 int32 sums times their scales [+ 16 bf16 at add], in fp32: with an add, one fused
 * multiply-add (one rounding; written out, so that no compiler's contraction choice can differ
 * between the callers: dequantize_rows and the int8 GEMM's end give the same bits). */
static inline __m512 dequantize16(__m512i acc, __m512 scale, const uint16_t *add) {
    __m512 y = _mm512_cvtepi32_ps(acc);
    return add ? _mm512_fmadd_ps(y, scale, load16(add, KV_BF16)) : _mm512_mul_ps(y, scale);
}
#endif

/* out = bf16(acc * x_scale * w_scale [+ add]), the product and the add in one rounding. */
static void dequantize_rows(const Job *j, int64_t begin, int64_t end) {
    int64_t n = j->d;
    for (int64_t r = begin; r < end; r++) {
        const int32_t *acc = j->acc + r * n;
        const uint16_t *add = j->add ? j->add + r * j->add_stride : NULL;
        uint16_t *out = j->out + r * j->out_stride;
        float xs = j->x_scale[r];
        int64_t c = 0;
#ifdef __AVX512F__
        __m512 vxs = _mm512_set1_ps(xs);
        for (; c + 16 <= n; c += 16)
            store16_bf16(out + c, dequantize16(_mm512_loadu_si512(acc + c),
                                               _mm512_mul_ps(vxs, _mm512_loadu_ps(j->w_scale + c)), add ? add + c : NULL));
#endif
        for (; c < n; c++) {
            float y = (float)acc[c], s = xs * j->w_scale[c];
            out[c] = f32_to_bf16(add ? fmaf(y, s, bf16_to_f32(add[c])) : y * s);
        }
    }
}

#ifdef __AVX512F__
/* silu(gate) * up in fp32 of 16 gate and 16 up sums and their scales (x_scale * w_scale): the end
 * of silu_mul_quantize_rows and of the int8 GEMM's gate_up, so both give the same bits. */
static inline __m512 silu_mul16(__m512i gate, __m512 gate_scale, __m512i up, __m512 up_scale) {
    __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(gate), gate_scale);
    __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(up), up_scale);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

/* silu(g) * u of a gate and an up sum and their scales (x_scale * w_scale), one lane (silu_times,
 * common.h). Where there is no AVX-512 the end of silu_mul_quantize_rows and of the int8 GEMM's
 * gate_up, so both give the same bits. */
static inline float silu_mul_lane(int32_t gate, float gate_scale, int32_t up, float up_scale) {
    return silu_times((float)gate * gate_scale, (float)up * up_scale);
}

/* acc [rows, 2d] = the sums of [gate | up] -> silu(gate) * up in fp32, quantized to [rows, d]. */
static void silu_mul_quantize_rows(const Job *j, int64_t begin, int64_t end, float *row) {
    int64_t d = j->d;
    const float *gs = j->w_scale, *us = j->w_scale + d;
    for (int64_t r = begin; r < end; r++) {
        const int32_t *gate = j->acc + r * 2 * d, *up = gate + d;
        float xs = j->x_scale[r];
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 vxs = _mm512_set1_ps(xs);
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(row + i, silu_mul16(_mm512_loadu_si512(gate + i), _mm512_mul_ps(vxs, _mm512_loadu_ps(gs + i)),
                                                 _mm512_loadu_si512(up + i), _mm512_mul_ps(vxs, _mm512_loadu_ps(us + i))));
#endif
        for (; i < d; i++) row[i] = silu_mul_lane(gate[i], xs * gs[i], up[i], xs * us[i]);
        quantize_row(row, d, j->mul, j->q + r * d, j->q_scale + r);
    }
}

static void *run_rows(void *arg) {
    Rows *span = (Rows *)arg;
    const Job *j = span->job;
    if (j->op == DEQUANTIZE) {
        dequantize_rows(j, span->begin, span->end);
        return NULL;
    }
    if (j->op == QUANTIZE_F32) {
        for (int64_t r = span->begin; r < span->end; r++)
            quantize_row(j->h + r * j->d, j->d, j->mul, j->q + r * j->d, j->q_scale + r);
        return NULL;
    }
    float *row = malloc((size_t)j->d * sizeof(float)); /* one fp32 row, the input's width */
    if (row == NULL) {
        span->failed = 1;
        return NULL;
    }
    if (j->op == QUANTIZE)
        quantize_rows(j, span->begin, span->end, row);
    else if (j->op == RMS_QUANTIZE)
        rms_quantize_rows(j, span->begin, span->end, row);
    else
        silu_mul_quantize_rows(j, span->begin, span->end, row);
    free(row);
    return NULL;
}

/* Rows per thread below which fewer threads take the rows (as fused_ops.c). */
#define MIN_ROWS_PER_THREAD 16

static int run(const Job *job, int num_threads) {
    if (job->rows < 1) return 0;
    int threads = span_threads(num_threads, job->rows / MIN_ROWS_PER_THREAD);
    Rows spans[MAX_THREADS];
    for (int s = 0; s < threads; s++) {
        spans[s].job = job;
        spans[s].begin = job->rows * s / threads;
        spans[s].end = job->rows * (s + 1) / threads;
        spans[s].failed = 0;
    }
    run_spans(run_rows, spans, sizeof spans[0], threads);
    for (int s = 0; s < threads; s++)
        if (spans[s].failed) return -1;
    return 0;
}

/* ---- int8 GEMMs with their ends (int8_gemm): AVX512-VNNI, or AVX2 -----------------------------
 *
 * The same int32 sums as torch._int_mm, and the same ends as the functions above, in one kernel.
 * The weight is packed once at load (int8_gemm_pack) in units of I8_BLOCKS blocks of 16 output
 * columns (gate_up: the gate half's blocks, then the same blocks of the up half), k quad by k
 * quad: packed[unit][p][c][j][e] = w[4 p + e] of the unit's block c, column j, so that a block's
 * weights for one k quad are one 64-byte vector (two 32-byte ones on AVX2). Two builds:
 *  - AVX512-VNNI (I8_GEMM 1): `vpdpbusd` multiplies the quad with a broadcast quad of a row of x;
 *    it takes unsigned bytes on one side, so the packed weight holds w + 128 (0..255) and a sum
 *    loses 128 times its row's sum of x again (I8_OFFSET). Micro-tiles of 6 rows x 4 blocks keep
 *    24 sums in registers.
 *  - AVX2 (I8_GEMM 2; AMD Zen 3, Intel before Ice Lake): `vpmaddubsw` multiplies unsigned by
 *    signed bytes and adds pairs into 16 bits, which would saturate for w + 128; so it takes |w|
 *    (unsigned) against x with w's sign (`vpsignb`), pairs of at most 2 x 127 x 127 = 32,258, then
 *    `vpmaddwd` by ones adds the pairs of a quad into 32 bits: exact, for x within +-127 (as
 *    quantize_row makes every row; w is +-127 too). The packed weight holds w itself. Micro-tiles
 *    of 4 rows x 1 block (8 sums, 16 registers in all), block by block of a unit of 2.
 * Every sum is exact in int32 (|sum| <= k 255 127). A unit passes over every row of a panel of x
 * (its weights in L1/L2), and threads take runs of (panel, unit) items as they come free (I8Share). Ends:
 *   dequantize: out = bf16(acc x_scale w_scale [+ add]), as dequantize_rows; or, for fp32 models
 *               (int8_gemm_f32), out = acc x_scale w_scale [+ add] in fp32, the add fused;
 *   gate_up: silu(gate) * up to an fp32 buffer as silu_mul_quantize_rows makes it, then each row
 *            quantized (quantize_row) by a second pass over the rows.
 * So the bits are those of torch._int_mm followed by dequantize_bf16 or silu_mul_quantize. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_GEMM 1
#define I8_ROWS 6
#define I8_BLOCKS 4
#define I8_OFFSET 128
#define I8_PANEL_BYTES (768 << 10) /* of x at a time: a share of the L2 */
#elif defined(__AVX2__) && defined(__FMA__)
#define I8_GEMM 2
#define I8_ROWS 4
#define I8_BLOCKS 2
#define I8_OFFSET 0
#define I8_PANEL_BYTES (384 << 10) /* (an AMD Zen 3's L2 is 512 KiB) */
#endif

/* With AMX-INT8 (Intel Sapphire Rapids and later), the AVX512-VNNI build runs each unit's rows 32 at
 * a time on the tiles (i8_amx_tile) where k is in 64s, the rest on the vectors: the same int32
 * sums, the same ends, so the same bits whichever runs them. */
#include "amx.h"
#define I8_AMX_ROWS 32 /* (two A tiles of 16 rows) */
#if I8_GEMM == 1 && HAVE_AMX && defined(__AMX_INT8__)
#define I8_AMX 1
static int i8_tiles_wanted = 1;
#else
#define I8_AMX 0
#endif

/* Whether the int8 GEMMs take the AMX tiles (where the build, the CPU and Linux give them): `on` 1
 * or 0 sets whether they may, -1 only asks. */
int int8_gemm_tiles(int on) {
#if I8_AMX
    if (on >= 0) i8_tiles_wanted = on;
    return i8_tiles_wanted && amx_usable();
#else
    (void)on;
    return 0;
#endif
}

#ifdef I8_GEMM
/* Rows of x a gate_up GEMM takes at a time (int8_gemm_gate_up), so that their part of h is
 * quantized from the caches: with all of a prefill pass's 8,192 rows at once, h (48 MiB for
 * SmolLM2) went to DRAM and back, 0.69 against 0.76 TOP/s (2-core AMD EPYC Zen 4, alternated,
 * blocks of 192-384 rows alike). */
#define I8_GATE_UP_BLOCK 256

/* Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte. */
static inline int ranges_overlap(const void *a, int64_t a_bytes, const void *b, int64_t b_bytes) {
    const uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return pa < pb + (uintptr_t)b_bytes && pb < pa + (uintptr_t)a_bytes;
}

/* Units of a weight of n columns (gate_up: n / 2 gate columns and as many up columns). */
static inline int64_t i8_units(int64_t n, int gate_up) {
    return gate_up ? (n / 32 + I8_BLOCKS / 2 - 1) / (I8_BLOCKS / 2) : (n / 16 + I8_BLOCKS - 1) / I8_BLOCKS;
}

/* The block (of 16 columns) that block c of `unit` is: gate_up, the gate half's block (the up
 * half's for c >= I8_BLOCKS / 2, counted from that half's start). */
static inline int64_t i8_block(int64_t unit, int c, int gate_up) {
    return gate_up ? I8_BLOCKS / 2 * unit + c % (I8_BLOCKS / 2) : I8_BLOCKS * unit + c;
}

/* Bytes of the packed copy of a [k, n] weight (the last unit's missing blocks are zeros). */
int64_t int8_gemm_packed_bytes(int64_t k, int64_t n, int gate_up) { return i8_units(n, gate_up) * I8_BLOCKS * 16 * k; }

/* The packed copy (above) of q [k, n] (Int8Weight.q; gate_up: [gate | up] columns), n % 16 == 0
 * (gate_up: n % 32 == 0) and k % 4 == 0; returns 0, or -2 for other shapes. */
int int8_gemm_pack(const int8_t *q, int64_t k, int64_t n, int gate_up, uint8_t *packed) {
    if (n < 16 || n % (gate_up ? 32 : 16) || k < 4 || k % 4) return -2;
    const int64_t units = i8_units(n, gate_up), quads = k / 4, half = gate_up ? n / 32 : n / 16;
    for (int64_t unit = 0; unit < units; unit++)
        for (int c = 0; c < I8_BLOCKS; c++) {
            int64_t block = i8_block(unit, c, gate_up);
            int64_t col0 = 16 * (block + (gate_up && c >= I8_BLOCKS / 2 ? half : 0));
            for (int64_t p = 0; p < quads; p++)
                for (int64_t j = 0; j < 16; j++)
                    for (int64_t e = 0; e < 4; e++)
                        packed[(((unit * quads + p) * I8_BLOCKS + c) * 16 + j) * 4 + e] =
                            block < half ? (uint8_t)(q[(4 * p + e) * n + col0 + j] + I8_OFFSET) : 0;
        }
    return 0;
}

typedef struct {
    const int8_t *x;      /* [rows, k] */
    const float *x_scale; /* [rows] */
    const uint8_t *packed;
    const float *w_scale; /* [n] */
    int64_t rows, k, n;
    int gate_up;
    const uint16_t *add; /* dequantize: optional bf16 [rows, n] with row stride add_stride */
    int64_t add_stride;
    uint16_t *out; /* dequantize: bf16 [rows, n] with row stride out_stride */
    int64_t out_stride;
    const float *add_f32; /* dequantize to fp32 (out_f32 set): optional fp32 add, stride add_stride */
    float *out_f32;       /* in place of out: fp32 [rows, n] with row stride out_stride */
    float *h; /* gate_up: fp32 [rows, n / 2], silu(gate) * up */
} I8Gemm;

/* A thread's part: runs of units taken as it comes free (UnitRuns in common.h: panels shrink where
 * there are few units, so that the 9 units of SmolLM2's o and down projections on AVX512-VNNI
 * still split evenly). */
typedef struct {
    const I8Gemm *g;
    const UnitRuns *runs;
    int tiles; /* the rows 32 at a time on the AMX tiles (I8_AMX) */
    int failed;
} I8Share;

#if I8_GEMM == 1
/* sum of x over k, as int32 */
static inline int32_t row_sum_i8(const int8_t *x, int64_t k) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512(x + i));
    int32_t s = _mm512_reduce_add_epi32(acc);
    for (; i < k; i++) s += x[i];
    return s;
}

/* Row m's end from its sums by the unit's four blocks (acc0..acc3; `sum`: the row's sum of x, the
 * offset's 128 times which comes off each): the dequantized outputs or, for gate_up, silu(gate) * up. */
static inline __attribute__((always_inline)) void i8_row_end(const I8Gemm *g, int64_t m, const int64_t n0[I8_BLOCKS],
                                                             __v16si acc0, __v16si acc1, __v16si acc2, __v16si acc3,
                                                             int32_t sum) {
    const __v16si acc[I8_BLOCKS] = {acc0, acc1, acc2, acc3};
    const __m512i lost = _mm512_set1_epi32(128 * sum);
    const __m512 vxs = _mm512_set1_ps(g->x_scale[m]);
    if (g->gate_up) {
        const int64_t d = g->n / 2;
        for (int c = 0; c < I8_BLOCKS / 2; c++) {
            if (n0[c] >= d) continue;
            _mm512_storeu_ps(g->h + m * d + n0[c],
                             silu_mul16(_mm512_sub_epi32((__m512i)acc[c], lost),
                                        _mm512_mul_ps(vxs, _mm512_loadu_ps(g->w_scale + n0[c])),
                                        _mm512_sub_epi32((__m512i)acc[I8_BLOCKS / 2 + c], lost),
                                        _mm512_mul_ps(vxs, _mm512_loadu_ps(g->w_scale + d + n0[c]))));
        }
        return;
    }
    for (int c = 0; c < I8_BLOCKS; c++) {
        if (n0[c] >= g->n) continue;
        if (g->out_f32) {
            const __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)acc[c], lost));
            const __m512 scale = _mm512_mul_ps(vxs, _mm512_loadu_ps(g->w_scale + n0[c]));
            const float *add = g->add_f32 ? g->add_f32 + m * g->add_stride + n0[c] : NULL;
            _mm512_storeu_ps(g->out_f32 + m * g->out_stride + n0[c],
                             add ? _mm512_fmadd_ps(y, scale, _mm512_loadu_ps(add)) : _mm512_mul_ps(y, scale));
            continue;
        }
        store16_bf16(g->out + m * g->out_stride + n0[c],
                     dequantize16(_mm512_sub_epi32((__m512i)acc[c], lost),
                                  _mm512_mul_ps(vxs, _mm512_loadu_ps(g->w_scale + n0[c])),
                                  g->add ? g->add + m * g->add_stride + n0[c] : NULL));
    }
}

/* Rows m0..m0+R of x by a unit (w: its packed weights; n0: its blocks' first columns, past the
 * end for a missing block), then the end. */
static inline __attribute__((always_inline)) void i8_tile(const I8Gemm *g, int64_t m0, const int R,
                                                          const uint8_t *w, const int64_t n0[I8_BLOCKS],
                                                          const int32_t *sums) {
    /* (sums typed as 16 ints, the type of GCC's vpdpbusd builtin: as __m512i, whose elements are
     * 64-bit, each call converts them and GCC 12 then keeps all 24 in stack slots, a load and a
     * store around every vpdpbusd: 0.42 TOP/s against 0.93 on a 2-core AMD Zen 4) */
    __v16si acc[I8_ROWS][I8_BLOCKS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < I8_BLOCKS; c++) acc[r][c] = (__v16si)_mm512_setzero_si512();
    const int64_t k = g->k, quads = k / 4;
    const int8_t *x = g->x + m0 * k;
    for (int64_t p = 0; p < quads; p++) {
        __m512i wv[I8_BLOCKS];
        for (int c = 0; c < I8_BLOCKS; c++) wv[c] = _mm512_loadu_si512(w + (p * I8_BLOCKS + c) * 64);
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, x + r * k + 4 * p, 4);
            __m512i xb = _mm512_set1_epi32(quad);
            for (int c = 0; c < I8_BLOCKS; c++) acc[r][c] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][c], wv[c], xb);
        }
    }
    for (int r = 0; r < R; r++) i8_row_end(g, m0 + r, n0, acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums[r]);
}

#if I8_AMX
/* Rows m0..m0+32 of x by a unit on the AMX tiles (k % 64 == 0): the blocks two at a time, each
 * 16 rows x 16 columns of sums a tile (`tdpbsud`: x's signed bytes by the packed unsigned w + 128,
 * the same sums as vpdpbusd's), a unit's k quads read as B tiles straight from the packed copy
 * (its rows, one k quad each, I8_BLOCKS * 64 bytes apart); the sums go through `acc` to the end. */
static void i8_amx_tile(const I8Gemm *g, int64_t m0, const uint8_t *w, const int64_t n0[I8_BLOCKS],
                        const int32_t *sums) {
    int32_t acc[I8_AMX_ROWS][I8_BLOCKS * 16] __attribute__((aligned(64)));
    const int64_t k = g->k, stride = I8_BLOCKS * 64;
    const int8_t *x = g->x + m0 * k;
    for (int pair = 0; pair < I8_BLOCKS / 2; pair++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint8_t *b = w + pair * 128;
        for (int64_t kk = 0; kk < k; kk += 64, b += 16 * stride) {
            _tile_loadd(4, x + kk, k);
            _tile_loadd(5, x + 16 * k + kk, k);
            _tile_loadd(6, b, stride);
            _tile_loadd(7, b + 64, stride);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
        }
        _tile_stored(0, acc[0] + 32 * pair, sizeof acc[0]);
        _tile_stored(1, acc[0] + 32 * pair + 16, sizeof acc[0]);
        _tile_stored(2, acc[16] + 32 * pair, sizeof acc[0]);
        _tile_stored(3, acc[16] + 32 * pair + 16, sizeof acc[0]);
    }
    for (int r = 0; r < I8_AMX_ROWS; r++) {
        const int32_t *a = acc[r];
        i8_row_end(g, m0 + r, n0, (__v16si)_mm512_load_si512(a), (__v16si)_mm512_load_si512(a + 16),
                   (__v16si)_mm512_load_si512(a + 32), (__v16si)_mm512_load_si512(a + 48), sums[r]);
    }
}
#endif

#else /* I8_GEMM == 2 */
/* The sums of R rows of x (from x, rows k apart) by one block of a unit (w: its first quad,
 * quads I8_BLOCKS * 64 bytes apart), into sums[r][16]. */
static inline __attribute__((always_inline)) void i8_block_sums(const int8_t *x, int64_t k, const int R,
                                                                const uint8_t *w, int32_t sums[][16]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[I8_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int64_t quads = k / 4;
    for (int64_t p = 0; p < quads; p++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + p * I8_BLOCKS * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + p * I8_BLOCKS * 64 + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, x + r * k + 4 * p, 4);
            const __m256i xb = _mm256_set1_epi32(quad);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)sums[r], acc[r][0]);
        _mm256_storeu_si256((__m256i *)(sums[r] + 8), acc[r][1]);
    }
}

/* Rows m0..m0+R of x by a unit (as the AVX-512 i8_tile; `sums` unused: no offset to take back),
 * block by block into a small buffer of int32 sums, then the end from it. */
static inline __attribute__((always_inline)) void i8_tile(const I8Gemm *g, int64_t m0, const int R,
                                                          const uint8_t *w, const int64_t n0[I8_BLOCKS],
                                                          const int32_t *sums) {
    (void)sums;
    int32_t acc[I8_BLOCKS][I8_ROWS][16];
    const int64_t k = g->k, limit = g->gate_up ? g->n / 2 : g->n;
    const int8_t *x = g->x + m0 * k;
    for (int c = 0; c < I8_BLOCKS; c++)
        if (n0[c] < limit) i8_block_sums(x, k, R, w + c * 64, acc[c]);
    for (int r = 0; r < R; r++) {
        const int64_t m = m0 + r;
        const float xs = g->x_scale[m];
        if (g->gate_up) {
            const int64_t d = g->n / 2;
            for (int c = 0; c < I8_BLOCKS / 2; c++) {
                if (n0[c] >= d) continue;
                const float *gs = g->w_scale + n0[c], *us = g->w_scale + d + n0[c];
                float *h = g->h + m * d + n0[c];
                const int32_t *gate = acc[c][r], *up = acc[I8_BLOCKS / 2 + c][r];
                for (int i = 0; i < 16; i++) h[i] = silu_mul_lane(gate[i], xs * gs[i], up[i], xs * us[i]);
            }
            continue;
        }
        const __m256 vxs = _mm256_set1_ps(xs);
        for (int c = 0; c < I8_BLOCKS; c++) {
            if (n0[c] >= g->n) continue;
            for (int half = 0; half < 16; half += 8) {
                const int64_t col = n0[c] + half;
                const __m256 y = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc[c][r] + half)));
                const __m256 scale = _mm256_mul_ps(vxs, _mm256_loadu_ps(g->w_scale + col));
                const int64_t at = m * g->add_stride + col;
                if (g->out_f32) {
                    _mm256_storeu_ps(g->out_f32 + m * g->out_stride + col,
                                     g->add_f32 ? _mm256_fmadd_ps(y, scale, _mm256_loadu_ps(g->add_f32 + at))
                                                : _mm256_mul_ps(y, scale));
                } else {
                    const __m256 v =
                        g->add ? _mm256_fmadd_ps(y, scale, load8_bf16(g->add + at)) : _mm256_mul_ps(y, scale);
                    _mm_storeu_si128((__m128i *)(g->out + m * g->out_stride + col), to_bf16x8(v));
                }
            }
        }
    }
}
#endif

/* A unit over rows [first, last): micro-tiles of I8_ROWS rows, then the rest (a constant R for
 * each call, so that the sums stay in registers). (A unit's weights are one sequential stream,
 * which the hardware prefetchers follow: prefetching the next unit's during this one's tiles
 * changed nothing measurable, 200 rows, 30 layers' weights from DRAM, a 2-core AMD Zen 4.) */
static void i8_unit_rows(const I8Gemm *g, const uint8_t *w, const int64_t n0[I8_BLOCKS], int64_t first,
                         int64_t last, const int32_t *sums) {
    int64_t m = first;
    for (; m + I8_ROWS <= last; m += I8_ROWS) i8_tile(g, m, I8_ROWS, w, n0, sums + (m - first));
    switch (last - m) {
#if I8_ROWS > 5
    case 5: i8_tile(g, m, 5, w, n0, sums + (m - first)); break;
#endif
#if I8_ROWS > 4
    case 4: i8_tile(g, m, 4, w, n0, sums + (m - first)); break;
#endif
    case 3: i8_tile(g, m, 3, w, n0, sums + (m - first)); break;
    case 2: i8_tile(g, m, 2, w, n0, sums + (m - first)); break;
    case 1: i8_tile(g, m, 1, w, n0, sums + (m - first)); break;
    }
}

/* The items of one thread (I8Share), in runs of units (take_units in common.h). With a fixed span
 * of units x rows for each thread instead, the core that ran faster (the two vCPUs of a shared host
 * do not keep one pace) waited for the other at every GEMM's end: 8 layers' w8a8 GEMMs (fp32 ends)
 * on a 2-core AMD EPYC Zen 3, alternated in one process, median GOP/s in two runs: 200 rows 163 ->
 * 169, 103 -> 143; 2,048 rows 173 -> 184, 125 -> 141; the LM head's 49,152 columns at 200 rows 130
 * -> 136, 108 -> 109. Items of one unit each made the LM head slower (130 -> 108): a thread's
 * weights were no longer one stream. */
static void *run_i8_units(void *arg) {
    I8Share *u = (I8Share *)arg;
    const I8Gemm *g = u->g;
    const int64_t unit_bytes = (int64_t)I8_BLOCKS * 16 * g->k, limit = g->gate_up ? g->n / 2 : g->n;
    int32_t *sums = malloc((size_t)u->runs->panel * sizeof(int32_t));
    if (sums == NULL) {
        u->failed = 1;
        return NULL;
    }
#if I8_OFFSET
    int64_t summed = -1; /* the panel whose row sums are in `sums` (a thread's runs come in order) */
#endif
#if I8_AMX
    if (u->tiles) amx_configure();
#endif
    for (int64_t first, last, u0, u1; take_units(u->runs, &first, &last, &u0, &u1);) {
#if I8_OFFSET
        if (summed != first) {
            for (int64_t m = first; m < last; m++) sums[m - first] = row_sum_i8(g->x + m * g->k, g->k);
            summed = first;
        }
#endif
        for (int64_t unit = u0; unit < u1; unit++) {
            int64_t n0[I8_BLOCKS];
            for (int c = 0; c < I8_BLOCKS; c++) {
                int64_t col = 16 * i8_block(unit, c, g->gate_up);
                n0[c] = col < limit ? col : g->n; /* a missing block's outputs are not stored */
            }
            const uint8_t *w = g->packed + unit * unit_bytes;
            int64_t m = first;
#if I8_AMX
            for (; u->tiles && m + I8_AMX_ROWS <= last; m += I8_AMX_ROWS) i8_amx_tile(g, m, w, n0, sums + (m - first));
#endif
            i8_unit_rows(g, w, n0, m, last, sums + (m - first));
        }
    }
#if I8_AMX
    if (u->tiles) _tile_release();
#endif
    free(sums);
    return NULL;
}

static int run_i8(const I8Gemm *g, int num_threads) {
    if (g->rows < 1) return 0;
    const int64_t units = i8_units(g->n, g->gate_up);
    int threads = span_threads(num_threads, units * g->rows / (4 * I8_ROWS)); /* (at least 4 micro-tiles a thread) */
    int64_t next = 0;
#if I8_AMX
    const int tiles = g->rows >= I8_AMX_ROWS && g->k % 64 == 0 && int8_gemm_tiles(-1);
#else
    const int tiles = 0;
#endif
    /* (panels in 32s on the tiles, so that only the last has rows for the vectors) */
    const UnitRuns runs =
        unit_runs(g->rows, I8_PANEL_BYTES / g->k, units, threads, tiles ? I8_AMX_ROWS : I8_ROWS, &next);
    I8Share shares[MAX_THREADS];
    for (int s = 0; s < threads; s++) shares[s] = (I8Share){.g = g, .runs = &runs, .tiles = tiles};
    run_spans(run_i8_units, shares, sizeof shares[0], threads);
    for (int s = 0; s < threads; s++)
        if (shares[s].failed) return -1;
    return 0;
}

/* A dequantizing GEMM (not gate_up) of the operands and end in g, where the packing takes its shape. */
static int run_i8_dequantize(const I8Gemm *g, int num_threads) {
    if (g->n < 16 || g->n % 16 || g->k < 4 || g->k % 4) return -2;
    return run_i8(g, num_threads);
}

/* bf16(x @ W^T [+ add]) as torch._int_mm then dequantize_bf16: x int8 [rows, k] (contiguous) with
 * scales x_scale, the weight packed by int8_gemm_pack (n columns, not gate_up) with scales
 * w_scale. Returns 0, -1 (no memory), or -2 (a shape the packing does not take). */
int int8_gemm_bf16(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale, int64_t rows,
                   int64_t k, int64_t n, const uint16_t *add, int64_t add_stride, uint16_t *out, int64_t out_stride,
                   int num_threads) {
    I8Gemm g = {.x = x, .x_scale = x_scale, .packed = packed, .w_scale = w_scale, .rows = rows, .k = k, .n = n,
                .add = add, .add_stride = add_stride, .out = out, .out_stride = out_stride};
    return run_i8_dequantize(&g, num_threads);
}

/* x @ W^T [+ add] in fp32 (models in float32): as int8_gemm_bf16, with fp32 `add` and `out`. */
int int8_gemm_f32(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale, int64_t rows,
                  int64_t k, int64_t n, const float *add, int64_t add_stride, float *out, int64_t out_stride,
                  int num_threads) {
    I8Gemm g = {.x = x, .x_scale = x_scale, .packed = packed, .w_scale = w_scale, .rows = rows, .k = k, .n = n,
                .add_f32 = add, .add_stride = add_stride, .out_f32 = out, .out_stride = out_stride};
    return run_i8_dequantize(&g, num_threads);
}

/* The rows of x a gate_up GEMM takes at a time (its scratch h needs no more, int8_gemm_gate_up). */
int64_t int8_gemm_gate_up_block(void) { return I8_GATE_UP_BLOCK; }

/* The int8 rows of silu(gate) * up [* mul] as torch._int_mm then silu_mul_quantize: x int8 [rows,
 * k] with scales x_scale, the fused [gate | up] weight packed with gate_up (2 d columns) with
 * scales w_scale; `h`: fp32 scratch of min(rows, int8_gemm_gate_up_block()) x d, or rows x d
 * where q shares x's memory. q [rows, d] and q_scale [rows] may share x's and x_scale's memory:
 * then all rows go at once, and q is written after every sum is made. */
int int8_gemm_gate_up(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale,
                      int64_t rows, int64_t k, int64_t d, const float *mul, float *h, int8_t *q, float *q_scale,
                      int num_threads) {
    if (d < 16 || d % 16 || k < 4 || k % 4) return -2;
    /* Blocks of rows while q is not x's memory: each block's sums, then its rows quantized while
     * its part of h is still in the caches. */
    const int64_t block = ranges_overlap(q, rows * d, x, rows * k) ? rows : I8_GATE_UP_BLOCK;
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t nb = rows - r0 < block ? rows - r0 : block;
        I8Gemm g = {.x = x + r0 * k, .x_scale = x_scale + r0, .packed = packed, .w_scale = w_scale, .rows = nb,
                    .k = k, .n = 2 * d, .gate_up = 1, .h = h};
        int rc = run_i8(&g, num_threads);
        if (rc) return rc;
        Job job = {.op = QUANTIZE_F32, .rows = nb, .d = d, .h = h, .q = q + r0 * d, .q_scale = q_scale + r0,
                   .mul = mul};
        rc = run(&job, num_threads);
        if (rc) return rc;
    }
    return 0;
}
#else
int64_t int8_gemm_gate_up_block(void) { return 0; }
int64_t int8_gemm_packed_bytes(int64_t k, int64_t n, int gate_up) {
    (void)k, (void)n, (void)gate_up;
    return -2;
}
int int8_gemm_pack(const int8_t *q, int64_t k, int64_t n, int gate_up, uint8_t *packed) {
    (void)q, (void)k, (void)n, (void)gate_up, (void)packed;
    return -2;
}
int int8_gemm_bf16(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale, int64_t rows,
                   int64_t k, int64_t n, const uint16_t *add, int64_t add_stride, uint16_t *out, int64_t out_stride,
                   int num_threads) {
    (void)x, (void)x_scale, (void)packed, (void)w_scale, (void)rows, (void)k, (void)n, (void)add, (void)add_stride;
    (void)out, (void)out_stride, (void)num_threads;
    return -2;
}
int int8_gemm_f32(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale, int64_t rows,
                  int64_t k, int64_t n, const float *add, int64_t add_stride, float *out, int64_t out_stride,
                  int num_threads) {
    (void)x, (void)x_scale, (void)packed, (void)w_scale, (void)rows, (void)k, (void)n, (void)add, (void)add_stride;
    (void)out, (void)out_stride, (void)num_threads;
    return -2;
}
int int8_gemm_gate_up(const int8_t *x, const float *x_scale, const uint8_t *packed, const float *w_scale,
                      int64_t rows, int64_t k, int64_t d, const float *mul, float *h, int8_t *q, float *q_scale,
                      int num_threads) {
    (void)x, (void)x_scale, (void)packed, (void)w_scale, (void)rows, (void)k, (void)d, (void)mul, (void)h, (void)q;
    (void)q_scale, (void)num_threads;
    return -2;
}
#endif

/* Each function returns 0, or -1 when a thread's row buffer could not be allocated. */

/* `mul` (optional, [d]): the rows are multiplied by it before they are quantized. */

int quantize_bf16(const uint16_t *x, int64_t x_stride, const float *mul, int8_t *q, float *q_scale, int64_t rows,
                  int64_t d, int num_threads) {
    Job job = {.op = QUANTIZE, .rows = rows, .d = d, .x = x, .x_stride = x_stride, .q = q, .q_scale = q_scale,
               .mul = mul};
    return run(&job, num_threads);
}

/* The same of fp32 rows (models in float32): x is read, not changed. */
int quantize_f32(const float *x, int64_t x_stride, const float *mul, int8_t *q, float *q_scale, int64_t rows,
                 int64_t d, int num_threads) {
    Job job = {.op = QUANTIZE, .rows = rows, .d = d, .xf = x, .x_stride = x_stride, .q = q, .q_scale = q_scale,
               .mul = mul};
    return run(&job, num_threads);
}

int rms_norm_quantize(const uint16_t *x, int64_t x_stride, const uint16_t *residual, uint16_t *residual_out,
                      const uint16_t *w, float eps, const float *mul, int8_t *q, float *q_scale, int64_t rows,
                      int64_t d, int num_threads) {
    Job job = {.op = RMS_QUANTIZE, .rows = rows, .d = d, .x = x, .x_stride = x_stride, .residual = residual,
               .residual_out = residual_out, .w = w, .eps = eps, .q = q, .q_scale = q_scale, .mul = mul};
    return run(&job, num_threads);
}

int dequantize_bf16(const int32_t *acc, const float *x_scale, const float *w_scale, const uint16_t *add,
                    int64_t add_stride, uint16_t *out, int64_t out_stride, int64_t rows, int64_t n, int num_threads) {
    Job job = {.op = DEQUANTIZE, .rows = rows, .d = n, .acc = acc, .x_scale = x_scale, .w_scale = w_scale,
               .add = add, .add_stride = add_stride, .out = out, .out_stride = out_stride};
    return run(&job, num_threads);
}

int silu_mul_quantize(const int32_t *acc, const float *x_scale, const float *w_scale, const float *mul, int8_t *q,
                      float *q_scale, int64_t rows, int64_t d, int num_threads) {
    Job job = {.op = SILU_MUL_QUANTIZE, .rows = rows, .d = d, .acc = acc, .x_scale = x_scale, .w_scale = w_scale,
               .q = q, .q_scale = q_scale, .mul = mul};
    return run(&job, num_threads);
}
