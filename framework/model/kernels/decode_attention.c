/* Decode attention straight from the paged KV pool, for CPUs.
 *
 * One query token per request attends to the request's first seq_lens[i] KV slots, which are
 * looked up in the request-to-token table (no gathered or padded copies of the KV). Each request
 * is one task: for every KV head, the `group` query heads that share it read each K and V row
 * once. Scores and the softmax are fp32; K/V and q may be bf16 or fp32.
 *
 * The KV rows are read from DRAM (a decode step reads every running request's whole KV, far more
 * than the caches hold), and a request's slots are scattered over the pool. So the tokens go in
 * chunks of CHUNK: the whole slot row of each token (every KV head, contiguous) is prefetched into
 * L2 one chunk ahead, and all KV heads are done chunk by chunk, so each row comes from DRAM once
 * and the other heads read it from the caches. The prefetches go out a few lines at a time from
 * inside the loops (Prefetcher): a burst of a chunk's 192 prefetches into L1 held the loads
 * behind it until the line fill buffers drained, so the arithmetic waited for the memory instead
 * of overlapping it. A chunk whose slots are not one contiguous run still gets its prefetches in
 * one burst into L1 (spread ones lost 6 % there). Measured on a 2-core Xeon (30 layers' pools,
 * 200 requests, 72,900 tokens): 4.05 -> 3.95 ms a layer with the chunks, -> 3.60 with hsum16
 * (common.h), 3.40 -> 2.92-3.01 with the spread L2 prefetches (each prompt's slots contiguous:
 * 3.36 -> 2.74-2.77; fully scattered slots: 4.58 -> 4.66).
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

#include "common.h"

typedef struct {
    const void *q;             /* [n, heads, head_dim] */
    const void *k, *v;         /* [slots, kv_heads, head_dim] */
    const int64_t *req_to_token; /* [pool_rows, row_stride] */
    const int64_t *pool_idx;   /* [n] row of each request in req_to_token */
    const int64_t *seq_lens;   /* [n] */
    void *out;                 /* [n, heads, head_dim], q's dtype */
    int64_t row_stride;
    int heads, kv_heads, head_dim;
    int q_bf16, kv_bf16;
    float scale;
} Args;

typedef struct {
    const Args *a;
    int begin, end;
    int64_t max_len;
    int failed; /* set when the span's scratch memory could not be allocated */
} Span;

/* Row `d` elements at `p` (bf16 or fp32) into fp32 `dst`. */
static inline void load_row(float *dst, const void *p, int d, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)p;
        for (int j = 0; j < d; j++) dst[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(dst, p, (size_t)d * sizeof(float));
    }
}

/* Tokens per chunk: a chunk's slot rows (CHUNK x kv_heads x head_dim, 12 KiB for SmolLM2's bf16
 * K) stay in L1 while every KV head reads them. */
#define CHUNK 32

