/* bf16 GEMMs from weights packed once in blocks of 16 output columns, on AMX tiles (Xeon Sapphire
 * Rapids and later) or with AVX512-BF16 alone (AMD Zen 4 and later, Xeons before AMX).
 *
 * y[m, n] = x[m, :] . w[n, :], with the weight packed once at load (packed_gemm_pack) so that every
 * tile of it, 16 output columns by 32 k, is one contiguous KiB: packed[b][k / 2][16][2] holds
 * w[16 b + j][2 p + e] at [b][p][j][e]. That is an AMX B tile per 32 k, and per k pair one
 * 64-byte vector of 16 columns x 2 k, the operand `vdpbf16ps` takes against a broadcast pair of x.
 * x is read as it lies. At decode sizes the GEMM streams the weight once from DRAM; oneDNN is
 * slower there (its per-call cost, and SiLU(gate) * up in three calls where this takes one; the
 * measurements are in cpu_kernels.PackedGemm).
 *
 * Tiles: 0-3 sums, [16 rows][16 columns] fp32, for two row groups x two column blocks; 4, 5: the
 * row groups' x for 32 k; 6, 7: the column blocks' weights for the same 32 k. At decode sizes a
 * pair of column blocks goes over every pair of row groups while the pair's weights (32 x k bf16)
 * stay in L1 (run_units); a prefill tile takes each pair of row groups over a panel of column
 * blocks instead, its x in L1 and the panel's weights in L2 (run_units_by_rows).
 * Vectors: micro-tiles of VEC_ROWS rows x VEC_BLOCKS column blocks, 24 fp32 sums in registers, for
 * every k pair one weight load per block and one broadcast of x per row.
 * Epilogues, all in fp32 before one bf16 rounding:
 *   plain:    y = bf16(acc)
 *   add:      y = bf16(acc + other[m, n])          (residual add, oneDNN's binary add post-op)
 *   gate_up:  packed is [gate; up] (2 * n_out columns), y = bf16(bf16(silu(gate)) * up), the
 *             rounding of oneDNN's swish GEMM followed by its binary-mul GEMM
 * The sums run in another order than oneDNN's, so results match it up to fp32 rounding before the
 * bf16 rounding (the tests compare with fp32 references).
 *
 * GGUF Q4_1 weights (q4_gemm_pack, q4_gemm_bf16; framework/model/gguf_decode.py): the file's blocks
 * repacked per 16 columns x 32 k (a third of the bf16 bytes), for decode steps. Either widened per
 * unit of columns to the bf16 of the dequantized weight and run as above (the same bits as the
 * bf16 copy of that weight), or multiplied as they are on the vectors, the exact weights d q + m
 * against the bf16 x (fewest instructions at a few rows).
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it
 * can) and called through ctypes. packed_gemm_supported says which paths the CPU and the build
 * have; without AVX512-BF16 the model keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"

/* 2: AMX tiles and vectors, 1: vectors only (AVX512-BF16), 0: neither (the calls return -1). */
int packed_gemm_supported(void) {
#if HAVE_AMX
    if (amx_usable()) return 2;
#endif
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* packed[b][p][j][e] = w[16 b + j][2 p + e] for w [n, k] (k even); rows past n are zeros. */
void packed_gemm_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
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

/* A Q4_1 block of the GGUF file: 32 consecutive k of one output column (one row of w) as
 * w = d q + m, fp16 d and m, q in 0..15: element e's q is the low nibble of qs[e] for e < 16, the
 * high nibble of qs[e - 16] above. */
#define Q4_FILE_BLOCK 20
/* Packed, per 16 columns x 32 k (Q4_BLOCK bytes): 8 groups of 32 bytes, group g for k 4g..4g+3:
 * byte 2j = q[4g][j] | q[4g + 2][j] << 4, byte 2j + 1 = q[4g + 1][j] | q[4g + 3][j] << 4 (column
 * j); then the columns' 16 d and 16 m, fp16. Zero-extended to 16-bit lanes, a group's bytes are
 * two `vdpbf16ps` operands after one or two instructions each: lane pair j holds (k 4g, 4g + 1) in
 * the low nibbles and (k 4g + 2, 4g + 3) in the high ones, and a nibble q or'ed under 0x4300 is
 * the bf16 of 128 + q. So a block's sums are s = sum x (128 + q) and w . x = d s + (m - 128 d) sum x.
 * Blocks are stored column block by column block, k in order within each. */
#define Q4_BLOCK 320
#define Q4_ROWS 4 /* rows of x at a time: 4 x 2 column blocks, 8 sums and 8 totals in registers */
#define Q4_PREFETCH 8 /* blocks ahead */

/* The packed copy (Q4_BLOCK bytes per 16 columns x 32 k, laid out as above) of a GGUF Q4_1
 * weight of n rows (output columns, n a multiple of 16) by k (a multiple of 32): `blocks` is the
 * file's rows, k / 32 blocks of Q4_FILE_BLOCK bytes each. Returns 0, or -1 for such n or k. */
int q4_gemm_pack(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *packed) {
    if (n < 16 || n % 16 || k < 32 || k % 32) return -1;
    const int64_t kbs = k / 32;
    for (int64_t cb = 0; cb < n / 16; cb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint8_t *dst = packed + (cb * kbs + kb) * Q4_BLOCK;
            for (int j = 0; j < 16; j++) {
                const uint8_t *src = blocks + ((cb * 16 + j) * kbs + kb) * Q4_FILE_BLOCK;
                memcpy(dst + 256 + 2 * j, src, 2);     /* d */
                memcpy(dst + 288 + 2 * j, src + 2, 2); /* m */
                uint8_t q[32];
                for (int e = 0; e < 16; e++) {
                    q[e] = src[4 + e] & 15;
                    q[e + 16] = src[4 + e] >> 4;
                }
                for (int grp = 0; grp < 8; grp++) {
                    dst[32 * grp + 2 * j] = (uint8_t)(q[4 * grp] | q[4 * grp + 2] << 4);
                    dst[32 * grp + 2 * j + 1] = (uint8_t)(q[4 * grp + 1] | q[4 * grp + 3] << 4);
                }
            }
        }
    return 0;
}

#if defined(__AVX512BF16__)
typedef struct {
    const uint16_t *x, *packed, *other;
    const uint16_t *x_tail; /* the last row group, zero-padded to 16 rows (NULL: none partial) */
    uint16_t *y;
    int64_t rows, k, n_out, x_stride, y_stride, other_stride;
    int epilogue;
    int stream; /* non-temporal stores of y (finish) */
} Gemm;

typedef struct {
    const Gemm *g;
    int64_t begin, end; /* units of column blocks: see run_units and run_units_vec */
} Units;

#define PANEL_BYTES (768 << 10) /* of x at a time: a share of the 2 MiB L2 (run_units, run_units_vec) */
#define L1_UNIT_BYTES (40 << 10) /* a unit's weights that stay in the 48 KiB L1 of the AMX Xeons (run_units) */
#define COL_PANEL_BYTES (1 << 20) /* of weights at a time in run_units_by_rows: half the L2 */
#define ROW_ORDER_ROWS 1024      /* GEMMs of at least this many rows take run_units_by_rows */

/* The epilogues run once per output, so they matter at a few hundred rows: one instruction for
 * the bf16 rounding (to_bf16x16, common.h) and a reciprocal refined by one Newton step (~23 bits)
 * for the SiLU instead of a division (the epilogues took a third of a decode step's GEMM time at
 * 256 rows with common.h's to_bf16x16 and a division). */

/* x / (1 + exp(-x)), exp's argument held to 80: exp16 overflows to inf past ~88.7, and the
 * reciprocal of inf times inf is NaN (x / (1 + e^80) is ~1e-33 x, zero next to anything else). */
static inline __m512 silu16(__m512 x) {
    __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(80.0f)));
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))); /* r (2 - d r) */
    return _mm512_mul_ps(x, r);
}

