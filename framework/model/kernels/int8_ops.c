/* The element-wise ends of int8 GEMMs (model.quantization = "w8a8", framework/model/int8.py).
 *
 * A W8A8 linear layer multiplies int8 activations, one scale per row (token), by int8 weights,
 * one scale per output column: y[r, c] = acc[r, c] * x_scale[r] * w_scale[c], acc the int32 sum
 * torch._int_mm computes. These functions make the int8 rows from what the layer before gives
 * (bf16 rows, an RMSNorm, the gate and up products) and turn the int32 sums back into bf16, each
 * in one pass with the op around it, so no bf16 or fp32 copy of an activation is written between.
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

enum { QUANTIZE = 0, RMS_QUANTIZE = 1, DEQUANTIZE = 2, SILU_MUL_QUANTIZE = 3 };

typedef struct {
    int op;
    int64_t rows, d; /* d: the width of an input row (the gate's width for SILU_MUL_QUANTIZE) */
    const uint16_t *x; /* QUANTIZE, RMS_QUANTIZE: bf16 [rows, d] with row stride x_stride */
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
} Job;

typedef struct {
    const Job *job;
    int64_t begin, end;
    int failed; /* the span's row buffer could not be allocated */
} Rows;

/* row [d] (fp32; first times mul [d] where there is one, in place) as int8 values and their scale. */
static void quantize_row(float *row, int64_t d, const float *mul, int8_t *q, float *scale) {
    float amax = 0.0f;
    int64_t i = 0;
    if (mul) {
#ifdef __AVX512F__
        for (; i + 16 <= d; i += 16)
            _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_loadu_ps(mul + i)));
#endif
        for (; i < d; i++) row[i] *= mul[i];
        i = 0;
    }
#ifdef __AVX512F__
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; i < d; i++) amax = fmaxf(amax, fabsf(row[i]));
    *scale = amax / 127.0f;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    i = 0;
#ifdef __AVX512F__
    __m512 vinv = _mm512_set1_ps(inv);
    for (; i + 16 <= d; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), vinv)); /* (to nearest even) */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
#endif
    for (; i < d; i++) {
        float v = nearbyintf(row[i] * inv); /* (to nearest even, as the vector conversion) */
        q[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
}

static void quantize_rows(const Job *j, int64_t begin, int64_t end, float *row) {
    int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
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

/* out = bf16(acc * x_scale * w_scale [+ add]), rounded once. */
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
        for (; c + 16 <= n; c += 16) {
            __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + c)),
                                     _mm512_mul_ps(vxs, _mm512_loadu_ps(j->w_scale + c)));
            if (add) y = _mm512_add_ps(y, load16(add + c, KV_BF16));
            store16_bf16(out + c, y);
        }
#endif
        for (; c < n; c++) {
            float y = (float)acc[c] * (xs * j->w_scale[c]);
            out[c] = f32_to_bf16(add ? y + bf16_to_f32(add[c]) : y);
        }
    }
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
        __m512 vxs = _mm512_set1_ps(xs), one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= d; i += 16) {
            __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(gate + i)),
                                     _mm512_mul_ps(vxs, _mm512_loadu_ps(gs + i)));
            __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(up + i)),
                                     _mm512_mul_ps(vxs, _mm512_loadu_ps(us + i)));
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
        }
#endif
        for (; i < d; i++) {
            float g = (float)gate[i] * (xs * gs[i]), u = (float)up[i] * (xs * us[i]);
            row[i] = g / (1.0f + expf(-g)) * u;
        }
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

/* Each function returns 0, or -1 when a thread's row buffer could not be allocated. */

/* `mul` (optional, [d]): the rows are multiplied by it before they are quantized. */

int quantize_bf16(const uint16_t *x, int64_t x_stride, const float *mul, int8_t *q, float *q_scale, int64_t rows,
                  int64_t d, int num_threads) {
    Job job = {.op = QUANTIZE, .rows = rows, .d = d, .x = x, .x_stride = x_stride, .q = q, .q_scale = q_scale,
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
