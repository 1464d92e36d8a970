/* Channel-wise asymmetric quantization of KV chunks: the hot loops of storage/codecs.py's q8/q4/q2
 * levels, one pass each over a chunk, compiled at first use by storage/native.py.
 *
 * The arithmetic is the numpy reference's, operation for operation, so the bytes and values are
 * identical (tested): min/max as numpy's minimum/maximum (`a < b ? a : b`, first operand kept on
 * ties and NaN), quantizing as `(x * inv) + bias` rounded after each operation (built with
 * -ffp-contract=off: no fused multiply-add), truncation to an integer, and de-quantizing as
 * `(q * s) + z`. Parameters (z, s) are computed by the caller from the min/max; this file knows only
 * float32 K/V and the record layout:
 *
 *   record of one layer = [z | s] (C values each, fp16 or fp32) + packed values,
 *   values token-major [T, C], C = 2 * H * D channels ordered (K/V, head, d);
 *   bits < 8: the T*C values split into g = 8/bits parts of T/g tokens, byte = OR_k part_k << k*bits.
 *
 * K/V arrays are [L, 2, H, T, D] float32 with any element strides except a contiguous D.
 * No allocation larger than a layer's parameters, no threads, no globals: callers run chunks on as
 * many threads as they like (ctypes releases the GIL).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;

/* IEEE half -> float, exact (normals, subnormals, inf, nan). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Read one layer's C zero points and C scales (fp16 or fp32) as float32. */
static void read_params(const uint8_t *rec, i64 c, int f32params, float *z, float *s) {
    if (f32params) {
        memcpy(z, rec, (size_t)c * 4);
        memcpy(s, rec + c * 4, (size_t)c * 4);
        return;
    }
#ifdef __F16C__ /* eight at a time (vcvtph2ps, the same floats): the scalar loop below took
                 * 20-30% of a de-quantize whose output stays in cache */
    if (c % 8 == 0) {
        for (i64 k = 0; k < 2; k++) {
            float *dst = k ? s : z;
            for (i64 i = 0; i < c; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 2 * (k * c + i)))));
        }
        return;
    }
#endif
#ifdef __FLT16_MAX__ /* the compiler's half type: vector conversions (F16C, NEON) */
    _Float16 hz[2048];
    if (c <= 2048) {
        for (i64 k = 0; k < 2; k++) {
            memcpy(hz, rec + k * c * 2, (size_t)c * 2);
            float *dst = k ? s : z;
            for (i64 i = 0; i < c; i++) dst[i] = (float)hz[i];
        }
        return;
    }
#endif
    for (i64 i = 0; i < c; i++) {
        uint16_t hz, hs;
        memcpy(&hz, rec + 2 * i, 2);
        memcpy(&hs, rec + 2 * (c + i), 2);
        z[i] = half_to_float(hz);
        s[i] = half_to_float(hs);
    }
}

/* Per-channel min and max over the T tokens of each layer: mn, mx [L, C]. Returns 1 if any value
 * is NaN (the caller then takes the reference path, which reports it), else 0. */
int kvq_minmax(const float *x, i64 nl, i64 h, i64 t, i64 d,
               i64 s_l, i64 s_kv, i64 s_h, i64 s_t, float *mn, float *mx) {
    int nan = 0;
    for (i64 l = 0; l < nl; l++) {
        for (i64 kv = 0; kv < 2; kv++) {
            for (i64 hh = 0; hh < h; hh++) {
                const float *src = x + l * s_l + kv * s_kv + hh * s_h;
                float *lo = mn + (l * 2 * h + kv * h + hh) * d;
                float *hi = mx + (l * 2 * h + kv * h + hh) * d;
                memcpy(lo, src, (size_t)d * 4);
                memcpy(hi, src, (size_t)d * 4);
                for (i64 tt = 0; tt < t; tt++) {
                    const float *row = src + tt * s_t;
                    int bad = 0;
                    for (i64 i = 0; i < d; i++) {
                        float v = row[i];
                        lo[i] = lo[i] < v ? lo[i] : v;
                        hi[i] = hi[i] > v ? hi[i] : v;
                        bad |= v != v;
                    }
                    nan |= bad;
                }
            }
        }
    }
    return nan;
}

/* Quantize and pack: out [L, rec] records whose first p_nbytes (the parameters, written by the
 * caller) are left alone; inv and bias [L, C] are 1/s and 1/2 - z/s as the reference computes them. */
