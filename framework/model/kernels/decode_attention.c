/* Decode attention straight from the paged KV pool, for CPUs.
 *
 * One query token per request attends to the request's first seq_lens[i] KV slots, which are
 * looked up in the request-to-token table (no gathered or padded copies of the KV). Each request
 * is one task: for every KV head, the `group` query heads that share it read each K and V row
 * once. Scores and the softmax are fp32; q may be bf16 or fp32, K/V fp32, bf16, float8_e5m2 or
 * int8 (kv_fmt: common.h's KV_* codes; e5m2 and int8 rows are widened as they are read, an int8
 * row's integers exactly: its scale, one per slot and head, multiplies the row's scores before the
 * softmax and its probabilities after the softmax's sums, so the int8 pool's reads are its bytes
 * and a scale per row; int8 requests stay off the AMX tiles: on AMX-INT8 tiles, S on tdpbssd and
 * P V on tdpbusd with P's 16 bits in two bytes, they ran no faster, ~2.1 against ~2.0 ms a layer
 * from DRAM on a 2-core Xeon, their tile work plus V's byte interleaving costing about what the
 * vectors' ~100 instructions a token do, docs/performance.md). With AVX512-VNNI, an int8 pool's
 * scores are integer dot products of its rows and the bf16 queries quantized to int8 (scores_i8;
 * q . k then differs from the bf16 query's by the query's rounding to 8 bits), and P V sums the V
 * rows' integers against the probabilities as int16 (values_i16, nearer the exact sums than P in
 * bf16); on AVX2 without AVX-512 the same, the queries (fp32 or bf16) rounded to int16 instead
 * (scores_i16, INT_QUERY_BITS). 200 requests of 100-400 prompt tokens and 64 decoded tokens, 30
 * layers' pools, 2-core AMD EPYC (Zen 4): bf16 pool 1.8-2.1 ms a layer; int8 with the rows widened
 * to bf16 for vdpbf16ps 1.57-1.81, on vpdpbusd 1.23-1.38 (with the KV in the caches 0.198 ->
 * 0.155, bf16 0.167-0.176).
 *
 * The KV rows are read from DRAM (a decode step reads every running request's whole KV, far more
 * than the caches hold), and a request's slots are scattered over the pool. So the tokens go in
 * chunks of CHUNK: the whole slot row of each token (every KV head, contiguous) is prefetched into
 * L2 one chunk ahead, and all KV heads are done chunk by chunk, so each row comes from DRAM once
 * and the other heads read it from the caches. The prefetches go out a few lines at a time from
 * inside the loops (Prefetcher): a burst of a chunk's 192 prefetches into L1 held the loads
 * behind it until the line fill buffers drained, so the arithmetic waited for the memory instead
 * of overlapping it. Measured on a 2-core Xeon (30 layers' pools, 200 requests, 72,900 tokens):
 * 4.05 -> 3.95 ms a layer with the chunks, -> 3.60 with hsum16 (common.h), 3.40 -> 2.92-3.01 with
 * the spread L2 prefetches (each prompt's slots contiguous: 3.36 -> 2.74-2.77; fully scattered
 * slots: 4.58 -> 4.66, so scattered chunks then kept a burst into L1).
 * On a 2-core AMD EPYC (Zen 4), the scattered chunks spread too and chunks of 64 tokens instead
 * of 32: 200 requests of 100-400 prompt tokens, 30 layers' pools, bf16, median ms a layer:
 * 64 decoded tokens each (a decode step's slots, as many apart as there are requests) 2.90 ->
 * 2.18; fully scattered slots 5.3 -> 2.65; every request's slots contiguous 2.08 -> 1.93; an e5m2
 * pool at 64 decoded tokens 1.95 -> 1.65; 4 requests of 300 decoded tokens 0.14 -> 0.075.
 *
 * On CPUs with AMX-BF16, bf16 requests of up to 16 query heads go on the tiles instead
 * (amx_request): the arithmetic that the vector paths spend ~130 cycles a token on takes 18 tile
 * products per 16 tokens. Measured on the same Xeon and pools: 0.78 against 1.45-1.58 ms a layer
 * with the KV in the caches; from DRAM 2.56 against 2.85-2.92 (interleaved slots), 4.30 against
 * 4.46-4.66 (fully scattered); a decode step of 16 requests (5,080 tokens) 5.7 -> 4.1 ms, of 64
 * requests 26.8 -> 24.1. With the KV of 200 requests from DRAM both run at the memory's pace.
 *
 * Built on first use by framework/model/cpu_kernels.py (cc -O3 -march=native, -fopenmp where it can)
 * and called through ctypes, which releases the GIL; the requests are split over `num_threads`
 * threads by KV length (torch's OpenMP team, else pthreads: run_spans in common.h).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"

typedef struct {
    const void *q;             /* [n, heads, head_dim] */
    const void *k, *v;         /* [slots, kv_heads, head_dim] */
    const float *k_scale, *v_scale; /* an int8 pool's [slots, kv_heads] scales (kv_fmt KV_I8) */
    const int64_t *req_to_token; /* [pool_rows, row_stride] */
    const int64_t *pool_idx;   /* [n] row of each request in req_to_token */
    const int64_t *seq_lens;   /* [n] */
    void *out;                 /* [n, heads, head_dim], q's dtype */
    int64_t row_stride;
    int heads, kv_heads, head_dim;
    int q_bf16, kv_fmt;
    float scale;
    int amx; /* bf16 requests go on the AMX tiles (amx_request) */
} Args;

/* One request's query heads as integers (quantize_queries: int8 on AVX512-VNNI, int16 on AVX2),
 * from the group's first head on: `q` [heads, 64], their scales, and (int8) 128 times each one's
 * sum. */
typedef struct {
    const void *q;
    const float *scale;
    const int32_t *corr;
} QueryInt;

typedef struct {
    const Args *a;
    int begin, end;
    int64_t max_len;
    int failed; /* set when the span's scratch memory could not be allocated */
} Span;

/* A dispatcher's body: `call` with G a constant for groups of 1-4 (each its own copy of an
 * always-inlined path, so that the compiler keeps the group's vectors in registers), larger groups
 * in one shared copy with G the variable `group`. */
#define BY_GROUP(group, call)                             \
    switch (group) {                                      \
    case 1: { const int G = 1; call; } break;             \
    case 2: { const int G = 2; call; } break;             \
    case 3: { const int G = 3; call; } break;             \
    case 4: { const int G = 4; call; } break;             \
    default: { const int G = (group); call; } break;      \
    }

/* Row `d` elements at `p` (fmt: KV_F32, KV_BF16, KV_E5M2 or KV_I8) into fp32 `dst`. */
static inline void load_row(float *dst, const void *p, int d, int fmt) {
    if (fmt == KV_BF16) {
        const uint16_t *s = (const uint16_t *)p;
        for (int j = 0; j < d; j++) dst[j] = bf16_to_f32(s[j]);
    } else if (fmt == KV_E5M2) {
        const uint8_t *s = (const uint8_t *)p;
        for (int j = 0; j < d; j++) dst[j] = e5m2_to_f32(s[j]);
    } else if (fmt == KV_I8) { /* the integers: their scale is applied to the scores and probabilities */
        const int8_t *s = (const int8_t *)p;
        for (int j = 0; j < d; j++) dst[j] = (float)s[j];
    } else {
        memcpy(dst, p, (size_t)d * sizeof(float));
    }
}

/* Tokens per chunk: a chunk's slot rows (CHUNK x kv_heads x head_dim, 24 KiB for SmolLM2's bf16
 * K) stay in L1 while every KV head reads them. (96 and 128 were no faster than 64.) */
#define CHUNK 64

/* Prefetch the slot rows (`row_bytes` from `base + slot * row_bytes`) of tokens [t0, t1). */
static inline void prefetch_rows(const char *base, const int64_t *slots, int64_t t0, int64_t t1, size_t row_bytes) {
#if defined(__AVX512F__) || defined(__AVX2__)
    for (int64_t t = t0; t < t1; t++) {
        const char *p = base + (size_t)slots[t] * row_bytes;
        for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
    }
#else
    (void)base, (void)slots, (void)t0, (void)t1, (void)row_bytes;
#endif
}

/* The next chunk's rows, prefetched a few lines at a time from inside the loops over the
 * current chunk: `lines` at each of the loops' `calls` prefetch_next calls. */
typedef struct {
    const char *base;
    const int64_t *slots;
    int64_t t, end;
    size_t row_bytes, off;
    int lines;
} Prefetcher;

/* Prefetch the next `lines` cache lines of the range (all of them: lines < 0). */
static inline void prefetch_lines(Prefetcher *pf, int lines) {
#if defined(__AVX512F__) || defined(__AVX2__)
    while (pf->t < pf->end && lines-- != 0) {
        _mm_prefetch(pf->base + (size_t)pf->slots[pf->t] * pf->row_bytes + pf->off, _MM_HINT_T1);
        pf->off += 64;
        if (pf->off >= pf->row_bytes) pf->off = 0, pf->t++;
    }
#else
    (void)pf, (void)lines;
#endif
}

static inline void prefetch_next(Prefetcher *pf) { prefetch_lines(pf, pf->lines); }

/* The range [t0, t1), spread over `calls` calls of prefetch_next, whether or not the slots are
 * one contiguous run. With no calls to spread them over (a path without them, or a chunk too
 * short), the whole range goes now, in one burst into L1. */
static inline void prefetch_start(Prefetcher *pf, const char *base, const int64_t *slots, int64_t t0, int64_t t1,
                                  size_t row_bytes, int64_t calls) {
    pf->base = base, pf->slots = slots, pf->t = t0, pf->end = t1, pf->row_bytes = row_bytes, pf->off = 0;
    int64_t lines = (t1 - t0) * (int64_t)((row_bytes + 63) / 64);
    pf->lines = calls > 0 ? (int)((lines + calls - 1) / calls) : 0;
    if (t1 > t0 && calls <= 0) {
        prefetch_rows(base, slots, t0, t1, row_bytes);
        pf->t = t1;
    }
}

#ifdef __AVX512F__
/* Token t's 64-element row of one head (base: the head's first row; slot rows `row_bytes` apart)
 * as four fp32 vectors. */
static inline void load_row64(const char *base, const int64_t *slots, int64_t t, size_t row_bytes, size_t elem,
                              int fmt, __m512 out[4]) {
    const char *p = base + (size_t)slots[t] * row_bytes;
    for (int c = 0; c < 4; c++) out[c] = load16(p + c * 16 * elem, fmt);
}

/* The P V paths' accumulators: `group` query heads' 64 fp32 columns from `acc` into registers
 * (4 x group vectors; always inlined with `group` a constant, they stay there), and back. */
static inline __attribute__((always_inline)) void values_acc_load(__m512 av[8][4], const float *acc,
                                                                  const int group) {
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) av[g][c] = _mm512_loadu_ps(acc + g * 64 + c * 16);
}

static inline __attribute__((always_inline)) void values_acc_store(__m512 av[8][4], float *acc, const int group) {
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, av[g][c]);
}

/* head_scores' and head_values' fp32 paths (head_dim 64; any q, any pool, the rows widened to
 * fp32) with the group a constant, as for the bf16 paths: with the group a variable, GCC kept the
 * values' 4 x group accumulators on the stack. The same operations in the same order, so the same
 * bits. 50 requests' KV in the caches (2-core AMD EPYC, Zen 4): fp32 q and pool 0.85 -> 0.74 ms a
 * layer, bf16 q and an e5m2 pool 0.42 -> 0.37. */
