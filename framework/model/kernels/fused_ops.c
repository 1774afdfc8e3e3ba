/* Fused element-wise ops of the llama layer for bf16 activations on CPUs.
 *
 * In PyTorch each of these is 2-8 separate ops, each a pass over memory and an OpenMP fork/join;
 * for a decode batch ([200, 576]) the op overheads are most of their cost. Each function does
 * one pass, with torch's roundings (fp32 math, bf16 result of every step torch rounds), so the
 * results match the PyTorch path up to the order of a sum. Large inputs split their rows over
 * `num_threads` threads (run_spans in common.h). Built and loaded by framework/model/cpu_kernels.py.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* The widest slot row (kv_heads * head_dim) rope_kv_bf16 takes into a pool of one byte a value
 * (float8_e5m2 or int8), and rope_kv_f32 into any pool: k is rotated into a scratch row of this
 * many values before it is rounded. */
#define BYTE_ROW_MAX 4096

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

typedef struct {
    int op;
    const uint16_t *x, *w, *residual; /* rms_norm: x [rows, d], w [d]; residual optional */
    uint16_t *out, *residual_out;
    int64_t rows, d, x_stride;
    float eps;
    /* rope_kv: x is qkv [rows, (heads + 2 kv_heads) * head_dim]; cos/sin [rows, head_dim / 2] */
    const uint16_t *cos, *sin;
    const int64_t *loc;
    void *k_pool, *v_pool; /* [slots, kv_heads, head_dim], bf16, float8_e5m2 or int8 (kv_fmt) */
    int heads, kv_heads, head_dim, kv_fmt;
    float *k_scale, *v_scale; /* an int8 pool's [slots, kv_heads] scales */
} Job;

/* A thread's rows [begin, end) of a job (a Job, or a JobF32 for the fp32 ops): run_row_spans. */
typedef struct {
    const void *job;
    int64_t begin, end;
} Rows;

enum { RMS_NORM = 0, SILU_MUL = 1, ROPE_KV = 2 };

/* out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w); with a residual, x is first bf16(x + residual),
 * which is also written to residual_out. */
static void rms_norm_rows(const Job *j, int64_t begin, int64_t end) {
    int64_t d = j->d;
    float row[8192];
    for (int64_t r = begin; r < end; r++) {
        float scale = rms_norm_input(j->x + r * j->x_stride, j->residual, j->residual_out, r, d, j->eps, row);
        uint16_t *o = j->out + r * d;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 vs = _mm512_set1_ps(scale);
        for (; i + 16 <= d; i += 16) {
            __m512 normed = round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(row + i), vs));
            store16_bf16(o + i, _mm512_mul_ps(normed, load16(j->w + i, 1)));
        }
#endif
        for (; i < d; i++) o[i] = f32_to_bf16(round_bf16(row[i] * scale) * bf16_to_f32(j->w[i]));
    }
}

/* x: [rows, 2d] = [gate | up] -> out [rows, d] = bf16(bf16(silu(gate)) * up), as F.silu(gate).mul_(up). */
static void silu_mul_rows(const Job *j, int64_t begin, int64_t end) {
    int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *gate = j->x + r * j->x_stride, *up = gate + d;
        uint16_t *o = j->out + r * d;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= d; i += 16) {
            __m512 g = load16(gate + i, 1);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            __m512 silu = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
            store16_bf16(o + i, _mm512_mul_ps(silu, load16(up + i, 1)));
        }
#endif
        for (; i < d; i++) {
            float g = bf16_to_f32(gate[i]);
            o[i] = f32_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_f32(up[i]));
        }
    }
}

/* One head of `half`-pairs rotated as RopeTables.apply: first half bf16(bf16(x1 c) - bf16(x2 s)),
 * second half bf16(bf16(x2 c) + bf16(x1 s)). */
static void rotate_head(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int half, uint16_t *out) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= half; i += 16) {
        __m512 x1 = load16(x + i, 1), x2 = load16(x + half + i, 1);
        __m512 c = load16(cos + i, 1), s = load16(sin + i, 1);
        __m512 a = _mm512_sub_ps(round_bf16x16(_mm512_mul_ps(x1, c)), round_bf16x16(_mm512_mul_ps(x2, s)));
        __m512 b = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, c)), round_bf16x16(_mm512_mul_ps(x1, s)));
        store16_bf16(out + i, a);
        store16_bf16(out + half + i, b);
    }
#endif
    for (; i < half; i++) {
        float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[half + i]);
        float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        out[i] = f32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
        out[half + i] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
}