/* Row m's outputs n0.. (the lanes in `store`): + other[m] for add, rounded to bf16 and stored.
 * With `stream`, whole aligned groups of 16 go past the caches (non-temporal stores): the caller
 * of a wide output that is read once, later (the LM head's logits), so that its lines are neither
 * read from DRAM before being written nor left to crowd out the weights. A row's column blocks
 * are stored one after the other, so the write-combining buffers fill whole lines. */
static inline void finish(const Gemm *g, int64_t m, int64_t n0, __mmask16 store, __m512 acc) {
    if (g->epilogue == ADD)
        acc = _mm512_add_ps(acc, widen_bf16x16(_mm256_maskz_loadu_epi16(store, g->other + m * g->other_stride + n0)));
    uint16_t *dst = g->y + m * g->y_stride + n0;
    if (g->stream && store == 0xFFFF && !((uintptr_t)dst & 31)) {
        _mm256_stream_si256((__m256i *)dst, to_bf16x16(acc));
        return;
    }
    _mm256_mask_storeu_epi16(dst, store, to_bf16x16(acc));
}

/* ---- vectors (AVX512-BF16) ----------------------------------------------------------------- */

/* A micro-tile: 6 rows of x by a unit of 4 column blocks (gate_up: two gate blocks and their two
 * up blocks), 24 sums in registers. 4 x 4 was as fast, 8 x 2 and 12 x 2 slower at a few rows, and
 * 8 x 3 wastes a third of the gate_up units (a 2-core Xeon held to AVX512-BF16, 1-2,048 rows). */
#define VEC_ROWS 6
#define VEC_BLOCKS 4