static inline __attribute__((always_inline)) void scores_f32(const float *qf, const int group, const char *k,
                                                             size_t row_bytes, size_t elem, int fmt,
                                                             const int64_t *slots, int64_t t0, int64_t t1,
                                                             int64_t len, float *scores) {
    __m512 qv[8][4];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) qv[g][c] = _mm512_loadu_ps(qf + g * 64 + c * 16);
    for (int64_t t = t0; t < t1; t++) {
        __m512 kr[4];
        load_row64(k, slots, t, row_bytes, elem, fmt, kr);
        for (int g = 0; g < group; g++) {
            __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
            acc = _mm512_fmadd_ps(qv[g][1], kr[1], acc);
            acc = _mm512_fmadd_ps(qv[g][2], kr[2], acc);
            acc = _mm512_fmadd_ps(qv[g][3], kr[3], acc);
            scores[g * len + t] = _mm512_reduce_add_ps(acc);
        }
    }
}

static void group_scores_f32(const float *qf, int group, const char *k, size_t row_bytes, size_t elem, int fmt,
                             const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *scores) {
    BY_GROUP(group, scores_f32(qf, G, k, row_bytes, elem, fmt, slots, t0, t1, len, scores));
}

static inline __attribute__((always_inline)) void values_f32(const float *probs, const int group, const char *v,
                                                             size_t row_bytes, size_t elem, int fmt,
                                                             const int64_t *slots, int64_t t0, int64_t t1,
                                                             int64_t len, float *acc, Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    __m512 av[8][4];
    values_acc_load(av, acc, group);
    for (int64_t t = t0; t < t1; t++) {
        __m512 vr[4];
        prefetch_next(&p);
        load_row64(v, slots, t, row_bytes, elem, fmt, vr);
        for (int g = 0; g < group; g++) {
            const __m512 pr = _mm512_set1_ps(probs[g * len + t]);
            for (int c = 0; c < 4; c++) av[g][c] = _mm512_fmadd_ps(pr, vr[c], av[g][c]);
        }
    }
    values_acc_store(av, acc, group);
    *pf = p;
}

static void group_values_f32(const float *probs, int group, const char *v, size_t row_bytes, size_t elem, int fmt,
                             const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf) {
    BY_GROUP(group, values_f32(probs, G, v, row_bytes, elem, fmt, slots, t0, t1, len, acc, pf));
}
#endif

/* The AVX2 + FMA paths (CPUs without AVX-512: AMD Zen 2 and 3, Intel's client CPUs), head_dim 64,
 * any q (fp32 rows `qf`) and an fp32, bf16 or int8 pool (e5m2 stays portable): where the portable
 * loops widened every row to the scratch and summed each score's 16 lanes one score at a time,
 * these widen a block of 16 K rows to fp32 once for the group's query heads, sum each score in 8
 * lanes and add 4 scores' lanes up together (hsum4), and take P V a half row (32 columns) at a
 * time with the group's sums in registers; both prefetch the next chunk as the AVX-512 paths do. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAVE_AVX2_PATHS 1

/* 8 elements of a row (fmt: KV_F32, KV_BF16 or KV_I8, integers as themselves) as fp32. */
static inline __m256 load8(const char *p, int fmt) {
    if (fmt == KV_BF16) return load8_bf16((const uint16_t *)p);
    if (fmt == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_loadu_ps((const float *)p);
}

/* The sums of four 8-lane vectors. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline __attribute__((always_inline)) void scores_avx2(const float *qf, const int group, const char *k,
                                                              size_t row_bytes, size_t elem, int fmt,
                                                              const int64_t *slots, int64_t t0, int64_t t1,
                                                              int64_t len, float *scores, Prefetcher *pf) {
    Prefetcher pfl = *pf; /* (a local copy, kept in registers) */
    float kb[16 * 64] __attribute__((aligned(32)));
    for (int64_t t = t0; t < t1; t += 16) {
        const int n = t1 - t < 16 ? (int)(t1 - t) : 16;
        for (int u = 0; u < n; u++) {
            const char *p = k + (size_t)slots[t + u] * row_bytes;
            for (int c = 0; c < 8; c++) _mm256_store_ps(kb + u * 64 + c * 8, load8(p + c * 8 * elem, fmt));
        }
        for (int u = n; u < 16; u++) memset(kb + u * 64, 0, 64 * sizeof(float));
        for (int g = 0; g < group; g++) {
            __m256 qv[8];
            for (int c = 0; c < 8; c++) qv[c] = _mm256_loadu_ps(qf + g * 64 + c * 8);
            if (n == 16) prefetch_next(&pfl);
            float out[16];
            for (int u = 0; u < 16; u += 4) {
                __m256 acc[4];
                for (int e = 0; e < 4; e++) {
                    const float *r = kb + (u + e) * 64;
                    acc[e] = _mm256_mul_ps(qv[0], _mm256_load_ps(r));
                    for (int c = 1; c < 8; c++) acc[e] = _mm256_fmadd_ps(qv[c], _mm256_load_ps(r + c * 8), acc[e]);
                }
                _mm_storeu_ps(out + u, hsum4(acc[0], acc[1], acc[2], acc[3]));
            }
            memcpy(scores + g * len + t, out, (size_t)n * sizeof(float));
        }
    }
    *pf = pfl;
}

static void group_scores_avx2(const float *qf, int group, const char *k, size_t row_bytes, size_t elem, int fmt,
                              const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *scores, Prefetcher *pf) {
    BY_GROUP(group, scores_avx2(qf, G, k, row_bytes, elem, fmt, slots, t0, t1, len, scores, pf));
}

static inline __attribute__((always_inline)) void values_avx2(const float *probs, const int group, const char *v,
                                                              size_t row_bytes, size_t elem, int fmt,
                                                              const int64_t *slots, int64_t t0, int64_t t1,
                                                              int64_t len, float *acc, Prefetcher *pf) {
    Prefetcher pfl = *pf;
    for (int half = 0; half < 2; half++) {
        __m256 av[8][4];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) av[g][c] = _mm256_loadu_ps(acc + g * 64 + half * 32 + c * 8);
        for (int64_t t = t0; t < t1; t++) {
            if (half == 0) prefetch_next(&pfl);
            const char *p = v + (size_t)slots[t] * row_bytes + (size_t)half * 32 * elem;
            __m256 vr[4];
            for (int c = 0; c < 4; c++) vr[c] = load8(p + c * 8 * elem, fmt);
            for (int g = 0; g < group; g++) {
                const __m256 pr = _mm256_set1_ps(probs[g * len + t]);
                for (int c = 0; c < 4; c++) av[g][c] = _mm256_fmadd_ps(pr, vr[c], av[g][c]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + g * 64 + half * 32 + c * 8, av[g][c]);
    }
    *pf = pfl;
}

static void group_values_avx2(const float *probs, int group, const char *v, size_t row_bytes, size_t elem, int fmt,
                              const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf) {
    BY_GROUP(group, values_avx2(probs, G, v, row_bytes, elem, fmt, slots, t0, t1, len, acc, pf));
}

/* An int8 pool on AVX2 (head_dim 64, group <= 8, q fp32 or bf16) is read as integers: AVX2 has
 * no int8 dot product, but vpmaddwd multiplies 16 pairs of int16 and sums each pair into 32 bits,
 * and vpmovsxbw widens 16 int8 values to int16 in one instruction (to fp32 took two for 8). So
 * the query heads are rounded to int16, round(q / s) with s = max |q| / 32767 per head (2^-16 of
 * the head's largest, against the int8 rows' own 2^-8), and q . k is the exact integer sum (at
 * most 64 x 32767 x 128 < 2^31) times s: 4 vpmaddwd a token and query head where the fp32 path
 * took 8 multiply-adds after widening each row to fp32 and storing it. P V takes the
 * probabilities as int16 a chunk (probs_to_i16, as on AVX512-VNNI) and two tokens' V rows
 * interleaved, each pair's two products summed by one vpmaddwd. 200 requests of 124-464 tokens (64
 * of them decoded, their slots as a decode step's, as many apart as there are requests), 8 layers'
 * pools from DRAM, two threads of a 2-core AMD EPYC Zen 3, against the rows widened to fp32, the two
 * alternated in one process: 4.83-5.03 -> 3.88-4.19 ms a layer (W200's decode attention 18.3 ->
 * 15.9 s). With the rows' loads, prefetches and products taken out, the rest (softmax, scales,
 * loops) still took 2.2 ms: that rest and the scattered reads set the pace now. */
#define INT_QUERY_BITS 16

static void quantize_queries(const float *qf, int heads, void *q_int, float *qs, int32_t *qcorr) {
    for (int r = 0; r < heads; r++) {
        const float *x = qf + r * 64;
        const float s = max_abs_f32(x, 64) / 32767.0f;
        const __m256 vs = _mm256_set1_ps(s);
        qs[r] = s;
        qcorr[r] = 0; /* (int16 queries need no correction) */
        for (int c = 0; c < 4; c++) {
            const __m256i lo = s > 0.0f ? _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + c * 16), vs))
                                        : _mm256_setzero_si256(); /* (to nearest even) */
            const __m256i hi = s > 0.0f ? _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + c * 16 + 8), vs))
                                        : _mm256_setzero_si256();
            /* (packs works within 128-bit lanes: the 64-bit permute puts the 16 values in order) */
            _mm256_storeu_si256((__m256i *)((int16_t *)q_int + r * 64 + c * 16),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
    }
}

/* The sums of eight 8-lane int32 vectors, lane u the sum of a[u]. */
static inline __m256i hsum8_epi32(const __m256i a[8]) {
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

/* head_scores of an int8 pool from the int16 query heads `q16`: 8 tokens at a time, each K row
 * widened once for the group, each dot product's 8 lanes summed with the other 7 tokens'
 * (hsum8_epi32), then times the query head's scale (the row's own is the softmax's). */
static inline __attribute__((always_inline)) void scores_i16(const int16_t *q16, const float *qs, const int group,
                                                             const int8_t *k, int64_t kv_stride, const int64_t *slots,
                                                             int64_t t0, int64_t t1, int64_t len, float *scores,
                                                             Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    for (int64_t t = t0; t < t1; t += 8) {
        const int n = t1 - t < 8 ? (int)(t1 - t) : 8;
        __m256i dots[8][8]; /* [query head][token] */
        for (int u = 0; u < 8; u++) {
            __m256i kr[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                             _mm256_setzero_si256()};
            if (u < n) {
                const int8_t *row = k + (size_t)slots[t + u] * kv_stride;
                for (int c = 0; c < 4; c++)
                    kr[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + c * 16)));
            }
            for (int g = 0; g < group; g++) {
                const __m256i *qg = (const __m256i *)(q16 + g * 64);
                dots[g][u] = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(kr[0], _mm256_loadu_si256(qg)),
                                     _mm256_madd_epi16(kr[1], _mm256_loadu_si256(qg + 1))),
                    _mm256_add_epi32(_mm256_madd_epi16(kr[2], _mm256_loadu_si256(qg + 2)),
                                     _mm256_madd_epi16(kr[3], _mm256_loadu_si256(qg + 3))));
            }
        }
        /* one prefetch_next per query head and 16 tokens, as run_span counts them */
        if (n == 8 && ((t - t0) & 8))
            for (int g = 0; g < group; g++) prefetch_next(&p);
        for (int g = 0; g < group; g++) {
            const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8_epi32(dots[g])), _mm256_set1_ps(qs[g]));
            if (n == 8) {
                _mm256_storeu_ps(scores + g * len + t, sc);
            } else {
                float out[8];
                _mm256_storeu_ps(out, sc);
                memcpy(scores + g * len + t, out, (size_t)n * sizeof(float));
            }
        }
    }
    *pf = p;
}

