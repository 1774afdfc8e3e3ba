/* bf16 GEMMs of a few rows (decode batches) straight from nn.Linear weights, for CPUs with
 * AVX512-BF16 (Xeon Sapphire Rapids and later, AMD Zen 4 and later).
 *
 * y[m, n] = x[m, :] . w[n, :] for m < rows <= 16, w the [n_out, k] row-major weight as it is
 * (no packed copy). At these sizes the GEMM only streams the weight from DRAM, and oneDNN's
 * `_linear_pointwise` spends ~15 us per call outside the arithmetic (measured here: a 64x64
 * GEMM), 150 calls per decode step of SmolLM2, ~2 ms of a 20 ms step. Here a call costs a ctypes
 * call and one OpenMP region.
 *
 * The output columns go in blocks of 16 weight rows split over the threads; for each row of x the
 * 16 dot products are accumulated 32 products at a time (one dpbf16 each, exact products summed in
 * fp32) and finished together by hsum16. The block's weight rows (18 KiB at k = 576) stay in L1
 * while the rows of x pass over them. Epilogues, all in fp32 before one bf16 rounding:
 *   plain:    y = bf16(acc)
 *   add:      y = bf16(acc + other[m, n])         (residual add, oneDNN's binary add post-op)
 *   gate_up:  w is [gate; up] (2 * n_out rows), y = bf16(bf16(silu(gate)) * up), the rounding
 *             of oneDNN's swish GEMM followed by its binary-mul GEMM.
 * The sums run in another order than oneDNN's, so results match it up to fp32 rounding before the
 * bf16 rounding (the tests compare with fp32 references).
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it
 * can) and called through ctypes. Without AVX512-BF16 `skinny_supported` returns 0 and the model
 * keeps oneDNN.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

/* The most rows of x a call takes. */
#define MAX_ROWS 16

typedef struct {
    const uint16_t *x, *w, *other;
    uint16_t *y;
    int64_t rows, k, n_out, x_stride, y_stride, other_stride;
    int epilogue;
} Gemm;

typedef struct {
    const Gemm *g;
    int64_t begin, end; /* blocks of 16 output columns */
} Blocks;

int skinny_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* 16 dot products of x (k bf16) with the weight rows w_rows[0..16) (row pointers), in fp32. */
static inline __m512 dot16(const uint16_t *x, const uint16_t *const w_rows[16], int64_t k) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(w_rows[j] + c));
    }
    if (c < k) { /* the last k % 32 elements, zero-masked */
        __mmask32 m = (__mmask32)((1ull << (k - c)) - 1);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + c);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w_rows[j] + c));
    }
    return hsum16(acc);
}

/* x / (1 + exp(-x)) */
static inline __m512 silu16(__m512 x) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static void *run_blocks(void *arg) {
    const Blocks *b = (const Blocks *)arg;
    const Gemm *g = b->g;
    /* gate_up: a block is 8 gate rows and the same 8 up rows, one hsum16 for both */
    int per_block = g->epilogue == GATE_UP ? 8 : 16;
    const uint16_t *w_rows[16];
    for (int64_t blk = b->begin; blk < b->end; blk++) {
        int64_t n0 = blk * per_block;
        int64_t valid = g->n_out - n0 < per_block ? g->n_out - n0 : per_block;
        for (int j = 0; j < per_block; j++) {
            int64_t n = n0 + (j < valid ? j : 0); /* past the end: any valid row, result dropped */
            if (g->epilogue == GATE_UP) {
                w_rows[j] = g->w + n * g->k;
                w_rows[8 + j] = g->w + (g->n_out + n) * g->k;
            } else {
                w_rows[j] = g->w + n * g->k;
            }
        }
        __mmask16 store = first_lanes(valid);
        for (int64_t m = 0; m < g->rows; m++) {
            __m512 acc = dot16(g->x + m * g->x_stride, w_rows, g->k);
            uint16_t *y = g->y + m * g->y_stride + n0;
            if (g->epilogue == GATE_UP) {
                /* lanes 0-7 gate, 8-15 up */
                __m512 gate = round_bf16x16(silu16(acc));
                __m512 up = _mm512_shuffle_f32x4(acc, acc, 0xEE);
                __m512 out = _mm512_mul_ps(up, gate);
                _mm256_mask_storeu_epi16(y, (__mmask16)(store & 0xFF), to_bf16x16(out));
                continue;
            }
            if (g->epilogue == ADD) {
                const uint16_t *o = g->other + m * g->other_stride + n0;
                acc = _mm512_add_ps(acc, widen_bf16x16(_mm256_maskz_loadu_epi16(store, o)));
            }
            _mm256_mask_storeu_epi16(y, store, to_bf16x16(acc));
        }
    }
    return NULL;
}
#endif

/* y = epilogue(x @ w^T), see the top of the file. x: [rows, k] (row stride x_stride), w: [n_out, k]
 * contiguous ([2 * n_out, k] for gate_up), y: [rows, n_out] (row stride y_stride), other: [rows,
 * n_out] for add. Returns 0, or -1 when the call is not supported (no AVX512-BF16, rows > 16). */
int skinny_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *other,
                     int64_t other_stride, uint16_t *y, int64_t y_stride, int64_t rows, int64_t k,
                     int64_t n_out, int epilogue, int num_threads) {
#if defined(__AVX512BF16__)
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n_out < 1) return -1;
    Gemm g = {x, w, other, y, rows, k, n_out, x_stride, y_stride, other_stride, epilogue};
    int64_t per_block = epilogue == GATE_UP ? 8 : 16;
    int64_t blocks = (n_out + per_block - 1) / per_block;
    num_threads = span_threads(num_threads, blocks);
    Blocks spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++)
        spans[s] = (Blocks){&g, blocks * s / num_threads, blocks * (s + 1) / num_threads};
    run_spans(run_blocks, spans, sizeof spans[0], num_threads);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)other, (void)other_stride, (void)y, (void)y_stride;
    (void)rows, (void)k, (void)n_out, (void)epilogue, (void)num_threads;
    return -1;
#endif
}
