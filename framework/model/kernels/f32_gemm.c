/* fp32 GEMMs on AVX2 + FMA vectors, from weights packed in units of 16 output columns, for
 * float32 models on CPUs without AVX-512 (model.dtype = "auto" is float32 there: AMD Zen 2 and 3,
 * Intel's client CPUs), where PyTorch's float32 GEMM (MKL) runs well only on large passes: on a
 * 2-core AMD EPYC Zen 3 it reached 103-165 GFLOP/s at a prefill tile's 2,048 rows, 93-149 at a
 * decode step's 200 and 33-65 on the LM head's 49,152 columns there; this kernel 126-175 at the
 * 200 rows, 59-109 on the LM head, and about MKL's rate at 2,048 rows (82-141, the box varying
 * +-15 %).
 *
 *   out[m, c] = sum_p x[m, p] w[c, p] (+ bias[c])
 *
 * The weight [n, k] (a Linear's, PyTorch's layout) is packed once (f32_gemm_pack) unit by unit:
 * packed[unit][p][j] = w[16 unit + j, p], zeros past n, so that one k step of a unit is two
 * consecutive 32-byte vectors. A micro-tile of F32_ROWS rows by one unit keeps 12 sums in
 * registers; each k step broadcasts one element of each row against the unit's two vectors (12
 * FMAs to 2 loads and 6 broadcasts). A unit's weights (16 k floats: 36 KiB at k = 576) stay in L2
 * while it passes over a panel of rows of x; the threads take runs of units of a panel as they
 * come free (UnitRuns in common.h), the panels shorter where there are few units.
 *
 * Each output is one fp32 sum in k order (then + bias), so the bits differ from MKL's, whose sums
 * go in other orders: the same values to fp32 rounding (tests/test_cpu_kernels.py).
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it
 * can) and called through ctypes; without AVX2 and FMA it builds but takes nothing
 * (f32_gemm_supported 0). */
#include <math.h>
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
#define F32_PANEL_BYTES (480 << 10) /* of x at a time: most of a Zen 3 core's 512 KiB L2, so that a decode step's 200 rows of k = 576 are one panel */

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