static void group_scores_int(const void *q_int, const float *qs, const int32_t *qcorr, int group, const int8_t *k,
                             int64_t kv_stride, const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                             float *scores, Prefetcher *pf) {
    (void)qcorr;
    BY_GROUP(group, scores_i16((const int16_t *)q_int, qs, G, k, kv_stride, slots, t0, t1, len, scores, pf));
}

/* Tokens t and t + 1 (`pair` 0: a zero row in its place) of an int8 pool's V rows, the 32 columns
 * from `col` on, interleaved for vpmaddwd: x[2b] holds columns 16b + 0..3 and 16b + 8..11, x[2b + 1]
 * 16b + 4..7 and 16b + 12..15, each as the pair (v_t, v_t+1). */
static inline void v_pairs_i16(const char *v, size_t row_bytes, const int64_t *slots, int64_t t, int pair, int col,
                               __m256i x[4]) {
    const int8_t *a = (const int8_t *)v + (size_t)slots[t] * row_bytes + col;
    const int8_t *b = pair ? (const int8_t *)v + (size_t)slots[t + 1] * row_bytes + col : NULL;
    for (int blk = 0; blk < 2; blk++) {
        const __m256i va = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + blk * 16)));
        const __m256i vb = b ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + blk * 16)))
                             : _mm256_setzero_si256();
        x[2 * blk] = _mm256_unpacklo_epi16(va, vb);
        x[2 * blk + 1] = _mm256_unpackhi_epi16(va, vb);
    }
}

/* P V of an int8 pool on AVX2 from the chunk's probabilities as int16 (probs_to_i16): half a row (32
 * columns) at a time, two tokens' rows interleaved (v_pairs_i16), each pair (P_t, P_t+1) broadcast
 * against them, the int32 sums (at most 64 x 32767 x 128 < 2^31 a chunk) added to the fp32 sums
 * times the chunk's scale, in column order. */
static inline __attribute__((always_inline)) void values_i16(const int16_t *p16, const float *p_scale, const int group,
                                                             const char *v, size_t row_bytes, const int64_t *slots,
                                                             int64_t t0, int64_t t1, int64_t len, float *acc,
                                                             Prefetcher *pf) {
    Prefetcher p = *pf;
    for (int half = 0; half < 2; half++) {
        __m256i sums[8][4];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) sums[g][c] = _mm256_setzero_si256();
        for (int64_t t = t0; t < t1; t += 2) {
            const int pair = t + 1 < t1;
            if (half == 0) { /* one prefetch_next per token, as run_span counts them */
                prefetch_next(&p);
                if (pair) prefetch_next(&p);
            }
            __m256i x[4];
            v_pairs_i16(v, row_bytes, slots, t, pair, half * 32, x);
            for (int g = 0; g < group; g++) {
                /* (P_t, P_t+1), read as one without a branch: past a chunk's last token the V row
                 * in its place is 0 (v_pairs_i16), so whatever follows P_t adds nothing (probs_i16 has
                 * room past its end; 200 requests, 8 layers' pools, Zen 3: ~7 % of the layer) */
                int32_t pr;
                memcpy(&pr, p16 + g * len + t, sizeof pr);
                const __m256i b = _mm256_set1_epi32(pr);
                for (int c = 0; c < 4; c++) sums[g][c] = _mm256_add_epi32(sums[g][c], _mm256_madd_epi16(x[c], b));
            }
        }
        for (int g = 0; g < group; g++) {
            const __m256 s = _mm256_set1_ps(p_scale[g]);
            for (int blk = 0; blk < 2; blk++) {
                const __m256i lo = sums[g][2 * blk], hi = sums[g][2 * blk + 1];
                float *o = acc + g * 64 + half * 32 + blk * 16;
                const __m256 first = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20)); /* columns 0..7 */
                const __m256 second = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31)); /* 8..15 */
                _mm256_storeu_ps(o, _mm256_fmadd_ps(first, s, _mm256_loadu_ps(o)));
                _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(second, s, _mm256_loadu_ps(o + 8)));
            }
        }
    }
    *pf = p;
}

/* chunk_to_i16 (probs_to_i16's chunk) of the AVX512-VNNI build, on 8 lanes: the same products and
 * roundings. */
static float chunk_to_i16(const float *p, const float *vs, int64_t n, int16_t *q) {
    __m256 m = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_loadu_ps(vs + t)));
    float top = max_lanes8(m, 0.0f);
    for (; t < n; t++) top = p[t] * vs[t] > top ? p[t] * vs[t] : top; /* (fmaxf is a libm call here) */
    const float inv = top > 0.0f ? 32767.0f / top : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256i x =
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(p + t), _mm256_loadu_ps(vs + t)), vinv));
        _mm_storeu_si128((__m128i *)(q + t),
                         _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
    }
    for (; t < n; t++) q[t] = (int16_t)lrintf(p[t] * vs[t] * inv); /* (to nearest even) */
    return top / 32767.0f;
}
#else
#define HAVE_AVX2_PATHS 0
#endif

#if defined(__AVX512BF16__)
/* A 64-element K row (bf16, e5m2 or int8 at p) as two vectors of bf16 pairs. */
static inline void k_row_bf16(const char *p, int fmt, __m512bh out[2]) {
    if (fmt == KV_E5M2) {
        out[0] = (__m512bh)e5m2x32_to_bf16(p);
        out[1] = (__m512bh)e5m2x32_to_bf16(p + 32);
    } else if (fmt == KV_I8) {
        out[0] = (__m512bh)i8x32_to_bf16(p);
        out[1] = (__m512bh)i8x32_to_bf16(p + 32);
    } else {
        out[0] = (__m512bh)_mm512_loadu_si512(p);
        out[1] = (__m512bh)_mm512_loadu_si512(p + 64);
    }
}
#endif

#if defined(__AVX512BF16__)
/* head_scores' bf16 pool and q, 16 tokens at a time (t0..t1 a multiple of 16 long), with the
 * group a constant (group_scores_bf16 dispatches: 1-4, larger groups in one shared copy), so that
 * the query rows stay in registers, and the 16 rows' addresses taken once for the group. On a
 * 2-core AMD EPYC (Zen 4, no AMX), decode attention of 50 requests with the KV in the caches 0.42
 * -> 0.40 ms a layer, of 200 from DRAM 2.65-2.72 -> 2.55-2.60. */
static inline __attribute__((always_inline)) void scores_bf16(const uint16_t *q, const int group, const uint16_t *k,
                                                              int64_t kv_stride, const int64_t *slots, int64_t t0,
                                                              int64_t t1, int64_t len, float *scores, Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    __m512bh qv[8][2];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 2; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * 64 + c * 32);
    for (int64_t t = t0; t < t1; t += 16) {
        const uint16_t *rows[16];
        for (int u = 0; u < 16; u++) rows[u] = k + (size_t)slots[t + u] * kv_stride;
        for (int g = 0; g < group; g++) {
            __m512 acc[16];
            prefetch_next(&p);
            for (int u = 0; u < 16; u++) {
                acc[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], (__m512bh)_mm512_loadu_si512(rows[u]));
                acc[u] = _mm512_dpbf16_ps(acc[u], qv[g][1], (__m512bh)_mm512_loadu_si512(rows[u] + 32));
            }
            _mm512_storeu_ps(scores + g * len + t, hsum16(acc));
        }
    }
    *pf = p;
}

static void group_scores_bf16(const uint16_t *q, int group, const uint16_t *k, int64_t kv_stride, const int64_t *slots,
                              int64_t t0, int64_t t1, int64_t len, float *scores, Prefetcher *pf) {
    BY_GROUP(group, scores_bf16(q, G, k, kv_stride, slots, t0, t1, len, scores, pf));
}
#endif

#ifdef __AVX512F__
/* 16 x 16 dwords: r[i][j] <- r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* r[4a + c], 128-bit lane l: column 4l + c of rows 4a..4a + 3 */
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
        __m512i u2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[8 + c] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_I8_SCORES 1
#define INT_QUERY_BITS 8
/* The query rows of an int8 pool's requests (bf16 q) as int8 for vpdpbusd: per query head of 64
 * values, s = max |q| / 127 and round(q / s) (to nearest even), with 128 times their sum (see
 * scores_i8). */
static void quantize_queries(const float *qf, int heads, void *q_int, float *qs, int32_t *qcorr) {
    int8_t *qi8 = (int8_t *)q_int;
    for (int r = 0; r < heads; r++) {
        const float *x = qf + r * 64;
        const float s = max_abs_f32(x, 64) / 127.0f;
        qs[r] = s;
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i v = s > 0.0f ? _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + c * 16), _mm512_set1_ps(s)))
                                 : _mm512_setzero_si512(); /* (to nearest even) */
            sum = _mm512_add_epi32(sum, v);
            _mm_storeu_si128((__m128i *)(qi8 + r * 64 + c * 16), _mm512_cvtsepi32_epi8(v));
        }
        qcorr[r] = 128 * _mm512_reduce_add_epi32(sum);
    }
}

/* head_scores of an int8 pool (head_dim 64) on vpdpbusd, for the group's query heads quantized
 * (quantize_queries): a K row is one 64-byte vector, taken as unsigned bytes k + 128 (its sign
 * bit flipped), so that vpdpbusd (unsigned x signed) sums (k + 128) q, 16 lanes of 4 products,
 * and 128 sum(q) comes off the token's total: the exact integer dot product of the int8 rows,
 * times q's scale (the row's own scale is the softmax's, softmax_numerators). Against widening
 * the rows to bf16 for vdpbf16ps: 3 instructions a row and query head instead of ~5.
 * Sixteen tokens at a time, their rows transposed (transpose16) so that lane u sums token u's
 * products, each 4 bytes of q broadcast against the 16 tokens' 4 bytes there: 16 vpdpbusd for 16
 * tokens and a query head, no sums across the lanes (summing 16 products' vectors across their
 * lanes took ~46 shuffles and adds for each 16 tokens and query head). The same integers, so the
 * same bits; with the KV in the caches 32.4 -> 30.1 ns a token and layer (one thread, 30
 * requests, 2-core AMD EPYC Zen 4); from DRAM no change (the reads set the pace there). */