/* Rows m0..m0+R of x by the unit's column blocks w[0..VEC_BLOCKS), then their epilogue. */
static inline __attribute__((always_inline)) void vec_tile(const Gemm *g, int64_t m0, const int R,
                                                           const uint16_t *const w[VEC_BLOCKS],
                                                           const int64_t n0[VEC_BLOCKS]) {
    __m512 acc[VEC_ROWS][VEC_BLOCKS];
    const uint16_t *x[VEC_ROWS];
    for (int r = 0; r < R; r++) {
        x[r] = g->x + (m0 + r) * g->x_stride;
        for (int c = 0; c < VEC_BLOCKS; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const int64_t pairs = g->k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[VEC_BLOCKS];
        for (int c = 0; c < VEC_BLOCKS; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w[c] + p * 32);
        for (int r = 0; r < R; r++) {
            __m512bh xb = pair_bcast(x[r] + 2 * p);
            for (int c = 0; c < VEC_BLOCKS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
        }
    }
    for (int r = 0; r < R; r++) {
        int64_t m = m0 + r;
        if (g->epilogue == GATE_UP) {
            for (int c = 0; c < VEC_BLOCKS / 2; c++)
                finish(g, m, n0[c], first_lanes(g->n_out - n0[c]),
                       _mm512_mul_ps(acc[r][VEC_BLOCKS / 2 + c], widen_bf16x16(to_bf16x16(silu16(acc[r][c])))));
            continue;
        }
        for (int c = 0; c < VEC_BLOCKS; c++) finish(g, m, n0[c], first_lanes(g->n_out - n0[c]), acc[r][c]);
    }
}

/* The span's units over the rows, in panels of at most PANEL_BYTES of x as on the tiles: a unit's
 * weights (4 blocks: 72 KiB at k = 576) stay in L2 while the panel's micro-tiles pass over them. */
static void *run_units_vec(void *arg) {
    const Units *u = (const Units *)arg;
    const Gemm *g = u->g;
    const int64_t block_elems = g->k * 16, blocks = (g->n_out + 15) / 16;
    const int gate_up = g->epilogue == GATE_UP;
    int64_t panel = PANEL_BYTES / (g->k * 2) / VEC_ROWS * VEC_ROWS;
    if (panel < VEC_ROWS) panel = VEC_ROWS;
    for (int64_t first = 0; first < g->rows; first += panel) {
        const int64_t last = first + panel < g->rows ? first + panel : g->rows;
        for (int64_t unit = u->begin; unit < u->end; unit++) {
            const uint16_t *w[VEC_BLOCKS];
            int64_t n0[VEC_BLOCKS];
            for (int c = 0; c < VEC_BLOCKS; c++) {
                /* gate_up: blocks 2 unit + c % 2 of the gate half, then of the up half */
                int64_t col = gate_up ? VEC_BLOCKS / 2 * unit + c % (VEC_BLOCKS / 2) : VEC_BLOCKS * unit + c;
                int64_t upper = gate_up && c >= VEC_BLOCKS / 2 ? blocks : 0;
                /* a block past the end takes block 0's weights, its outputs not stored (n0 = n_out) */
                w[c] = g->packed + ((col < blocks ? col : 0) + upper) * block_elems;
                n0[c] = col < blocks ? col * 16 : g->n_out;
            }
            int64_t m = first;
            for (; m + VEC_ROWS <= last; m += VEC_ROWS) vec_tile(g, m, VEC_ROWS, w, n0);
            switch (last - m) { /* (a constant R for each, so that the sums stay in registers) */
            case 5: vec_tile(g, m, 5, w, n0); break;
            case 4: vec_tile(g, m, 4, w, n0); break;
            case 3: vec_tile(g, m, 3, w, n0); break;
            case 2: vec_tile(g, m, 2, w, n0); break;
            case 1: vec_tile(g, m, 1, w, n0); break;
            }
        }
    }
    if (g->stream) _mm_sfence(); /* this thread's streamed stores, seen before the caller reads y */
    return NULL;
}

/* ---- GGUF Q4_1 weights (q4_gemm_bf16) ------------------------------------------------------- */

typedef struct {
    Gemm g;          /* x, y, other, strides, rows, k, n_out, epilogue (packed: unused) */
    const uint8_t *q4;
    const float *xsum; /* [rows][k / 32]: the sum of each row's 32 x of a block */
} Q4Gemm;

typedef struct {
    const Q4Gemm *q;
    int64_t begin, end; /* units: two column blocks (gate_up: a gate block and its up block) */
} Q4Units;

/* Rows m0..m0+R of x by the unit's two column blocks (w[c]: their first k block), then the epilogue. */
static inline __attribute__((always_inline)) void q4_tile(const Q4Gemm *q, int64_t m0, const int R,
                                                          const uint8_t *const w[2], const int64_t n0[2]) {
    const Gemm *g = &q->g;
    const int64_t kbs = g->k / 32;
    const __m512i low = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
    __m512 tot[Q4_ROWS][2];
    for (int r = 0; r < R; r++) tot[r][0] = tot[r][1] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint8_t *b[2] = {w[0] + kb * Q4_BLOCK, w[1] + kb * Q4_BLOCK};
        for (int c = 0; c < 2; c++)
            for (int line = 0; line < Q4_BLOCK / 64; line++)
                _mm_prefetch((const char *)b[c] + Q4_PREFETCH * Q4_BLOCK + 64 * line, _MM_HINT_T0);
        __m512 acc[Q4_ROWS][2];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int grp = 0; grp < 8; grp++) {
            __m512bh lo_pairs[2], hi_pairs[2];
            for (int c = 0; c < 2; c++) {
                __m512i z = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b[c] + 32 * grp)));
                lo_pairs[c] = (__m512bh)_mm512_ternarylogic_epi32(z, low, bias, 0xEA); /* (z & low) | bias */
                hi_pairs[c] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(z, 4), bias);
            }
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = g->x + (m0 + r) * g->x_stride + kb * 32 + 4 * grp;
                __m512bh xlo = pair_bcast(xr), xhi = pair_bcast(xr + 2);
                for (int c = 0; c < 2; c++)
                    acc[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][c], xlo, lo_pairs[c]), xhi, hi_pairs[c]);
            }
        }
        for (int c = 0; c < 2; c++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b[c] + 256)));
            const __m512 m = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f),
                                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b[c] + 288))));
            for (int r = 0; r < R; r++) {
                const __m512 sum_x = _mm512_set1_ps(q->xsum[(m0 + r) * kbs + kb]);
                tot[r][c] = _mm512_fmadd_ps(d, acc[r][c], _mm512_fmadd_ps(m, sum_x, tot[r][c]));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        if (g->epilogue == GATE_UP) {
            finish(g, m0 + r, n0[0], 0xFFFF, _mm512_mul_ps(tot[r][1], round_bf16x16(silu16(tot[r][0]))));
            continue;
        }
        for (int c = 0; c < 2; c++)
            if (n0[c] < g->n_out) finish(g, m0 + r, n0[c], 0xFFFF, tot[r][c]);
    }
}

