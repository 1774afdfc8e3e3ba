/* Prefill (extend) attention of one request on AMX tiles, straight from the paged KV pool, for
 * bf16 models with head_dim 64 on CPUs with AMX-BF16.
 *
 * The request's ext_len new tokens sit at positions prefix_len.. of its seq_len KV slots
 * (kv_indices); query i sees keys 0..prefix_len + i. For each query head and block of 16 queries
 * (`attend`): the scores against every key the block sees, the softmax of each whole row (no
 * online rescaling; exp to ~7.5e-5 by exp2_softmax below, P being rounded to bf16), then
 * P V. Only one block's scores are held at a time (16 rows of at most seq_len, per thread),
 * never an [L, S] matrix.
 *   S = Q K^T: Q's tile is 16 query rows x 32 of head_dim, read in place; K is first copied out of
 *       the pool once per KV head into the tiles' layout (K^T, head_dim in pairs), 1 KiB a tile.
 *   O = P V: P (the probabilities, fp32 softmax rounded to bf16, as torch's flash attention does
 *       for bf16) goes 16 x 32 a tile; V is copied once per KV head into the tiles' layout too
 *       (tokens in pairs). O sums in four fp32 tiles and is divided by the row sums at the end.
 * Queries sharing a KV head (grouped-query attention) read the same copies. An online softmax
 * per 32-key block was tried first and was slower than SDPA: every block handed its scores from
 * the tiles to the vector registers and back, and the tiles' latency was never hidden.
 *
 * On CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5), the same blocks run on the vectors
 * (`tiles` 0): the copies of K and V are laid out as `vdpbf16ps` takes them too, a 64-byte row of
 * a K tile being 16 keys x one head_dim pair and a row of a V tile 16 columns x one key pair. So
 * S = Q K^T is 8 query rows x 32 keys in 16 registers, each head_dim pair of a row broadcast
 * against the block's two K rows, and O = P V is 6 query rows x 64 columns in 24 registers, each
 * pair of P broadcast against four V rows. The softmax between them is the tiles' own.
 *
 * Work: the copies are split over the threads in equal runs of (KV head, 32-key block) pairs, then
 * the (query head, query block) pairs, longest first, go to whichever thread is free next. W200's
 * prefill attention replayed (its 200 prompts on an int8 pool, 9 heads, 3 KV heads, two threads of
 * a 2-core AMD EPYC Zen 4; copies by KV head and pairs dealt in turn before): 3.36 -> 3.25 s for
 * 30 layers. Built on first use by
 * framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it can) and called through
 * ctypes. extend_attention_supported says which paths the CPU and the build give; where there is
 * no AVX512-BF16, PyTorch's SDPA stays.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"

#define HEAD_DIM 64
#define TILE_ELEMS 512 /* bf16 elements of a 16 x 64-byte tile */

/* The vector path needs AVX512-BF16 (and BW for the copies' 16-bit shuffles). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_VECTORS 1
#else
#define HAVE_VECTORS 0
#endif

/* 2: the tiles and the vectors, 1: the vectors only, 0: neither (SDPA then). */
int extend_attention_supported(void) {
#if HAVE_AMX
    if (amx_usable()) return 2;
#endif
    return HAVE_VECTORS;
}

#if HAVE_VECTORS
typedef struct {
    const uint16_t *q;
    const void *k, *v; /* the pool: bf16, float8_e5m2 bytes or int8 (kv_fmt) */
    const float *k_scale, *v_scale; /* an int8 pool's [slots, kv_heads] scales */
    int kv_fmt;
    const int64_t *kv_indices;
    uint16_t *out;
    uint16_t *kt, *vt; /* the tile copies of K and V, every KV head */
    int64_t q_stride, out_stride, seq_len, prefix_len, ext_len, kv_blocks; /* kv_blocks: of 32 keys */
    int heads, kv_heads;
    float scale;
    int tiles; /* the AMX tiles (else the vectors) */
    int64_t *next; /* the next work item (query head, query block) a thread takes (run_attention) */
} Ext;

typedef struct {
    const Ext *e;
    int first, step; /* share `first` of `step` equal shares of the copies' blocks (run_copies) */
    int failed;      /* no memory for the span's scratch */
} Share;

/* K^T tile (32-key block b, half `half` of it: keys 16 half.., head_dim pairs 16 c..) of KV head h:
 * [16 head_dim pairs][16 keys][2]. */
