/* Matrix products against low-bit weights in engine.quant's stored layout, for engine/qlinear.py:
 * y = x W^T for a few rows of x (decode, short turns), and W de-quantized into float32 or bfloat16
 * (for many rows, where a float GEMM of the whole batch is faster than any product of ours).
 *
 * int4: rows of W in blocks of 32 inputs, 16 bytes a block (byte i: input i in the low nibble, input
 * i + 16 in the high one), one float16 scale and minimum per row and group of `group` inputs (the last
 * group may be shorter): w = q * scale + min. Then for a row r of x and a row j of W,
 *     y[r, j] = sum_g scale[j, g] * (sum_{i in g} q[j, i] x[r, i]) + sum_g min[j, g] * xsum[r, g],
 * where xsum[r, g] (the sums of x over each group) is computed once per call. A block's 32 values
 * are unpacked to floats once and used for every row of x.
 * int8: w = q * scale[j], q in -127..127, one float32 scale a row of W.
 *
 * The weights are read where they are mapped (no repacked copy), so every process on a node shares
 * one copy in the page cache. Work is split over rows of W; threads are the calling thread's OpenMP
 * team (torch's, built with -fopenmp on a torch that runs GNU OpenMP), otherwise POSIX threads
 * started per call. Vector code uses GCC/Clang vector extensions (16 x float32): AVX-512 or pairs of
 * AVX2 registers with -march=native on x86, NEON on arm64. Fused multiply-add is allowed: results
 * match a float reference up to rounding, which the tests bound.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint8_t v16bu __attribute__((vector_size(16), aligned(1)));
typedef int8_t v16s __attribute__((vector_size(16)));
typedef int8_t v16su __attribute__((vector_size(16), aligned(1)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16w __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* bytes -> floats through 32-bit integers: GCC 12 splits a direct byte-to-float conversion, and a
 * signed byte widening, into scalar conversions; the unsigned widening (vpmovzxbd, then vcvtdq2ps)
 * stays vector code. Signed bytes go through it with their sign bit flipped. */
static inline v16f u8_to_f(v16b b) { return __builtin_convertvector(__builtin_convertvector(b, v16i), v16f); }
static inline v16f s8_to_f(v16s b) { return u8_to_f((v16b)b ^ 0x80) - 128.0f; }

#define MAX_ROWS 8 /* rows of x per product; the caller splits larger batches */
#define BLOCK 32

static inline v16f load16(const float *p) { return *(const v16fu *)p; }
static inline float hsum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* IEEE half -> float, exact (normals, subnormals, inf, nan). */
static inline float half_to_float(uint16_t h) {
#ifdef __FLT16_MAX__
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

typedef struct {
    int kind; /* 4: int4 product, 8: int8 product, 32/16: float32/bfloat16 product, 40/80: de-quantize int4/int8 */
    const float *x;
    i64 m, k, n, group, ldx, ldy;
    const uint8_t *q;
    const uint16_t *scale, *mins; /* int4 */
    const float *scale8;          /* int8 */
    const float *xsum;            /* [m, groups] sums of x per group (int4) */
    const int8_t *xq;             /* [m, k] x quantized per block of 32 (int4 with VNNI) */
    const float *xd;              /* [m, k / 32] those blocks' scales */
    const int32_t *gidx;          /* [k / 32] group of each block (VNNI path: no division per block) */
    float *y;
    uint16_t *ybf16; /* de-quantize into bfloat16 instead of float32 when set */
    int accumulate;
    int threads;
    int prefetch_rows; /* products: rows of W ahead of the current one asked into the cache (0: none) */
} job_t;

/* Software prefetch of later rows of W. A product reads W once, row after row, a few hundred bytes a
 * row at the default model's widths, between other work that takes the cache; each row asks for the
 * one `prefetch_rows` ahead (docs/benchmarks.md, "Tuning at the edge"). */
/* Ask for `bytes` from `p` on to come into every cache level (the non-temporal hint, locality 0,
 * made int4 decode at the 1.2B shape 20% slower, bench.decode_switches). */
static inline void prefetch(const void *p, i64 bytes) {
    for (i64 o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

/* Prefetch row j + prefetch_rows of an int4 W (values, scales, minimums), where it is before j1. */
static inline void q4_prefetch(const job_t *jb, i64 j, i64 j1) {
    const i64 a = j + jb->prefetch_rows;
    if (jb->prefetch_rows == 0 || a >= j1) return;
    const i64 groups = (jb->k + jb->group - 1) / jb->group;
    prefetch(jb->q + a * (jb->k / 2), jb->k / 2);
    prefetch(jb->scale + a * groups, groups * 2);
    if (jb->mins) prefetch(jb->mins + a * groups, groups * 2);
}

/* ---- int4 ---------------------------------------------------------------------------------------- */

/* n (<= 16) IEEE halves -> floats */
static inline void halves(const uint16_t *h, float *out, int n) {
#if defined(__AVX512F__)
    __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), h));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), v);