/* The span's units, each over all rows (its weights stay in L1 after the first row group). */
static void *run_q4_units(void *arg) {
    const Q4Units *u = (const Q4Units *)arg;
    const Q4Gemm *q = u->q;
    const Gemm *g = &q->g;
    const int64_t kbs = g->k / 32, blocks = g->n_out / 16;
    const int gate_up = g->epilogue == GATE_UP;
    for (int64_t unit = u->begin; unit < u->end; unit++) {
        /* gate_up: gate block `unit` and up block `unit`; else blocks 2 unit and 2 unit + 1, the
         * second past the end for an odd count (block 0's weights read, its outputs not stored) */
        int64_t col[2] = {gate_up ? unit : 2 * unit, gate_up ? blocks + unit : 2 * unit + 1};
        if (!gate_up && col[1] >= blocks) col[1] = 0;
        const uint8_t *w[2] = {q->q4 + col[0] * kbs * Q4_BLOCK, q->q4 + col[1] * kbs * Q4_BLOCK};
        const int64_t n0[2] = {16 * col[0], gate_up || 2 * unit + 1 < blocks ? 16 * col[1] : g->n_out};
        int64_t m = 0;
        for (; m + Q4_ROWS <= g->rows; m += Q4_ROWS) q4_tile(q, m, Q4_ROWS, w, n0);
        switch (g->rows - m) { /* (a constant R for each, so that the sums stay in registers) */
        case 3: q4_tile(q, m, 3, w, n0); break;
        case 2: q4_tile(q, m, 2, w, n0); break;
        case 1: q4_tile(q, m, 1, w, n0); break;
        }
    }
    return NULL;
}

/* One packed Q4_1 block (16 columns x 32 k) as the bf16 block packed_gemm_pack makes of the
 * dequantized weight: bf16(d q + m) (d q is exact in fp32, so the one rounding of the fused
 * multiply-add is that of d q + m; then round to nearest even, as torch rounds fp32 to bf16), k
 * pair p of column j at dst[32 p + 2 j + e]. A group's 16-bit lanes are already in that order. */
static inline void q4_widen_block(const uint8_t *src, uint16_t *dst) {
    const __m512i low = _mm512_set1_epi32(15);
    const __m512i lanes_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lanes_hi = _mm512_add_epi32(lanes_lo, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 288)));
    /* per fp32 lane of a pair's first 16 (columns 0-7, each for its 2 k) and last 16 (columns 8-15) */
    const __m512 d0 = _mm512_permutexvar_ps(lanes_lo, d), d1 = _mm512_permutexvar_ps(lanes_hi, d);
    const __m512 m0 = _mm512_permutexvar_ps(lanes_lo, m), m1 = _mm512_permutexvar_ps(lanes_hi, m);
    for (int grp = 0; grp < 8; grp++) {
        /* a group's bytes of columns 0-7 and 8-15; low nibbles: k pair 2 grp, high: 2 grp + 1 */
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * grp)));
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + 32 * grp + 16)));
        __m512 a_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, low)), d0, m0);
        __m512 b_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), d1, m1);
        __m512 a_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), d0, m0);
        __m512 b_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d1, m1);
        _mm512_storeu_si512(dst + 32 * (2 * grp), (__m512i)_mm512_cvtne2ps_pbh(b_lo, a_lo));
        _mm512_storeu_si512(dst + 32 * (2 * grp + 1), (__m512i)_mm512_cvtne2ps_pbh(b_hi, a_hi));
    }
}

