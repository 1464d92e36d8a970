/* One decoder layer for a few rows (decode, a lookup pass) in one call, for engine/fused_decode.py:
 * RMSNorm, the QKV product, RoPE, the K/V rows written into a float working set, attention, the
 * output product added into the residual, RMSNorm, the gate/up product, SiLU times up, and the down
 * product added into the residual. The products and attention are the compiled kernels of
 * engine/qmatmul.c and engine/attention.c, reached through the function pointers the caller puts in
 * the layer's description (each keeps its own threads); what lies between them here is a few
 * thousand floats a row, done on the calling thread. This file knows no model format, no files and
 * no torch: the caller checks that the layer is one it can run (compiled products without biases,
 * float32 rows, a float working set) and describes it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;

typedef int (*q4_fn)(const float *, i64, i64, i64, const void *, const void *, const void *, i64, i64, float *, i64,
                     int, int, int, int);
typedef int (*q8_fn)(const float *, i64, i64, i64, const void *, const void *, i64, float *, i64, int, int, int);
typedef int (*f_fn)(const float *, i64, i64, i64, const void *, int, i64, float *, i64, int, int, int);
typedef int (*attn_fn)(const float *, i64, const i64 *, i64, const float *, i64, const float *, i64, i64, i64, i64,
                       float, float *, i64, float *, int);

/* A weight [n, k] as engine/qlinear.py holds it. */
typedef struct {
    int kind; /* 4: int4 (q, scale, mins, group), 8: int8 (q, scale), 32 / 16: float32 / bfloat16 (q) */
    int int8_activations;
    int prefetch_rows;
    int pad;
    const void *q, *scale, *mins;
    i64 n, k, group;
} lin_t;

/* One layer and the kernels it runs on. */
typedef struct {
    i64 hidden, hq, hkv, d, inter;
    float eps, attn_scale;
    const float *attn_norm, *mlp_norm;
    lin_t qkv, o, gate_up, down;
    const float *cos, *sin_half; /* rope tables [P, D] and [P, D / 2] */
    void *q4, *q8, *fm, *attn;
} layer_t;

#define MAX_ROWS 8

/* Floats of scratch a layer needs for `rows` rows. */
i64 fd_scratch_floats(i64 hidden, i64 hq, i64 hkv, i64 d, i64 inter, i64 rows) {
    return rows * (hidden + (hq + 2 * hkv) * d + hq * d + 2 * inter);
}

typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp of 16 floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 6
 * (truncation error under 2e-7 relative), 2^n put into the exponent; x clamped to [-87, 88] (SiLU
 * needs no more). GCC vector extensions: AVX-512 or pairs of AVX2 registers, NEON on arm64. */
static inline v16f vexp(v16f x) {
    const v16f lo = (v16f){0} - 87.0f, hi = (v16f){0} + 88.0f;
    v16i m = x < lo;
    x = (v16f)(((v16i)x & ~m) | ((v16i)lo & m));
    m = x > hi;
    x = (v16f)(((v16i)x & ~m) | ((v16i)hi & m));
    const v16f t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds to the nearest integer */
    const v16f n = t - 12582912.0f;
    const v16f r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    v16f p = r * (1.0f / 720) + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (v16f)((v16i)p + (((v16i)t - 0x4B400000) << 23));
}

/* g = silu(g) * u over `n` floats */
static void silu_mul(float *g, const float *u, i64 n) {
    i64 i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f a = *(v16fu *)(g + i);
        *(v16fu *)(g + i) = a / (1.0f + vexp((v16f){0} - a)) * *(const v16fu *)(u + i);
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void rms_norm(const float *x, const float *w, i64 n, float eps, float *out) {
    float ss = 0.0f;
    for (i64 i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i64 i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Rotate `heads` heads of `d` at `x` by position `p`'s angles (the half-rotation layout). */
static void rope(float *x, i64 heads, i64 d, const float *cos, const float *sin_half) {
    const i64 half = d / 2;
    for (i64 h = 0; h < heads; h++) {
        float *a = x + h * d, *b = a + half;
        for (i64 i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * cos[i] - x2 * sin_half[i];
            b[i] = x2 * cos[half + i] + x1 * sin_half[i];
        }
    }
}

static int product(const layer_t *L, const lin_t *w, const float *x, i64 m, i64 ldx, float *y, i64 ldy,
                   int accumulate, int threads) {
    if (w->kind == 32 || w->kind == 16)
        return ((f_fn)L->fm)(x, m, ldx, w->k, w->q, w->kind == 16, w->n, y, ldy, accumulate, threads, 0);
    if (w->kind == 4)
        return ((q4_fn)L->q4)(x, m, ldx, w->k, w->q, w->scale, w->mins, w->n, w->group, y, ldy, accumulate, threads,
                              w->int8_activations, w->prefetch_rows);
    return ((q8_fn)L->q8)(x, m, ldx, w->k, w->q, w->scale, w->n, y, ldy, accumulate, threads, w->prefetch_rows);
}

/* The layer over `n` rows of `x` [n, hidden] (updated in place) at positions `pos` (ascending), with
 * `ws` scratch of `fd_scratch_floats` floats for n rows; the layer's keys and values at `kbase` /
 * `vbase`, `head_stride` floats a K/V head, rows of D; `density` as attention's (or NULL). Returns 0,
 * 1 when a product refused its arguments, 2 when attention could not allocate its scratch, -1 for a
 * row count out of range. */
int fd_layer(const layer_t *L, float *ws, float *x, i64 n, const i64 *pos, float *kbase, float *vbase,
             i64 head_stride, float *density, int threads) {
    if (n < 1 || n > MAX_ROWS) return -1;
    const i64 hid = L->hidden, d = L->d, hq = L->hq, hkv = L->hkv, inter = L->inter;
    const i64 qkvw = (hq + 2 * hkv) * d, aw = hq * d;
    float *h = ws, *qkv = h + n * hid, *att = qkv + n * qkvw, *gu = att + n * aw;
    for (i64 r = 0; r < n; r++) rms_norm(x + r * hid, L->attn_norm, hid, L->eps, h + r * hid);
    if (product(L, &L->qkv, h, n, hid, qkv, qkvw, 0, threads)) return 1;
    for (i64 r = 0; r < n; r++) {
        float *row = qkv + r * qkvw;
        const i64 p = pos[r];
        rope(row, hq + hkv, d, L->cos + p * d, L->sin_half + p * (d / 2));
        for (i64 g = 0; g < hkv; g++) {
            memcpy(kbase + g * head_stride + p * d, row + (hq + g) * d, (size_t)d * sizeof(float));
            memcpy(vbase + g * head_stride + p * d, row + (hq + hkv + g) * d, (size_t)d * sizeof(float));
        }
    }
    if (((attn_fn)L->attn)(qkv, qkvw, pos, n, kbase, head_stride, vbase, head_stride, hkv, hq / hkv, d, L->attn_scale,
                           att, aw, density, threads))
        return 2;
    if (product(L, &L->o, att, n, aw, x, hid, 1, threads)) return 1;
    for (i64 r = 0; r < n; r++) rms_norm(x + r * hid, L->mlp_norm, hid, L->eps, h + r * hid);
    if (product(L, &L->gate_up, h, n, hid, gu, 2 * inter, 0, threads)) return 1;
    for (i64 r = 0; r < n; r++) {
        float *g = gu + r * 2 * inter;
        silu_mul(g, g + inter, inter);
    }
    if (product(L, &L->down, gu, n, 2 * inter, x, hid, 1, threads)) return 1;
    return 0;
}