/* Prefetch the slot rows (`row_bytes` from `base + slot * row_bytes`) of tokens [t0, t1). */
static inline void prefetch_rows(const char *base, const int64_t *slots, int64_t t0, int64_t t1, size_t row_bytes) {
#ifdef __AVX512F__
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
#ifdef __AVX512F__
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

/* The range [t0, t1), spread over `calls` calls of prefetch_next. With no calls to spread them
 * over (a path without them, or a chunk too short), or slots that are not one contiguous run,
 * the whole range goes now, in one burst into L1 (spread prefetches lost 6 % there). */
static inline void prefetch_start(Prefetcher *pf, const char *base, const int64_t *slots, int64_t t0, int64_t t1,
                                  size_t row_bytes, int64_t calls) {
    pf->base = base, pf->slots = slots, pf->t = t0, pf->end = t1, pf->row_bytes = row_bytes, pf->off = 0;
    int64_t lines = (t1 - t0) * (int64_t)((row_bytes + 63) / 64);
    pf->lines = calls > 0 ? (int)((lines + calls - 1) / calls) : 0;
    if (t1 > t0 && (calls <= 0 || slots[t1 - 1] - slots[t0] != t1 - 1 - t0)) {
        prefetch_rows(base, slots, t0, t1, row_bytes);
        pf->t = t1;
    }
}

#ifdef __AVX512F__
/* Token t's 64-element row of one head (base: the head's first row; slot rows `row_bytes` apart)
 * as four fp32 vectors. */
static inline void load_row64(const char *base, const int64_t *slots, int64_t t, size_t row_bytes, size_t elem,
                              int bf16, __m512 out[4]) {
    const char *p = base + (size_t)slots[t] * row_bytes;
    for (int c = 0; c < 4; c++) out[c] = load16(p + c * 16 * elem, bf16);
}
#endif

/* scores[g * len + t] = q[g] . k_t for t in [t0, t1), the group's query heads over one KV head;
 * `q` is the query rows in their own dtype (`qf` the same rows as fp32). */
static void head_scores(const void *q, const float *qf, int group, const void *k, int64_t kv_stride, int d,
                        int q_bf16, int kv_bf16, const int64_t *slots, int64_t t0, int64_t t1, int64_t len,
                        float *scores, Prefetcher *pf) {
    (void)pf; /* used by the AVX512-BF16 path only */
    size_t elem = kv_bf16 ? 2 : 4;
#if defined(__AVX512BF16__)
    if (d == 64 && group <= 8 && q_bf16 && kv_bf16) {
        /* bf16 x bf16 products are exact in fp32: one dpbf16 sums 32 of them into 16 lanes */
        __m512bh qv[8][2];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 2; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + g * d + c * 32);
        int64_t t = t0;
        /* 16 tokens at a time: 16 dot-product vectors, summed lane-wise by one transpose tree
         * (hsum16) instead of 16 horizontal reductions */
        for (; t + 16 <= t1; t += 16) {
            for (int g = 0; g < group; g++) {
                __m512 acc[16];
                prefetch_next(pf);
                for (int u = 0; u < 16; u++) {
                    const uint16_t *kp = (const uint16_t *)k + (size_t)slots[t + u] * kv_stride;
                    acc[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], (__m512bh)_mm512_loadu_si512(kp));
                    acc[u] = _mm512_dpbf16_ps(acc[u], qv[g][1], (__m512bh)_mm512_loadu_si512(kp + 32));
                }
                _mm512_storeu_ps(scores + g * len + t, hsum16(acc));
            }
        }
        for (; t < t1; t++) {
            const uint16_t *kp = (const uint16_t *)k + (size_t)slots[t] * kv_stride;
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp), k1 = (__m512bh)_mm512_loadu_si512(kp + 32);
            for (int g = 0; g < group; g++) {
                __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0);
                acc = _mm512_dpbf16_ps(acc, qv[g][1], k1);
                scores[g * len + t] = _mm512_reduce_add_ps(acc);
            }
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (d == 64 && group <= 8) {
        __m512 qv[8][4];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) qv[g][c] = _mm512_loadu_ps(qf + g * d + c * 16);
        for (int64_t t = t0; t < t1; t++) {
            __m512 kr[4];
            load_row64((const char *)k, slots, t, kv_stride * elem, elem, kv_bf16, kr);
            for (int g = 0; g < group; g++) {
                __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
                acc = _mm512_fmadd_ps(qv[g][1], kr[1], acc);
                acc = _mm512_fmadd_ps(qv[g][2], kr[2], acc);
                acc = _mm512_fmadd_ps(qv[g][3], kr[3], acc);
                scores[g * len + t] = _mm512_reduce_add_ps(acc);
            }
        }
        return;
    }
#endif
    (void)q;
    (void)q_bf16;
    float *row = (float *)malloc((size_t)d * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        load_row(row, (const char *)k + (size_t)slots[t] * kv_stride * elem, d, kv_bf16);
        for (int g = 0; g < group; g++) {
            float acc = 0.0f;
            for (int j = 0; j < d; j++) acc += qf[g * d + j] * row[j];
            scores[g * len + t] = acc;
        }
    }
    free(row);
}