/* The Q4_1 blocks of a unit's columns widened (q4_widen_block) into `scratch`: a GEMM of those
 * columns alone (y, other and n_out moved to them) on bf16 blocks laid out as packed_gemm_pack lays
 * out its weight ([gate; up] for gate_up: each gate block, then each up block); returns it. */
typedef struct {
    const Q4Gemm *q;
    int64_t begin, end; /* units: per_unit column blocks (gate_up: gate blocks and their up blocks) */
    int64_t per_unit;
    uint16_t *scratch; /* per_unit (gate_up: 2 per_unit) blocks of 16 x k bf16 */
} Q4WideUnits;

static Gemm q4_widen_unit(const Q4WideUnits *u, int64_t unit) {
    const Gemm *g = &u->q->g;
    const int64_t kbs = g->k / 32, blocks = g->n_out / 16, first = unit * u->per_unit;
    const int gate_up = g->epilogue == GATE_UP;
    const int64_t count = blocks - first < u->per_unit ? blocks - first : u->per_unit;
    for (int half = 0; half < 1 + gate_up; half++)
        for (int64_t c = 0; c < count; c++)
            for (int64_t kb = 0; kb < kbs; kb++) {
                const uint8_t *src = u->q->q4 + ((half * blocks + first + c) * kbs + kb) * Q4_BLOCK;
                for (int line = 0; line < Q4_BLOCK / 64; line++)
                    _mm_prefetch((const char *)src + Q4_PREFETCH * Q4_BLOCK + 64 * line, _MM_HINT_T0);
                q4_widen_block(src, u->scratch + ((half * count + c) * kbs + kb) * 512);
            }
    Gemm v = *g;
    v.packed = u->scratch;
    v.y = g->y + 16 * first;
    v.other = g->other ? g->other + 16 * first : NULL;
    v.n_out = 16 * count;
    return v;
}

/* A Q4_1 weight on the vectors (q4_gemm_bf16, widen 2): each unit of VEC_BLOCKS columns widened,
 * then run as run_units_vec runs a unit: the same bits as the packed bf16 weight there. */
static void *run_q4_units_vec(void *arg) {
    const Q4WideUnits *u = (const Q4WideUnits *)arg;
    for (int64_t unit = u->begin; unit < u->end; unit++) {
        Gemm v = q4_widen_unit(u, unit);
        Units one = {&v, 0, 1};
        run_units_vec(&one);
    }
    return NULL;
}
#endif

#if HAVE_AMX
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

/* The next unit's weights, prefetched into L2 a few lines every 32 k while a unit's passes run: the
 * weights come from DRAM, and the tiles had waited for them at the start of every unit. A decode
 * step's GEMMs (SmolLM2, 30 layers; 2-core Xeon): 16 rows 6.7 -> 6.1 ms, 64 rows 10.6 -> 8.9, 200
 * rows 25.3 -> 19.6-20.7 (LM head 4.9 -> 4.3), 1,024 rows 99.9 -> 95-97 (LM head 40.7 -> 32). */
typedef struct {
    const char *b0, *b1; /* the two column blocks (b1 NULL: none) */
    int64_t lines, done, per_step;
} NextWeights;

/* Prefetch of the weights of unit `unit` (lines of each block spread over `passes` passes), or none. */
static NextWeights next_weights(const Gemm *g, int64_t unit, int64_t passes) {
    const int64_t blocks = (g->n_out + 15) / 16, block_elems = g->k * 16, steps = g->k / 32;
    const int gate_up = g->epilogue == GATE_UP;
    int64_t b0 = gate_up ? unit : 2 * unit, b1 = gate_up ? unit + blocks : 2 * unit + 1;
    NextWeights nw = {(const char *)(g->packed + b0 * block_elems),
                      gate_up || b1 < blocks ? (const char *)(g->packed + b1 * block_elems) : NULL,
                      block_elems * 2 / 64, 0, 0};
    nw.per_step = (nw.lines + passes * steps - 1) / (passes * steps);
    return nw;
}

/* One pass (see Pass) of unit `unit`: rows [16 group, 16 group + 32) by the unit's column blocks,
 * the sums stored into `pass`. The epilogue of `pending` (the pass before; NULL: none) runs during
 * the tile products, a few rows after every 32 k: the vector work fills the time the tiles take,
 * instead of following it (at a few hundred rows the epilogues took a third of the time after the
 * tiles). `stream_x` / `stream_w`: that operand's tiles are loaded with the hint that they will not
 * be reused (TILELOADDT1), so that they do not evict the other's, which the next passes read again.
 * `nw`: weights to prefetch meanwhile (NULL: none). */