static inline uint16_t *k_tile(const Ext *e, int h, int64_t b, int half, int c) {
    return e->kt + (((h * e->kv_blocks + b) * 2 + half) * 2 + c) * TILE_ELEMS;
}

/* V tile (32-key block b, head_dim columns 16 c..) of KV head h: [16 key pairs][16 columns][2]. */
static inline uint16_t *v_tile(const Ext *e, int h, int64_t b, int c) {
    return e->vt + ((h * e->kv_blocks + b) * 4 + c) * TILE_ELEMS;
}

/* Token t's row of KV head h in `pool` (e->k or e->v) as bf16: in place in a bf16 pool, else
 * widened into `buf` (an int8 row: bf16(value * scale), as memory.widen_kv); zeros past seq_len. */
static const uint16_t *head_row(const Ext *e, const void *pool, int64_t t, int h, uint16_t buf[HEAD_DIM]) {
    static const uint16_t zeros[HEAD_DIM];
    if (t >= e->seq_len) return zeros;
    size_t at = (size_t)e->kv_indices[t] * e->kv_heads * HEAD_DIM + (size_t)h * HEAD_DIM;
    if (e->kv_fmt == KV_BF16) return (const uint16_t *)pool + at;
    if (e->kv_fmt == KV_I8) {
        const float *scales = pool == e->k ? e->k_scale : e->v_scale;
        const __m512 s = _mm512_set1_ps(scales[(size_t)e->kv_indices[t] * e->kv_heads + h]);
        for (int j = 0; j < HEAD_DIM; j += 16)
            store16_bf16(buf + j, _mm512_mul_ps(load16((const int8_t *)pool + at + j, KV_I8), s));
        return buf;
    }
    e5m2_row_to_bf16(buf, (const uint8_t *)pool + at, HEAD_DIM);
    return buf;
}

/* Copy block b (32 keys) of KV head h's keys and values into the tiles' layout; keys past seq_len
 * are zeros. */
static void copy_block(const Ext *e, int h, int64_t b) {
    uint16_t wide[4][HEAD_DIM];
    /* K: a key's 16 head_dim pairs 16 c.. go down column key % 16 of tile (b, half, c) */
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    /* V: two keys' 16 columns interleaved, one 64-byte tile row */
    const __m512i interleave = interleave_words_index();
    for (int64_t t = b * 32; t < b * 32 + 32; t += 2) {
        const uint16_t *k0 = head_row(e, e->k, t, h, wide[0]), *k1 = head_row(e, e->k, t + 1, h, wide[1]);
        const uint16_t *v0 = head_row(e, e->v, t, h, wide[2]), *v1 = head_row(e, e->v, t + 1, h, wide[3]);
        int key = (int)(t % 32);
        for (int c = 0; c < 2; c++) {
            _mm512_i32scatter_epi32((int *)k_tile(e, h, b, key / 16, c) + key % 16, rows,
                                    _mm512_loadu_si512(k0 + 32 * c), 4);
            _mm512_i32scatter_epi32((int *)k_tile(e, h, b, key / 16, c) + key % 16 + 1, rows,
                                    _mm512_loadu_si512(k1 + 32 * c), 4);
        }
        for (int c = 0; c < 4; c++) {
            __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + 16 * c)));
            __m512i bb = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + 16 * c)));
            _mm512_storeu_si512(v_tile(e, h, b, c) + (key / 2) * 32, _mm512_permutex2var_epi16(a, interleave, bb));
        }
    }
}

/* Share s->first of s->step: an equal run of the (KV head, block) pairs, so that the threads copy
 * as much whatever the KV heads' count (by KV head, SmolLM2's 3 went 2 to one thread and 1 to the
 * other). */
static void *run_copies(void *arg) {
    Share *s = (Share *)arg;
    const Ext *e = s->e;
    const int64_t total = e->kv_heads * e->kv_blocks;
    const int64_t begin = total * s->first / s->step, end = total * (s->first + 1) / s->step;
    for (int64_t n = begin; n < end; n++) copy_block(e, (int)(n / e->kv_blocks), n % e->kv_blocks);
    return NULL;
}