#else
    for (int i = 0; i < n; i++) out[i] = half_to_float(h[i]);
#endif
}

/* Row j's scales, and minimums where the weight stores them (groups g.. g + n - 1, n <= 16), as floats.
 * A symmetric weight (`mins` NULL: GGUF's Q4_0, `w = (q - 8) * scale`) has none: each is -8 times its
 * scale, and the minimums' term is taken over the scales times -8 (`q4_min_term`). */
static inline void q4_group_params(const job_t *jb, i64 j, i64 groups, i64 g, int n, float *sc, float *mn) {
    halves(jb->scale + j * groups + g, sc + g, n);
    if (jb->mins) halves(jb->mins + j * groups + g, mn + g, n);
}

/* sum_g min[g] * xs[g] as 16 lanes to be summed with the row's products, min[g] = mf * mv[g]: the row's
 * minimums (mf 1) or its scales (mf -8, symmetric; exact, so both forms give the same bits). */
static inline v16f q4_min_term(const job_t *jb, const float *sc, const float *mn, const float *xs, i64 groups) {
    const float *mv = jb->mins ? mn : sc;
    const float mf = jb->mins ? 1.0f : -8.0f;
    v16f t = (v16f){0};
    i64 g = 0;
    for (; g + 16 <= groups; g += 16) t += (mf * load16(mv + g)) * load16(xs + g);
    if (g < groups) {
#if defined(__AVX512F__)
        const __mmask16 left = (__mmask16)((1u << (groups - g)) - 1);
        t += (mf * (v16f)_mm512_maskz_loadu_ps(left, mv + g)) * (v16f)_mm512_maskz_loadu_ps(left, xs + g);
#else
        float v = 0.0f;
        for (; g < groups; g++) v += mf * mv[g] * xs[g];
        t[0] += v;
#endif
    }
    return t;
}

/* One row of W against m rows of x (m a compile-time constant after inlining, so the accumulators
 * live in registers). Two accumulators per row of x alternate between groups, so consecutive groups'
 * multiply-adds do not wait for each other. */
static inline __attribute__((always_inline)) void q4_row(const job_t *jb, i64 j, const int m, float *sc,
                                                         float *mn) {
    const i64 k = jb->k, group = jb->group, groups = (k + group - 1) / group, bpg = group / BLOCK;
    const i64 nblocks = k / BLOCK;
    const uint8_t *qj = jb->q + j * (k / 2);
    for (i64 g = 0; g < groups; g += 16) {
        const int n = groups - g < 16 ? (int)(groups - g) : 16;
        q4_group_params(jb, j, groups, g, n, sc, mn);
    }
    v16f acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < m; r++) acc0[r] = acc1[r] = (v16f){0};
    for (i64 g = 0, b = 0; g < groups; g++) {
        v16f plo[MAX_ROWS], phi[MAX_ROWS];
        for (int r = 0; r < m; r++) plo[r] = phi[r] = (v16f){0};
        const i64 bend = b + bpg < nblocks ? b + bpg : nblocks;
        for (; b < bend; b++) {
            const v16b raw = *(const v16bu *)(qj + b * 16);
            const v16f lo = u8_to_f(raw & 15), hi = u8_to_f(raw >> 4);
            for (int r = 0; r < m; r++) {
                const float *xr = jb->x + r * jb->ldx + b * BLOCK;
                plo[r] += lo * load16(xr);
                phi[r] += hi * load16(xr + 16);
            }
        }
        const float s = sc[g];
        if (g & 1)
            for (int r = 0; r < m; r++) acc1[r] += s * (plo[r] + phi[r]);
        else
            for (int r = 0; r < m; r++) acc0[r] += s * (plo[r] + phi[r]);
    }
    for (int r = 0; r < m; r++) {
        /* the minimums' term: sum_g min[g] * xsum[r, g], sixteen groups at a time */
        const float v = hsum16(acc0[r] + acc1[r] + q4_min_term(jb, sc, mn, jb->xsum + r * groups, groups));
        float *yr = jb->y + r * jb->ldy + j;
        *yr = jb->accumulate ? *yr + v : v;
    }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q4_VNNI 1
