/* Helpers shared by the CPU kernels: bf16 <-> fp32 (round to nearest even, as torch), with
 * AVX512F 16-lane loads, stores and exp, and the fan-out of work spans over pthreads. Kernels
 * include this header; cpu_kernels.py hashes it into every kernel's build key. */
#ifndef BATCHYARD_KERNELS_COMMON_H
#define BATCHYARD_KERNELS_COMMON_H

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

/* The threads for `items` units of work: num_threads within [1, min(items, MAX_THREADS)]. Span s
 * of them takes items [items * s / threads, items * (s + 1) / threads). */
static inline int span_threads(int num_threads, int64_t items) {
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    if (num_threads > items) num_threads = (int)items;
    return num_threads < 1 ? 1 : num_threads;
}

/* A GEMM's work as runs of units handed to its threads as they come free: (panel, unit) items, a
 * panel being `panel` rows of x, taken panel by panel from the counter `next` the threads share. */
typedef struct {
    int64_t rows, panel, units;
    int threads;
    int64_t *next;
} UnitRuns;

/* The runs of `units` units over `rows` rows for `threads` threads, counting with *next (0): panels
 * of at most `cap` rows rounded down to a multiple of `step` (at least `step`), fewer where that
 * gives each thread at least 8 items, so that a GEMM of few units still ends on all threads about
 * together. */
static inline UnitRuns unit_runs(int64_t rows, int64_t cap, int64_t units, int threads, int64_t step, int64_t *next) {
    const int64_t panels = units > 0 ? (8 * (int64_t)threads + units - 1) / units : 1;
    int64_t per = (rows + panels - 1) / panels;
    per = (per + step - 1) / step * step;
    cap = cap < step ? step : cap / step * step;
    return (UnitRuns){.rows = rows, .panel = per < cap ? per : cap, .units = units, .threads = threads, .next = next};
}

/* The next run: units [*u0, *u1) over rows [*first, *last), a (2 threads)-th of the items left, at
 * least one, within one panel. So the runs are long at first (a run's units are one stream of
 * weights, which the prefetchers follow) and short at the end, where a thread that ran faster
 * takes over what the other has not reached. Returns 0 when nothing is left. */
