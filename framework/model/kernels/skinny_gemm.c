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
#include <stdlib.h>
#include <string.h>

#include "common.h"

enum { PLAIN = 0, ADD = 1, GATE_UP = 2 };

/* The most rows of x a call takes. */
#define MAX_ROWS 16

typedef struct {
    const uint16_t *x, *w, *other;
    const uint16_t *xt; /* AMX: x in tile layout, [k / 2][rows][2] */
    uint16_t *y;
    int64_t rows, k, n_out, x_stride, y_stride, other_stride;
    int epilogue;
} Gemm;

typedef struct {
    const Gemm *g;
    int64_t begin, end; /* blocks of 16 output columns */
} Blocks;

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Linux lets a process use the AMX tiles once it has asked for their state (arch_prctl). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return usable;
}
#else
#define HAVE_AMX 0
#endif

int skinny_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Whether calls with use_amx run on AMX tiles (built for a CPU with AMX-BF16, and the kernel
 * lets this process use them). */
int skinny_amx(void) {
#if HAVE_AMX
    return amx_usable();
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

/* Row m's outputs n0.. (the lanes in `store`): + other[m] for add, rounded to bf16 and stored. */
static inline void finish(const Gemm *g, int64_t m, int64_t n0, __mmask16 store, __m512 acc) {
    if (g->epilogue == ADD)
        acc = _mm512_add_ps(acc, widen_bf16x16(_mm256_maskz_loadu_epi16(store, g->other + m * g->other_stride + n0)));
    _mm256_mask_storeu_epi16(g->y + m * g->y_stride + n0, store, to_bf16x16(acc));
}

/* Output block `blk` (16 columns; gate_up: 8 gate and the same 8 up columns) for every row of x. */
static void avx512_block(const Gemm *g, int64_t blk) {
    /* gate_up: a block is 8 gate rows and the same 8 up rows, one hsum16 for both */
    int per_block = g->epilogue == GATE_UP ? 8 : 16;
    const uint16_t *w_rows[16];
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
    __mmask16 store = (__mmask16)((1u << valid) - 1);
    for (int64_t m = 0; m < g->rows; m++) {
        __m512 acc = dot16(g->x + m * g->x_stride, w_rows, g->k);
        if (g->epilogue == GATE_UP) {
            /* lanes 0-7 gate, 8-15 up */
            __m512 up = _mm512_shuffle_f32x4(acc, acc, 0xEE);
            acc = _mm512_mul_ps(up, round_bf16x16(silu16(acc)));
            store &= 0xFF;
        }
        finish(g, m, n0, store, acc);
    }
}

static void *run_blocks(void *arg) {
    const Blocks *b = (const Blocks *)arg;
    for (int64_t blk = b->begin; blk < b->end; blk++) avx512_block(b->g, blk);
    return NULL;
}

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0 and 1: two blocks' sums, [16 columns][rows] fp32; 2 and 3: the blocks' weights for 32
 * k, [16 columns][32] bf16 as they lie in w; 4: x for the same 32 k, [16 k pairs][rows pairs]. */
static void amx_configure(int64_t rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16;
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[4] = (uint16_t)(rows * 4);
    cfg.colsb[2] = cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);
}

/* sums[b][j * 16 + m] = x[m] . w_b[j] for the 16 weight rows at w_0 (and w_1 when `two`). */
static void amx_sums(const Gemm *g, const uint16_t *w0, const uint16_t *w1, int two, float sums[2][256]) {
    const size_t w_stride = (size_t)g->k * 2, xt_stride = (size_t)g->rows * 4;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < g->k; c += 32) {
        _tile_loadd(4, g->xt + c * g->rows, xt_stride);
        _tile_loadd(2, w0 + c, w_stride);
        _tile_dpbf16ps(0, 2, 4);
        if (two) {
            _tile_loadd(3, w1 + c, w_stride);
            _tile_dpbf16ps(1, 3, 4);
        }
    }
    _tile_stored(0, sums[0], 64);
    if (two) _tile_stored(1, sums[1], 64);
}

/* Units of 16 output columns: two blocks a unit for plain and add (x's tile loaded once for
 * both), the gate block and its up block for gate_up. Then the AVX-512 path does the columns
 * past the last whole block, in the last span. */