/* With AVX-512 VNNI the rows of x are quantized to int8 per block of 32 inputs (symmetric, one float
 * scale a block: MNN-LLM's W4A8) and multiplied four blocks at a time: W's 64 bytes of four blocks
 * give their low nibbles (inputs 0-15 of each block) and high nibbles (16-31) as two vectors of 64
 * unsigned 4-bit values with no shuffle, x's quantized rows are stored in that order (`XQ_STEP`
 * bytes per four blocks: the four blocks' inputs 0-15, then their inputs 16-31), and two vpdpbusd
 * leave each block's 32 products summed in four int32 lanes (lanes 4b..4b+3: block b). Those are
 * converted once and scaled by a vector of weight times activation scales, 16 blocks' worth built
 * at a time and spread to the lanes by a permute. The minimums' term uses the sums of the quantized
 * rows. */
#define XQ_STEP 128
static inline __attribute__((always_inline)) void q4_row_vnni(const job_t *jb, i64 j, const int m, float *sc,
                                                              float *mn) {
    const i64 k = jb->k, group = jb->group, groups = (k + group - 1) / group;
    const i64 nblocks = k / BLOCK, xstride = (nblocks + 3) / 4 * XQ_STEP;
    const uint8_t *qj = jb->q + j * (k / 2);
    /* groups of one block: the scales and minimums go from their halves straight into registers, and
     * the minimums' term is summed beside the products (no trip through `sc` and `mn`) */
    const int direct = group == BLOCK;
    for (i64 g = 0; g < groups && !direct; g += 16) {
        const int n = groups - g < 16 ? (int)(groups - g) : 16;
        q4_group_params(jb, j, groups, g, n, sc, mn);
    }
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[MAX_ROWS], mt[MAX_ROWS];
    for (int r = 0; r < m; r++) acc[r] = mt[r] = _mm512_setzero_ps();
    for (i64 b0 = 0; b0 < nblocks; b0 += 16) {
        const i64 nb = nblocks - b0 < 16 ? nblocks - b0 : 16;
        const __mmask16 bm = (__mmask16)((1u << nb) - 1);
        /* W's scale of each of these 16 blocks (its group's) */
        __m512 ws;
        if (direct) {
            ws = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, jb->scale + j * groups + b0));
            const __m512 mv = jb->mins ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(bm, jb->mins + j * groups + b0))
                                       : _mm512_mul_ps(ws, _mm512_set1_ps(-8.0f)); /* exact: the same bits */
            for (int r = 0; r < m; r++)
                mt[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(bm, jb->xsum + r * groups + b0), mt[r]);
        } else {
            ws = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), bm, _mm512_maskz_loadu_epi32(bm, jb->gidx + b0), sc, 4);
        }
        __m512 cs[MAX_ROWS];
        for (int r = 0; r < m; r++) cs[r] = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(bm, jb->xd + r * nblocks + b0));
        __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (i64 b = b0; b < b0 + nb; b += 4) {
            const int left = (int)(nblocks - b);
            const __mmask64 bytes = left >= 4 ? ~0ull : (1ull << (16 * left)) - 1; /* a last, partial step */
            const __m512i raw = _mm512_maskz_loadu_epi8(bytes, qj + b * 16);
            const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            for (int r = 0; r < m; r++) {
                const int8_t *xr = jb->xq + r * xstride + b / 4 * XQ_STEP;
                const __m512i dots = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xr)), hi,
                    _mm512_loadu_si512((const void *)(xr + 64)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_permutexvar_ps(idx, cs[r]), acc[r]);
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(4));
        }
    }
    for (int r = 0; r < m; r++) {
        const __m512 t = direct ? mt[r] : (__m512)q4_min_term(jb, sc, mn, jb->xsum + r * groups, groups);
        const float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], t));
        float *yr = jb->y + r * jb->ldy + j;
        *yr = jb->accumulate ? *yr + v : v;
    }
}
#else
#define Q4_VNNI 0
#endif