static inline int take_units(const UnitRuns *u, int64_t *first, int64_t *last, int64_t *u0, int64_t *u1) {
    const int64_t total = (u->rows + u->panel - 1) / u->panel * u->units;
    int64_t at = __atomic_load_n(u->next, __ATOMIC_RELAXED);
    for (;;) {
        if (at >= total) return 0;
        const int64_t run = (total - at) / (2 * (int64_t)u->threads), panel_end = (at / u->units + 1) * u->units;
        int64_t end = at + (run > 1 ? run : 1);
        end = end < panel_end ? end : panel_end;
        if (__atomic_compare_exchange_n(u->next, &at, end, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *first = at / u->units * u->panel;
            *last = *first + u->panel < u->rows ? *first + u->panel : u->rows;
            *u0 = at % u->units, *u1 = *u0 + (end - at);
            return 1;
        }
    }
}

/* The epilogue codes of packed_gemm.c (cpu_kernels._GEMM_EPILOGUES). */
enum { PLAIN = 0, ADD = 1, GATE_UP = 2 };

/* fn(span) for each of `count` spans (an array of `span_size`-byte structs, count <= MAX_THREADS);
 * returns when all are done.
 *
 * Built with OpenMP (cpu_kernels.py tries -fopenmp first), the spans run on an OpenMP team. The
 * kernels are loaded after torch, so the loader binds them to the libgomp torch already loaded
 * (the same soname): the team is made of torch's own OpenMP threads, hot and never fighting them.
 * With a thread of our own instead, torch's OpenMP threads still spinning after the previous GEMM
 * take the second core from it: decode attention ran ~1.8x slower that way on the plain worker.
 * Without OpenMP: span 0 on the calling thread, the others on their own pthreads (a span whose
 * thread cannot be started runs on the calling thread too). */
#ifdef _OPENMP
#include <omp.h>
static inline void run_spans(void *(*fn)(void *), void *spans, size_t span_size, int count) {
    char *base = (char *)spans;
    if (count <= 1) {
        if (count == 1) fn(base);
        return;
    }
#pragma omp parallel num_threads(count)
    {
        int team = omp_get_num_threads();
        for (int s = omp_get_thread_num(); s < count; s += team) fn(base + (size_t)s * span_size);
    }
}
#else
static inline void run_spans(void *(*fn)(void *), void *spans, size_t span_size, int count) {
    pthread_t threads[MAX_THREADS];
    char *base = (char *)spans;
    int started = 1; /* spans 1..started-1 run on their own threads */
    while (started < count && pthread_create(&threads[started], NULL, fn, base + started * span_size) == 0)
        started++;
    fn(base);
    for (int s = started; s < count; s++) fn(base + s * span_size);
    for (int s = 1; s < started; s++) pthread_join(threads[s], NULL);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (softmax numerators) by exp16's method (the same reduction and polynomial;
 * within ~1.4e-6 relative of exp down to -87), in plain C without float comparisons, so that a
 * loop over an array of values vectorizes where there is no AVX-512 (AVX2, NEON; a float
 * compare-and-select may trap, which keeps GCC from vectorizing it): the portable paths' softmax,
 * where libm's expf is a call a value. Below -104 (-inf included) it gives exp(-104), which rounds
 * to 0 at the precision of any sum of them. */
static inline float exp_neg_lanes(float x) {
    uint32_t bits, floor_bits;
    const float lowest = -104.0f;
    memcpy(&bits, &x, 4);
    memcpy(&floor_bits, &lowest, 4);
    /* a negative float's bits, unsigned, grow with its magnitude (0 and -0 stay below): clamp in integers */
    bits = bits > floor_bits ? floor_bits : bits;
    memcpy(&x, &bits, 4);
    float y = x * 1.44269504088896341f; /* log2(e) */
    float n = (y + 12582912.0f) - 12582912.0f; /* y to the nearest integer (even on ties): 1.5 * 2^23 */
    float f = (y - n) * 0.69314718055994531f;
    float p = 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    /* 2^n, n in [-150, 0], as two normal factors */
    int32_t h = (int32_t)n / 2, l = (int32_t)n - h;
    int32_t hb = (h + 127) << 23, lb = (l + 127) << 23;
    float hf, lf;
    memcpy(&hf, &hb, 4);
    memcpy(&lf, &lb, 4);
    return p * hf * lf;
}

/* silu(g) * u in fp32: g / (1 + exp(-g)) as g e' / (1 + e) with e = exp(-|g|) and e' 1 (g >= 0) or
 * e (g < 0), so that exp only sees values <= 0 (exp_neg_lanes: a loop of them vectorizes). The
 * fp32 SiLU-mul ends (fused_ops.c, int8_ops.c, w4_gemm.c) all take it, so they give the same bits. */
static inline float silu_times(float g, float u) {
    const float e = exp_neg_lanes(-fabsf(g));
    const float pos = 0.5f + copysignf(0.5f, g); /* 1 for g >= 0, else 0 */
    return g * (pos + (1.0f - pos) * e) / (1.0f + e) * u;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* How a KV pool's buffers hold their values (TokenToKVPool: float32, bfloat16, float8_e5m2 stored
 * as bytes, or int8 with scales of their own); cpu_kernels.KV_FORMATS passes these codes. */
#define KV_F32 0
#define KV_BF16 1
#define KV_E5M2 2
#define KV_I8 3 /* int8 values, one fp32 scale per slot and head in a buffer of their own */

static inline size_t kv_elem_size(int fmt) { return fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1; }

/* A float8_e5m2 byte's value: the upper half of an fp16 (1 sign, 5 exponent, 2 mantissa bits). */
static inline float e5m2_to_f32(uint8_t b) {
    int e = (b >> 2) & 31, m = b & 3;
    float v = e == 0 ? ldexpf((float)m, -16) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(4 + m), e - 17);
    return b & 0x80 ? -v : v;
}

/* The largest finite float8_e5m2 (57344) as fp32 bits: K/V beyond it are stored as it (TokenToKVPool). */
#define E5M2_MAX_BITS 0x47600000u

/* f rounded to float8_e5m2 as torch's cast of f clamped to +-57344 (round to nearest even,
 * subnormals below 2^-14, NaN stays NaN): what TokenToKVPool.set_kv stores. */