/* A thread's part: runs of units taken as it comes free (UnitRuns in common.h). */
typedef struct {
    const F32Gemm *g;
    const UnitRuns *runs;
} F32Share;

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
static void f32_unit_rows(const F32Gemm *g, const float *w, int64_t n0, int64_t first, int64_t last,
                          const float *next) {
    const int64_t k = g->k;
    for (int64_t p0 = 0; p0 < k; p0 += F32_KC) {
        const int64_t p1 = p0 + F32_KC < k ? p0 + F32_KC : k;
        const int head = p0 == 0, tail = p1 == k;
        /* the next unit's block of weights on its way into L2, a few lines after each micro-tile */
        const char *pf = next ? (const char *)(next + p0 * F32_UNIT) : NULL;
        const char *pf_end = next ? (const char *)(next + p1 * F32_UNIT) : NULL;
        const int64_t tiles = (last - first + F32_ROWS - 1) / F32_ROWS;
        const int64_t lines = tiles > 0 ? ((p1 - p0) * F32_UNIT * 4 / 64 + tiles - 1) / tiles : 0;
        int64_t m = first;
        for (; m + F32_ROWS <= last; m += F32_ROWS) {
            f32_tile(g, m, F32_ROWS, w, n0, p0, p1, head, tail);
            for (int64_t l = 0; l < lines && pf < pf_end; l++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        }
        switch (last - m) {
        case 5: f32_tile(g, m, 5, w, n0, p0, p1, head, tail); break;
        case 4: f32_tile(g, m, 4, w, n0, p0, p1, head, tail); break;
        case 3: f32_tile(g, m, 3, w, n0, p0, p1, head, tail); break;
        case 2: f32_tile(g, m, 2, w, n0, p0, p1, head, tail); break;
        case 1: f32_tile(g, m, 1, w, n0, p0, p1, head, tail); break;
        }
    }
}

/* The items of one thread (F32Share), each run of units over its panel's rows, the next unit's
 * weights prefetched meanwhile. With a fixed span of units x rows for each thread instead, the core
 * that ran faster (the two vCPUs of a shared host do not keep one pace) waited for the other at
 * every GEMM's end: 8 layers' GEMMs on a 2-core AMD EPYC Zen 3, alternated in one process, median
 * GFLOP/s in two runs: 200 rows 119 -> 122, 91 -> 100; 2,048 rows 114 -> 123, 100 -> 110; the LM
 * head's 49,152 columns at 200 rows 99 -> 107, 78 -> 80. */
static void *run_f32_units(void *arg) {
    const F32Share *s = (const F32Share *)arg;
    const F32Gemm *g = s->g;
    for (int64_t first, last, u0, u1; take_units(s->runs, &first, &last, &u0, &u1);)
        for (int64_t unit = u0; unit < u1; unit++)
            f32_unit_rows(g, g->packed + unit * g->k * F32_UNIT, unit * F32_UNIT, first, last,
                          unit + 1 < u1 ? g->packed + (unit + 1) * g->k * F32_UNIT : NULL);
    return NULL;
}

/* out = x @ W^T (+ bias): x fp32 [rows, k] (unit stride along rows, row stride x_stride), the
 * weight packed by f32_gemm_pack (n columns), out fp32 [rows, n] (row stride out_stride). Returns 0. */
int f32_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias, int64_t rows, int64_t k,
             int64_t n, float *out, int64_t out_stride, int num_threads) {
    if (rows < 1 || n < 1) return 0;
    const F32Gemm g = {.x = x, .x_stride = x_stride, .packed = packed, .bias = bias, .rows = rows, .k = k, .n = n,
                       .out = out, .out_stride = out_stride};
    const int64_t units = (n + F32_UNIT - 1) / F32_UNIT;
    const int threads = span_threads(num_threads, units * rows / (4 * F32_ROWS)); /* (at least 4 micro-tiles a thread) */
    int64_t next = 0;
    const int64_t cap = F32_PANEL_BYTES / (k * (int64_t)sizeof(float));
    const UnitRuns runs = unit_runs(rows, cap, units, threads, F32_ROWS, &next);
    F32Share shares[MAX_THREADS];
    for (int s = 0; s < threads; s++) shares[s] = (F32Share){.g = &g, .runs = &runs};
    run_spans(run_f32_units, shares, sizeof shares[0], threads);
    return 0;
}

/* ---- fp32 prefill attention of one request, from the paged KV pool (f32_extend_attention) -------
 *
 * The request's ext_len new tokens sit at positions prefix_len.. of its seq_len KV slots
 * (kv_indices); query i sees keys 0..prefix_len + i. Both products are GEMMs of the micro-tiles
 * above: S = Q K^T with K packed as a weight of seq_len columns (K[t] is column t: units of 16
 * keys, packed[unit][d][16]), and O = P V with V packed as a weight of head_dim columns over k =
 * the keys (packed[unit][t][16], 4 units of 16 of head_dim 64). Each work item is F32_ROWS query
 * rows of the query heads that share one KV head: their scores against every key the last of them
 * sees (q times the softmax's scale as it is copied: the same bits where the scale is a power of 2,
 * 1/8 for head_dim 64), the softmax of each row (fp32, the probabilities past a row's last key 0),
 * then their P V, divided by the row sums.
 * The copies of K and V (widened: bf16 to fp32, an int8 pool's integers times their row's scale)
 * are made once per KV head for all its query heads, by token ranges over the threads; the items,
 * longest first, go to whichever thread is free next (an atomic counter). */
#define ATT_DIM 64

typedef struct {
    const float *q; /* [ext_len, heads, 64], row stride q_stride */
    const void *k, *v;
    const float *k_scale, *v_scale;
    int kv_fmt;
    const int64_t *kv_indices;
    float *out; /* [ext_len, heads, 64], row stride out_stride */
    float *kp, *vp; /* packed K and V, every KV head */
    int64_t q_stride, out_stride, seq_len, prefix_len, ext_len, keys_pad; /* keys_pad: seq_len in 16s */
    int heads, kv_heads;
    float scale;
    int64_t *next;
} F32Ext;