/* n bf16 values as float8_e5m2 bytes (f32_to_e5m2). */
static void store_e5m2(uint8_t *dst, const uint16_t *src, size_t n) {
    size_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm_storeu_si128((__m128i *)(dst + i), f32x16_to_e5m2(load16(src + i, KV_BF16)));
#endif
    for (; i < n; i++) dst[i] = f32_to_e5m2(bf16_to_f32(src[i]));
}

/* A head row of n fp32 values as an int8 pool keeps it (memory.quantize_kv_rows, the same bits):
 * s = max |x| / 127 into *scale, the values round(x / s) to nearest even (0 where s is 0). */
static void store_i8(int8_t *dst, float *scale, const float *src, int n) {
    const float s = max_abs_f32(src, n) / 127.0f;
    *scale = s;
    if (s == 0.0f) {
        memset(dst, 0, (size_t)n);
        return;
    }
    int i = 0;
    /* x / s is within [-127, 127] up to its rounding, which rounds into it */
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(src + i), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
    }
#elif defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(src + i), vs)); /* (to nearest even) */
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(words, words));
    }
#endif
    for (; i < n; i++) dst[i] = (int8_t)nearbyintf(src[i] / s);
}

/* store_i8 of a head row of n bf16 values (at most a slot row, BYTE_ROW_MAX). */
static void store_i8_bf16(int8_t *dst, float *scale, const uint16_t *src, int n) {
    float row[BYTE_ROW_MAX];
    for (int i = 0; i < n; i++) row[i] = bf16_to_f32(src[i]);
    store_i8(dst, scale, row, n);
}

/* q rotated into out [rows, heads * head_dim]; k rotated and v copied into the pool at loc (into
 * an e5m2 or int8 pool k is rotated in bf16 first, then both are rounded as TokenToKVPool.set_kv
 * does). */
static void rope_kv_rows(const Job *j, int64_t begin, int64_t end) {
    int d = j->head_dim, half = d / 2;
    size_t kv_row = (size_t)j->kv_heads * d;
    uint16_t rotated[BYTE_ROW_MAX];
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *qkv = j->x + r * j->x_stride, *v = qkv + (size_t)(j->heads + j->kv_heads) * d;
        const uint16_t *cos = j->cos + r * half, *sin = j->sin + r * half;
        for (int h = 0; h < j->heads; h++) rotate_head(qkv + (size_t)h * d, cos, sin, half, j->out + (r * j->heads + h) * d);
        size_t at = (size_t)j->loc[r] * kv_row;
        uint16_t *k = j->kv_fmt != KV_BF16 ? rotated : (uint16_t *)j->k_pool + at;
        for (int h = 0; h < j->kv_heads; h++)
            rotate_head(qkv + (size_t)(j->heads + h) * d, cos, sin, half, k + (size_t)h * d);
        if (j->kv_fmt == KV_E5M2) {
            store_e5m2((uint8_t *)j->k_pool + at, rotated, kv_row);
            store_e5m2((uint8_t *)j->v_pool + at, v, kv_row);
        } else if (j->kv_fmt == KV_I8) {
            size_t s = (size_t)j->loc[r] * j->kv_heads;
            for (int h = 0; h < j->kv_heads; h++) {
                store_i8_bf16((int8_t *)j->k_pool + at + (size_t)h * d, j->k_scale + s + h, rotated + (size_t)h * d, d);
                store_i8_bf16((int8_t *)j->v_pool + at + (size_t)h * d, j->v_scale + s + h, v + (size_t)h * d, d);
            }
        } else {
            memcpy((uint16_t *)j->v_pool + at, v, kv_row * sizeof(uint16_t));
        }
    }
}

static void *run_rows(void *arg) {
    const Rows *rows = (const Rows *)arg;
    const Job *job = (const Job *)rows->job;
    if (job->op == RMS_NORM)
        rms_norm_rows(job, rows->begin, rows->end);
    else if (job->op == SILU_MUL)
        silu_mul_rows(job, rows->begin, rows->end);
    else
        rope_kv_rows(job, rows->begin, rows->end);
    return NULL;
}

/* Rows per thread below which one thread does all the work (handing rows to torch's OpenMP team
 * costs more). SmolLM2's shapes on a 2-core Xeon, one thread / two: 16 rows rope_kv 9.4 / 9.3 us,
 * RMSNorm 5.4 / 6.7; 64 rows 16.0 / 12.9 and 11.7 / 9.7; 200 rows (a W200 decode step) 42-43 /
 * 25-27 and 28-29 / 18 (add + RMSNorm 37.5-37.9 / 23). It was 256, which kept decode steps of up
 * to 511 requests on one thread. */