void kvq_quantize(const float *x, i64 nl, i64 h, i64 t, i64 d,
                  i64 s_l, i64 s_kv, i64 s_h, i64 s_t,
                  const float *inv, const float *bias, int bits,
                  uint8_t *out, i64 rec, i64 p_nbytes) {
    const i64 c = 2 * h * d;
    const i64 g = 8 / bits;
    const i64 tg = t / g; /* tokens per part; the caller checks t % g == 0 */
    for (i64 l = 0; l < nl; l++) {
        uint8_t *dst = out + l * rec + p_nbytes;
        for (i64 kv = 0; kv < 2; kv++) {
            for (i64 hh = 0; hh < h; hh++) {
                const i64 ch = (kv * h + hh) * d;
                const float *src = x + l * s_l + kv * s_kv + hh * s_h;
                const float *iv = inv + l * c + ch;
                const float *bs = bias + l * c + ch;
                for (i64 tb = 0; tb < tg; tb++) {
                    uint8_t *o = dst + tb * c + ch;
                    for (i64 k = 0; k < g; k++) {
                        const float *row = src + (k * tg + tb) * s_t;
                        const int shift = (int)(k * bits);
                        if (k == 0) {
                            for (i64 i = 0; i < d; i++) {
                                float y = row[i] * iv[i];
                                y = y + bs[i];
                                o[i] = (uint8_t)(int32_t)y;
                            }
                        } else {
                            for (i64 i = 0; i < d; i++) {
                                float y = row[i] * iv[i];
                                y = y + bs[i];
                                o[i] |= (uint8_t)((uint32_t)(int32_t)y << shift);
                            }
                        }
                    }
                }
            }
        }
    }
}

#ifdef __FLT16_MAX__
/* The whole encode of one chunk with fp16 parameters, layer by layer while the layer is in cache:
 * min/max, the parameters exactly as the reference's `_Quant.params` computes them (directed fp16
 * rounding by a margin, each float32 operation rounded), then quantize and pack. Returns 0, or 1
 * without a complete result when the chunk needs the reference path: a NaN, a magnitude of 65000
 * or more (float32 parameters), or more than 2048 channels. */
int kvq_encode_f16(const float *x, i64 nl, i64 h, i64 t, i64 d, i64 s_l, i64 s_kv, i64 s_h, i64 s_t,
                   int bits, uint8_t *out, i64 rec) {
    const i64 c = 2 * h * d;
    if (c > 2048) return 1;
    const float qscale = (float)((1.0 + 0x1p-10) / (double)((1 << bits) - 1));
    float mn[2048], mx[2048], inv[2048], bias[2048];
    _Float16 hp[2048];
    for (i64 l = 0; l < nl; l++) {
        const float *xl = x + l * s_l;
        if (kvq_minmax(xl, 1, h, t, d, s_l, s_kv, s_h, s_t, mn, mx)) return 1;
        int big = 0;
        for (i64 i = 0; i < c; i++) {
            float a = -mn[i];
            a = a > mx[i] ? a : mx[i];
            big |= !(a < 65000.0f);
            float m = a * 0x1p-10f;
            m = m + 0x1p-24f;
            hp[i] = (_Float16)(mn[i] - m);
            mn[i] = (float)hp[i]; /* z, exactly as stored */
        }
        if (big) return 1;
        uint8_t *r = out + l * rec;
        memcpy(r, hp, (size_t)c * 2);
        for (i64 i = 0; i < c; i++) {
            float sc = mx[i] - mn[i];
            sc = sc * qscale;
            sc = sc + 0x1p-24f;
            hp[i] = (_Float16)sc;
            sc = (float)hp[i];
            inv[i] = 1.0f / sc;
            float b = mn[i] * inv[i];
            bias[i] = 0.5f - b;
        }
        memcpy(r + c * 2, hp, (size_t)c * 2);
        kvq_quantize(xl, 1, h, t, d, s_l, s_kv, s_h, s_t, inv, bias, bits, r, rec, 4 * c);
    }
    return 0;
}
#endif

/* One output row of D values, (q * s) + z as the scalar loop computes it (a separate multiply and add,
 * exact int -> float), written with non-temporal stores: past the caches, without first reading the
 * destination lines in (NT_W floats a store; `o` aligned to NT_W floats, d a multiple of NT_W). */