static void q4_rows(const job_t *jb, i64 j0, i64 j1) {
    const i64 groups = (jb->k + jb->group - 1) / jb->group;
    float sc[groups + 16], mn[groups + 16];
#if Q4_VNNI
    if (jb->xq) {
        for (i64 j = j0; j < j1; j++) {
            q4_prefetch(jb, j, j1);
            switch (jb->m) {
            case 1: q4_row_vnni(jb, j, 1, sc, mn); break;
            case 2: q4_row_vnni(jb, j, 2, sc, mn); break;
            case 4: q4_row_vnni(jb, j, 4, sc, mn); break;
            default: q4_row_vnni(jb, j, (int)jb->m, sc, mn); break;
            }
        }
        return;
    }
#endif
    for (i64 j = j0; j < j1; j++) {
        q4_prefetch(jb, j, j1);
        switch (jb->m) { /* constant row counts: the accumulators stay in registers */
        case 1: q4_row(jb, j, 1, sc, mn); break;
        case 2: q4_row(jb, j, 2, sc, mn); break;
        case 3: q4_row(jb, j, 3, sc, mn); break;
        case 4: q4_row(jb, j, 4, sc, mn); break;
        default: q4_row(jb, j, (int)jb->m, sc, mn); break;
        }
    }
}

/* 16 floats -> 16 bfloat16 at o, rounded to nearest even, in vector operations (a loop over lanes
 * did not vectorize where the lanes came from two vectors: int4 to bfloat16 ran 8x slower than to float32) */
static inline void store_bf16(uint16_t *o, v16f x) {
    v16w u;
    memcpy(&u, &x, 64);
    const v16h h = __builtin_convertvector((u + 0x7fff + ((u >> 16) & 1)) >> 16, v16h);
    memcpy(o, &h, 32);
}

static void q4_dequant_rows(const job_t *jb, i64 j0, i64 j1) {
    const i64 k = jb->k, groups = (k + jb->group - 1) / jb->group;
    for (i64 j = j0; j < j1; j++) {
        const uint8_t *qj = jb->q + j * (k / 2);
        for (i64 b = 0; b < k / BLOCK; b++) {
            const i64 g = b * BLOCK / jb->group;
            const float s = half_to_float(jb->scale[j * groups + g]);
            const float mn = jb->mins ? half_to_float(jb->mins[j * groups + g]) : -8.0f * s;
            v16b raw = *(const v16bu *)(qj + b * 16);
            v16f lo = u8_to_f(raw & 15) * s + mn;
            v16f hi = u8_to_f(raw >> 4) * s + mn;
            if (jb->ybf16) {
                uint16_t *o = jb->ybf16 + j * jb->ldy + b * BLOCK;
                store_bf16(o, lo);
                store_bf16(o + 16, hi);
            } else {
                float *o = jb->y + j * jb->ldy + b * BLOCK;
                memcpy(o, &lo, 64);
                memcpy(o + 16, &hi, 64);
            }
        }
    }
}

/* ---- int8 ---------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void q8_row(const job_t *jb, i64 j, const int m) {
    const i64 k = jb->k;
    const int8_t *qj = (const int8_t *)jb->q + j * k;
    v16f acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < m; r++) acc0[r] = acc1[r] = (v16f){0};
    i64 i = 0;
    for (; i + 32 <= k; i += 32) {
        const v16f w0 = s8_to_f(*(const v16su *)(qj + i)), w1 = s8_to_f(*(const v16su *)(qj + i + 16));
        for (int r = 0; r < m; r++) {
            acc0[r] += w0 * load16(jb->x + r * jb->ldx + i);
            acc1[r] += w1 * load16(jb->x + r * jb->ldx + i + 16);
        }
    }
    if (i < k) { /* k is a multiple of 16 */
        const v16f w0 = s8_to_f(*(const v16su *)(qj + i));
        for (int r = 0; r < m; r++) acc0[r] += w0 * load16(jb->x + r * jb->ldx + i);
    }
    for (int r = 0; r < m; r++) {
        const float v = jb->scale8[j] * hsum16(acc0[r] + acc1[r]);
        float *yr = jb->y + r * jb->ldy + j;
        *yr = jb->accumulate ? *yr + v : v;
    }
}