/* 2^y for the softmax's y = scale (s - max) <= 0, to 7.5e-5 relative: 2^n 2^f with n = round(y),
 * |f| <= 1/2, 2^f by the cubic of least relative error there. Six instructions where common.h's
 * exp2_neg16 takes eight: no clamp (y is finite here: keys past seq_len are zero rows), and one
 * degree less for probabilities that are rounded to bf16 (2^-9 relative) next. With the loop's
 * two sums and masks on the last block only (2-core Xeon): 1,024 tokens, one thread 2.42-2.59 ->
 * 2.06-2.31 ms; W200's prefill attention replayed (its 200 prompts, 30 layers' pools, two
 * threads) 1.30-1.32 -> 1.24-1.27 s. Against fp32 attention the mean error is unchanged, the
 * largest within an output's bf16 rounding (7.8e-3 -> 9.2e-3 at 1,000 tokens). */
static inline __m512 exp2_softmax(__m512 y) {
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05517161265f), f, _mm512_set1_ps(0.24261116982f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326102734f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992805719f));
    return _mm512_scalef_ps(p, n);
}

/* The softmax numerators of 32 scores s (lanes outside keep0 / keep1 zero) as bf16 into p, and
 * added to the two sums. */
static inline __attribute__((always_inline)) void numerators(const float *s, uint16_t *p, __m512 scale, __m512 shift,
                                                             __mmask16 keep0, __mmask16 keep1, __m512 *sum0,
                                                             __m512 *sum1) {
    __m512 x0 = _mm512_maskz_mov_ps(keep0, exp2_softmax(_mm512_fmadd_ps(_mm512_loadu_ps(s), scale, shift)));
    __m512 x1 = _mm512_maskz_mov_ps(keep1, exp2_softmax(_mm512_fmadd_ps(_mm512_loadu_ps(s + 16), scale, shift)));
    *sum0 = _mm512_add_ps(*sum0, x0);
    *sum1 = _mm512_add_ps(*sum1, x1);
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
}

#if HAVE_AMX
/* The scores of 16 query rows (Q's two tiles loaded in tiles 4 and 5) against key block b into
 * scores + b * 32 (row stride ld). */
static inline void tile_scores(const Ext *e, int h, int64_t b, float *scores, int64_t ld) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(7, k_tile(e, h, b, 0, 0), 64);
    _tile_dpbf16ps(0, 4, 7);
    _tile_loadd(7, k_tile(e, h, b, 0, 1), 64);
    _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(7, k_tile(e, h, b, 1, 0), 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(7, k_tile(e, h, b, 1, 1), 64);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, scores + b * 32, ld * 4);
    _tile_stored(1, scores + b * 32 + 16, ld * 4);
}

/* o [16][64] = P V over `blocks` key blocks, on the tiles. */
static void tile_values(const Ext *e, int h, int64_t blocks, const uint16_t *probs, int64_t ldp, float *o) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; b++) {
        _tile_loadd(6, probs + b * 32, ldp * 2);
        _tile_loadd(7, v_tile(e, h, b, 0), 64);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, v_tile(e, h, b, 1), 64);
        _tile_dpbf16ps(1, 6, 7);
        _tile_loadd(7, v_tile(e, h, b, 2), 64);
        _tile_dpbf16ps(2, 6, 7);
        _tile_loadd(7, v_tile(e, h, b, 3), 64);
        _tile_dpbf16ps(3, 6, 7);
    }
    _tile_stored(0, o, HEAD_DIM * 4);
    _tile_stored(1, o + 16, HEAD_DIM * 4);
    _tile_stored(2, o + 32, HEAD_DIM * 4);
    _tile_stored(3, o + 48, HEAD_DIM * 4);
}
#endif

/* The scores of `n` (<= 8) query rows q (row stride qs) against key block b (its K copy `kb`:
 * half 0's 32 head_dim pairs of 16 keys, then half 1's) into s (row stride ld), on the vectors. */
static inline __attribute__((always_inline)) void vector_scores(const uint16_t *q, int64_t qs, const uint16_t *kb,
                                                                float *s, int64_t ld, int n) {
    __m512 lo[8], hi[8];
    for (int r = 0; r < n; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int d = 0; d < HEAD_DIM / 2; d++) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(kb + d * 32);
        const __m512bh k1 = (__m512bh)_mm512_load_si512(kb + 1024 + d * 32);
        for (int r = 0; r < n; r++) {
            const __m512bh x = pair_bcast(q + r * qs + 2 * d);
            lo[r] = _mm512_dpbf16_ps(lo[r], k0, x);
            hi[r] = _mm512_dpbf16_ps(hi[r], k1, x);
        }
    }
    for (int r = 0; r < n; r++) {
        _mm512_storeu_ps(s + r * ld, lo[r]);
        _mm512_storeu_ps(s + r * ld + 16, hi[r]);
    }
}