static inline __attribute__((always_inline)) void scores_i8(const int8_t *qi8, const float *qs, const int32_t *qcorr,
                                                            const int group, const int8_t *k, int64_t kv_stride,
                                                            const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                                                            float *scores, Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i qv[8];
    for (int g = 0; g < group; g++) qv[g] = _mm512_loadu_si512(qi8 + g * 64);
    int64_t t = t0;
    for (; t + 16 <= t1; t += 16) {
        __m512i r[16];
        for (int u = 0; u < 16; u++)
            r[u] = _mm512_xor_si512(_mm512_loadu_si512(k + (size_t)slots[t + u] * kv_stride), flip);
        /* the group's calls of prefetch_next (run_span counts them) and one more: the next chunk
         * all asked for ahead of its end (with the KV in the caches 31.0 -> 30.1 ns) */
        for (int g = 0; g <= group; g++) prefetch_next(&p);
        transpose16(r); /* r[i], lane u: bytes 4i..4i + 3 of token t + u's row */
        __m512i acc[8][2];
        for (int g = 0; g < group; g++) acc[g][0] = acc[g][1] = _mm512_setzero_si512();
        for (int i = 0; i < 16; i += 2)
            for (int g = 0; g < group; g++) {
                const int32_t *qd = (const int32_t *)(qi8 + g * 64);
                acc[g][0] = _mm512_dpbusd_epi32(acc[g][0], r[i], _mm512_set1_epi32(qd[i]));
                acc[g][1] = _mm512_dpbusd_epi32(acc[g][1], r[i + 1], _mm512_set1_epi32(qd[i + 1]));
            }
        for (int g = 0; g < group; g++) {
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(acc[g][0], acc[g][1]), _mm512_set1_epi32(qcorr[g]));
            _mm512_storeu_ps(scores + g * len + t, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qs[g])));
        }
    }
    for (; t < t1; t++) {
        const __m512i row = _mm512_xor_si512(_mm512_loadu_si512(k + (size_t)slots[t] * kv_stride), flip);
        for (int g = 0; g < group; g++) {
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), row, qv[g]);
            scores[g * len + t] = (float)(_mm512_reduce_add_epi32(sums) - qcorr[g]) * qs[g];
        }
    }
    *pf = p;
}

static void group_scores_int(const void *q_int, const float *qs, const int32_t *qcorr, int group, const int8_t *k,
                             int64_t kv_stride, const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                             float *scores, Prefetcher *pf) {
    BY_GROUP(group, scores_i8((const int8_t *)q_int, qs, qcorr, G, k, kv_stride, slots, t0, t1, len, scores, pf));
}
#else
#define HAVE_I8_SCORES 0
#endif

/* The bits an int8 pool's query heads are rounded to where its rows are read as integers
 * (quantize_queries, group_scores_int, values_i16_group, probs_to_i16 and chunk_to_i16): 8 on
 * AVX512-VNNI (bf16 q), 16 on AVX2 (any q); 0: the rows are widened. */
#ifndef INT_QUERY_BITS
#define INT_QUERY_BITS 0
#endif

/* The portable paths (no AVX-512: AVX2, NEON) keep LANES partial sums or maxima, each in its own
 * order, so that GCC vectorizes their loops without reassociating a single sum (a lone
 * accumulator chains every multiply-add on the one before). They widen each K or V row into the
 * span's `row` scratch (head_dim floats). */
#define LANES 16 /* sum_lanes16's */

/* a . b over d values, in LANES partial sums added up as the AVX-512 path adds its lanes. */
static inline float dot_lanes(const float *a, const float *b, int d) {
    float part[LANES] = {0};
    int j = 0;
    for (; j + LANES <= d; j += LANES)
        for (int l = 0; l < LANES; l++) part[l] += a[j + l] * b[j + l];
    float s = sum_lanes16(part);
    for (; j < d; j++) s += a[j] * b[j];
    return s;
}

/* scores[g * len + t] = q[g] . k_t for t in [t0, t1), the group's query heads over one KV head;
 * `q` is the query rows in their own dtype (`qf` the same rows as fp32); `row`: d floats of
 * scratch for the portable path. */
static void head_scores(const void *q, const float *qf, const QueryInt *q_int, int group, const void *k,
                        int64_t kv_stride, int d, int q_bf16, int kv_fmt, const int64_t *slots, int64_t t0,
                        int64_t t1, int64_t len, float *scores, Prefetcher *pf, float *row) {
    (void)pf, (void)q_int; /* used by the vector paths only */
    size_t elem = kv_elem_size(kv_fmt);
#if INT_QUERY_BITS
    if (q_int) {
        group_scores_int(q_int->q, q_int->scale, q_int->corr, group, (const int8_t *)k, kv_stride, slots, t0, t1, len,
                         scores, pf);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    if (d == 64 && group <= 8 && q_bf16 && kv_fmt != KV_F32) {
        /* bf16 x bf16 products are exact in fp32: one dpbf16 sums 32 of them into 16 lanes */
        __m512bh qv[8][2];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 2; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + g * d + c * 32);
        int64_t t = t0;
        /* 16 tokens at a time: 16 dot-product vectors, summed lane-wise by one transpose tree
         * (hsum16) instead of 16 horizontal reductions; a bf16 pool's rows read in place
         * (scores_bf16), an e5m2 pool's widened once for all the group's query heads */
        if (kv_fmt == KV_BF16) {
            t = t0 + (t1 - t0) / 16 * 16;
            group_scores_bf16((const uint16_t *)q, group, (const uint16_t *)k, kv_stride, slots, t0, t, len, scores, pf);
        }
        for (; t + 16 <= t1; t += 16) {
            __m512bh wide[16][2];
            for (int u = 0; u < 16; u++)
                k_row_bf16((const char *)k + (size_t)slots[t + u] * kv_stride * elem, kv_fmt, wide[u]);
            for (int g = 0; g < group; g++) {
                __m512 acc[16];
                prefetch_next(pf);
                for (int u = 0; u < 16; u++) {
                    acc[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], wide[u][0]);
                    acc[u] = _mm512_dpbf16_ps(acc[u], qv[g][1], wide[u][1]);
                }
                _mm512_storeu_ps(scores + g * len + t, hsum16(acc));
            }
        }
        for (; t < t1; t++) {
            __m512bh kr[2];
            k_row_bf16((const char *)k + (size_t)slots[t] * kv_stride * elem, kv_fmt, kr);
            for (int g = 0; g < group; g++) {
                __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kr[0]);
                acc = _mm512_dpbf16_ps(acc, qv[g][1], kr[1]);
                scores[g * len + t] = _mm512_reduce_add_ps(acc);
            }
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (d == 64 && group <= 8) {
        group_scores_f32(qf, group, (const char *)k, kv_stride * elem, elem, kv_fmt, slots, t0, t1, len, scores);
        return;
    }
#endif
#if HAVE_AVX2_PATHS
    if (d == 64 && group <= 8 && kv_fmt != KV_E5M2) {
        group_scores_avx2(qf, group, (const char *)k, kv_stride * elem, elem, kv_fmt, slots, t0, t1, len, scores, pf);
        return;
    }
#endif
    (void)q;
    (void)q_bf16;
    for (int64_t t = t0; t < t1; t++) {
        load_row(row, (const char *)k + (size_t)slots[t] * kv_stride * elem, d, kv_fmt);
        for (int g = 0; g < group; g++) scores[g * len + t] = dot_lanes(qf + g * d, row, d);
    }
}

#if defined(__AVX512BF16__)
/* How the P V paths take a V row's values: bf16, int8 widened to bf16 (exactly), int8 widened to
 * int16 (values_i16). */
enum { V_BF16, V_I8_AS_BF16, V_I8_AS_I16 };

/* 32 values of a V row as 16-bit lanes (`mode`: the enum above). */
static inline __m512i v_row32(const char *p, const int mode) {
    return mode == V_I8_AS_I16    ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p))
           : mode == V_I8_AS_BF16 ? i8x32_to_bf16(p)
                                  : _mm512_loadu_si512(p);
}

/* The V rows of tokens t and t + 1 (`two` 0: token t's and a row of zeros) as four vectors of
 * their values in pairs, one pair a 32-bit lane, interleaved by unpacklo / unpackhi within each
 * 128-bit lane (a cheaper instruction than a cross-lane permute; values_columns_in_order puts the
 * columns back); a call of prefetch_next for each row read. */
static inline __attribute__((always_inline)) void v_pairs(const char *v, size_t row_bytes, const int64_t *slots,
                                                          int64_t t, const int two, const int mode, Prefetcher *p,
                                                          __m512i vp[4]) {
    const size_t half = mode == V_BF16 ? 64 : 32; /* bytes of 32 values */
    prefetch_next(p);
    const char *ra = v + (size_t)slots[t] * row_bytes, *rb = NULL;
    if (two) {
        prefetch_next(p);
        rb = v + (size_t)slots[t + 1] * row_bytes;
    }
    for (int c = 0; c < 2; c++) {
        const __m512i a = v_row32(ra + c * half, mode);
        const __m512i b = two ? v_row32(rb + c * half, mode) : _mm512_setzero_si512();
        vp[2 * c] = _mm512_unpacklo_epi16(a, b);
        vp[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

/* head_values' bf16 path with the group a constant (values_bf16_group dispatches, as for the
 * scores), so that its 4 x group accumulators stay in registers: with the group a variable GCC
 * kept them on the stack and tested the group at every token pair. Two tokens at a time: their
 * rows interleaved into pairs by unpacklo/unpackhi (within each 128-bit lane, a cheaper
 * instruction than a cross-lane permute), one vdpbf16ps per 16 columns and query head against the
 * broadcast pair of its two probabilities (adjacent in probs_bf16: one 32-bit load). The unpacks
 * leave each accumulator's 16 columns out of order (see values_columns_in_order); `acc` is kept in
 * that order between chunks and put back in column order once, after the last. With the scores'
 * prefetcher also a local copy (it too had been kept in memory), on a 2-core AMD EPYC (Zen 4, no
 * AMX): 50 requests' KV in the caches 0.46 -> 0.36 ms a layer, 200 requests from DRAM 2.76-2.84 ->
 * 2.36-2.44; the same bits. */
static inline __attribute__((always_inline)) void values_bf16(const uint16_t *probs_bf16, const int group,
                                                              const char *v, size_t row_bytes, const int i8,
                                                              const int64_t *slots, int64_t t0, int64_t t1,
                                                              int64_t len, float *acc, Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    const int mode = i8 ? V_I8_AS_BF16 : V_BF16;
    __m512 av[8][4];
    values_acc_load(av, acc, group);
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) {
        __m512i vp[4];
        v_pairs(v, row_bytes, slots, t, 1, mode, &p, vp);
        for (int g = 0; g < group; g++) {
            const __m512bh pr = pair_bcast(probs_bf16 + g * len + t); /* (P_t, P_t+1) */
            for (int c = 0; c < 4; c++) av[g][c] = _mm512_dpbf16_ps(av[g][c], (__m512bh)vp[c], pr);
        }
    }
    if (t < t1) { /* a last odd token: its row paired with zeros, its probability with 0 */
        __m512i vp[4];
        v_pairs(v, row_bytes, slots, t, 0, mode, &p, vp);
        for (int g = 0; g < group; g++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int32_t)probs_bf16[g * len + t]);
            for (int c = 0; c < 4; c++) av[g][c] = _mm512_dpbf16_ps(av[g][c], (__m512bh)vp[c], pr);
        }
    }
    values_acc_store(av, acc, group);
    *pf = p;
}

static void values_bf16_group(const uint16_t *probs_bf16, int group, const char *v, size_t row_bytes, int fmt,
                              const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf) {
    if (fmt == KV_I8) {
        BY_GROUP(group, values_bf16(probs_bf16, G, v, row_bytes, 1, slots, t0, t1, len, acc, pf));
    } else {
        BY_GROUP(group, values_bf16(probs_bf16, G, v, row_bytes, 0, slots, t0, t1, len, acc, pf));
    }
}