typedef struct {
    const F32Ext *e;
    int first, step;
    int failed;
} F32ExtShare;

/* Slot `slot`'s row of KV head h in the pool (fmt: KV_F32, KV_BF16 or KV_I8 with its scale) as fp32. */
static void att_row(const void *pool, const float *scales, int fmt, int64_t slot, int h, int kv_heads, float *dst) {
    const int64_t at = (slot * kv_heads + h) * ATT_DIM;
    if (fmt == KV_F32) {
        memcpy(dst, (const float *)pool + at, ATT_DIM * sizeof(float));
    } else if (fmt == KV_BF16) {
        const uint16_t *src = (const uint16_t *)pool + at;
        for (int j = 0; j < ATT_DIM; j++) dst[j] = bf16_to_f32(src[j]);
    } else {
        const int8_t *src = (const int8_t *)pool + at;
        const float sc = scales[slot * kv_heads + h];
        for (int j = 0; j < ATT_DIM; j++) dst[j] = (float)src[j] * sc;
    }
}

/* Share `first` of `step` of the tokens: their K and V rows of every KV head into the packed copies. */
static void *att_copies(void *arg) {
    const F32ExtShare *sh = (const F32ExtShare *)arg;
    const F32Ext *e = sh->e;
    const int64_t t0 = e->keys_pad * sh->first / sh->step, t1 = e->keys_pad * (sh->first + 1) / sh->step;
    float row[ATT_DIM];
    for (int h = 0; h < e->kv_heads; h++) {
        float *kp = e->kp + (size_t)h * e->keys_pad * ATT_DIM, *vp = e->vp + (size_t)h * e->keys_pad * ATT_DIM;
        for (int64_t t = t0; t < t1; t++) {
            if (t < e->seq_len) {
                att_row(e->k, e->k_scale, e->kv_fmt, e->kv_indices[t], h, e->kv_heads, row);
            } else {
                memset(row, 0, sizeof row);
            }
            for (int j = 0; j < ATT_DIM; j++) kp[((t / F32_UNIT) * ATT_DIM + j) * F32_UNIT + t % F32_UNIT] = row[j];
            if (t < e->seq_len) {
                att_row(e->v, e->v_scale, e->kv_fmt, e->kv_indices[t], h, e->kv_heads, row);
            }
            for (int c = 0; c < ATT_DIM / F32_UNIT; c++)
                memcpy(vp + ((size_t)c * e->keys_pad + t) * F32_UNIT, row + c * F32_UNIT, F32_UNIT * sizeof(float));
        }
    }
    return NULL;
}

/* The query heads of KV head h (`group` of them) at rows [r0, r0 + R) (R <= F32_ROWS), as one
 * item: their q rows times the scale into `qg` (group x F32_ROWS rows of 64, head by head), their
 * scores into `p` (group x F32_ROWS rows of keys_pad) by one GEMM over K's units, each row's
 * softmax, then P V into `o` by one GEMM over V's 4 units, divided by the row sums (`inv`). So a
 * unit of K (4 KiB) or a block of V's (F32_KC keys, 16 KiB) comes into L1 once for all the group's
 * heads; with an item per query head before (W200's 200 prompts, one layer's int8 pool, 2-core AMD
 * EPYC Zen 3, alternated, medians): 441 -> 411 ms a layer with each prompt's slots in order, 461 ->
 * 431 with them shuffled. */
