/* bf16 GEMMs on AMX tiles from weights packed in the tiles' layout, for CPUs with AMX-BF16 (Xeon
 * Sapphire Rapids and later).
 *
 * y[m, n] = x[m, :] . w[n, :], with the weight packed once at load (amx_pack_bf16) so that every
 * tile of it, 16 output columns by 32 k, is one contiguous KiB: packed[b][k / 2][16][2] holds
 * w[16 b + j][2 p + e] at [b][p][j][e]. x is read as it lies, 16 rows to a tile. At decode sizes
 * the GEMM streams the weight once from DRAM; oneDNN's AMX kernels are slower there (measured on
 * a 2-core Xeon, a decode step's GEMMs of SmolLM2-135M: see cpu_kernels.AmxGemm).
 *
 * Tiles: 0-3 sums, [16 rows][16 columns] fp32, for two row groups x two column blocks; 4, 5: the
 * row groups' x for 32 k; 6, 7: the column blocks' weights for the same 32 k. A pair of column
 * blocks goes over every pair of row groups while the pair's weights (32 x k bf16) stay in L2.
 * Epilogues, all in fp32 before one bf16 rounding (as kernels/skinny_gemm.c):
 *   plain:    y = bf16(acc)
 *   add:      y = bf16(acc + other[m, n])          (residual add)
 *   gate_up:  packed is [gate; up] (2 * n_out columns), y = bf16(bf16(silu(gate)) * up)
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it
 * can) and called through ctypes. Without AMX-BF16 at build time, or where Linux does not let the
 * process use the tiles, amx_gemm_supported returns 0 and the model keeps its other GEMMs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"

int amx_gemm_supported(void) {
#if HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* packed[b][p][j][e] = w[16 b + j][2 p + e] for w [n, k] (k even); rows past n are zeros. */
void amx_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    int64_t blocks = (n + 15) / 16, pairs = k / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < 16; j++) {
            int64_t row = 16 * b + j;
            uint16_t *dst = packed + b * pairs * 32 + j * 2;
            if (row >= n) {
                for (int64_t p = 0; p < pairs; p++) dst[p * 32] = dst[p * 32 + 1] = 0;
                continue;
            }
            const uint16_t *src = w + row * k;
            for (int64_t p = 0; p < pairs; p++) {
                dst[p * 32] = src[2 * p];
                dst[p * 32 + 1] = src[2 * p + 1];
            }
        }
}

#if HAVE_AMX
typedef struct {
    const uint16_t *x, *packed, *other;
    const uint16_t *x_tail; /* the last row group, zero-padded to 16 rows (NULL: none partial) */
    uint16_t *y;
    int64_t rows, k, n_out, x_stride, y_stride, other_stride;
    int epilogue;
} Gemm;

typedef struct {
    const Gemm *g;
    int64_t begin, end; /* units: a pair of column blocks (gate_up: a gate block and its up block) */
} Units;

#define PANEL_BYTES (768 << 10) /* of x at a time: a share of the 2 MiB L2 (run_units) */

/* The epilogues run once per output, so they matter at a few hundred rows: one instruction for
 * the bf16 rounding (to_bf16x16, common.h) and a reciprocal refined by one Newton step (~23 bits)
 * for the SiLU instead of a division (the epilogues took a third of a decode step's GEMM time at
 * 256 rows with common.h's to_bf16x16 and a division). */

/* x / (1 + exp(-x)) */
static inline __m512 silu16(__m512 x) {
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))); /* r (2 - d r) */
    return _mm512_mul_ps(x, r);
}

/* Row m's outputs n0.. (the lanes in `store`): + other[m] for add, rounded to bf16 and stored. */
static inline void finish(const Gemm *g, int64_t m, int64_t n0, __mmask16 store, __m512 acc) {
    if (g->epilogue == ADD)
        acc = _mm512_add_ps(acc, widen_bf16x16(_mm256_maskz_loadu_epi16(store, g->other + m * g->other_stride + n0)));
    _mm256_mask_storeu_epi16(g->y + m * g->y_stride + n0, store, to_bf16x16(acc));
}

/* Row group `group`'s x: 16 rows from x itself, or the zero-padded copy of the last group. */
static inline const uint16_t *group_rows(const Gemm *g, int64_t group, size_t *stride) {
    if (g->x_tail && (group + 1) * 16 > g->rows) {
        *stride = (size_t)g->k * 2;
        return g->x_tail;
    }
    *stride = (size_t)g->x_stride * 2;
    return g->x + group * 16 * g->x_stride;
}