#define MIN_ROWS_PER_THREAD 32

/* The threads for `rows` rows: at most num_threads, at least MIN_ROWS_PER_THREAD rows each, one at least. */
static int row_threads(int64_t rows, int num_threads) {
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > rows / MIN_ROWS_PER_THREAD) num_threads = (int)(rows / MIN_ROWS_PER_THREAD);
    return num_threads < 1 ? 1 : num_threads;
}

/* fn over `rows` rows of `job`, split evenly over row_threads(rows, num_threads) threads. */
static void run_row_spans(void *(*fn)(void *), const void *job, int64_t rows, int num_threads) {
    num_threads = row_threads(rows, num_threads);
    Rows spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++) spans[s] = (Rows){job, rows * s / num_threads, rows * (s + 1) / num_threads};
    run_spans(fn, spans, sizeof spans[0], num_threads);
}

static void run(const Job *job, int num_threads) { run_row_spans(run_rows, job, job->rows, num_threads); }

/* Returns 0, or -1 when d is larger than the row buffer. */
int rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, uint16_t *residual_out,
                  const uint16_t *w, uint16_t *out, int64_t rows, int64_t d, float eps, int num_threads) {
    if (d > 8192) return -1;
    Job job = {RMS_NORM, x, w, residual, out, residual_out, rows, d, x_stride, eps, NULL, NULL, NULL, NULL, NULL,
               0, 0, 0, 0, NULL, NULL};
    run(&job, num_threads);
    return 0;
}

int silu_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t d, int num_threads) {
    Job job = {SILU_MUL, x, NULL, NULL, out, NULL, rows, d, x_stride, 0.0f, NULL, NULL, NULL, NULL, NULL,
               0, 0, 0, 0, NULL, NULL};
    run(&job, num_threads);
    return 0;
}

/* ---- fp32 rows (float32 models) --------------------------------------------------------------
 * The same two ops for fp32 activations, one pass each where PyTorch's fp32 path takes 4-6 ops:
 * loops written so that GCC vectorizes them on any vector ISA (16 partial sums of squares, added
 * up as sum_lanes16; SiLU's exp by exp_neg_lanes), so the values are PyTorch's to fp32 rounding. */
typedef struct {
    const float *x, *w, *residual; /* rms_norm: x [rows, d] (row stride x_stride), w [d], residual optional */
    float *out, *residual_out;
    int64_t rows, d, x_stride;
    float eps;
    int silu; /* silu_mul instead: x [rows, 2 d] = [gate | up] -> out [rows, d] */
} JobF32;

/* out = w * (h * rsqrt(mean(h^2) + eps)), h = x, or x + residual (written to residual_out):
 * rms_norm_row_f32 (common.h) a row. */
static void rms_norm_rows_f32(const JobF32 *j, int64_t begin, int64_t end) {
    const int64_t d = j->d;
    for (int64_t r = begin; r < end; r++)
        rms_norm_row_f32(j->x + r * j->x_stride, j->residual ? j->residual + r * d : NULL,
                         j->residual ? j->residual_out + r * d : NULL, j->w, d, j->eps, j->out + r * d);
}

/* out = silu(gate) * up in fp32 (silu_times, common.h). */
static void silu_mul_rows_f32(const JobF32 *j, int64_t begin, int64_t end) {
    const int64_t d = j->d;
    for (int64_t r = begin; r < end; r++) {
        const float *gate = j->x + r * j->x_stride, *up = gate + d;
        float *o = j->out + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = silu_times(gate[i], up[i]);
    }
}

/* One head of `half`-pairs rotated as RopeTables.apply does in fp32: first half x1 c - x2 s,
 * second half x2 c + x1 s, each product rounded to fp32 before the add (KEEP_ROUNDED: never one
 * fused multiply-add, which would round once and differ from PyTorch's bits). */
