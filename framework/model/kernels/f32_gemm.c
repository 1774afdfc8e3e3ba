/* fp32 GEMMs on AVX2 + FMA vectors, from weights packed in units of 16 output columns, for
 * float32 models on CPUs without AVX-512 (model.dtype = "auto" is float32 there: AMD Zen 2 and 3,
 * Intel's client CPUs), where PyTorch's float32 GEMM (MKL) runs well only on large passes: on a
 * 2-core AMD EPYC Zen 3 it reached 138-165 GFLOP/s at a prefill tile's 2,048 rows but 93 at a
 * decode step's 200, and the LM head's rows are a decode step's too.
 *
 *   out[m, c] = sum_p x[m, p] w[c, p] (+ bias[c])
 *
 * The weight [n, k] (a Linear's, PyTorch's layout) is packed once (f32_gemm_pack) unit by unit:
 * packed[unit][p][j] = w[16 unit + j, p], zeros past n, so that one k step of a unit is two
 * consecutive 32-byte vectors. A micro-tile of F32_ROWS rows by one unit keeps 12 sums in
 * registers; each k step broadcasts one element of each row against the unit's two vectors (12
 * FMAs to 2 loads and 6 broadcasts). A unit's weights (16 k floats: 36 KiB at k = 576) stay in L2
 * while it passes over a panel of rows of x; the threads take equal spans of the units x rows
 * positions, unit-major, so that a decode step's few rows still split by columns.
 *
 * Each output is one fp32 sum in k order (then + bias), so the bits differ from MKL's, whose sums
 * go in other orders: the same values to fp32 rounding (tests/test_cpu_kernels.py).
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it
 * can) and called through ctypes; without AVX2 and FMA it builds but takes nothing
 * (f32_gemm_supported 0). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define F32_UNIT 16 /* output columns a unit */

int64_t f32_gemm_packed_floats(int64_t n, int64_t k) { return (n + F32_UNIT - 1) / F32_UNIT * F32_UNIT * k; }