static inline uint8_t f32_to_e5m2(float f) {
    uint32_t bits, mag;
    memcpy(&bits, &f, sizeof bits);
    mag = bits & 0x7fffffffu;
    uint8_t r;
    if (mag > 0x7f800000u) {
        r = 0x7f;
    } else if (mag >= E5M2_MAX_BITS) {
        r = 0x7b;
    } else if (mag < (113u << 23)) { /* below 2^-14: in steps of 2^-16, rounded by an fp32 add */
        float t;
        memcpy(&t, &mag, sizeof t);
        t += 128.0f;
        uint32_t u;
        memcpy(&u, &t, sizeof u);
        r = (uint8_t)(u - (134u << 23));
    } else {
        r = (uint8_t)((mag - (112u << 23) + 0x0fffffu + ((mag >> 21) & 1u)) >> 21);
    }
    return (uint8_t)(r | (bits >> 24 & 0x80));
}

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef __AVX512F__
/* The first n lanes of 16 (none for n <= 0, all for n >= 16). */
static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* 16 bf16 values as fp32 lanes (exact). */
static inline __m512 widen_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 values at p (fmt: KV_F32, KV_BF16, KV_E5M2, or KV_I8 as the integers, before their scale)
 * as fp32 lanes (exact). */
static inline __m512 load16(const void *p, int fmt) {
    if (fmt == KV_BF16) return widen_bf16x16(_mm256_loadu_si256((const __m256i *)p));
    if (fmt == KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    if (fmt == KV_E5M2) /* the bytes as the upper halves of fp16s */
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    return _mm512_loadu_ps((const float *)p);
}

/* f32_to_e5m2 of 16 lanes. */
static inline __m128i f32x16_to_e5m2(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 21), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(0x0fffff - (112 << 23))), odd), 21);
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(128.0f))),
                                   _mm512_set1_epi32(134 << 23));
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(113 << 23)), sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32((int)E5M2_MAX_BITS)), _mm512_set1_epi32(0x7b));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f));
    r = _mm512_or_si512(r, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
    return _mm512_cvtepi32_epi8(r);
}

#ifdef __AVX512BW__
/* 32 float8_e5m2 bytes as bf16, in 7 simple instructions: the 5 exponent bits rebased to bf16's 8
 * (+112), the 2 mantissa bits the top of bf16's 7. Exact for normal values; e5m2's subnormals
 * (|x| < 6.2e-5) become zeros. inf and NaN are never stored (TokenToKVPool clamps to the
 * largest finite value), so they are not decoded. */
static inline __m512i e5m2x32_to_bf16(const void *p) {
    __m512i w = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)), 8);
    /* sign at bit 15, exponent at 11..7, mantissa at 6..5 */
    __m512i moved = _mm512_and_si512(_mm512_srai_epi16(w, 3), _mm512_set1_epi16((short)0x8FE0));
    __mmask32 normal = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7C00));
    return _mm512_mask_add_epi16(_mm512_and_si512(w, _mm512_set1_epi16((short)0x8000)), normal, moved,
                                 _mm512_set1_epi16(112 << 7));
}

#ifdef __AVX512BF16__
/* 32 int8 values as bf16 (exact: every integer up to 256 is a bf16). */
static inline __m512i i8x32_to_bf16(const void *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

/* n (a multiple of 32) float8_e5m2 bytes at src as bf16 at dst (e5m2x32_to_bf16). */
static inline void e5m2_row_to_bf16(uint16_t *dst, const uint8_t *src, int64_t n) {
    for (int64_t j = 0; j < n; j += 32) _mm512_storeu_si512(dst + j, e5m2x32_to_bf16(src + j));
}
#endif

/* 16 fp32 lanes rounded to bf16 (nearest even; NaN stays NaN), as f32_to_bf16. With AVX512-BF16
 * one instruction (vcvtneps2bf16), which differs only in flushing fp32 denormals (|x| < 1.2e-38,
 * far below any activation) to zero where torch rounds them. */
static inline __m256i to_bf16x16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

static inline void store16_bf16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, to_bf16x16(x)); }

/* x rounded to bf16 and widened back: the value torch holds after a bf16 op. */
static inline __m512 round_bf16x16(__m512 x) { return widen_bf16x16(to_bf16x16(x)); }

/* The index for _mm512_permutex2var_epi16(a, index, b) that interleaves the first 16 words of a
 * and b: (a0, b0, a1, b1, ..., a15, b15); plus 16 in every word, their last 16. Word 2j picks a's
 * word j, word 2j + 1 b's (index 32 + j). Two rows' 16 columns so become the pairs `vdpbf16ps`
 * sums over (the V copies of extend_attention.c). */