/* o [n][64] (n <= 6 rows of P, row stride ldp) = P V over `blocks` key blocks of V's copy `vh`
 * (a block: four column tiles of 16 key pairs x 16 columns), on the vectors. */
static inline __attribute__((always_inline)) void vector_values(const uint16_t *p, int64_t ldp, const uint16_t *vh,
                                                                int64_t blocks, const float *inv_sum, uint16_t *out,
                                                                int64_t out_stride, int n) {
    __m512 acc[6][4];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *vb = vh + b * 4 * TILE_ELEMS;
        for (int j = 0; j < 16; j++) {
            __m512bh v[4];
            for (int c = 0; c < 4; c++) v[c] = (__m512bh)_mm512_load_si512(vb + c * TILE_ELEMS + j * 32);
            for (int r = 0; r < n; r++) {
                const __m512bh x = pair_bcast(p + r * ldp + b * 32 + 2 * j);
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], x);
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        for (int c = 0; c < 4; c++) store16_bf16(out + r * out_stride + c * 16, _mm512_mul_ps(acc[r][c], inv));
    }
}

/* vector_scores and vector_values for n rows, each count a constant in its own copy: with n
 * unknown at compile time the sums were kept on the stack, not in registers (1,024 tokens, 9
 * heads, two threads of a Zen 4: 4.2 -> 3.6 ms). */
static void scores_rows(const uint16_t *q, int64_t qs, const uint16_t *kb, float *s, int64_t ld, int n) {
    switch (n) {
    case 8: vector_scores(q, qs, kb, s, ld, 8); break;
    case 7: vector_scores(q, qs, kb, s, ld, 7); break;
    case 6: vector_scores(q, qs, kb, s, ld, 6); break;
    case 5: vector_scores(q, qs, kb, s, ld, 5); break;
    case 4: vector_scores(q, qs, kb, s, ld, 4); break;
    case 3: vector_scores(q, qs, kb, s, ld, 3); break;
    case 2: vector_scores(q, qs, kb, s, ld, 2); break;
    case 1: vector_scores(q, qs, kb, s, ld, 1); break;
    }
}

static void values_rows(const uint16_t *p, int64_t ldp, const uint16_t *vh, int64_t blocks, const float *inv_sum,
                        uint16_t *out, int64_t out_stride, int n) {
    switch (n) {
    case 6: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 6); break;
    case 5: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 5); break;
    case 4: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 4); break;
    case 3: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 3); break;
    case 2: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 2); break;
    case 1: vector_values(p, ldp, vh, blocks, inv_sum, out, out_stride, 1); break;
    }
}

/* Query head g, queries i0..i0+15 (fewer at the end). The block's scores over all the keys it
 * sees are computed first (on the tiles: tile after tile, the tiles never waiting on vector code),
 * then the softmax of each whole row, then P V: no online rescaling, and on the tiles only three
 * hand-overs between the tiles and the vector registers per block. `scores` and `probs` hold 16
 * rows of up to kv_blocks * 32 keys (and a cache line). */