/* The packed copy (above) of w [n, k]. */
void f32_gemm_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t units = (n + F32_UNIT - 1) / F32_UNIT;
    for (int64_t unit = 0; unit < units; unit++)
        for (int64_t p = 0; p < k; p++)
            for (int64_t j = 0; j < F32_UNIT; j++) {
                const int64_t c = unit * F32_UNIT + j;
                packed[(unit * k + p) * F32_UNIT + j] = c < n ? w[c * k + p] : 0.0f;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define F32_ROWS 6
#define F32_KC 256 /* k steps a block (f32_unit_rows) */
#define F32_PANEL_BYTES (384 << 10) /* of x at a time: a share of the L2 */

int f32_gemm_supported(void) { return 1; }

typedef struct {
    const float *x; /* [rows, k], row stride x_stride */
    int64_t x_stride;
    const float *packed;
    const float *bias; /* [n] or NULL */
    int64_t rows, k, n;
    float *out; /* [rows, n], row stride out_stride */
    int64_t out_stride;
} F32Gemm;

/* A thread's share of the positions unit * rows + row, [begin, end). */
typedef struct {
    const F32Gemm *g;
    int64_t begin, end;
} F32Span;

/* Rows m0..m0+R of x by one unit (w: its packed weights; n0: its first column) over k steps
 * [p0, p1): the block's sums are stored (`first`) or added to the outputs, and at the last block
 * (`last`) the bias is added. */
static inline __attribute__((always_inline)) void f32_tile(const F32Gemm *g, int64_t m0, const int R,
                                                           const float *w, int64_t n0, int64_t p0, int64_t p1,
                                                           int first, int last) {
    __m256 acc[F32_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t xs = g->x_stride;
    const float *x = g->x + m0 * xs;
    for (int64_t p = p0; p < p1; p++) {
        const __m256 w0 = _mm256_loadu_ps(w + p * F32_UNIT), w1 = _mm256_loadu_ps(w + p * F32_UNIT + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * xs + p);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    const int64_t cols = g->n - n0 < F32_UNIT ? g->n - n0 : F32_UNIT;
    const int bias = last && g->bias != NULL;
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias) {
        float b[F32_UNIT] = {0};
        memcpy(b, g->bias + n0, (size_t)cols * sizeof(float));
        b0 = _mm256_loadu_ps(b);
        b1 = _mm256_loadu_ps(b + 8);
    }
    for (int r = 0; r < R; r++) {
        float *o = g->out + (m0 + r) * g->out_stride + n0;
        float tmp[F32_UNIT];
        float *dst = cols == F32_UNIT ? o : tmp;
        if (!first && cols < F32_UNIT) memcpy(tmp, o, (size_t)cols * sizeof(float));
        __m256 y0 = acc[r][0], y1 = acc[r][1];
        if (!first) {
            y0 = _mm256_add_ps(_mm256_loadu_ps(dst), y0);
            y1 = _mm256_add_ps(_mm256_loadu_ps(dst + 8), y1);
        }
        if (bias) {
            y0 = _mm256_add_ps(y0, b0);
            y1 = _mm256_add_ps(y1, b1);
        }
        _mm256_storeu_ps(dst, y0);
        _mm256_storeu_ps(dst + 8, y1);
        if (dst == tmp) memcpy(o, tmp, (size_t)cols * sizeof(float));
    }
}

/* A unit over rows [first, last), k block by k block (F32_KC steps: the sums of a block, then
 * the block's sum added to the outputs, as MKL's blocks do; a unit's block of weights, 16 KiB,
 * stays in L1 over the rows), each in micro-tiles of F32_ROWS rows, then the rest (a constant R
 * for each call, so that the sums stay in registers). */
static void f32_unit_rows(const F32Gemm *g, const float *w, int64_t n0, int64_t first, int64_t last) {
    const int64_t k = g->k;
    for (int64_t p0 = 0; p0 < k; p0 += F32_KC) {
        const int64_t p1 = p0 + F32_KC < k ? p0 + F32_KC : k;
        const int head = p0 == 0, tail = p1 == k;
        int64_t m = first;
        for (; m + F32_ROWS <= last; m += F32_ROWS) f32_tile(g, m, F32_ROWS, w, n0, p0, p1, head, tail);
        switch (last - m) {
        case 5: f32_tile(g, m, 5, w, n0, p0, p1, head, tail); break;
        case 4: f32_tile(g, m, 4, w, n0, p0, p1, head, tail); break;
        case 3: f32_tile(g, m, 3, w, n0, p0, p1, head, tail); break;
        case 2: f32_tile(g, m, 2, w, n0, p0, p1, head, tail); break;
        case 1: f32_tile(g, m, 1, w, n0, p0, p1, head, tail); break;
        }
    }
}

static void *run_f32_units(void *arg) {
    const F32Span *s = (const F32Span *)arg;
    const F32Gemm *g = s->g;
    if (s->begin >= s->end) return NULL;
    const int64_t rows = g->rows, first_unit = s->begin / rows, last_unit = (s->end - 1) / rows;
    int64_t panel = F32_PANEL_BYTES / (g->k * (int64_t)sizeof(float)) / F32_ROWS * F32_ROWS;
    if (panel < F32_ROWS) panel = F32_ROWS;
    for (int64_t first = 0; first < rows; first += panel) {
        const int64_t last = first + panel < rows ? first + panel : rows;
        for (int64_t unit = first_unit; unit <= last_unit; unit++) {
            /* this span's rows of the unit, within the panel */
            int64_t lo = unit == first_unit ? s->begin - unit * rows : 0;
            int64_t hi = unit == last_unit ? s->end - unit * rows : rows;
            lo = lo > first ? lo : first;
            hi = hi < last ? hi : last;
            if (lo < hi) f32_unit_rows(g, g->packed + unit * g->k * F32_UNIT, unit * F32_UNIT, lo, hi);
        }
    }
    return NULL;
}

/* Position `share` of `total` (units x rows), its row rounded to a whole micro-tile. */
static int64_t f32_split(int64_t total, int64_t share, int threads, int64_t rows) {
    const int64_t at = total * share / threads, unit = at / rows;
    const int64_t row = (at % rows + F32_ROWS / 2) / F32_ROWS * F32_ROWS;
    return row >= rows ? (unit + 1) * rows : unit * rows + row;
}

/* out = x @ W^T (+ bias): x fp32 [rows, k] (unit stride along rows, row stride x_stride), the
 * weight packed by f32_gemm_pack (n columns), out fp32 [rows, n] (row stride out_stride). Returns 0. */
int f32_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias, int64_t rows, int64_t k,
             int64_t n, float *out, int64_t out_stride, int num_threads) {
    if (rows < 1 || n < 1) return 0;
    const F32Gemm g = {.x = x, .x_stride = x_stride, .packed = packed, .bias = bias, .rows = rows, .k = k, .n = n,
                       .out = out, .out_stride = out_stride};
    const int64_t total = (n + F32_UNIT - 1) / F32_UNIT * rows;
    const int threads = span_threads(num_threads, total / (4 * F32_ROWS)); /* (at least 4 micro-tiles a thread) */
    F32Span spans[MAX_THREADS];
    for (int s = 0; s < threads; s++) {
        spans[s].g = &g;
        spans[s].begin = f32_split(total, s, threads, rows);
        spans[s].end = s + 1 == threads ? total : f32_split(total, s + 1, threads, rows);
    }
    run_spans(run_f32_units, spans, sizeof spans[0], threads);
    return 0;
}

#else /* no AVX2 + FMA: nothing to run */

int f32_gemm_supported(void) { return 0; }

int f32_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias, int64_t rows, int64_t k,
             int64_t n, float *out, int64_t out_stride, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)rows, (void)k, (void)n, (void)out, (void)out_stride;
    (void)num_threads;
    return -2;
}

#endif