static void *run_amx(void *arg) {
    const Blocks *b = (const Blocks *)arg;
    const Gemm *g = b->g;
    const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    float sums[2][256];
    int gate_up = g->epilogue == GATE_UP;
    int64_t whole = g->n_out / 16;
    amx_configure(g->rows);
    for (int64_t blk = b->begin; blk < b->end; blk += gate_up ? 1 : 2) {
        int64_t n0 = blk * 16;
        const uint16_t *w0 = g->w + n0 * g->k;
        int two = gate_up || blk + 1 < b->end;
        amx_sums(g, w0, gate_up ? w0 + g->n_out * g->k : w0 + 16 * g->k, two, sums);
        for (int64_t m = 0; m < g->rows; m++) {
            __m512 acc = _mm512_i32gather_ps(column, sums[0] + m, 4);
            if (gate_up) {
                __m512 up = _mm512_i32gather_ps(column, sums[1] + m, 4);
                finish(g, m, n0, 0xFFFF, _mm512_mul_ps(up, round_bf16x16(silu16(acc))));
                continue;
            }
            finish(g, m, n0, 0xFFFF, acc);
            if (two) finish(g, m, n0 + 16, 0xFFFF, _mm512_i32gather_ps(column, sums[1] + m, 4));
        }
    }
    _tile_release();
    if (b->end == whole && whole * 16 < g->n_out) {
        int per_block = gate_up ? 8 : 16;
        for (int64_t blk = whole * 16 / per_block; blk * per_block < g->n_out; blk++) avx512_block(g, blk);
    }
    return NULL;
}
#endif
#endif

/* y = epilogue(x @ w^T), see the top of the file. x: [rows, k] (row stride x_stride), w: [n_out, k]
 * contiguous ([2 * n_out, k] for gate_up), y: [rows, n_out] (row stride y_stride), other: [rows,
 * n_out] for add. With use_amx, on AMX tiles where skinny_amx() and k is a multiple of 32. Returns
 * 0, or -1 when the call is not supported (no AVX512-BF16, rows > 16, no memory). */
int skinny_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *other,
                     int64_t other_stride, uint16_t *y, int64_t y_stride, int64_t rows, int64_t k,
                     int64_t n_out, int epilogue, int use_amx, int num_threads) {
#if defined(__AVX512BF16__)
    if (rows < 1 || rows > MAX_ROWS || k < 1 || n_out < 1) return -1;
    Gemm g = {x, w, other, NULL, y, rows, k, n_out, x_stride, y_stride, other_stride, epilogue};
    void *(*run)(void *) = run_blocks;
    int64_t blocks = (n_out + (epilogue == GATE_UP ? 7 : 15)) / (epilogue == GATE_UP ? 8 : 16);
    uint16_t *xt = NULL;
#if HAVE_AMX
    if (use_amx && k % 32 == 0 && n_out >= 16 && amx_usable()) {
        /* x's pairs of k, row after row: a tile of 32 k is 16 rows of `rows` pairs */
        xt = (uint16_t *)malloc((size_t)k * rows * sizeof(uint16_t));
        if (!xt) return -1;
        for (int64_t m = 0; m < rows; m++)
            for (int64_t p = 0; p < k / 2; p++) {
                xt[(p * rows + m) * 2] = x[m * x_stride + 2 * p];
                xt[(p * rows + m) * 2 + 1] = x[m * x_stride + 2 * p + 1];
            }
        g.xt = xt;
        run = run_amx;
        blocks = n_out / 16;
    }
#else
    (void)use_amx;
#endif
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > blocks) num_threads = (int)blocks;
    if (num_threads < 1) num_threads = 1;
    Blocks spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++) {
        spans[s].g = &g;
        spans[s].begin = blocks * s / num_threads;
        spans[s].end = blocks * (s + 1) / num_threads;
    }
    run_spans(run, spans, sizeof spans[0], num_threads);
    free(xt);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)other, (void)other_stride, (void)y, (void)y_stride;
    (void)rows, (void)k, (void)n_out, (void)epilogue, (void)use_amx, (void)num_threads;
    return -1;
#endif
}