static void q8_rows(const job_t *jb, i64 j0, i64 j1) {
    for (i64 j = j0; j < j1; j++) {
        if (jb->prefetch_rows && j + jb->prefetch_rows < j1) prefetch(jb->q + (j + jb->prefetch_rows) * jb->k, jb->k);
        switch (jb->m) {
        case 1: q8_row(jb, j, 1); break;
        case 2: q8_row(jb, j, 2); break;
        case 3: q8_row(jb, j, 3); break;
        case 4: q8_row(jb, j, 4); break;
        default: q8_row(jb, j, (int)jb->m); break;
        }
    }
}

static void q8_dequant_rows(const job_t *jb, i64 j0, i64 j1) {
    const i64 k = jb->k;
    const int8_t *q = (const int8_t *)jb->q;
    for (i64 j = j0; j < j1; j++) {
        const float s = jb->scale8[j];
        for (i64 i = 0; i < k; i += 16) {
            v16f w = s8_to_f(*(const v16su *)(q + j * k + i)) * s;
            if (jb->ybf16) {
                store_bf16(jb->ybf16 + j * jb->ldy + i, w);
            } else {
                memcpy(jb->y + j * jb->ldy + i, &w, 64);
            }
        }
    }
}

/* ---- float32 and bfloat16 ------------------------------------------------------------------------ */

/* 16 bfloat16 -> floats (exact: the upper halves of their float32 words) */
static inline v16f bf16_to_f(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, 32);
    const v16w u = __builtin_convertvector(h, v16w) << 16;
    v16f f;
    memcpy(&f, &u, 64);
    return f;
}

/* One row of a float32 (bf16 0) or bfloat16 (bf16 1) W against m float rows of x; k % 16 == 0. m and bf16
 * are compile-time constants after inlining. */
static inline __attribute__((always_inline)) void f_row(const job_t *jb, i64 j, const int m, const int bf16) {
    const i64 k = jb->k;
    v16f acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < m; r++) acc0[r] = acc1[r] = (v16f){0};
    const float *w32 = (const float *)jb->q + j * k;
    const uint16_t *w16 = (const uint16_t *)jb->q + j * k;
    i64 i = 0;
    for (; i + 32 <= k; i += 32) {
        const v16f w0 = bf16 ? bf16_to_f(w16 + i) : load16(w32 + i);
        const v16f w1 = bf16 ? bf16_to_f(w16 + i + 16) : load16(w32 + i + 16);
        for (int r = 0; r < m; r++) {
            acc0[r] += w0 * load16(jb->x + r * jb->ldx + i);
            acc1[r] += w1 * load16(jb->x + r * jb->ldx + i + 16);
        }
    }
    if (i < k) {
        const v16f w0 = bf16 ? bf16_to_f(w16 + i) : load16(w32 + i);
        for (int r = 0; r < m; r++) acc0[r] += w0 * load16(jb->x + r * jb->ldx + i);
    }
    for (int r = 0; r < m; r++) {
        const float v = hsum16(acc0[r] + acc1[r]);
        float *yr = jb->y + r * jb->ldy + j;
        *yr = jb->accumulate ? *yr + v : v;
    }
}

static inline __attribute__((always_inline)) void f_rows_of(const job_t *jb, i64 j0, i64 j1, const int bf16) {
    const i64 row = jb->k * (bf16 ? 2 : 4);
    for (i64 j = j0; j < j1; j++) {
        if (jb->prefetch_rows && j + jb->prefetch_rows < j1) prefetch(jb->q + (j + jb->prefetch_rows) * row, row);
        switch (jb->m) {
        case 1: f_row(jb, j, 1, bf16); break;
        case 2: f_row(jb, j, 2, bf16); break;
        case 4: f_row(jb, j, 4, bf16); break;
        default: f_row(jb, j, (int)jb->m, bf16); break;
        }
    }
}

static void f_rows(const job_t *jb, i64 j0, i64 j1) {
    if (jb->kind == 16)
        f_rows_of(jb, j0, j1, 1);
    else
        f_rows_of(jb, j0, j1, 0);
}

/* ---- threads ------------------------------------------------------------------------------------- */