#if defined(__AVX512F__)
#define NT_W 16
static inline void nt_row(float *o, const uint8_t *src, int shift, uint32_t mask, const float *sc,
                          const float *zc, i64 d) {
    const __m512i m = _mm512_set1_epi32((int)mask);
    const __m128i sh = _mm_cvtsi32_si128(shift);
    for (i64 i = 0; i < d; i += 16) {
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        w = _mm512_and_si512(_mm512_srl_epi32(w, sh), m);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(w), _mm512_loadu_ps(sc + i));
        _mm512_stream_ps(o + i, _mm512_add_ps(v, _mm512_loadu_ps(zc + i)));
    }
}
#elif defined(__AVX2__)
#define NT_W 8
static inline void nt_row(float *o, const uint8_t *src, int shift, uint32_t mask, const float *sc,
                          const float *zc, i64 d) {
    const __m256i m = _mm256_set1_epi32((int)mask);
    const __m128i sh = _mm_cvtsi32_si128(shift);
    for (i64 i = 0; i < d; i += 8) {
        __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        w = _mm256_and_si256(_mm256_srl_epi32(w, sh), m);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_loadu_ps(sc + i));
        _mm256_stream_ps(o + i, _mm256_add_ps(v, _mm256_loadu_ps(zc + i)));
    }
}
#endif

/* De-quantize records [L, rec] (parameters first, fp16 or fp32) into out [L, 2, H, T, D] float32:
 * out = (q * s) + z. With `stream` (and AVX2 or AVX-512, out and its strides aligned to a vector)
 * the values are written with non-temporal stores: the same values, for an output much larger than
 * the caches (a whole context into the working set), where it halves the memory traffic.
 * Returns 0, or -1 if a layer's parameters do not fit in memory. */
int kvq_dequantize(const uint8_t *payload, i64 rec, i64 nl, i64 h, i64 t, i64 d, int bits, int f32params,
                   float *out, i64 s_l, i64 s_kv, i64 s_h, i64 s_t, int stream) {
    const i64 c = 2 * h * d;
    const i64 g = 8 / bits;
    const i64 tg = t / g;
    const i64 p_nbytes = 2 * c * (f32params ? 4 : 2);
    const uint32_t mask = (1u << bits) - 1u;
#ifdef NT_W
    const int nt = stream && d % NT_W == 0 && (uintptr_t)out % (NT_W * sizeof(float)) == 0 &&
                   s_l % NT_W == 0 && s_kv % NT_W == 0 && s_h % NT_W == 0 && s_t % NT_W == 0;
#else
    (void)stream;
#endif
    float stack[2 * 2048];
    float *z = 2 * c <= 2 * 2048 ? stack : malloc((size_t)(2 * c) * sizeof(float));
    if (z == NULL) return -1;
    float *s = z + c;
    for (i64 l = 0; l < nl; l++) {
        const uint8_t *r = payload + l * rec;
        read_params(r, c, f32params, z, s);
        const uint8_t *packed = r + p_nbytes;
        for (i64 kv = 0; kv < 2; kv++) {
            for (i64 hh = 0; hh < h; hh++) {
                const i64 ch = (kv * h + hh) * d;
                const float *zc = z + ch, *sc = s + ch;
                float *dst = out + l * s_l + kv * s_kv + hh * s_h;
                for (i64 tt = 0; tt < t; tt++) {
                    const uint8_t *src = packed + (tt % tg) * c + ch;
                    const int shift = (int)((tt / tg) * bits);
                    float *o = dst + tt * s_t;
#ifdef NT_W
                    if (nt) {
                        nt_row(o, src, shift, mask, sc, zc, d);
                        continue;
                    }
#endif
                    if (bits == 8) {
                        for (i64 i = 0; i < d; i++) {
                            float v = (float)src[i] * sc[i];
                            o[i] = v + zc[i];
                        }
                    } else {
                        for (i64 i = 0; i < d; i++) {
                            float v = (float)((src[i] >> shift) & mask) * sc[i];
                            o[i] = v + zc[i];
                        }
                    }
                }
            }
        }
    }
#ifdef NT_W
    if (nt) _mm_sfence(); /* the non-temporal stores are visible before the caller hands `out` on */
#endif
    if (z != stack) free(z);
    return 0;
}