static void att_item(const F32Ext *e, int h, int64_t r0, float *qg, float *p, float *o, float *inv) {
    const int group = e->heads / e->kv_heads;
    const int64_t rows = e->ext_len - r0 < F32_ROWS ? e->ext_len - r0 : F32_ROWS;
    const int64_t keys = e->prefix_len + r0 + rows; /* the last row's keys */
    const int64_t keys16 = (keys + F32_UNIT - 1) / F32_UNIT * F32_UNIT;
    const __m256 scale = _mm256_set1_ps(e->scale);
    for (int g = 0; g < group; g++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *src = e->q + (r0 + r) * e->q_stride + (int64_t)(h * group + g) * ATT_DIM;
            float *dst = qg + (g * F32_ROWS + r) * ATT_DIM;
            for (int j = 0; j < ATT_DIM; j += 8) _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_loadu_ps(src + j), scale));
        }
        if (rows < F32_ROWS) /* (the last block: rows the GEMMs below run over but nothing reads) */
            memset(qg + (g * F32_ROWS + rows) * ATT_DIM, 0, (size_t)(F32_ROWS - rows) * ATT_DIM * sizeof(float));
    }
    /* S = Q K^T: a GEMM of the group's rows by K's units (a head's rows past `rows` are not used) */
    const int64_t all = (group - 1) * F32_ROWS + rows;
    F32Gemm s = {.x = qg, .x_stride = ATT_DIM, .packed = e->kp + (size_t)h * e->keys_pad * ATT_DIM, .bias = NULL,
                 .rows = all, .k = ATT_DIM, .n = keys16, .out = p, .out_stride = e->keys_pad};
    for (int64_t unit = 0; unit < keys16 / F32_UNIT; unit++)
        f32_unit_rows(&s, s.packed + unit * ATT_DIM * F32_UNIT, unit * F32_UNIT, 0, all, NULL);
    for (int64_t i = 0; i < all; i++) {
        const int64_t r = i % F32_ROWS;
        if (r >= rows) continue;
        float *row = p + i * e->keys_pad;
        const int64_t seen = e->prefix_len + r0 + r + 1;
        __m256 vmx = _mm256_set1_ps(-INFINITY);
        int64_t t = 0;
        for (; t + 8 <= seen; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(row + t));
        float part[8] = {0}, mx = max_lanes8(vmx, -INFINITY), sum;
        for (; t < seen; t++) mx = row[t] > mx ? row[t] : mx;
        /* exp by exp_neg_lanes in 8 partial sums, a loop GCC vectorizes */
        for (t = 0; t + 8 <= seen; t += 8)
            for (int l = 0; l < 8; l++) {
                const float x = exp_neg_lanes(row[t + l] - mx);
                row[t + l] = x;
                part[l] += x;
            }
        sum = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
        for (; t < seen; t++) {
            row[t] = exp_neg_lanes(row[t] - mx);
            sum += row[t];
        }
        for (t = seen; t < keys16; t++) row[t] = 0.0f;
        inv[i] = 1.0f / sum;
    }
    /* O = P V: a GEMM of P's rows by V's 4 units over the keys, then / the row sums */
    F32Gemm pv = {.x = p, .x_stride = e->keys_pad, .packed = e->vp + (size_t)h * e->keys_pad * ATT_DIM, .bias = NULL,
                  .rows = all, .k = keys16, .n = ATT_DIM, .out = o, .out_stride = ATT_DIM};
    for (int c = 0; c < ATT_DIM / F32_UNIT; c++)
        f32_unit_rows(&pv, pv.packed + (size_t)c * e->keys_pad * F32_UNIT, c * F32_UNIT, 0, all, NULL);
    for (int64_t i = 0; i < all; i++) {
        const int64_t r = i % F32_ROWS;
        if (r >= rows) continue;
        float *dst = e->out + (r0 + r) * e->out_stride + (int64_t)(h * group + i / F32_ROWS) * ATT_DIM;
        for (int j = 0; j < ATT_DIM; j++) dst[j] = o[i * ATT_DIM + j] * inv[i];
    }
}

static void *att_items(void *arg) {
    F32ExtShare *sh = (F32ExtShare *)arg;
    const F32Ext *e = sh->e;
    const int group = e->heads / e->kv_heads;
    const size_t rows = (size_t)group * F32_ROWS;
    /* p, then qg and o (rows x 64 each), then inv (rows) */
    float *p = (float *)aligned_alloc(64, (rows * e->keys_pad + 2 * rows * ATT_DIM + rows) * sizeof(float));
    if (p == NULL) {
        sh->failed = 1;
        return NULL;
    }
    float *qg = p + rows * e->keys_pad, *o = qg + rows * ATT_DIM, *inv = o + rows * ATT_DIM;
    const int64_t blocks = (e->ext_len + F32_ROWS - 1) / F32_ROWS, items = blocks * e->kv_heads;
    for (int64_t n; (n = __atomic_fetch_add(e->next, 1, __ATOMIC_RELAXED)) < items;) {
        const int64_t block = blocks - 1 - n / e->kv_heads; /* the longest first */
        att_item(e, (int)(n % e->kv_heads), block * F32_ROWS, qg, p, o, inv);
    }
    free(p);
    return NULL;
}