static void rotate_head_f32(const float *x, const float *cos, const float *sin, int half, float *out) {
    int i = 0;
#ifdef __AVX2__
    for (; i + 8 <= half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        __m256 x1c = _mm256_mul_ps(x1, c), x2s = _mm256_mul_ps(x2, s), x2c = _mm256_mul_ps(x2, c),
               x1s = _mm256_mul_ps(x1, s);
        KEEP_ROUNDED(x1c);
        KEEP_ROUNDED(x2s);
        KEEP_ROUNDED(x2c);
        KEEP_ROUNDED(x1s);
        _mm256_storeu_ps(out + i, _mm256_sub_ps(x1c, x2s));
        _mm256_storeu_ps(out + half + i, _mm256_add_ps(x2c, x1s));
    }
#endif
    for (; i < half; i++) {
        float x1c = x[i] * cos[i], x2s = x[half + i] * sin[i], x2c = x[half + i] * cos[i], x1s = x[i] * sin[i];
        KEEP_ROUNDED(x1c);
        KEEP_ROUNDED(x2s);
        KEEP_ROUNDED(x2c);
        KEEP_ROUNDED(x1s);
        out[i] = x1c - x2s;
        out[half + i] = x2c + x1s;
    }
}

typedef struct {
    const float *qkv;             /* [rows, (heads + 2 kv_heads) * head_dim], row stride qkv_stride */
    const float *cos, *sin;       /* [rows, head_dim / 2] */
    const int64_t *loc;
    float *q_out;                 /* [rows, heads * head_dim] */
    void *k_pool, *v_pool;        /* [slots, kv_heads, head_dim]: fp32, bf16, float8_e5m2 or int8 (kv_fmt) */
    float *k_scale, *v_scale;     /* an int8 pool's [slots, kv_heads] scales */
    int64_t qkv_stride;
    int heads, kv_heads, head_dim, kv_fmt;
} RopeF32;

/* A slot row of n fp32 values (kv_heads heads of d) into a pool of format fmt at `at` (an int8
 * pool's scales from scale on), rounded as TokenToKVPool.set_kv rounds it. */
static void store_slot_f32(void *pool, size_t at, float *scale, const float *row, int n, int d, int fmt) {
    if (fmt == KV_F32) {
        memcpy((float *)pool + at, row, (size_t)n * sizeof(float));
    } else if (fmt == KV_BF16) {
        uint16_t *dst = (uint16_t *)pool + at;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(row[i]);
    } else if (fmt == KV_E5M2) {
        uint8_t *dst = (uint8_t *)pool + at;
        for (int i = 0; i < n; i++) dst[i] = f32_to_e5m2(row[i]);
    } else {
        for (int h = 0; h < n / d; h++)
            store_i8((int8_t *)pool + at + (size_t)h * d, scale + h, row + (size_t)h * d, d);
    }
}

static void *rope_kv_rows_f32(void *arg) {
    const Rows *rows = (const Rows *)arg;
    const RopeF32 *j = (const RopeF32 *)rows->job;
    const int d = j->head_dim, half = d / 2, kv_row = j->kv_heads * d;
    float rotated[BYTE_ROW_MAX];
    for (int64_t r = rows->begin; r < rows->end; r++) {
        const float *qkv = j->qkv + r * j->qkv_stride, *v = qkv + (size_t)(j->heads + j->kv_heads) * d;
        const float *cos = j->cos + r * half, *sin = j->sin + r * half;
        for (int h = 0; h < j->heads; h++)
            rotate_head_f32(qkv + (size_t)h * d, cos, sin, half, j->q_out + (r * j->heads + h) * d);
        for (int h = 0; h < j->kv_heads; h++)
            rotate_head_f32(qkv + (size_t)(j->heads + h) * d, cos, sin, half, rotated + h * d);
        const size_t slot = (size_t)j->loc[r];
        float *k_scale = j->k_scale ? j->k_scale + slot * j->kv_heads : NULL;
        float *v_scale = j->v_scale ? j->v_scale + slot * j->kv_heads : NULL;
        store_slot_f32(j->k_pool, slot * kv_row, k_scale, rotated, kv_row, d, j->kv_fmt);
        store_slot_f32(j->v_pool, slot * kv_row, v_scale, v, kv_row, d, j->kv_fmt);
    }
    return NULL;
}

static void *run_rows_f32(void *arg) {
    const Rows *rows = (const Rows *)arg;
    const JobF32 *job = (const JobF32 *)rows->job;
    if (job->silu)
        silu_mul_rows_f32(job, rows->begin, rows->end);
    else
        rms_norm_rows_f32(job, rows->begin, rows->end);
    return NULL;
}

static void run_f32(const JobF32 *job, int num_threads) { run_row_spans(run_rows_f32, job, job->rows, num_threads); }