#if HAVE_I8_SCORES
/* P V of an int8 pool on vpdpwssd (AVX512-VNNI): the probabilities of a chunk of tokens (times the
 * V rows' scales) as int16, round(p / s) with s = the chunk's largest / 32767 per query head
 * (run_span: probs_i16, p_scale), and the V rows' int8 values widened to int16 (vpmovsxbw, one
 * instruction for 32 values where the widening to bf16 takes five). Two tokens' rows interleaved
 * into pairs as in values_bf16 (the same lane order, values_columns_in_order), each pair's two
 * products summed into int32 lanes (at most 64 x 32767 x 128 < 2^31 a chunk), then added to the
 * fp32 sums times s once a chunk. Against P rounded to bf16 (2^-9 of each probability) the error is
 * at most 2^-16 of the chunk's largest (against float64 attention the kernel's outputs are then
 * as far off as their own bf16 rounding; with P in bf16 1.38x as far). With the KV in the caches
 * (30 requests, one thread, 2-core AMD EPYC Zen 4) 30.1 -> 25.7 ns a token and layer. In W200
 * (w8a8), where the reads set most of the pace, less: decode attention against P in bf16 6.46 /
 * 5.55 -> 5.32 / 5.35 s (two alternated pairs), with scores_i8's transposed rows against the
 * kernel before both 5.40 -> 5.30 s on average (four alternated pairs, 4.88-5.64 s). */
static inline __attribute__((always_inline)) void values_i16(const int16_t *p16, const float *p_scale, const int group,
                                                             const char *v, size_t row_bytes, const int64_t *slots,
                                                             int64_t t0, int64_t t1, int64_t len, float *acc,
                                                             Prefetcher *pf) {
    Prefetcher p = *pf; /* (a local copy, kept in registers) */
    __m512i sums[8][4];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) sums[g][c] = _mm512_setzero_si512();
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) {
        __m512i vp[4];
        v_pairs(v, row_bytes, slots, t, 1, V_I8_AS_I16, &p, vp);
        for (int g = 0; g < group; g++) {
            int32_t pair; /* (P_t, P_t+1) */
            memcpy(&pair, p16 + g * len + t, sizeof pair);
            const __m512i pr = _mm512_set1_epi32(pair);
            for (int c = 0; c < 4; c++) sums[g][c] = _mm512_dpwssd_epi32(sums[g][c], vp[c], pr);
        }
    }
    if (t < t1) { /* a last odd token: its row paired with zeros, its probability with 0 */
        __m512i vp[4];
        v_pairs(v, row_bytes, slots, t, 0, V_I8_AS_I16, &p, vp);
        for (int g = 0; g < group; g++) {
            const __m512i pr = _mm512_set1_epi32((int32_t)(uint16_t)p16[g * len + t]);
            for (int c = 0; c < 4; c++) sums[g][c] = _mm512_dpwssd_epi32(sums[g][c], vp[c], pr);
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 s = _mm512_set1_ps(p_scale[g]);
        for (int c = 0; c < 4; c++) {
            float *o = acc + g * 64 + c * 16;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][c]), s, _mm512_loadu_ps(o)));
        }
    }
    *pf = p;
}

/* One chunk of probs_to_i16 (below): the n probabilities p times the V rows' scales vs as int16
 * into q, round(p vs / s) with s = their largest / 32767 (0 for a chunk of zeros), which it
 * returns. The products are made in both passes (the same bits each time) instead of being stored
 * first: one pass over the probabilities fewer (30 requests' KV in the caches, 2-core AMD EPYC Zen
 * 4: 0.229 -> 0.222 ms a layer; from DRAM within the noise). */
static float chunk_to_i16(const float *p, const float *vs, int64_t n, int16_t *q) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 keep = first_lanes(n - t);
        m = _mm512_max_ps(m, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + t), _mm512_maskz_loadu_ps(keep, vs + t)));
    }
    const float top = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 keep = first_lanes(n - t);
        const __m512 pv = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, p + t), _mm512_maskz_loadu_ps(keep, vs + t));
        const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(pv, inv));
        _mm256_mask_storeu_epi16(q + t, keep, _mm512_cvtsepi32_epi16(x));
    }
    return top / 32767.0f;
}
#endif

/* Accumulator c of values_bf16 (c = 2 * half + hi, half: columns 32 * half..) holds in its lane
 * 4k + e column 32 * half + 8k + 4 * hi + e (the unpacks' order). Rows of 64 columns at `acc`
 * back into column order, `rows` of them. */