static inline __m512i interleave_words_index(void) {
    const __m512i j = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_or_si512(j, _mm512_slli_epi32(_mm512_add_epi32(j, _mm512_set1_epi32(32)), 16));
}

#ifdef __AVX512BF16__
/* A bf16 pair (two consecutive elements at p) broadcast to every 32-bit lane: the operand
 * `vdpbf16ps` takes against 16 pairs of the other side. */
static inline __m512bh pair_bcast(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}
#endif

#define LOG2E 1.44269504088896341f

/* exp(x) for 16 lanes: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by a degree-6
 * polynomial (relative error ~2e-7); -inf gives 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(89.0f));
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(LOG2E));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^y for y <= 0 (softmax numerators in log2 units), to ~4e-5 relative: 2^n * 2^f with
 * n = round(y), |f| <= 1/2, 2^f by a degree-4 polynomial; below -126 it gives 0. For
 * probabilities that are rounded to bf16 (2^-9 relative) next: 8 instructions where exp16 takes
 * 13, and exp16 was ~30 % of the prefill attention kernel at 256-1,024 tokens. Decode attention
 * uses it; prefill attention now takes a cubic of its own (exp2_softmax, extend_attention.c). */
static inline __m512 exp2_neg16(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-127.0f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(0.0096181291f); /* ln2^4 / 24 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f)); /* ln2^3 / 6 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f)); /* ln2^2 / 2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f)); /* ln2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i of the result = the sum of the 16 lanes of v[i] (16 dot products, each left as 16
 * partial sums, finished together): four levels of pairwise shuffles and adds (45 instructions
 * for 16 sums, against ~8 for each horizontal reduction), which leave sum 4e + j in lane 4j + e;
 * one permute puts them in order. */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: lanes 0-7 v[2i], 8-15 v[2i+1] */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit quarter j: v[4i + j] */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in quarter j: lanes 0-1 v[8i + j], 2-3 v[8i + 4 + j] */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
}
#endif

#ifdef __AVX2__
/* 8 bf16 values at p as fp32 lanes (exact): the words shifted into the upper halves. */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 fp32 lanes rounded to bf16 (nearest even; NaN stays NaN), as f32_to_bf16 and to_bf16x16. */
static inline __m128i to_bf16x8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    const __m256i words = _mm256_srli_epi32(rounded, 16); /* (each <= 0xffff: the pack keeps it) */
    return _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

/* 32 fp32 values x times inv, rounded to nearest even (each within +-127: inv is 127 / max|x| or
 * 0), as int8 at q: two saturating packs narrow the four vectors of int32 but interleave 4-value
 * groups across the 128-bit halves, and the permute puts them back in order. `ints` (or NULL)
 * gets the four vectors of int32. */
static inline void quantize32_i8(const float *x, __m256 inv, int8_t *q, __m256i *ints) {
    __m256i v[4];
    for (int b = 0; b < 4; b++) v[b] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * b), inv));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    if (ints)
        for (int b = 0; b < 4; b++) ints[b] = v[b];
}
#endif

/* v as it is, but out of the compiler's sight: a product passed through KEEP_ROUNDED is rounded to
 * its type on its own and never contracted with a following add into one fused multiply-add
 * (GCC contracts across statements, intrinsics included, at -O3 unless told not to). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KEEP_ROUNDED(v) __asm__("" : "+x"(v))
#elif defined(__GNUC__) && defined(__aarch64__)
#define KEEP_ROUNDED(v) __asm__("" : "+w"(v))
#else
#define KEEP_ROUNDED(v) ((void)(v))
#endif

#ifdef __AVX2__
/* The largest of `start` and v's 8 lanes, a NaN lane passed over (the lanes scanned in order: the
 * AVX2 paths' maxima, whose value does not depend on the order). */
static inline float max_lanes8(__m256 v, float start) {
    float lanes[8], top = start;
    _mm256_storeu_ps(lanes, v);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}
#endif

/* The largest |x| of n fp32 values (0 for none; a NaN among them is passed over, as fmaxf does):
 * the scale of an int8 or int16 row (quantize_row, store_i8, quantize_queries). The largest is the
 * same in any order, so every ISA's path gives the same value. */