/* acc[g] += sum over t in [t0, t1) of probs[g * len + t] * v_t */
static void head_values(const float *probs, int group, const void *v, int64_t kv_stride, int d, int bf16,
                        const int64_t *slots, int64_t t0, int64_t t1, int64_t len, float *acc, Prefetcher *pf) {
    (void)pf; /* used by the AVX-512 path only */
    size_t elem = bf16 ? 2 : 4;
#ifdef __AVX512F__
    if (d == 64 && group <= 8) {
        __m512 av[8][4];
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) av[g][c] = _mm512_loadu_ps(acc + g * d + c * 16);
        for (int64_t t = t0; t < t1; t++) {
            __m512 vr[4];
            prefetch_next(pf);
            load_row64((const char *)v, slots, t, kv_stride * elem, elem, bf16, vr);
            for (int g = 0; g < group; g++) {
                __m512 p = _mm512_set1_ps(probs[g * len + t]);
                for (int c = 0; c < 4; c++) av[g][c] = _mm512_fmadd_ps(p, vr[c], av[g][c]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * d + c * 16, av[g][c]);
        return;
    }
#endif
    float *row = (float *)malloc((size_t)d * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        load_row(row, (const char *)v + (size_t)slots[t] * kv_stride * elem, d, bf16);
        for (int g = 0; g < group; g++) {
            float p = probs[g * len + t];
            for (int j = 0; j < d; j++) acc[g * d + j] += p * row[j];
        }
    }
    free(row);
}

/* scores[0..len) *= scale, then exp(score - max) in place; returns the sum. */
static float softmax_numerators(float *scores, int64_t len, float scale) {
    float mx = -INFINITY, sum = 0.0f;
    int64_t t = 0;
#ifdef __AVX512F__
    __m512 vmx = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    for (; t + 16 <= len; t += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(scores + t), vscale);
        _mm512_storeu_ps(scores + t, x);
        vmx = _mm512_max_ps(vmx, x);
    }
    mx = _mm512_reduce_max_ps(vmx);
#endif
    for (; t < len; t++) {
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
#endif
    for (; t < len; t++) {
        scores[t] = expf(scores[t] - mx);
        sum += scores[t];
    }
    return sum;
}

static void *run_span(void *arg) {
    Span *span = (Span *)arg;
    const Args *a = span->a;
    int d = a->head_dim, heads = a->heads, group = heads / a->kv_heads;
    int64_t kv_stride = (int64_t)a->kv_heads * d; /* elements per slot */
    size_t kv_elem = a->kv_bf16 ? 2 : 4, q_elem = a->q_bf16 ? 2 : 4;
    size_t slot_bytes = (size_t)kv_stride * kv_elem;
    float *qf = (float *)malloc((size_t)heads * d * sizeof(float));
    float *acc = (float *)malloc((size_t)heads * d * sizeof(float));
    float *inv_sum = (float *)malloc((size_t)heads * sizeof(float));
    float *scores = (float *)malloc((size_t)(span->max_len > 0 ? span->max_len : 1) * heads * sizeof(float));
    span->failed = !qf || !acc || !inv_sum || !scores;
    for (int i = span->failed ? span->end : span->begin; i < span->end; i++) {
        int64_t len = a->seq_lens[i];
        const int64_t *slots = a->req_to_token + a->pool_idx[i] * a->row_stride;
        size_t q_off = (size_t)i * heads * d;
        const char *q = (const char *)a->q + q_off * q_elem;
        load_row(qf, q, heads * d, a->q_bf16);
        /* q . k for every head, chunk by chunk, the next chunk's K rows on their way (after the
         * last chunk, the first chunk of V), spread over the loops (Prefetcher) */
        int64_t first = len < CHUNK ? len : CHUNK;
        /* whether head_scores / head_values call prefetch_next (their AVX512-BF16 / AVX-512
         * paths for head_dim 64) */
#if defined(__AVX512BF16__)
        const int spread_k = d == 64 && group <= 8 && a->q_bf16 && a->kv_bf16;
#else
        const int spread_k = 0;
#endif
#ifdef __AVX512F__
        const int spread_v = d == 64 && group <= 8;
#else
        const int spread_v = 0;
#endif
        prefetch_rows((const char *)a->k, slots, 0, first, slot_bytes);
        Prefetcher pf;
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
            int64_t t1 = t0 + CHUNK < len ? t0 + CHUNK : len;
            int64_t t2 = t1 + CHUNK < len ? t1 + CHUNK : len;
            /* calls of prefetch_next: per KV head, per 16 tokens and query head */
            int64_t calls = spread_k ? (int64_t)a->kv_heads * ((t1 - t0) / 16) * group : 0;
            if (t1 < len)
                prefetch_start(&pf, (const char *)a->k, slots, t1, t2, slot_bytes, calls);
            else
                prefetch_start(&pf, (const char *)a->v, slots, 0, first, slot_bytes, calls);
            for (int h = 0; h < a->kv_heads; h++)
                head_scores(q + (size_t)h * group * d * q_elem, qf + (size_t)h * group * d, group,
                            (const char *)a->k + (size_t)h * d * kv_elem, kv_stride, d, a->q_bf16, a->kv_bf16, slots,
                            t0, t1, len, scores + (size_t)h * group * len, &pf);
            prefetch_lines(&pf, -1);
        }
        for (int r = 0; r < heads; r++) inv_sum[r] = 1.0f / softmax_numerators(scores + (size_t)r * len, len, a->scale);
        memset(acc, 0, (size_t)heads * d * sizeof(float));
        for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
            int64_t t1 = t0 + CHUNK < len ? t0 + CHUNK : len;
            int64_t t2 = t1 + CHUNK < len ? t1 + CHUNK : len;
            /* calls of prefetch_next: per KV head and token */
            int64_t calls = spread_v ? (int64_t)a->kv_heads * (t1 - t0) : 0;
            prefetch_start(&pf, (const char *)a->v, slots, t1, t2, slot_bytes, calls);
            for (int h = 0; h < a->kv_heads; h++)
                head_values(scores + (size_t)h * group * len, group, (const char *)a->v + (size_t)h * d * kv_elem,
                            kv_stride, d, a->kv_bf16, slots, t0, t1, len, acc + (size_t)h * group * d, &pf);
            prefetch_lines(&pf, -1);
        }
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
    free(qf);
    free(acc);
    free(inv_sum);
    free(scores);
    return NULL;
}

/* Returns 0, or -1 when scratch memory could not be allocated. Spans whose thread cannot be
 * started run on the calling thread. */
int decode_attention(const void *q, const void *k, const void *v, const int64_t *req_to_token,
                     int64_t row_stride, const int64_t *pool_idx, const int64_t *seq_lens, void *out,
                     int n, int heads, int kv_heads, int head_dim, int q_bf16, int kv_bf16, float scale,
                     int num_threads) {
    Args a = {q, k, v, req_to_token, pool_idx, seq_lens, out, row_stride, heads, kv_heads, head_dim,
              q_bf16, kv_bf16, scale};
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