/* One pass of the tiles: up to two row groups (rows first_row.., at most 32) by up to two column
 * blocks (n0.., n1..), and their sums once stored: sums[2 * group + block][row % 16][column]. */
typedef struct {
    float sums[4][256];
    int64_t first_row, rows, n0, n1;
    int two; /* the second column block is there */
} Pass;

/* Outputs of the pass's rows [r0, r1). */
static void finish_rows(const Gemm *g, const Pass *p, int64_t r0, int64_t r1) {
    const __mmask16 keep0 = first_lanes(g->n_out - p->n0), keep1 = first_lanes(g->n_out - p->n1);
    for (int64_t r = r0; r < r1; r++) {
        const float *s0 = p->sums[2 * (r / 16)] + (r % 16) * 16, *s1 = p->sums[2 * (r / 16) + 1] + (r % 16) * 16;
        int64_t m = p->first_row + r;
        __m512 acc = _mm512_loadu_ps(s0);
        if (g->epilogue == GATE_UP) {
            finish(g, m, p->n0, keep0, _mm512_mul_ps(_mm512_loadu_ps(s1), widen_bf16x16(to_bf16x16(silu16(acc)))));
            continue;
        }
        finish(g, m, p->n0, keep0, acc);
        if (p->two) finish(g, m, p->n1, keep1, _mm512_loadu_ps(s1));
    }
}

/* The epilogue of each pass runs during the next pass's tile products, a few rows after every
 * 32 k: the vector work fills the time the tiles take, instead of following it (at a few hundred
 * rows the epilogues took a third of the time after the tiles). Two Pass buffers alternate. */
static void *run_units(void *arg) {
    const Units *u = (const Units *)arg;
    const Gemm *g = u->g;
    const int64_t tile_elems = 512, block_elems = g->k * 16; /* a weight tile; a column block */
    const int64_t groups = (g->rows + 15) / 16, blocks = (g->n_out + 15) / 16, steps = g->k / 32;
    int gate_up = g->epilogue == GATE_UP;
    Pass passes[2], *pending = NULL;
    int next = 0;
    amx_configure();
    /* The rows go in panels of at most PANEL_BYTES of x (an even number of row groups), each
     * panel over all of the span's units, so that x is read from L2 rather than L3 once it
     * outgrows it. The 150 GEMMs of SmolLM2's 30 layers (2-core Xeon): 1,024 rows 105 -> 87 ms
     * (oneDNN 134), 2,048 rows 252 -> 180 (oneDNN 173); up to 256 rows (k <= 1,536) one panel. */
    int64_t panel = PANEL_BYTES / (g->k * 2) / 32 * 2;
    if (panel < 2) panel = 2;
    const int64_t units = u->end - u->begin, items = (groups + panel - 1) / panel * units;
    for (int64_t item = 0; item < items; item++) {
        const int64_t first = item / units * panel, last = first + panel < groups ? first + panel : groups;
        const int64_t unit = u->begin + item % units;
        int64_t b0 = gate_up ? unit : 2 * unit, b1 = gate_up ? unit + blocks : 2 * unit + 1;
        int two = gate_up || b1 < blocks;
        const uint16_t *w0 = g->packed + b0 * block_elems, *w1 = g->packed + b1 * block_elems;
        /* The next unit's weights go into L2 while this unit's passes run, a few lines every 32 k:
         * the weights come from DRAM, and the tiles had waited for them at the start of every
         * unit. A decode step's GEMMs (SmolLM2, 30 layers; 2-core Xeon): 16 rows 6.7 -> 6.1 ms,
         * 64 rows 10.6 -> 8.9, 200 rows 25.3 -> 19.6-20.7 (LM head 4.9 -> 4.3), 1,024 rows
         * 99.9 -> 95-97 (LM head 40.7 -> 32). */
        const char *next0 = NULL, *next1 = NULL;
        int64_t next_lines = 0, next_done = 0, next_per_step = 0;
        if (unit + 1 < u->end) { /* (the next panel's first unit is not prefetched) */
            int64_t nb0 = gate_up ? unit + 1 : 2 * unit + 2, nb1 = gate_up ? unit + 1 + blocks : 2 * unit + 3;
            next0 = (const char *)(g->packed + nb0 * block_elems);
            next1 = gate_up || nb1 < blocks ? (const char *)(g->packed + nb1 * block_elems) : NULL;
            next_lines = block_elems * 2 / 64;
            int64_t passes = (last - first + 1) / 2;
            next_per_step = (next_lines + passes * steps - 1) / (passes * steps);
        }
        for (int64_t group = first; group < last; group += 2) {
            int two_groups = group + 1 < last;
            size_t s0 = 0, s1 = 0;
            const uint16_t *x0 = group_rows(g, group, &s0);
            const uint16_t *x1 = two_groups ? group_rows(g, group + 1, &s1) : NULL;
            Pass *pass = &passes[next];
            pass->first_row = group * 16;
            pass->rows = (group + 2) * 16 < g->rows ? 32 : g->rows - group * 16;
            pass->n0 = b0 * 16;
            pass->n1 = gate_up ? b0 * 16 : b1 * 16;
            pass->two = two;
            int64_t done = 0, per_step = pending ? (pending->rows + steps - 1) / steps : 0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < g->k; c += 32) {
                _tile_loadd(6, w0 + c / 32 * tile_elems, 64);
                _tile_loadd(4, x0 + c, s0);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(7, w1 + c / 32 * tile_elems, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_groups) {
                    _tile_loadd(5, x1 + c, s1);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
                for (int64_t l = 0; l < next_per_step && next_done < next_lines; l++, next_done++) {
                    _mm_prefetch(next0 + next_done * 64, _MM_HINT_T1);
                    if (next1) _mm_prefetch(next1 + next_done * 64, _MM_HINT_T1);
                }
                if (pending && done < pending->rows) {
                    int64_t upto = done + per_step < pending->rows ? done + per_step : pending->rows;
                    finish_rows(g, pending, done, upto);
                    done = upto;
                }
            }
            if (pending) finish_rows(g, pending, done, pending->rows);
            _tile_stored(0, pass->sums[0], 64);
            _tile_stored(1, pass->sums[1], 64);
            if (two_groups) {
                _tile_stored(2, pass->sums[2], 64);
                _tile_stored(3, pass->sums[3], 64);
            }
            pending = pass;
            next ^= 1;
        }
    }
    if (pending) finish_rows(g, pending, 0, pending->rows);
    _tile_release();
    return NULL;
}
#endif