static void attend(const Ext *e, int g, int64_t i0, uint16_t q_pad[16 * HEAD_DIM], float *scores, uint16_t *probs) {
    const int h = g / (e->heads / e->kv_heads);
    const int rows = e->ext_len - i0 < 16 ? (int)(e->ext_len - i0) : 16;
    const uint16_t *q = e->q + i0 * e->q_stride + g * HEAD_DIM;
    int64_t qs = e->q_stride;
    if (rows < 16) { /* past the request's last query: zeros, never read beyond q */
        memset(q_pad, 0, 16 * HEAD_DIM * sizeof(uint16_t));
        for (int r = 0; r < rows; r++) memcpy(q_pad + r * HEAD_DIM, q + r * e->q_stride, HEAD_DIM * 2);
        q = q_pad;
        qs = HEAD_DIM;
    }
    /* row r sees keys [0, prefix_len + i0 + r] */
    const int64_t blocks = (e->prefix_len + i0 + rows + 31) / 32, width = blocks * 32;
    /* row strides a cache line past width: a power of two would put a tile's 16 rows in one L1 set */
    const int64_t ld = width + 16, ldp = width + 32;
#if HAVE_AMX
    if (e->tiles) {
        _tile_loadd(4, q, qs * 2);
        _tile_loadd(5, q + 32, qs * 2);
    }
#endif
    /* Each row's max over the blocks that every row of the block sees whole, taken as they are
     * stored (in L1 then; a pass over a long row afterwards read them back from L2: 16 rows of 975
     * fp32 scores are 62 KiB); the rest of the row in the softmax, masked. One thread, 975
     * tokens: 2.48-2.54 -> 2.07-2.22 ms; W200's prefill attention in the engine 1.83-1.85 ->
     * 1.63-1.69 s (2-core Xeon, on the tiles). */
    const int64_t shared = (e->prefix_len + i0 + 1) / 32;
    const uint16_t *kh = e->kt + (size_t)h * e->kv_blocks * 4 * TILE_ELEMS;
    __m512 rmax[16];
    for (int r = 0; r < 16; r++) rmax[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks; b++) {
#if HAVE_AMX
        if (e->tiles)
            tile_scores(e, h, b, scores, ld);
        else
#endif
        {
            scores_rows(q, qs, kh + b * 4 * TILE_ELEMS, scores + b * 32, ld, rows < 8 ? rows : 8);
            if (rows > 8) scores_rows(q + 8 * qs, qs, kh + b * 4 * TILE_ELEMS, scores + 8 * ld + b * 32, ld, rows - 8);
        }
        if (b < shared)
            for (int r = 0; r < rows; r++)
                rmax[r] = _mm512_max_ps(rmax[r], _mm512_max_ps(_mm512_loadu_ps(scores + r * ld + b * 32),
                                                               _mm512_loadu_ps(scores + r * ld + b * 32 + 16)));
    }
    const __m512 scale = _mm512_set1_ps(e->scale * LOG2E); /* exponents in log2 units (exp2_softmax) */
    float inv_sum[16];
    for (int r = 0; r < 16; r++) {
        float *s = scores + r * ld;
        uint16_t *p = probs + r * ldp;
        if (r >= rows) { /* padding rows: P = 0 */
            memset(p, 0, (size_t)width * 2);
            continue;
        }
        const int64_t seen = e->prefix_len + i0 + r + 1; /* keys [0, seen) */
        __m512 vmax = rmax[r];
        for (int64_t j = shared * 32; j < seen; j += 16) {
            vmax = _mm512_mask_max_ps(vmax, first_lanes(seen - j), vmax, _mm512_loadu_ps(s + j));
        }
        /* exp(scale * s - scale * max) as 2^(log2(e) (scale * s - scale * max)), 0 past `seen` */
        const __m512 shift = _mm512_set1_ps(-_mm512_reduce_max_ps(vmax) * e->scale * LOG2E);
        /* two sums (two dependency chains), and masks only past the whole 32-key blocks */
        __m512 vsum0 = _mm512_setzero_ps(), vsum1 = _mm512_setzero_ps();
        const int64_t whole = seen / 32 * 32;
        int64_t j = 0;
        for (; j < whole; j += 32) numerators(s + j, p + j, scale, shift, 0xFFFF, 0xFFFF, &vsum0, &vsum1);
        for (; j < width; j += 32)
            numerators(s + j, p + j, scale, shift, first_lanes(seen - j), first_lanes(seen - j - 16), &vsum0, &vsum1);
        inv_sum[r] = 1.0f / _mm512_reduce_add_ps(_mm512_add_ps(vsum0, vsum1));
    }
    uint16_t *out = e->out + i0 * e->out_stride + g * HEAD_DIM;
#if HAVE_AMX
    if (e->tiles) {
        float o[16 * HEAD_DIM];
        tile_values(e, h, blocks, probs, ldp, o);
        for (int r = 0; r < rows; r++) {
            __m512 inv = _mm512_set1_ps(inv_sum[r]);
            for (int c = 0; c < HEAD_DIM; c += 16)
                store16_bf16(out + r * e->out_stride + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * HEAD_DIM + c), inv));
        }
        return;
    }
#endif
    /* on the vectors the sums go out from the registers, divided by the row sums and rounded */
    const uint16_t *vh = e->vt + (size_t)h * e->kv_blocks * 4 * TILE_ELEMS;
    for (int r0 = 0; r0 < rows; r0 += 6)
        values_rows(probs + r0 * ldp, ldp, vh, blocks, inv_sum + r0, out + r0 * e->out_stride, e->out_stride,
                    rows - r0 < 6 ? rows - r0 : 6);
}