static void values_columns_in_order(float *acc, int rows) {
    /* column j of a 16-column output block (lo, hi: the block's two accumulators): lane j % 4 +
     * 4 * (j / 8) of lo for (j / 4) even, of hi (index + 16) for (j / 4) odd */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int r = 0; r < rows; r++)
        for (int half = 0; half < 2; half++) {
            float *p = acc + r * 64 + half * 32;
            const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
            _mm512_storeu_ps(p, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
}
#endif

#if INT_QUERY_BITS
/* Each query head's probabilities times the V rows' scales (`v_scale`: [kv_heads][len], query
 * head r's KV head r / group) of the chunks of CHUNK tokens as int16 for values_i16: p16[r * len +
 * t] = round(p v_scale / s), p_scale[chunk * heads + r] = s, s = the chunk's largest / 32767
 * (chunk_to_i16 of the build). */
static void probs_to_i16(const float *probs, const float *v_scale, int heads, int group, int64_t len, int16_t *p16,
                         float *p_scale) {
    for (int r = 0; r < heads; r++) {
        const float *p = probs + (size_t)r * len, *vs = v_scale + (size_t)(r / group) * len;
        for (int64_t t0 = 0, chunk = 0; t0 < len; t0 += CHUNK, chunk++) {
            const int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;
            p_scale[chunk * heads + r] = chunk_to_i16(p + t0, vs + t0, n, p16 + (size_t)r * len + t0);
        }
    }
}

/* P V of an int8 pool read as integers: values_i16 of the build (AVX512-VNNI's or AVX2's). */
static void values_i16_group(const int16_t *p16, const float *p_scale, int group, const char *v, size_t row_bytes,
                             const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf) {
    BY_GROUP(group, values_i16(p16, p_scale, G, v, row_bytes, slots, t0, t1, len, acc, pf));
}
#endif

/* acc[g] += sum over t in [t0, t1) of probs[g * len + t] * v_t; `probs_bf16`: the same
 * probabilities rounded to bf16, for a bf16 pool and q on AVX512-BF16 (NULL elsewhere), where
 * head_dim 64 leaves `acc` in values_bf16's lane order (values_columns_in_order puts it back);
 * `probs_i16` and `p_scale`: where an int8 pool is read as integers (INT_QUERY_BITS), the same
 * probabilities as int16 and the scales of the chunk [t0, t1) (values_i16: AVX512-VNNI's in
 * values_bf16's lane order, AVX2's in column order; NULL elsewhere);
 * `row`: d floats of scratch for the portable path */
static void head_values(const float *probs, const uint16_t *probs_bf16, const int16_t *probs_i16,
                        const float *p_scale, int group, const void *v, int64_t kv_stride, int d, int fmt,
                        const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf,
                        float *row) {
    (void)pf, (void)probs_bf16, (void)probs_i16, (void)p_scale; /* used by the vector paths only */
    size_t elem = kv_elem_size(fmt);
#if INT_QUERY_BITS
    if (probs_i16) { /* an int8 pool, head_dim 64, group <= 8 (run_span) */
        values_i16_group(probs_i16, p_scale, group, (const char *)v, kv_stride * elem, slots, t0, t1, len, acc, pf);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    if (d == 64 && group <= 8 && (fmt == KV_BF16 || fmt == KV_I8) && probs_bf16) {
        /* P V on vdpbf16ps (values_bf16; an int8 pool's rows widened to bf16, exactly), where the
         * fp32 path below widens every row and takes a multiply-add per token and query head. (An
         * e5m2 pool stays there: its rows widened to bf16 would lose e5m2's subnormals, which the
         * fp32 path reads exactly.) On a 2-core AMD EPYC (Zen 4, no AMX), 50 requests' KV in the
         * caches: 0.45 -> 0.40-0.41 ms a layer; 200 requests from DRAM 2.85-3.17 -> 2.79-2.82 (there
         * the memory's time adds to the arithmetic's, so the vectors' share of it counts in full);
         * W200's decode attention 9.67 -> 9.05 s. */
        values_bf16_group(probs_bf16, group, (const char *)v, kv_stride * elem, fmt, slots, t0, t1, len, acc, pf);
        return;
    }
#endif
#ifdef __AVX512F__
    if (d == 64 && group <= 8) {
        group_values_f32(probs, group, (const char *)v, kv_stride * elem, elem, fmt, slots, t0, t1, len, acc, pf);
        return;
    }
#endif
#if HAVE_AVX2_PATHS
    if (d == 64 && group <= 8 && fmt != KV_E5M2) {
        group_values_avx2(probs, group, (const char *)v, kv_stride * elem, elem, fmt, slots, t0, t1, len, acc, pf);
        return;
    }
#endif
    for (int64_t t = t0; t < t1; t++) {
        load_row(row, (const char *)v + (size_t)slots[t] * kv_stride * elem, d, fmt);
        for (int g = 0; g < group; g++) {
            float p = probs[g * len + t];
            for (int j = 0; j < d; j++) acc[g * d + j] += p * row[j];
        }
    }
}

/* scores[0..len) *= scale (first times mul[0..len) where there is one: an int8 pool's K scales),
 * then exp(score - max) in place; returns the sum. */
static float softmax_numerators(float *scores, int64_t len, float scale, const float *mul) {
    float mx = -INFINITY, sum = 0.0f;
    int64_t t = 0;
#ifdef __AVX512F__
    __m512 vmx = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    for (; t + 16 <= len; t += 16) {
        __m512 x = _mm512_loadu_ps(scores + t);
        if (mul) x = _mm512_mul_ps(x, _mm512_loadu_ps(mul + t));
        x = _mm512_mul_ps(x, vscale);
        _mm512_storeu_ps(scores + t, x);
        vmx = _mm512_max_ps(vmx, x);
    }
    mx = _mm512_reduce_max_ps(vmx);
#elif defined(__AVX2__)
    /* the AVX-512 path's on 8 lanes: GCC's scalar maxima below took ~0.2 ms of a 200-request
     * layer's ~3.6 (2-core AMD EPYC Zen 3; the same bits) */
    __m256 vmx = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    for (; t + 8 <= len; t += 8) {
        __m256 x = _mm256_loadu_ps(scores + t);
        if (mul) x = _mm256_mul_ps(x, _mm256_loadu_ps(mul + t));
        x = _mm256_mul_ps(x, vscale);
        _mm256_storeu_ps(scores + t, x);
        vmx = _mm256_max_ps(vmx, x);
    }
    mx = max_lanes8(vmx, mx);
#else
    /* the scaling (a loop that vectorizes without AVX-512), then LANES running maxima (float
     * compares, which GCC keeps scalar, but in sixteen independent chains) */
    if (mul)
        for (int64_t i = 0; i < len; i++) scores[i] *= mul[i];
    for (int64_t i = 0; i < len; i++) scores[i] *= scale;
    float mx_l[LANES];
    for (int l = 0; l < LANES; l++) mx_l[l] = -INFINITY;
    for (; t + LANES <= len; t += LANES)
        for (int l = 0; l < LANES; l++) mx_l[l] = scores[t + l] > mx_l[l] ? scores[t + l] : mx_l[l];
    for (int l = 0; l < LANES; l++) mx = fmaxf(mx, mx_l[l]);
    for (; t < len; t++) mx = fmaxf(mx, scores[t]);
    t = len;
#endif
    for (; t < len; t++) {
        if (mul) scores[t] *= mul[t];
        scores[t] *= scale;
        mx = fmaxf(mx, scores[t]);
    }
    t = 0;
#ifdef __AVX512F__
    __m512 vsum = _mm512_setzero_ps();
    vmx = _mm512_set1_ps(mx);
    for (; t + 16 <= len; t += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t), vmx));
        _mm512_storeu_ps(scores + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#else
    float sum_l[LANES] = {0};
    for (; t + LANES <= len; t += LANES)
        for (int l = 0; l < LANES; l++) {
            float e = exp_neg_lanes(scores[t + l] - mx);
            scores[t + l] = e;
            sum_l[l] += e;
        }
    sum = sum_lanes16(sum_l);
#endif
    for (; t < len; t++) {
        scores[t] = exp_neg_lanes(scores[t] - mx);
        sum += scores[t];
    }
    return sum;
}

#if HAVE_AMX
/* Decode attention of one request on AMX tiles (bf16 q, bf16 or e5m2 KV, head_dim 64, at most 16
 * query heads: every query head of the request in one tile). e5m2 rows are always copied out,
 * widened to bf16 (e5m2x32_to_bf16) on the way.
 *   S = K Q^T: 16 tokens' K rows (32 of head_dim) are a tile read straight from the pool when
 *       their slots are evenly spaced (else copied out first: block_rows); Q^T is a tile per KV head and half
 *       of head_dim, [16 head_dim pairs][16 query heads][2], zero in the columns of the other
 *       KV heads' queries, so one fp32 tile [16 tokens][16 query heads] sums every KV head.
 *   O = P V: V's rows go into the tiles as they lie, [16 tokens][32 of head_dim]; read as the
 *       tiles' pairs, a row holds head_dim columns (2j, 2j + 1) in pair j. So P goes in twice,
 *       [16 query heads][16 tokens][2], once in the pairs' first halves (P . V gives the even
 *       columns) and once in the second (the odd ones): four fp32 tiles of O, no copy of V.
 * P is the fp32 softmax rounded to bf16 (as torch's flash attention for bf16); the row sums are
 * fp32. Work per 16 tokens with SmolLM2's 3 KV heads: 6 tile products for S and 12 for O.
 * A block that has to be copied is copied one block ahead, after the tile products of the block
 * before it, into the other half of a double buffer: the copy's loads then wait for the memory
 * while the tiles work, not before them. With a decode step of 200 requests (30 layers' pools,
 * 2-core Xeon), an e5m2 pool: 2.36-2.47 -> 2.09-2.37 ms a layer at 64 decoded tokens, 2.92-3.09 ->
 * 2.63-2.87 at 128; a bf16 pool's copies no faster. Reading evenly spaced slots in place instead
 * of copying them (a steady decode batch's tokens, as many slots apart as it has requests): a bf16
 * pool at 128 decoded tokens 3.61-3.72 -> 2.74-2.87 ms a layer, as fast as consecutive slots.
 * A decode step with drafts (jump-forward) gives a request one row per token: up to MULTI_MAX of
 * them share one pass over its K blocks (amx_request), then each takes its own pass over V, the
 * first from DRAM and the rest from L2. 200 requests of 150-350 + 64 tokens (30 layers' pools,
 * 2-core Xeon), three rows each: 3.95 -> 3.51 ms a layer (one row each: 2.31-2.35 either way).
 * In the V pass a block's P tiles are written while the block before it is in the tiles, and the
 * softmax's maximum runs in four chains: with the KV in the L3 (one layer's pools read again,
 * 200 requests) 1.32-1.42 -> 1.28-1.32 ms a layer; from DRAM the memory sets the pace either way
 * (2.19-2.35 -> 2.20-2.23). */

typedef struct {
    float *scores;  /* [queries][16 * blocks][16]: token t's scores for the 16 query heads at t * 16 */
    uint16_t *rows; /* one block's slot rows copied out of the pool, [16][kv_heads * 64] */
    uint32_t *qt;   /* Q^T tiles, [queries][kv_heads][2 halves][16 pairs][16 query heads] */
    uint32_t *pt;   /* P tiles, [2 blocks][kv_heads][2 halves of the pairs][16 query heads][16 tokens] */
} TileScratch;

/* The slot rows of tokens [t0, t0 + 16) as bf16, rows `*stride` bytes apart: in a bf16 pool when
 * the slots are evenly spaced (consecutive, or a decode stretch where the same requests took one
 * slot each step), else copied into `buf`, `slot` elements apart (widened from an e5m2 pool; zeros
 * past len: 0 x a stale row must not be NaN). */
static const uint16_t *block_rows(const void *pool, int fmt, const int64_t *slots, int64_t t0, int64_t len,
                                  int64_t slot, uint16_t *buf, size_t *stride) {
    if (fmt == KV_BF16 && t0 + 16 <= len) {
        int64_t step = slots[t0 + 1] - slots[t0];
        int even = step > 0;
        for (int u = 2; even && u < 16; u++) even = slots[t0 + u] - slots[t0 + u - 1] == step;
        if (even) {
            *stride = (size_t)(step * slot * 2);
            return (const uint16_t *)pool + slots[t0] * slot;
        }
    }
    *stride = (size_t)slot * 2;
    for (int u = 0; u < 16; u++) {
        uint16_t *dst = buf + u * slot;
        if (t0 + u >= len) {
            memset(dst, 0, (size_t)slot * 2);
        } else if (fmt == KV_E5M2) {
            e5m2_row_to_bf16(dst, (const uint8_t *)pool + slots[t0 + u] * slot, slot);
        } else {
            memcpy(dst, (const uint16_t *)pool + slots[t0 + u] * slot, (size_t)slot * 2);
        }
    }
    return buf;
}

/* Prefetch the slot rows of tokens [t0, min(t1, len)) into L2. amx_request sends a block's rows
 * two blocks ahead in one burst. Spread over the block instead they were slower: a token's rows
 * per row of P and a few per tile product, 2.65 -> 3.37 ms a layer (interleaved slots); the
 * vector paths' Prefetcher no faster, its burst into L1 for scattered slots 20 % slower. */
static inline void prefetch_l2(const char *base, const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                               size_t row_bytes) {
    for (int64_t t = t0; t < t1 && t < len; t++) {
        const char *p = base + (size_t)slots[t] * row_bytes;
        for (size_t off = 0; off < row_bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
    }
}

/* Queries of one request computed in one pass (a decode step's token and its drafts, which sit at
 * consecutive positions): each reads the K blocks as they pass through the tiles, so the request's
 * K comes from DRAM once rather than once per query. Their scores take tiles 0..MULTI_MAX - 1, K
 * tile 5, Q^T tiles 6 and 7 in turn (a tile product and the next Q^T load need not wait on each
 * other). */
#define MULTI_MAX 5
_Static_assert(MULTI_MAX <= 5, "the queries' scores take tiles 0-4: tile 5 holds K, 6 and 7 Q^T");

/* The tile numbers of the tile instructions are immediates: one case per query. */
static inline void scores_zero(int t) {
    switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    case 3: _tile_zero(3); break;
    default: _tile_zero(4); break;
    }
}

/* S_t += K (tile 5) . Q_t^T (tile 6 for even t, 7 for odd), Q_t^T loaded from `qt` first. */
static inline void scores_product(int t, const uint32_t *qt) {
    switch (t) {
    case 0: _tile_loadd(6, qt, 64); _tile_dpbf16ps(0, 5, 6); break;
    case 1: _tile_loadd(7, qt, 64); _tile_dpbf16ps(1, 5, 7); break;
    case 2: _tile_loadd(6, qt, 64); _tile_dpbf16ps(2, 5, 6); break;
    case 3: _tile_loadd(7, qt, 64); _tile_dpbf16ps(3, 5, 7); break;
    default: _tile_loadd(6, qt, 64); _tile_dpbf16ps(4, 5, 6); break;
    }
}

static inline void scores_store(int t, float *dst) {
    switch (t) {
    case 0: _tile_stored(0, dst, 64); break;
    case 1: _tile_stored(1, dst, 64); break;
    case 2: _tile_stored(2, dst, 64); break;
    case 3: _tile_stored(3, dst, 64); break;
    default: _tile_stored(4, dst, 64); break;
    }
}

/* out (bf16, [heads][64]) = P V for one query over its first len slots, from its scores
 * ([len][16], s->scores + ... as amx_request stored them); `prefetch`: V comes from DRAM (the
 * request's first pass over it), so its blocks are prefetched two ahead. */
static void amx_values(const Args *a, const float *scores, const int64_t *slots, int64_t len, int prefetch,
                       uint16_t *out, TileScratch *s) {
    const int heads = a->heads, kv_heads = a->kv_heads, group = heads / kv_heads;
    const int64_t slot = (int64_t)kv_heads * 64, blocks = (len + 15) / 16;
    const size_t pool_slot_bytes = (size_t)slot * kv_elem_size(a->kv_fmt);
    const char *v = (const char *)a->v;
    const uint16_t *rows[2];
    size_t stride[2];
    if (prefetch) prefetch_l2(v, slots, 0, 32, len, pool_slot_bytes);
    /* P's numerators 2^(log2(e) (scale * s - scale * max)) (exp2_neg16) */
    const __m512 scale = _mm512_set1_ps(a->scale * LOG2E);
    /* the maxima in four chains (a single chain waited on each max's latency, token by token) */
    __m512 m4[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                    _mm512_set1_ps(-INFINITY)};
    int64_t t = 0;
    for (; t + 4 <= len; t += 4)
        for (int c = 0; c < 4; c++) m4[c] = _mm512_max_ps(m4[c], _mm512_loadu_ps(scores + (t + c) * 16));
    for (; t < len; t++) m4[0] = _mm512_max_ps(m4[0], _mm512_loadu_ps(scores + t * 16));
    __m512 vmax = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
    __m512 vsum = _mm512_setzero_ps();
    const __m512 shift = _mm512_mul_ps(vmax, _mm512_set1_ps(-a->scale * LOG2E));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    rows[0] = block_rows(v, a->kv_fmt, slots, 0, len, slot, s->rows, &stride[0]);
    /* Block b's P tiles are written a block ahead, while block b - 1's products run: a tile load
     * right after the vector stores of its bytes waited for them to reach L1. */
    for (int64_t b = 0; b <= blocks; b++) {
        if (b < blocks) {
            const int64_t t0 = b * 16;
            __m512i p[16];
            for (int u = 0; u < 16; u++) {
                if (t0 + u < len) {
                    __m512 e = exp2_neg16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + (t0 + u) * 16), scale, shift));
                    vsum = _mm512_add_ps(vsum, e);
                    p[u] = _mm512_cvtepu16_epi32(to_bf16x16(e));
                } else {
                    p[u] = _mm512_setzero_si512();
                }
            }
            transpose16(p); /* p[g]: query head g's 16 probabilities, bf16 in the low halves */
            uint32_t *pt = s->pt + (b & 1) * kv_heads * 2 * 256;
            for (int g = 0; g < heads; g++) {
                uint32_t *tile = pt + (g / group) * 2 * 256 + g * 16;
                _mm512_storeu_si512(tile, p[g]);
                _mm512_storeu_si512(tile + 256, _mm512_slli_epi32(p[g], 16));
            }
        }
        if (b == 0) continue;
        const int64_t t0 = (b - 1) * 16;
        uint32_t *pt = s->pt + ((b - 1) & 1) * kv_heads * 2 * 256;
        const uint16_t *r = rows[(b - 1) & 1];
        for (int h = 0; h < kv_heads; h++) {
            _tile_loadd(4, pt + h * 2 * 256, 64);
            _tile_loadd(5, pt + h * 2 * 256 + 256, 64);
            _tile_loadd(6, r + h * 64, stride[(b - 1) & 1]);
            _tile_loadd(7, r + h * 64 + 32, stride[(b - 1) & 1]);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (prefetch) prefetch_l2(v, slots, t0 + 32, t0 + 48, len, pool_slot_bytes);
        if (b < blocks)
            rows[b & 1] = block_rows(v, a->kv_fmt, slots, t0 + 16, len, slot, s->rows + (b & 1) * 16 * slot,
                                     &stride[b & 1]);
    }
    /* o[c]: [16 query heads][16 columns]: head_dim 2j (c = 0), 2j + 1 (1), 32 + 2j (2), 33 + 2j (3) */
    float o[4][256], sums[16];
    _tile_stored(0, o[0], 64);
    _tile_stored(1, o[1], 64);
    _tile_stored(2, o[2], 64);
    _tile_stored(3, o[3], 64);
    _mm512_storeu_ps(sums, vsum);
    uint32_t order[16];
    for (int j = 0; j < 16; j++) order[j] = (uint32_t)(j % 2 ? 16 + j / 2 : j / 2);
    const __m512i lo = _mm512_loadu_si512(order), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int g = 0; g < heads; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
        for (int c = 0; c < 2; c++) {
            __m512 even = _mm512_loadu_ps(o[2 * c] + g * 16), odd = _mm512_loadu_ps(o[2 * c + 1] + g * 16);
            store16_bf16(out + g * 64 + c * 32, _mm512_mul_ps(_mm512_permutex2var_ps(even, lo, odd), inv));
            store16_bf16(out + g * 64 + c * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(even, hi, odd), inv));
        }
    }
}