/* y = epilogue(x @ w^T), see the top of the file. x: [rows, k] (row stride x_stride, k a multiple
 * of 32), packed: amx_pack_bf16 of w [n_out, k] ([2 * n_out, k] for gate_up, n_out a multiple of
 * 16 then), y: [rows, n_out] (row stride y_stride), other: [rows, n_out] for add. Returns 0, or -1
 * when the call is not supported (no AMX, k or n_out as above, no memory). */
int amx_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *other,
                  int64_t other_stride, uint16_t *y, int64_t y_stride, int64_t rows, int64_t k, int64_t n_out,
                  int epilogue, int num_threads) {
#if HAVE_AMX
    if (rows < 1 || k < 32 || k % 32 || n_out < 1 || (epilogue == GATE_UP && n_out % 16) || !amx_usable())
        return -1;
    Gemm g = {x, packed, other, NULL, y, rows, k, n_out, x_stride, y_stride, other_stride, epilogue};
    uint16_t *tail = NULL;
    if (rows % 16) {
        int64_t first = rows / 16 * 16;
        tail = (uint16_t *)calloc((size_t)16 * k, sizeof(uint16_t));
        if (!tail) return -1;
        for (int64_t m = first; m < rows; m++) memcpy(tail + (m - first) * k, x + m * x_stride, (size_t)k * 2);
        g.x_tail = tail;
    }
    int64_t blocks = (n_out + 15) / 16, units = epilogue == GATE_UP ? blocks : (blocks + 1) / 2;
    num_threads = span_threads(num_threads, units);
    Units spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++)
        spans[s] = (Units){&g, units * s / num_threads, units * (s + 1) / num_threads};
    run_spans(run_units, spans, sizeof spans[0], num_threads);
    free(tail);
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)other, (void)other_stride, (void)y, (void)y_stride;
    (void)rows, (void)k, (void)n_out, (void)epilogue, (void)num_threads;
    return -1;
#endif
}