/* Causal attention of one request's new tokens (fp32 q, `heads` heads of head_dim 64) over its
 * seq_len KV slots (an fp32, bf16 or int8 pool with its scales), into out. Returns 0, or -1 where it
 * does not take the call (another head_dim or pool, or no memory). */
int f32_extend_attention(const float *q, int64_t q_stride, const void *k, const void *v, const float *k_scale,
                         const float *v_scale, int kv_fmt, const int64_t *kv_indices, int64_t seq_len,
                         int64_t prefix_len, float *out, int64_t out_stride, int heads, int kv_heads, int head_dim,
                         float scale, int num_threads) {
    const int64_t ext_len = seq_len - prefix_len;
    if (head_dim != ATT_DIM || kv_heads < 1 || heads % kv_heads || ext_len < 1 || prefix_len < 0 ||
        (kv_fmt != KV_F32 && kv_fmt != KV_BF16 && kv_fmt != KV_I8) || (kv_fmt == KV_I8 && (!k_scale || !v_scale)))
        return -1;
    const int64_t keys_pad = (seq_len + F32_UNIT - 1) / F32_UNIT * F32_UNIT;
    const size_t floats = (size_t)kv_heads * keys_pad * ATT_DIM;
    float *kp = (float *)aligned_alloc(64, floats * sizeof(float)), *vp = (float *)aligned_alloc(64, floats * sizeof(float));
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -1;
    }
    int64_t next = 0;
    F32Ext e = {q, k, v, k_scale, v_scale, kv_fmt, kv_indices, out, kp, vp, q_stride, out_stride, seq_len, prefix_len,
                ext_len, keys_pad, heads, kv_heads, scale, &next};
    F32ExtShare shares[MAX_THREADS];
    const int copiers = span_threads(num_threads, keys_pad / 64);
    for (int s = 0; s < copiers; s++) shares[s] = (F32ExtShare){&e, s, copiers, 0};
    run_spans(att_copies, shares, sizeof shares[0], copiers);
    const int threads = span_threads(num_threads, (ext_len + F32_ROWS - 1) / F32_ROWS * heads / 4);
    for (int s = 0; s < threads; s++) shares[s] = (F32ExtShare){&e, s, threads, 0};
    run_spans(att_items, shares, sizeof shares[0], threads);
    free(kp);
    free(vp);
    int failed = 0;
    for (int s = 0; s < threads; s++) failed |= shares[s].failed;
    return failed ? -1 : 0;
}

#else /* no AVX2 + FMA: nothing to run */

int f32_gemm_supported(void) { return 0; }

int f32_gemm(const float *x, int64_t x_stride, const float *packed, const float *bias, int64_t rows, int64_t k,
             int64_t n, float *out, int64_t out_stride, int num_threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)rows, (void)k, (void)n, (void)out, (void)out_stride;
    (void)num_threads;
    return -2;
}

int f32_extend_attention(const float *q, int64_t q_stride, const void *k, const void *v, const float *k_scale,
                         const float *v_scale, int kv_fmt, const int64_t *kv_indices, int64_t seq_len,
                         int64_t prefix_len, float *out, int64_t out_stride, int heads, int kv_heads, int head_dim,
                         float scale, int num_threads) {
    (void)q, (void)q_stride, (void)k, (void)v, (void)k_scale, (void)v_scale, (void)kv_fmt, (void)kv_indices;
    (void)seq_len, (void)prefix_len, (void)out, (void)out_stride, (void)heads, (void)kv_heads, (void)head_dim;
    (void)scale, (void)num_threads;
    return -1;
}

#endif