/* How many rows from row i on (at most MULTI_MAX, before `end`) are queries of one request at
 * consecutive positions: the same request-to-token row, each one slot longer than the last. */
static int request_rows(const Args *a, int i, int end) {
    int n = 1;
    while (n < MULTI_MAX && i + n < end && a->pool_idx[i + n] == a->pool_idx[i] &&
           a->seq_lens[i + n] == a->seq_lens[i + n - 1] + 1)
        n++;
    return n;
}

/* out (bf16, [queries][heads][64]) = attention of `queries` (1..MULTI_MAX) rows of one request,
 * q [queries][heads][64]: query j sees the first len - (queries - 1 - j) slots. The K blocks go
 * through the tiles once for all of them; V once per query, the longest first (its pass brings V
 * into L2 for the others). */
static void amx_request(const Args *a, const uint16_t *q, int queries, const int64_t *slots, int64_t len,
                        uint16_t *out, TileScratch *s) {
    const int heads = a->heads, kv_heads = a->kv_heads, group = heads / kv_heads;
    const int64_t slot = (int64_t)kv_heads * 64, blocks = (len + 15) / 16;
    const size_t pool_slot_bytes = (size_t)slot * kv_elem_size(a->kv_fmt);
    const char *k = (const char *)a->k;
    const int64_t qt_elems = (int64_t)kv_heads * 2 * 256;
    /* Q^T: dword (pair r of head_dim half c, query head g) of KV head g / group's tile, per query */
    memset(s->qt, 0, (size_t)queries * qt_elems * 4);
    for (int j = 0; j < queries; j++)
        for (int g = 0; g < heads; g++)
            for (int c = 0; c < 2; c++) {
                uint32_t *tile = s->qt + j * qt_elems + ((g / group) * 2 + c) * 256;
                const uint16_t *qg = q + ((size_t)j * heads + g) * 64 + c * 32;
                for (int r = 0; r < 16; r++) memcpy(tile + r * 16 + g, qg + 2 * r, 4);
            }
    prefetch_l2(k, slots, 0, 32, len, pool_slot_bytes);
    const uint16_t *rows[2];
    size_t stride[2];
    rows[0] = block_rows(k, a->kv_fmt, slots, 0, len, slot, s->rows, &stride[0]);
    for (int64_t b = 0; b < blocks; b++) {
        int64_t t0 = b * 16;
        const uint16_t *r = rows[b & 1];
        for (int j = 0; j < queries; j++) scores_zero(j);
        for (int h = 0; h < kv_heads; h++)
            for (int c = 0; c < 2; c++) {
                _tile_loadd(5, r + h * 64 + c * 32, stride[b & 1]);
                for (int j = 0; j < queries; j++) scores_product(j, s->qt + j * qt_elems + (h * 2 + c) * 256);
            }
        for (int j = 0; j < queries; j++) scores_store(j, s->scores + (j * blocks + b) * 256);
        prefetch_l2(k, slots, t0 + 32, t0 + 48, len, pool_slot_bytes);
        if (b + 1 < blocks)
            rows[(b + 1) & 1] = block_rows(k, a->kv_fmt, slots, t0 + 16, len, slot, s->rows + ((b + 1) & 1) * 16 * slot,
                                           &stride[(b + 1) & 1]);
    }
    for (int j = queries - 1; j >= 0; j--)
        amx_values(a, s->scores + j * blocks * 256, slots, len - (queries - 1 - j), j == queries - 1,
                   out + (size_t)j * heads * 64, s);
}
#endif

/* An int8 pool's K and V scales of tokens [t0, t1), prefetched (one line for neighbouring slots). */
static inline void prefetch_scales(const Args *a, const int64_t *slots, int64_t t0, int64_t t1) {
#ifdef __AVX512F__
    uintptr_t last = 0;
    for (int64_t t = t0; t < t1; t++) {
        const float *k = a->k_scale + (size_t)slots[t] * a->kv_heads;
        if ((uintptr_t)k >> 6 == last) continue;
        last = (uintptr_t)k >> 6;
        _mm_prefetch((const char *)k, _MM_HINT_T0);
        _mm_prefetch((const char *)(a->v_scale + (size_t)slots[t] * a->kv_heads), _MM_HINT_T0);
    }
#else
    (void)a, (void)slots, (void)t0, (void)t1;
#endif
}

/* The scales of tokens [t0, t1) by head: tok_scale[h * len + t] K's, [(kv_heads + h) * len + t] V's. */
static inline void gather_scales(const Args *a, const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                                 float *tok_scale) {
    const int kvh = a->kv_heads;
    for (int64_t t = t0; t < t1; t++) {
        const float *k = a->k_scale + (size_t)slots[t] * kvh, *v = a->v_scale + (size_t)slots[t] * kvh;
        for (int h = 0; h < kvh; h++) {
            tok_scale[h * len + t] = k[h];
            tok_scale[(kvh + h) * len + t] = v[h];
        }
    }
}