/* fp32 RMSNorm of x's rows (with a residual: of x + residual, also written to residual_out; both
 * [rows, d] contiguous) times w, into out [rows, d]. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, float *residual_out, const float *w,
                  float *out, int64_t rows, int64_t d, float eps, int num_threads) {
    JobF32 job = {x, w, residual, out, residual_out, rows, d, x_stride, eps, 0};
    run_f32(&job, num_threads);
}

/* [gate | up] fp32 rows [rows, 2 d] (row stride x_stride) -> silu(gate) * up [rows, d]. */
void silu_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t d, int num_threads) {
    JobF32 job = {x, NULL, NULL, out, NULL, rows, d, x_stride, 0.0f, 1};
    run_f32(&job, num_threads);
}

/* Rotary embedding of q and k from the fused qkv projection, q into q_out, k and v into the KV
 * pool at slots loc (the work of RopeTables.apply + TokenToKVPool.set_kv; an int8 pool's scales
 * into k_scale and v_scale, NULL for other pools). */
int rope_kv_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cos, const uint16_t *sin,
                 const int64_t *loc, uint16_t *q_out, void *k_pool, void *v_pool, float *k_scale, float *v_scale,
                 int kv_fmt, int64_t rows, int heads, int kv_heads, int head_dim, int num_threads) {
    if ((kv_fmt != KV_BF16 && kv_fmt != KV_E5M2 && kv_fmt != KV_I8) ||
        (kv_fmt != KV_BF16 && kv_heads * head_dim > BYTE_ROW_MAX) || (kv_fmt == KV_I8 && (!k_scale || !v_scale)))
        return -1;
    Job job = {ROPE_KV, qkv, NULL, NULL, q_out, NULL, rows, 0, qkv_stride, 0.0f, cos, sin, loc, k_pool, v_pool,
               heads, kv_heads, head_dim, kv_fmt, k_scale, v_scale};
    run(&job, num_threads);
    return 0;
}

/* rope_kv_bf16 for fp32 rows: q rotated into q_out (fp32), k rotated and v copied into an fp32,
 * bf16, float8_e5m2 or int8 pool at loc, with RopeTables.apply's and TokenToKVPool.set_kv's
 * roundings (the same bits). Returns 0, or -1 for a pool it does not write (an int8 pool without
 * its scales, a slot row over BYTE_ROW_MAX values). */
int rope_kv_f32(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin, const int64_t *loc,
                float *q_out, void *k_pool, void *v_pool, float *k_scale, float *v_scale, int kv_fmt, int64_t rows,
                int heads, int kv_heads, int head_dim, int num_threads) {
    if (kv_fmt < KV_F32 || kv_fmt > KV_I8 || kv_heads * head_dim > BYTE_ROW_MAX || head_dim % 2 ||
        (kv_fmt == KV_I8 && (!k_scale || !v_scale)))
        return -1;
    RopeF32 job = {qkv, cos, sin, loc, q_out, k_pool, v_pool, kv_fmt == KV_I8 ? k_scale : NULL,
                   kv_fmt == KV_I8 ? v_scale : NULL, qkv_stride, heads, kv_heads, head_dim, kv_fmt};
    run_row_spans(rope_kv_rows_f32, &job, rows, num_threads);
    return 0;
}

#ifdef __AVX512F__
/* The lanes of v among `allowed` that an argmax picks: NaN where the row has one, else `best`. */
static inline __mmask16 argmax_hits16(__mmask16 allowed, __m512 v, __m512 best, int has_nan) {
    return has_nan ? _mm512_mask_cmp_ps_mask(allowed, v, v, _CMP_UNORD_Q)
                   : _mm512_mask_cmp_ps_mask(allowed, v, best, _CMP_EQ_OQ);
}
#endif

#ifdef __AVX2__
/* 8 values of a bf16 or fp32 row from index i on, as fp32 lanes (exact). */
static inline __m256 load8_row(const void *row, int bf16, int64_t i) {
    return bf16 ? load8_bf16((const uint16_t *)row + i) : _mm256_loadu_ps((const float *)row + i);
}
#endif

static inline float value_at(const void *row, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The largest value of a bf16 or fp32 row, or NaN where the row has one. (A lane's running
 * maximum may lose its value to a NaN, but a row with a NaN gives NaN whatever the lanes hold.)
 * The AVX2 path keeps four running maxima, so that the loads, not one chain of maxima, set the
 * pace: a row of logits comes from memory. */
static float row_max(const void *row, int bf16, int64_t d) {
    float best = -INFINITY;
    int has_nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    const size_t elem = bf16 ? 2 : 4;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= d; i += 16) {
        __m512 v = load16((const char *)row + i * elem, bf16 ? KV_BF16 : KV_F32);
        has_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        vmax = _mm512_max_ps(vmax, v);
    }
    best = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
    __m256 vmax[4], vnan = _mm256_setzero_ps();
    for (int l = 0; l < 4; l++) vmax[l] = _mm256_set1_ps(-INFINITY);
    for (; i + 32 <= d; i += 32)
        for (int l = 0; l < 4; l++) {
            const __m256 v = load8_row(row, bf16, i + 8 * l);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vmax[l] = _mm256_max_ps(vmax[l], v);
        }
    has_nan = _mm256_movemask_ps(vnan) != 0;
    for (int l = 0; l < 4; l++) best = max_lanes8(vmax[l], best);
#endif
    for (; i < d; i++) {
        const float v = value_at(row, bf16, i);
        has_nan |= v != v;
        if (v > best) best = v;
    }
    return has_nan ? NAN : best;
}