static void *run_attention(void *arg) {
    Share *s = (Share *)arg;
    const Ext *e = s->e;
    int64_t q_blocks = (e->ext_len + 15) / 16, items = q_blocks * e->heads;
    uint16_t q_pad[16 * HEAD_DIM];
    float *scores = (float *)aligned_alloc(64, (size_t)16 * (e->kv_blocks * 32 + 16) * sizeof(float));
    uint16_t *probs = (uint16_t *)aligned_alloc(64, (size_t)16 * (e->kv_blocks * 32 + 32) * sizeof(uint16_t));
    s->failed = !scores || !probs;
    if (!s->failed) {
#if HAVE_AMX
        if (e->tiles) amx_configure();
#endif
        /* item n: query block q_blocks - 1 - n / heads (the longest first), head n % heads; a
         * thread takes the next item as soon as it is done with one, so that neither waits long
         * for the other at the end (dealt in turn, a prompt of one query block gave 5 of SmolLM2's
         * 9 heads to one thread and 4 to the other) */
        for (int64_t n; (n = __atomic_fetch_add(e->next, 1, __ATOMIC_RELAXED)) < items;)
            attend(e, (int)(n % e->heads), (q_blocks - 1 - n / e->heads) * 16, q_pad, scores, probs);
#if HAVE_AMX
        if (e->tiles) _tile_release();
#endif
    }
    free(scores);
    free(probs);
    return NULL;
}
#endif

/* out[i, g * 64 ..] = attention of query i (q + i * q_stride, head g at g * 64) over the KV slots
 * kv_indices[0 .. prefix_len + i]; k, v: the pool, [slots, kv_heads, 64] bf16, float8_e5m2 or
 * int8 (kv_fmt: KV_BF16, KV_E5M2 or KV_I8, whose scales k_scale and v_scale are, NULL for the
 * others); on the AMX tiles (`tiles` 1) or the AVX512-BF16 vectors (0).
 * Returns 0, or -1 when the call is not supported (no AVX512-BF16, no AMX for `tiles`, head_dim
 * not 64, heads not a multiple of kv_heads, fp32 KV, no memory). */
int extend_attention(const uint16_t *q, int64_t q_stride, const void *k, const void *v, const float *k_scale,
                     const float *v_scale, int kv_fmt, const int64_t *kv_indices, int64_t seq_len, int64_t prefix_len,
                     uint16_t *out, int64_t out_stride, int heads, int kv_heads, int head_dim, float scale,
                     int num_threads, int tiles) {
#if HAVE_VECTORS
    int64_t ext_len = seq_len - prefix_len;
    if (head_dim != HEAD_DIM || kv_heads < 1 || heads % kv_heads || ext_len < 1 || prefix_len < 0 ||
        (kv_fmt != KV_BF16 && kv_fmt != KV_E5M2 && kv_fmt != KV_I8) || (kv_fmt == KV_I8 && (!k_scale || !v_scale)) ||
        (tiles && extend_attention_supported() != 2))
        return -1;
    int64_t kv_blocks = (seq_len + 31) / 32, next = 0;
    size_t copy_elems = (size_t)kv_heads * kv_blocks * 32 * HEAD_DIM;
    uint16_t *kt = (uint16_t *)aligned_alloc(64, copy_elems * 2), *vt = (uint16_t *)aligned_alloc(64, copy_elems * 2);
    if (!kt || !vt) {
        free(kt);
        free(vt);
        return -1;
    }
    Ext e = {q, k, v, k_scale, v_scale, kv_fmt, kv_indices, out, kt, vt, q_stride, out_stride, seq_len, prefix_len,
             ext_len, kv_blocks, heads, kv_heads, scale, tiles != 0, &next};
    const int copiers = span_threads(num_threads, kv_heads * kv_blocks);
    Share shares[MAX_THREADS];
    for (int s = 0; s < copiers; s++) shares[s] = (Share){&e, s, copiers, 0};
    run_spans(run_copies, shares, sizeof shares[0], copiers);
    num_threads = span_threads(num_threads, (ext_len + 15) / 16 * heads);
    for (int s = 0; s < num_threads; s++) shares[s] = (Share){&e, s, num_threads, 0};
    run_spans(run_attention, shares, sizeof shares[0], num_threads);
    free(kt);
    free(vt);
    int failed = 0;
    for (int s = 0; s < num_threads; s++) failed |= shares[s].failed;
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)k_scale, (void)v_scale, (void)kv_fmt, (void)kv_indices;
    (void)seq_len, (void)prefix_len, (void)out, (void)out_stride, (void)heads, (void)kv_heads, (void)head_dim;
    (void)scale, (void)num_threads, (void)tiles;
    return -1;
#endif
}