static void *run_span(void *arg) {
    Span *span = (Span *)arg;
    const Args *a = span->a;
    int d = a->head_dim, heads = a->heads, group = heads / a->kv_heads;
    int64_t kv_stride = (int64_t)a->kv_heads * d; /* elements per slot */
    size_t kv_elem = kv_elem_size(a->kv_fmt), q_elem = a->q_bf16 ? 2 : 4;
    size_t slot_bytes = (size_t)kv_stride * kv_elem;
    /* scratch of the path the span's requests take: the tiles' (amx_request) or the vector code's */
    float *qf = NULL, *acc = NULL, *inv_sum = NULL, *scores = NULL, *kv_row = NULL; /* kv_row: the portable paths' */
    uint16_t *probs_bf16 = NULL; /* the probabilities rounded to bf16 (head_values) */
    int16_t *probs_i16 = NULL; /* an int8 pool's: as int16, with their scales a chunk (probs_to_i16) */
    float *p_scale = NULL;
    float *tok_scale = NULL; /* an int8 pool's scales of the request's tokens (gather_scales) */
    void *q_int = NULL; /* an int8 pool's queries as integers, their scales and sums (quantize_queries) */
    float *q_int_scale = NULL;
    int32_t *q_int_corr = NULL;
    /* whether the span reads an int8 pool as integers (INT_QUERY_BITS; AVX512-VNNI: bf16 q only) */
    const int int_pool = INT_QUERY_BITS && a->kv_fmt == KV_I8 && d == 64 && group <= 8 &&
                         (a->q_bf16 || INT_QUERY_BITS == 16);
#if HAVE_AMX
    TileScratch tiles = {0};
    int max_queries = 1;
    if (a->amx) {
        for (int i = span->begin; i < span->end;) {
            int n = request_rows(a, i, span->end);
            if (n > max_queries) max_queries = n;
            i += n;
        }
        int64_t blocks = (span->max_len + 15) / 16;
        size_t score_floats = (size_t)max_queries * (blocks > 0 ? blocks : 1) * 16 * 16;
        tiles.scores = (float *)aligned_alloc(64, score_floats * sizeof(float));
        tiles.rows = (uint16_t *)malloc((size_t)2 * 16 * kv_stride * 2);
        tiles.qt = (uint32_t *)aligned_alloc(64, (size_t)max_queries * a->kv_heads * 2 * 256 * 4);
        tiles.pt = (uint32_t *)calloc((size_t)2 * a->kv_heads * 2 * 256, 4); /* other KV heads' rows stay 0 */
        span->failed = !tiles.scores || !tiles.rows || !tiles.qt || !tiles.pt;
        if (!span->failed) amx_configure();
    } else
#endif
    {
        qf = (float *)malloc((size_t)heads * d * sizeof(float));
        acc = (float *)malloc((size_t)heads * d * sizeof(float));
        inv_sum = (float *)malloc((size_t)heads * sizeof(float));
        scores = (float *)malloc((size_t)(span->max_len > 0 ? span->max_len : 1) * heads * sizeof(float));
        kv_row = (float *)malloc((size_t)d * sizeof(float));
        span->failed = !qf || !acc || !inv_sum || !scores || !kv_row;
        if (a->kv_fmt == KV_I8) {
            const size_t tokens = (size_t)(span->max_len > 0 ? span->max_len : 1);
            tok_scale = (float *)malloc(tokens * 2 * a->kv_heads * sizeof(float));
            span->failed |= !tok_scale;
        }
        if (int_pool) {
            const size_t tokens = (size_t)(span->max_len > 0 ? span->max_len : 1);
            q_int = malloc((size_t)heads * 64 * (INT_QUERY_BITS / 8));
            q_int_scale = (float *)malloc((size_t)heads * sizeof(float));
            q_int_corr = (int32_t *)malloc((size_t)heads * sizeof(int32_t));
            probs_i16 = (int16_t *)calloc(tokens * heads + 2, sizeof(int16_t)); /* (+2: values_i16) */
            p_scale = (float *)malloc((tokens + CHUNK - 1) / CHUNK * heads * sizeof(float));
            span->failed |= !q_int || !q_int_scale || !q_int_corr || !probs_i16 || !p_scale;
        }
#if defined(__AVX512BF16__)
        else if (a->q_bf16 && (a->kv_fmt == KV_BF16 || a->kv_fmt == KV_I8)) {
            probs_bf16 = (uint16_t *)malloc((size_t)(span->max_len > 0 ? span->max_len : 1) * heads * 2);
            span->failed |= !probs_bf16;
        }
#endif
    }
    for (int i = span->failed ? span->end : span->begin; i < span->end; i++) {
        int64_t len = a->seq_lens[i];
        const int64_t *slots = a->req_to_token + a->pool_idx[i] * a->row_stride;
        size_t q_off = (size_t)i * heads * d;
        const char *q = (const char *)a->q + q_off * q_elem;
#if HAVE_AMX
        if (a->amx) {
            int n = request_rows(a, i, span->end);
            amx_request(a, (const uint16_t *)q, n, slots, a->seq_lens[i + n - 1], (uint16_t *)a->out + q_off, &tiles);
            i += n - 1;
            continue;
        }
#endif
        load_row(qf, q, heads * d, a->q_bf16);
#if INT_QUERY_BITS
        if (q_int) quantize_queries(qf, heads, q_int, q_int_scale, q_int_corr);
#endif
        /* q . k for every head, chunk by chunk, the next chunk's K rows on their way (after the
         * last chunk, the first chunk of V), spread over the loops (Prefetcher) */
        int64_t first = len < CHUNK ? len : CHUNK;
        /* whether head_scores / head_values call prefetch_next (their AVX512-BF16 / AVX-512
         * paths for head_dim 64) */
#if defined(__AVX512BF16__)
        const int spread_k = d == 64 && group <= 8 && a->q_bf16 && a->kv_fmt != KV_F32;
#elif HAVE_AVX2_PATHS
        const int spread_k = d == 64 && group <= 8 && a->kv_fmt != KV_E5M2;
#else
        const int spread_k = 0;
#endif
#ifdef __AVX512F__
        const int spread_v = d == 64 && group <= 8;
#elif HAVE_AVX2_PATHS
        const int spread_v = d == 64 && group <= 8 && a->kv_fmt != KV_E5M2;
#else
        const int spread_v = 0;
#endif
        prefetch_rows((const char *)a->k, slots, 0, first, slot_bytes);
        if (tok_scale) prefetch_scales(a, slots, 0, first);
        Prefetcher pf;
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
            int64_t t1 = t0 + CHUNK < len ? t0 + CHUNK : len;
            int64_t t2 = t1 + CHUNK < len ? t1 + CHUNK : len;
            if (tok_scale) {
                gather_scales(a, slots, t0, t1, len, tok_scale);
                prefetch_scales(a, slots, t1, t2);
            }
            /* calls of prefetch_next: per KV head, per 16 tokens and query head */
            int64_t calls = spread_k ? (int64_t)a->kv_heads * ((t1 - t0) / 16) * group : 0;
            if (t1 < len)
                prefetch_start(&pf, (const char *)a->k, slots, t1, t2, slot_bytes, calls);
            else
                prefetch_start(&pf, (const char *)a->v, slots, 0, first, slot_bytes, calls);
            for (int h = 0; h < a->kv_heads; h++) {
                const int first_head = h * group;
                QueryInt qh = {NULL, NULL, NULL};
                if (q_int)
                    qh = (QueryInt){(const char *)q_int + (size_t)first_head * 64 * (INT_QUERY_BITS / 8),
                                    q_int_scale + first_head, q_int_corr + first_head};
                head_scores(q + (size_t)first_head * d * q_elem, qf + (size_t)first_head * d, q_int ? &qh : NULL, group,
                            (const char *)a->k + (size_t)h * d * kv_elem, kv_stride, d, a->q_bf16, a->kv_fmt, slots,
                            t0, t1, len, scores + (size_t)first_head * len, &pf, kv_row);
            }
            prefetch_lines(&pf, -1);
        }
        for (int r = 0; r < heads; r++)
            inv_sum[r] = 1.0f / softmax_numerators(scores + (size_t)r * len, len, a->scale,
                                                   tok_scale ? tok_scale + (size_t)(r / group) * len : NULL);
        if (tok_scale && !probs_i16) /* P times the V rows' scales (the sums above are P's own; probs_to_i16
                                         * multiplies them as it goes) */
            for (int r = 0; r < heads; r++) {
                float *p = scores + (size_t)r * len;
                const float *vs = tok_scale + (size_t)(a->kv_heads + r / group) * len;
                for (int64_t t = 0; t < len; t++) p[t] *= vs[t];
            }
#if defined(__AVX512BF16__)
        if (probs_bf16) { /* P rounded to bf16 (as on the tiles and in torch's flash attention), the sums fp32 */
            const int64_t all = (int64_t)heads * len;
            int64_t j = 0;
            for (; j + 16 <= all; j += 16) store16_bf16(probs_bf16 + j, _mm512_loadu_ps(scores + j));
            for (; j < all; j++) probs_bf16[j] = f32_to_bf16(scores[j]);
        }
#endif
#if INT_QUERY_BITS
        if (probs_i16) probs_to_i16(scores, tok_scale + (size_t)a->kv_heads * len, heads, group, len, probs_i16, p_scale);
#endif
        memset(acc, 0, (size_t)heads * d * sizeof(float));
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
            int64_t t1 = t0 + CHUNK < len ? t0 + CHUNK : len;
            int64_t t2 = t1 + CHUNK < len ? t1 + CHUNK : len;
            /* calls of prefetch_next: per KV head and token */
            int64_t calls = spread_v ? (int64_t)a->kv_heads * (t1 - t0) : 0;
            if (t1 < len || i + 1 >= span->end) {
                prefetch_start(&pf, (const char *)a->v, slots, t1, t2, slot_bytes, calls);
            } else {
                /* the last chunk: the next request's first K rows, which otherwise came in one
                 * burst just before they were read (200 requests from DRAM, 2-core AMD EPYC Zen
                 * 4, vectors: 2.80 -> 2.58-2.62 ms a layer) */
                const int64_t next_len = a->seq_lens[i + 1] < CHUNK ? a->seq_lens[i + 1] : CHUNK;
                prefetch_start(&pf, (const char *)a->k, a->req_to_token + a->pool_idx[i + 1] * a->row_stride, 0,
                               next_len, slot_bytes, calls);
                if (tok_scale) prefetch_scales(a, a->req_to_token + a->pool_idx[i + 1] * a->row_stride, 0, next_len);
            }
            for (int h = 0; h < a->kv_heads; h++)
                head_values(scores + (size_t)h * group * len, probs_bf16 ? probs_bf16 + (size_t)h * group * len : NULL,
                            probs_i16 ? probs_i16 + (size_t)h * group * len : NULL,
                            p_scale ? p_scale + (t0 / CHUNK) * heads + h * group : NULL, group,
                            (const char *)a->v + (size_t)h * d * kv_elem, kv_stride, d, a->kv_fmt, slots, t0, t1, len,
                            acc + (size_t)h * group * d, &pf, kv_row);
            prefetch_lines(&pf, -1);
        }
#if defined(__AVX512BF16__)
        if ((probs_bf16 || probs_i16) && d == 64 && group <= 8) values_columns_in_order(acc, heads);
#endif
        for (int r = 0; r < heads; r++) {
            float *row = acc + (size_t)r * d;
            for (int j = 0; j < d; j++) row[j] *= inv_sum[r];
        }
        if (a->q_bf16) {
            uint16_t *o = (uint16_t *)a->out + q_off;
            for (int j = 0; j < heads * d; j++) o[j] = f32_to_bf16(acc[j]);
        } else {
            memcpy((float *)a->out + q_off, acc, (size_t)heads * d * sizeof(float));
        }
    }
#if HAVE_AMX
    if (a->amx) {
        if (!span->failed) _tile_release();
        free(tiles.scores);
        free(tiles.rows);
        free(tiles.qt);
        free(tiles.pt);
    }
#endif
    free(qf);
    free(kv_row);
    free(acc);
    free(inv_sum);
    free(scores);
    free(probs_bf16);
    free(probs_i16);
    free(p_scale);
    free(tok_scale);
    free(q_int);
    free(q_int_scale);
    free(q_int_corr);
    return NULL;
}

/* The bits an int8 pool's query heads are rounded to where its rows are read as integers
 * (INT_QUERY_BITS): 8 on AVX512-VNNI (bf16 q; the scores on vpdpbusd, scores_i8), 16 on AVX2 (any q;
 * vpmaddwd, scores_i16), P V then with the probabilities as int16 (values_i16); 0 where the rows
 * are widened. */
int decode_attention_int_query_bits(void) { return INT_QUERY_BITS; }

/* Whether decode_attention (amx = 1) attends these requests on the AMX tiles (amx_request). */
int decode_attention_tiles(int heads, int kv_heads, int head_dim, int q_bf16, int kv_fmt) {
#if HAVE_AMX
    return head_dim == 64 && q_bf16 && (kv_fmt == KV_BF16 || kv_fmt == KV_E5M2) && kv_heads > 0 && heads <= 16 &&
           heads % kv_heads == 0 && amx_usable();
#else
    (void)heads, (void)kv_heads, (void)head_dim, (void)q_bf16, (void)kv_fmt;
    return 0;
#endif
}

/* `amx`: bf16 requests may go on the AMX tiles (decode_attention_tiles); k_scale, v_scale: an int8
 * pool's scales (NULL for other pools). Returns 0, -2 for an int8 pool without its scales, or -1
 * when scratch memory could not be allocated. Spans whose thread cannot be started run on the
 * calling thread. */
int decode_attention(const void *q, const void *k, const void *v, const float *k_scale, const float *v_scale,
                     const int64_t *req_to_token, int64_t row_stride, const int64_t *pool_idx,
                     const int64_t *seq_lens, void *out, int n, int heads, int kv_heads, int head_dim, int q_bf16,
                     int kv_fmt, float scale, int num_threads, int amx) {
    if (kv_fmt == KV_I8 && (!k_scale || !v_scale)) return -2;
    amx = amx && decode_attention_tiles(heads, kv_heads, head_dim, q_bf16, kv_fmt);
    Args a = {q, k, v, k_scale, v_scale, req_to_token, pool_idx, seq_lens, out, row_stride, heads, kv_heads,
              head_dim, q_bf16, kv_fmt, scale, amx};
    num_threads = span_threads(num_threads, n);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += seq_lens[i];
    /* Contiguous spans of about equal KV length. */
    Span spans[MAX_THREADS];
    int64_t done = 0;
    int i = 0;
    for (int s = 0; s < num_threads; s++) {
        int64_t target = total * (s + 1) / num_threads, max_len = 0;
        spans[s].a = &a;
        spans[s].begin = i;
        while (i < n && (done < target || s == num_threads - 1)) {
            if (seq_lens[i] > max_len) max_len = seq_lens[i];
            done += seq_lens[i++];
        }
        spans[s].end = i;
        spans[s].max_len = max_len;
    }
    run_spans(run_span, spans, sizeof spans[0], num_threads);
    int failed = 0;
    for (int s = 0; s < num_threads; s++) failed |= spans[s].failed;
    return failed ? -1 : 0;
}