/* Index of the largest value of each bf16 or fp32 row (the first on ties; the first NaN if there
 * is one, as torch.argmax), into out [rows]. A row is read once from memory for its maximum, then
 * again from the caches for the first index that holds it (a vector at a time: the scalar search
 * took ~2 ms of a 200-row decode step's 2.2 at a 49,152-token vocabulary). */
static void argmax_rows(const void *x, int bf16, int64_t x_stride, int64_t r0, int64_t r1, int64_t d, int64_t *out) {
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t r = r0; r < r1; r++) {
        const void *row = (const char *)x + r * x_stride * elem;
        const float best = row_max(row, bf16, d);
        const int has_nan = best != best;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 vbest = _mm512_set1_ps(best);
        for (; i + 16 <= d; i += 16) {
            __mmask16 hit = argmax_hits16(0xFFFF, load16((const char *)row + i * elem, bf16 ? KV_BF16 : KV_F32), vbest,
                                          has_nan);
            if (hit) {
                i += __builtin_ctz(hit);
                break;
            }
        }
#elif defined(__AVX2__)
        const __m256 vbest = _mm256_set1_ps(best);
        for (; i + 8 <= d; i += 8) {
            const __m256 v = load8_row(row, bf16, i);
            const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                       : _mm256_cmp_ps(v, vbest, _CMP_EQ_OQ));
            if (hit) {
                i += __builtin_ctz((unsigned)hit);
                break;
            }
        }
#endif
        for (; i < d; i++) {
            const float v = value_at(row, bf16, i);
            if (has_nan ? v != v : v == best) break;
        }
        out[r] = i < d ? i : 0;
    }
}

typedef struct {
    const void *x;
    int bf16;
    int64_t x_stride, begin, end, d;
    int64_t *out;
} ArgmaxRows;

static void *run_argmax(void *arg) {
    const ArgmaxRows *a = (const ArgmaxRows *)arg;
    argmax_rows(a->x, a->bf16, a->x_stride, a->begin, a->end, a->d, a->out);
    return NULL;
}

/* argmax_rows over `num_threads` threads, rows split evenly (a row of logits is ~100-200 KB, read
 * from DRAM: the LM head stores them past the caches). */
static void argmax(const void *x, int bf16, int64_t x_stride, int64_t rows, int64_t d, int64_t *out, int num_threads) {
    num_threads = span_threads(num_threads, rows);
    ArgmaxRows spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++)
        spans[s] = (ArgmaxRows){x, bf16, x_stride, rows * s / num_threads, rows * (s + 1) / num_threads, d, out};
    run_spans(run_argmax, spans, sizeof spans[0], num_threads);
}

/* argmax of bf16 rows [rows, d] (row stride x_stride) into out [rows]. */
void argmax_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t d, int64_t *out, int num_threads) {
    argmax(x, 1, x_stride, rows, d, out, num_threads);
}

/* The same over fp32 rows: a float32 model's logits (torch.argmax took ~11 ms of a 200-row decode
 * step at a 49,152-token vocabulary on a 2-core AMD EPYC Zen 3). */
void argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t d, int64_t *out, int num_threads) {
    argmax(x, 0, x_stride, rows, d, out, num_threads);
}


/* Index of the largest value of each row among the tokens its xgrammar bitmask allows (bit j of
 * word w: token 32w + j), as torch.argmax of the row with the other tokens set to -inf: the first
 * on ties, the first allowed NaN if there is one, 0 when nothing allowed is above -inf. x: bf16 or
 * fp32 rows [rows, d] with row stride x_stride; mask: int32 rows with stride mask_stride. */