static void run_part(const job_t *jb, int part, int parts) {
    /* contiguous ranges of W's rows, in multiples of 16 so no two threads write one cache line of y */
    const i64 units = (jb->n + 15) / 16;
    const i64 u0 = units * part / parts, u1 = units * (part + 1) / parts;
    const i64 j0 = u0 * 16, j1 = u1 * 16 < jb->n ? u1 * 16 : jb->n;
    if (j0 >= j1) return;
    switch (jb->kind) {
    case 4: q4_rows(jb, j0, j1); break;
    case 8: q8_rows(jb, j0, j1); break;
    case 16:
    case 32: f_rows(jb, j0, j1); break;
    case 40: q4_dequant_rows(jb, j0, j1); break;
    case 80: q8_dequant_rows(jb, j0, j1); break;
    }
}

typedef struct {
    const job_t *jb;
    int part, parts;
} part_t;

static __attribute__((unused)) void *part_main(void *arg) {
    part_t *p = arg;
    run_part(p->jb, p->part, p->parts);
    return NULL;
}

static void run(const job_t *jb) {
    int threads = jb->threads < 1 ? 1 : (jb->threads > 16 ? 16 : jb->threads);
    if (threads == 1 || jb->n < 64) {
        run_part(jb, 0, 1);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    run_part(jb, omp_get_thread_num(), omp_get_num_threads());
#else
    pthread_t tids[16];
    part_t parts[16];
    int started[16] = {0};
    for (int t = 1; t < threads; t++) {
        parts[t] = (part_t){jb, t, threads};
        started[t] = pthread_create(&tids[t], NULL, part_main, &parts[t]) == 0;
        if (!started[t]) run_part(jb, t, threads);
    }
    run_part(jb, 0, threads);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
#endif
}

/* ---- entry points (engine/qlinear.py declares them) ---------------------------------------------- */

int qm_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int qm_max_rows(void) { return MAX_ROWS; }

/* Whether q4_matmul can quantize activations to int8 (AVX-512 VNNI compiled in). */
int qm_int8_activations(void) { return Q4_VNNI; }

/* y[m, n] (+)= x[m, k] W^T, W int4 [n, k] (k a multiple of 32, group a multiple of 32); m <= MAX_ROWS.
 * `int8_activations`: quantize x per block of 32 and use the VNNI products where they were compiled
 * (`qm_int8_activations`). `prefetch_rows`: rows of W ahead asked into the cache (0: none). Returns 0,
 * or -1 for arguments out of range. */
int q4_matmul(const float *x, i64 m, i64 ldx, i64 k, const uint8_t *q, const uint16_t *scale,
              const uint16_t *mins, i64 n, i64 group, float *y, i64 ldy, int accumulate, int threads,
              int int8_activations, int prefetch_rows) {
    if (m < 1 || m > MAX_ROWS || k % BLOCK || group < BLOCK || group % BLOCK || prefetch_rows < 0) return -1;
    const i64 groups = (k + group - 1) / group;
    float xsum[m * groups]; /* at most 8 rows x k / 32 floats */
    job_t jb = {.kind = 4, .x = x, .m = m, .k = k, .n = n, .group = group, .ldx = ldx, .ldy = ldy, .q = q,
                .scale = scale, .mins = mins, .xsum = xsum, .y = y, .accumulate = accumulate, .threads = threads,
                .prefetch_rows = prefetch_rows};
#if Q4_VNNI
    const i64 nblocks = k / BLOCK, xstride = (nblocks + 3) / 4 * XQ_STEP;
    int8_t xq[m * xstride + 64];
    float xd[m * nblocks + 16];
    int32_t gidx[nblocks + 16];
    for (i64 b = 0; b < nblocks; b++) gidx[b] = (int32_t)(b * BLOCK / group);
    if (int8_activations) {
        if (nblocks % 4) memset(xq, 0, sizeof xq); /* a last, partial step's unused places */
        memset(xsum, 0, sizeof xsum);
        for (i64 r = 0; r < m; r++)
            for (i64 b = 0; b < nblocks; b++) {
                const float *xb = x + r * ldx + b * BLOCK;
                const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
                const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
                const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                xd[r * nblocks + b] = d;
                /* rounded to nearest even (as lrintf), within -127..127: the narrowing truncation is exact;
                 * block b's inputs 0-15 and 16-31 go to their places of the four-block step */
                const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
                const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
                int8_t *o = xq + r * xstride + b / 4 * XQ_STEP + (b % 4) * 16;
                _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(qlo));
                _mm_storeu_si128((__m128i *)(o + 64), _mm512_cvtepi32_epi8(qhi));
                const int s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
                /* the minimums' term over the same quantized rows: then the error is sum_i w_i e_i, with
                 * the weights (centred) rather than their unsigned 4-bit codes (mean 7.5) multiplying the
                 * activations' rounding errors e_i */
                xsum[r * groups + gidx[b]] += (float)s * d;
            }
        jb.xq = xq;
        jb.xd = xd;
        jb.gidx = gidx;
    }
#else
    int8_activations = 0;
#endif
    if (!int8_activations) /* the minimums' term over the float rows */
        for (i64 r = 0; r < m; r++)
            for (i64 g = 0; g < groups; g++) {
                const i64 e = (g + 1) * group < k ? (g + 1) * group : k;
                float t = 0.0f;
                for (i64 i = g * group; i < e; i++) t += x[r * ldx + i];
                xsum[r * groups + g] = t;
            }
    run(&jb);
    return 0;
}