static inline float max_abs_f32(const float *x, int64_t n) {
    float amax = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    /* four chains (one waited on each max's latency, vector by vector: RMSNorm with its int8 rows,
     * 200 rows of 576, 29 -> 21 us on two threads of a 2-core Xeon). A maximum is exact, so any
     * order gives the same bits; a NaN lane of x leaves its chain as it was (vmaxps returns its
     * second operand where either is a NaN). */
    __m512 m0 = _mm512_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 64 <= n; i += 64) {
        m0 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m0);
        m1 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i + 16)), m1);
        m2 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i + 32)), m2);
        m3 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i + 48)), m3);
    }
    for (; i + 16 <= n; i += 16) m0 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m0);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
#elif defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
    amax = max_lanes8(m, amax);
#endif
    for (; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
}

/* The sum of 16 partial sums in _mm512_reduce_add_ps's order (lanes i and i + 8, then i and
 * i + 4, i and i + 2, the last two): with partial sums kept per lane as the AVX-512 code keeps them,
 * the portable paths give its bits. */
static inline float sum_lanes16(const float part[16]) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = part[i + 8] + part[i];
    for (int i = 0; i < 4; i++) s4[i] = s8[i + 4] + s8[i];
    return (s4[2] + s4[0]) + (s4[3] + s4[1]);
}

/* One fp32 row's RMSNorm: o = w * (h * (1 / sqrt(mean(h^2) + eps))), h = x, or x + res (then
 * written to h_out), the squares in 16 partial sums added up as sum_lanes16 (loops GCC vectorizes
 * on any vector ISA): PyTorch's values to fp32 rounding. fused_ops.c's rms_norm_f32 and
 * w4_gemm.c's w4_rms_norm_quantize take it, so they give the same bits. */
static inline void rms_norm_row_f32(const float *x, const float *res, float *h_out, const float *w, int64_t d,
                                    float eps, float *o) {
    float part[16] = {0}, sum;
    int64_t i = 0;
    if (res) {
        for (; i + 16 <= d; i += 16)
            for (int l = 0; l < 16; l++) {
                const float v = x[i + l] + res[i + l];
                h_out[i + l] = v;
                part[l] += v * v;
            }
    } else {
        for (; i + 16 <= d; i += 16)
            for (int l = 0; l < 16; l++) part[l] += x[i + l] * x[i + l];
    }
    sum = sum_lanes16(part);
    for (; i < d; i++) {
        const float v = res ? x[i] + res[i] : x[i];
        if (res) h_out[i] = v;
        sum += v * v;
    }
    const float scale = 1.0f / sqrtf(sum / (float)d + eps);
    const float *src = res ? h_out : x;
    for (i = 0; i < d; i++) o[i] = w[i] * (src[i] * scale);
}

/* Row r of an RMSNorm's input in fp32 into `row` [d]: x (bf16, the row itself), or with a residual
 * ([rows, d], or NULL) bf16(x + residual), which is also written to residual_out's row r.
 * Returns the row's scale 1 / sqrt(mean(x^2) + eps). */
static inline float rms_norm_input(const uint16_t *x, const uint16_t *residual, uint16_t *residual_out, int64_t r,
                                   int64_t d, float eps, float *row) {
    const uint16_t *res = residual ? residual + r * d : NULL;
    uint16_t *res_out = residual ? residual_out + r * d : NULL;
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) {
        __m512 v = load16(x + i, KV_BF16);
        if (res) {
            v = round_bf16x16(_mm512_add_ps(v, load16(res + i, KV_BF16)));
            store16_bf16(res_out + i, v);
        }
        _mm512_storeu_ps(row + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#else
    /* 16 partial sums, summed in the vector code's order: the same bits without AVX-512 */
    float part[16] = {0};
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) {
            float v = bf16_to_f32(x[i + l]);
            if (res) {
                uint16_t h = f32_to_bf16(v + bf16_to_f32(res[i + l]));
                res_out[i + l] = h;
                v = bf16_to_f32(h);
            }
            row[i + l] = v;
            part[l] += v * v;
        }
    sum = sum_lanes16(part);
#endif
    for (; i < d; i++) {
        float v = bf16_to_f32(x[i]);
        if (res) {
            uint16_t h = f32_to_bf16(v + bf16_to_f32(res[i]));
            res_out[i] = h;
            v = bf16_to_f32(h);
        }
        row[i] = v;
        sum += v * v;
    }
    return 1.0f / sqrtf(sum / (float)d + eps);
}

#endif