void argmax_masked(const void *x, int bf16, int64_t x_stride, const int32_t *mask, int64_t mask_stride,
                   int64_t rows, int64_t d, int64_t *out) {
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * x_stride * elem;
        const int32_t *bits_row = mask + r * mask_stride;
        const int64_t num_words = (d + 31) / 32;
        float best = -INFINITY;
        int has_nan = 0;
        int64_t w = 0;
#ifdef __AVX512F__
        const int64_t full_words = d / 32;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (; w < full_words; w++) {
            uint32_t bits = (uint32_t)bits_row[w];
            if (!bits) continue;
            __mmask16 lo = (__mmask16)(bits & 0xFFFF), hi = (__mmask16)(bits >> 16);
            __m512 v0 = load16(row + w * 32 * elem, bf16), v1 = load16(row + (w * 32 + 16) * elem, bf16);
            has_nan |= (_mm512_mask_cmp_ps_mask(lo, v0, v0, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(hi, v1, v1, _CMP_UNORD_Q)) != 0;
            vmax = _mm512_mask_max_ps(vmax, lo, vmax, v0);
            vmax = _mm512_mask_max_ps(vmax, hi, vmax, v1);
        }
        best = _mm512_reduce_max_ps(vmax);
#endif
        for (; w < num_words; w++) {
            uint32_t bits = (uint32_t)bits_row[w];
            for (int j = 0; j < 32 && w * 32 + j < d; j++) {
                if (!(bits >> j & 1u)) continue;
                float v = value_at(row, bf16, w * 32 + j);
                has_nan |= v != v;
                if (v > best) best = v;
            }
        }
        /* The first allowed index holding `best` (or a NaN): 32 tokens a step with the vectors over
         * the full words, then one allowed token at a time from the word `from` on. (Token by token
         * throughout, 16 rows of 49,152 with nearly every token allowed took 671 us, now 91.) */
        int64_t arg = 0, from = 0;
        int found = 0;
#ifdef __AVX512F__
        if (has_nan || best > -INFINITY) {
            const __m512 vbest = _mm512_set1_ps(best);
            for (; !found && from < full_words; from++) {
                uint32_t bits = (uint32_t)bits_row[from];
                if (!bits) continue;
                __m512 v0 = load16(row + from * 32 * elem, bf16), v1 = load16(row + (from * 32 + 16) * elem, bf16);
                __mmask16 lo = (__mmask16)(bits & 0xFFFF), hi = (__mmask16)(bits >> 16);
                uint32_t hit = (uint32_t)argmax_hits16(lo, v0, vbest, has_nan) |
                               (uint32_t)argmax_hits16(hi, v1, vbest, has_nan) << 16;
                if (hit) {
                    arg = from * 32 + __builtin_ctz(hit);
                    found = 1;
                }
            }
        }
#endif
        if (!found && (has_nan || best > -INFINITY)) {
            for (w = from; w < num_words; w++) {
                uint32_t bits = (uint32_t)bits_row[w];
                while (bits) {
                    int j = __builtin_ctz(bits);
                    bits &= bits - 1;
                    int64_t i = w * 32 + j;
                    if (i >= d) break;
                    float v = value_at(row, bf16, i);
                    if (has_nan ? v != v : v == best) {
                        arg = i;
                        found = 1;
                        break;
                    }
                }
                if (found) break;
            }
        }
        out[r] = arg;
    }
}

/* hidden . weight over k bf16 values: the exact products summed in fp32 (16 lanes of pairs with
 * AVX512-BF16, then their sum; one sum in order elsewhere). */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t k) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX512BF16__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 32 <= k; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    s = _mm512_reduce_add_ps(acc);
#endif
    for (; i < k; i++) s += bf16_to_f32(a[i]) * bf16_to_f32(b[i]);
    return s;
}

/* The same over fp32 values (16 partial sums, added up as sum_lanes16). */
static inline float dot_f32(const float *a, const float *b, int64_t k) {
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= k; i += 16)
        for (int l = 0; l < 16; l++) part[l] += a[i + l] * b[i + l];
    float s = sum_lanes16(part);
    for (; i < k; i++) s += a[i] * b[i];
    return s;
}

typedef struct {
    void *logits; /* bf16, or fp32 (f32) */
    const void *hidden, *weight;
    int64_t l_stride, h_stride, begin, end, vocab, k;
    float margin;
    int64_t *counts;
    int f32;
} HeadRescore;

/* Column c of a row of logits recomputed from the row's hidden values h: hidden . weight_c, fp32
 * (dot_f32, stored as it is) or bf16 (dot_bf16, stored rounded to bf16). */