/* y[m, n] (+)= x[m, k] W^T, W int8 [n, k] with a float32 scale a row (k a multiple of 16); m <= MAX_ROWS;
 * `prefetch_rows` as for q4_matmul. */
int q8_matmul(const float *x, i64 m, i64 ldx, i64 k, const int8_t *q, const float *scale, i64 n, float *y,
              i64 ldy, int accumulate, int threads, int prefetch_rows) {
    if (m < 1 || m > MAX_ROWS || k % 16 || prefetch_rows < 0) return -1;
    job_t jb = {.kind = 8, .x = x, .m = m, .k = k, .n = n, .ldx = ldx, .ldy = ldy, .q = (const uint8_t *)q,
                .scale8 = scale, .y = y, .accumulate = accumulate, .threads = threads,
                .prefetch_rows = prefetch_rows};
    run(&jb);
    return 0;
}

/* y[m, n] (+)= x[m, k] W^T, W float32 (bf16 == 0) or bfloat16 [n, k] (k a multiple of 16), float32
 * rows and sums (a bfloat16 weight is widened exactly); m <= MAX_ROWS; `prefetch_rows` as above. */
int f_matmul(const float *x, i64 m, i64 ldx, i64 k, const void *w, int bf16, i64 n, float *y, i64 ldy,
             int accumulate, int threads, int prefetch_rows) {
    if (m < 1 || m > MAX_ROWS || k % 16 || prefetch_rows < 0) return -1;
    job_t jb = {.kind = bf16 ? 16 : 32, .x = x, .m = m, .k = k, .n = n, .ldx = ldx, .ldy = ldy,
                .q = (const uint8_t *)w, .y = y, .accumulate = accumulate, .threads = threads,
                .prefetch_rows = prefetch_rows};
    run(&jb);
    return 0;
}

/* W int4 [n, k] -> float32 (out_bf16 == 0) or bfloat16 rows of `ld` elements at `out`. */
int q4_dequantize(const uint8_t *q, const uint16_t *scale, const uint16_t *mins, i64 n, i64 k, i64 group,
                  void *out, i64 ld, int out_bf16, int threads) {
    if (k % BLOCK || group < BLOCK || group % BLOCK) return -1;
    job_t jb = {.kind = 40, .k = k, .n = n, .group = group, .ldy = ld, .q = q, .scale = scale, .mins = mins,
                .y = out_bf16 ? NULL : out, .ybf16 = out_bf16 ? out : NULL, .threads = threads};
    run(&jb);
    return 0;
}

/* W int8 [n, k] -> float32 or bfloat16 rows of `ld` elements at `out`. */
int q8_dequantize(const int8_t *q, const float *scale, i64 n, i64 k, void *out, i64 ld, int out_bf16,
                  int threads) {
    if (k % 16) return -1;
    job_t jb = {.kind = 80, .k = k, .n = n, .ldy = ld, .q = (const uint8_t *)q, .scale8 = scale,
                .y = out_bf16 ? NULL : out, .ybf16 = out_bf16 ? out : NULL, .threads = threads};
    run(&jb);
    return 0;
}