static inline __attribute__((always_inline)) void tile_pass(const Gemm *g, int64_t unit, int64_t group, Pass *pass,
                                                           const Pass *pending, int stream_x, int stream_w,
                                                           NextWeights *nw) {
    const int64_t tile_elems = 512, block_elems = g->k * 16; /* a weight tile; a column block */
    const int64_t blocks = (g->n_out + 15) / 16, steps = g->k / 32;
    const int gate_up = g->epilogue == GATE_UP;
    const int64_t b0 = gate_up ? unit : 2 * unit, b1 = gate_up ? unit + blocks : 2 * unit + 1;
    const int two = gate_up || b1 < blocks, two_groups = group + 1 < (g->rows + 15) / 16;
    const uint16_t *w0 = g->packed + b0 * block_elems, *w1 = g->packed + b1 * block_elems;
    size_t s0 = 0, s1 = 0;
    const uint16_t *x0 = group_rows(g, group, &s0);
    const uint16_t *x1 = two_groups ? group_rows(g, group + 1, &s1) : NULL;
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
        if (stream_w)
            _tile_stream_loadd(6, w0 + c / 32 * tile_elems, 64);
        else
            _tile_loadd(6, w0 + c / 32 * tile_elems, 64);
        if (stream_x)
            _tile_stream_loadd(4, x0 + c, s0);
        else
            _tile_loadd(4, x0 + c, s0);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            if (stream_w)
                _tile_stream_loadd(7, w1 + c / 32 * tile_elems, 64);
            else
                _tile_loadd(7, w1 + c / 32 * tile_elems, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (two_groups) {
            if (stream_x)
                _tile_stream_loadd(5, x1 + c, s1);
            else
                _tile_loadd(5, x1 + c, s1);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
        for (int64_t l = 0; nw && l < nw->per_step && nw->done < nw->lines; l++, nw->done++) {
            _mm_prefetch(nw->b0 + nw->done * 64, _MM_HINT_T1);
            if (nw->b1) _mm_prefetch(nw->b1 + nw->done * 64, _MM_HINT_T1);
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
}

/* A thread's passes in turn: two Pass buffers alternate, each pass finishing the one before it
 * (tile_pass); end_passes finishes the last one and gives the tiles back. */
typedef struct {
    Pass buf[2];
    Pass *pending;
    int next;
} Passes;

static inline __attribute__((always_inline)) void next_pass(const Gemm *g, Passes *ps, int64_t unit, int64_t group,
                                                           int stream_x, int stream_w, NextWeights *nw) {
    tile_pass(g, unit, group, &ps->buf[ps->next], ps->pending, stream_x, stream_w, nw);
    ps->pending = &ps->buf[ps->next];
    ps->next ^= 1;
}

static void end_passes(const Gemm *g, Passes *ps) {
    if (ps->pending) finish_rows(g, ps->pending, 0, ps->pending->rows);
    _tile_release();
    if (g->stream) _mm_sfence(); /* this thread's streamed stores, seen before the caller reads y */
}

/* Unit by unit (a unit: two column blocks, or a gate block and its up block), each over the rows in
 * passes of two row groups while its weights stay in L1: the order for decode steps, whose weights
 * come from DRAM once. */
static void *run_units(void *arg) {
    const Units *u = (const Units *)arg;
    const Gemm *g = u->g;
    const int64_t groups = (g->rows + 15) / 16;
    /* Where a unit's weights fit in L1 beside a pass's working set (k up to 640 here: qkv, o and
     * gate_up of SmolLM2, not down), x's tiles are loaded with the hint that they will not be
     * reused (TILELOADDT1), so they stop evicting the weights, which every pass of the unit reads
     * again. Measured (2-core Xeon, 200 rows): gate_up with L2-hot weights 0.337-0.350 -> 0.310-0.317
     * ms, 1,024 rows 1.55 -> 1.34-1.40; W200's decode GEMMs in the engine 3.63 -> 3.31 s. With
     * k = 1,536 (96 KiB of weights a unit) the hint made down 5 % slower. */
    const int x_stream = 2 * 16 * g->k * 2 <= L1_UNIT_BYTES;
    Passes ps = {.pending = NULL, .next = 0};
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
        NextWeights nw, *prefetch = NULL; /* (the next panel's first unit is not prefetched) */
        if (unit + 1 < u->end) nw = next_weights(g, unit + 1, (last - first + 1) / 2), prefetch = &nw;
        for (int64_t group = first; group < last; group += 2) next_pass(g, &ps, unit, group, x_stream, 0, prefetch);
    }
    end_passes(g, &ps);
    return NULL;
}

/* Row pairs outer, units inner, within column panels of at most COL_PANEL_BYTES of weights: the
 * order for prefill tiles (at least ROW_ORDER_ROWS rows). A pass's x (two row groups, 36 KiB at
 * k = 576) stays in L1 while the panel's units go over it, their weights from L2 (loaded with the
 * no-reuse hint); the panel's weights come from DRAM once, for its first row pair (the next unit's
 * prefetched meanwhile). The bits are those of run_units: every sum runs over k in the same order.
 * A prefill tile's four GEMMs of a layer, 30 layers' weights, each output the next one's input
 * (2-core Xeon with AMX): 2,048 rows 6.6-7.2 -> 5.8-6.3 ms a layer, 1,024 rows 3.47-3.50 ->
 * 3.22-3.29; 512 rows 1.69-1.74 either way, 200 rows 0.83-0.87 -> 0.92-0.95 (so not for decode).
 * Column panels of 512 KiB or 2 MiB were slower than 1 MiB at 2,048 rows. */
static void *run_units_by_rows(void *arg) {
    const Units *u = (const Units *)arg;
    const Gemm *g = u->g;
    const int64_t groups = (g->rows + 15) / 16;
    int64_t per_panel = COL_PANEL_BYTES / (2 * g->k * 16 * 2); /* units: two column blocks of k bf16 */
    if (per_panel < 1) per_panel = 1;
    Passes ps = {.pending = NULL, .next = 0};
    amx_configure();
    for (int64_t p0 = u->begin; p0 < u->end; p0 += per_panel) {
        const int64_t p1 = p0 + per_panel < u->end ? p0 + per_panel : u->end;
        for (int64_t group = 0; group < groups; group += 2)
            for (int64_t unit = p0; unit < p1; unit++) {
                NextWeights nw, *prefetch = NULL; /* while the first row pair reads the panel */
                if (group == 0 && unit + 1 < p1) nw = next_weights(g, unit + 1, 1), prefetch = &nw;
                next_pass(g, &ps, unit, group, 0, 1, prefetch);
            }
    }
    end_passes(g, &ps);
    return NULL;
}

/* A Q4_1 weight on the tiles (q4_gemm_bf16, widen 1): unit by unit as run_units, each unit's two
 * column blocks first widened to the bf16 blocks of the dequantized weight (q4_widen_unit), then
 * its passes run on them as on packed_gemm_pack's copy of the model's bf16 weight: the same tile
 * products in the same order, so the same bits, from a third of the bytes. Each unit's last pass
 * is finished before the next unit's. */
static void *run_q4_units_tiles(void *arg) {
    const Q4WideUnits *u = (const Q4WideUnits *)arg;
    const Gemm *g = &u->q->g;
    const int64_t groups = (g->rows + 15) / 16;
    const int x_stream = 2 * 16 * g->k * 2 <= L1_UNIT_BYTES; /* as run_units */
    amx_configure();
    for (int64_t unit = u->begin; unit < u->end; unit++) {
        Gemm v = q4_widen_unit(u, unit);
        Passes ps; /* (not zeroed: 8 KiB of sums) */
        ps.pending = NULL;
        ps.next = 0;
        for (int64_t group = 0; group < groups; group += 2) next_pass(&v, &ps, 0, group, x_stream, 0, NULL);
        if (ps.pending) finish_rows(&v, ps.pending, 0, ps.pending->rows);
    }
    _tile_release();
    return NULL;
}
#endif

#if HAVE_AMX
/* Gives g the zero-padded copy of x's last row group where it is partial (the tiles load 16 rows at
 * a time; group_rows): *tail is that copy (NULL where the groups are whole), for the caller to free.
 * Returns -1 without memory. */
static int pad_last_group(Gemm *g, uint16_t **tail) {
    *tail = NULL;
    if (g->rows % 16 == 0) return 0;
    const int64_t first = g->rows / 16 * 16;
    *tail = (uint16_t *)calloc((size_t)16 * g->k, sizeof(uint16_t));
    if (!*tail) return -1;
    for (int64_t m = first; m < g->rows; m++)
        memcpy(*tail + (m - first) * g->k, g->x + m * g->x_stride, (size_t)g->k * 2);
    g->x_tail = *tail;
    return 0;
}
#endif

/* y = epilogue(x @ w^T), see the top of the file, on the tiles (`tiles` 1) or the vectors (0). x:
 * [rows, k] (row stride x_stride, k a multiple of 32), packed: packed_gemm_pack of w [n_out, k]
 * ([2 * n_out, k] for gate_up, n_out a multiple of 16 then), y: [rows, n_out] (row stride
 * y_stride), other: [rows, n_out] for add. `stream` 1: y is stored past the caches (see finish),
 * for an output that is not read again soon. Returns 0, or -1 when the call is not supported
 * (the path not there, k or n_out as above, no memory). */
int packed_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *other,
                     int64_t other_stride, uint16_t *y, int64_t y_stride, int64_t rows, int64_t k, int64_t n_out,
                     int epilogue, int num_threads, int tiles, int stream) {
#if defined(__AVX512BF16__)
    if (rows < 1 || k < 32 || k % 32 || n_out < 1 || (epilogue == GATE_UP && n_out % 16)) return -1;
    Gemm g = {x, packed, other, NULL, y, rows, k, n_out, x_stride, y_stride, other_stride, epilogue, stream != 0};
    int64_t blocks = (n_out + 15) / 16;
    Units spans[MAX_THREADS];
    if (!tiles) {
        int64_t per = epilogue == GATE_UP ? VEC_BLOCKS / 2 : VEC_BLOCKS, units = (blocks + per - 1) / per;
        num_threads = span_threads(num_threads, units);
        for (int s = 0; s < num_threads; s++)
            spans[s] = (Units){&g, units * s / num_threads, units * (s + 1) / num_threads};
        run_spans(run_units_vec, spans, sizeof spans[0], num_threads);
        return 0;
    }
#if HAVE_AMX
    uint16_t *tail;
    if (!amx_usable() || pad_last_group(&g, &tail)) return -1;
    int64_t units = epilogue == GATE_UP ? blocks : (blocks + 1) / 2;
    num_threads = span_threads(num_threads, units);
    for (int s = 0; s < num_threads; s++)
        spans[s] = (Units){&g, units * s / num_threads, units * (s + 1) / num_threads};
    run_spans(rows >= ROW_ORDER_ROWS ? run_units_by_rows : run_units, spans, sizeof spans[0], num_threads);
    free(tail);
    return 0;
#else
    return -1;
#endif
#else
    (void)x, (void)x_stride, (void)packed, (void)other, (void)other_stride, (void)y, (void)y_stride;
    (void)rows, (void)k, (void)n_out, (void)epilogue, (void)num_threads, (void)tiles, (void)stream;
    return -1;
#endif
}

/* y = epilogue(x @ w^T) for a GGUF Q4_1 weight w packed by q4_gemm_pack ([n_out, k], [2 * n_out,
 * k] = [gate; up] for gate_up), with the epilogues of packed_gemm_bf16; x and y as there, n_out a
 * multiple of 16. `widen` 0: the products of the file's exact weights (d q + m in fp32) with the
 * bf16 x, summed in fp32, for a few rows (every Q4_ROWS rows take the unit's weights again, from
 * L1); 1: each unit's blocks widened to bf16 and run on the AMX tiles as packed_gemm_bf16 runs the
 * packed bf16 weight (the same bits as that weight there), 2: the same on the vectors. Returns
 * 0, or -1 when the call is not supported (no AVX512-BF16, no AMX for 1, k or n_out as above, no
 * memory). */
int q4_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *packed, const uint16_t *other,
                 int64_t other_stride, uint16_t *y, int64_t y_stride, int64_t rows, int64_t k, int64_t n_out,
                 int epilogue, int num_threads, int widen) {
#if defined(__AVX512BF16__)
    if (rows < 1 || k < 32 || k % 32 || n_out < 16 || n_out % 16 || epilogue < PLAIN || epilogue > GATE_UP)
        return -1;
    const int64_t kbs = k / 32;
    Q4Gemm q = {{x, NULL, other, NULL, y, rows, k, n_out, x_stride, y_stride, other_stride, epilogue, 0}, packed, NULL};
    if (widen) { /* 1: on the tiles, 2: on the vectors */
        const int64_t blocks = n_out / 16;
        int64_t per_unit = widen == 1 ? 2 : VEC_BLOCKS;
        if (epilogue == GATE_UP) per_unit /= 2;
        const int64_t units = (blocks + per_unit - 1) / per_unit;
        void *(*run)(void *) = run_q4_units_vec;
        uint16_t *tail = NULL;
        if (widen == 1) {
#if HAVE_AMX
            if (!amx_usable() || pad_last_group(&q.g, &tail)) return -1;
            run = run_q4_units_tiles;
#else
            return -1;
#endif
        } else if (widen != 2) {
            return -1;
        }
        Q4WideUnits spans[MAX_THREADS];
        num_threads = span_threads(num_threads, units);
        const size_t per_thread = (size_t)(epilogue == GATE_UP ? 2 : 1) * per_unit * 16 * k; /* bf16 values */
        uint16_t *scratch = (uint16_t *)aligned_alloc(64, (size_t)num_threads * per_thread * sizeof(uint16_t));
        if (!scratch) {
            free(tail);
            return -1;
        }
        for (int s = 0; s < num_threads; s++)
            spans[s] = (Q4WideUnits){&q, units * s / num_threads, units * (s + 1) / num_threads, per_unit,
                                     scratch + (size_t)s * per_thread};
        run_spans(run, spans, sizeof spans[0], num_threads);
        free(scratch);
        free(tail);
        return 0;
    }
    float *xsum = (float *)malloc((size_t)(rows * kbs) * sizeof(float));
    if (!xsum) return -1;
    q.xsum = xsum;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            const uint16_t *xb = x + m * x_stride + kb * 32;
            __m512 s = _mm512_add_ps(widen_bf16x16(_mm256_loadu_si256((const __m256i *)xb)),
                                     widen_bf16x16(_mm256_loadu_si256((const __m256i *)(xb + 16))));
            xsum[m * kbs + kb] = _mm512_reduce_add_ps(s);
        }
    const int64_t blocks = n_out / 16, units = epilogue == GATE_UP ? blocks : (blocks + 1) / 2;
    Q4Units spans[MAX_THREADS];
    num_threads = span_threads(num_threads, units);
    for (int s = 0; s < num_threads; s++)
        spans[s] = (Q4Units){&q, units * s / num_threads, units * (s + 1) / num_threads};
    run_spans(run_q4_units, spans, sizeof spans[0], num_threads);
    free(xsum);
    return 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)other, (void)other_stride, (void)y, (void)y_stride;
    (void)rows, (void)k, (void)n_out, (void)epilogue, (void)num_threads, (void)widen;
    return -1;
#endif
}