static inline void rescore_column(const HeadRescore *a, void *row, const void *h, int64_t c) {
    if (a->f32)
        ((float *)row)[c] = dot_f32((const float *)h, (const float *)a->weight + c * a->k, a->k);
    else
        ((uint16_t *)row)[c] = f32_to_bf16(dot_bf16((const uint16_t *)h, (const uint16_t *)a->weight + c * a->k, a->k));
}

/* Rows [begin, end) of head_rescore_bf16 / head_rescore_f32: each row read once for its largest
 * value, then again (from the caches) for the columns within the margin of it, a vector at a time
 * (fp32 logits were compared one at a time: ~10 ms of a 200-row decode step at a 49,152-token
 * vocabulary on a 2-core AMD EPYC Zen 3). */
static void *run_head_rescore(void *arg) {
    const HeadRescore *a = (const HeadRescore *)arg;
    const int bf16 = !a->f32;
    const size_t elem = bf16 ? 2 : 4;
    for (int64_t r = a->begin; r < a->end; r++) {
        void *row = (char *)a->logits + r * a->l_stride * elem;
        const void *h = (const char *)a->hidden + r * a->h_stride * elem;
        const float top = row_max(row, bf16, a->vocab);
        int64_t count = 0;
        if (top == top) { /* (a row with a NaN is left as it is) */
            const float lowest = top - a->margin;
            int64_t i = 0;
#ifdef __AVX512F__
            const __m512 vlowest = _mm512_set1_ps(lowest);
            for (; i + 16 <= a->vocab; i += 16) {
                __mmask16 hit = _mm512_cmp_ps_mask(load16((const char *)row + i * elem, bf16 ? KV_BF16 : KV_F32),
                                                   vlowest, _CMP_GE_OQ);
                for (; hit; hit &= (__mmask16)(hit - 1), count++) rescore_column(a, row, h, i + __builtin_ctz(hit));
            }
#elif defined(__AVX2__)
            const __m256 vlowest = _mm256_set1_ps(lowest);
            for (; i + 8 <= a->vocab; i += 8) {
                unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(load8_row(row, bf16, i), vlowest, _CMP_GE_OQ));
                for (; hit; hit &= hit - 1, count++) rescore_column(a, row, h, i + __builtin_ctz(hit));
            }
#endif
            for (; i < a->vocab; i++)
                if (value_at(row, bf16, i) >= lowest) {
                    rescore_column(a, row, h, i);
                    count++;
                }
        }
        if (a->counts) a->counts[r] = count;
    }
    return NULL;
}

/* The bf16 head's logits back where an int8 LM head's (model.int8_lm_head) decide the next token:
 * in each bf16 row of `logits` [rows, vocab] (row stride l_stride), every column within `margin`
 * of the row's largest value is recomputed as hidden_r . weight_c (hidden [rows, k], row stride
 * h_stride; weight [vocab, k] contiguous: the bf16 head) and stored rounded to bf16. How many
 * columns each row recomputed goes to counts [rows] (or nowhere, NULL). Rows split evenly over
 * `num_threads` threads. */
static void head_rescore(void *logits, int64_t l_stride, const void *hidden, int64_t h_stride, const void *weight,
                         int64_t rows, int64_t vocab, int64_t k, float margin, int64_t *counts, int num_threads,
                         int f32) {
    num_threads = span_threads(num_threads, rows);
    HeadRescore spans[MAX_THREADS];
    for (int s = 0; s < num_threads; s++)
        spans[s] = (HeadRescore){logits, hidden, weight, l_stride, h_stride, rows * s / num_threads,
                                 rows * (s + 1) / num_threads, vocab, k, margin, counts, f32};
    run_spans(run_head_rescore, spans, sizeof spans[0], num_threads);
}

void head_rescore_bf16(uint16_t *logits, int64_t l_stride, const uint16_t *hidden, int64_t h_stride,
                       const uint16_t *weight, int64_t rows, int64_t vocab, int64_t k, float margin, int64_t *counts,
                       int num_threads) {
    head_rescore(logits, l_stride, hidden, h_stride, weight, rows, vocab, k, margin, counts, num_threads, 0);
}

/* The same for a float32 model: fp32 logits, hidden and head weight, each value recomputed as an
 * fp32 dot product (sum_lanes16 of 16 partial sums) and stored as it is. */
void head_rescore_f32(float *logits, int64_t l_stride, const float *hidden, int64_t h_stride, const float *weight,
                      int64_t rows, int64_t vocab, int64_t k, float margin, int64_t *counts, int num_threads) {
    head_rescore(logits, l_stride, hidden, h_stride, weight, rows, vocab, k, margin, counts, num_threads, 1);
}
