/* Causal grouped-query attention with its two products, S = Q K^T and O = P V, in bfloat16 with float32
 * accumulation: `attn_forward` of engine/attention.c (same arguments, same work items, same column sums
 * of the probabilities). The softmax, the column sums (the information density) and the 1/sum scaling
 * stay float32; queries (scaled first), keys, values and the probabilities are rounded to bfloat16 as
 * they enter a product. For models whose weight products of many rows already run in bfloat16 (the
 * `bf16` weight format; int4 and int8 under `EngineConfig.quantized_prefill_bf16`): engine/model.py
 * picks it for prefill and recompute; decode stays on attn_rows.
 *
 * Two ways to multiply, the same packed operands and the same results up to float32 summation order:
 * - AMX tiles (Intel, Sapphire Rapids on): every tile is 16 rows of 64 bytes. S: a row tile of 16 query
 *   rows (bfloat16 [16, 32] per 32 dimensions) against four tiles of 16 keys, into four float32
 *   [16, 16] results. O: a row tile of probabilities (bfloat16 [16, 32] per 32 keys) against four tiles
 *   of values, into four [16, 16] results.
 * - AVX-512 BF16 dot products (VDPBF16PS: AMD Zen 4 on, Intel Cooper Lake on) where the tiles are
 *   absent: one 32-bit word of a row (two bfloat16) broadcast against one packed tile row (that pair
 *   for 16 keys or 16 columns), four rows by four key or column tiles in sixteen accumulators.
 * Packing: keys so that a tile's row p holds dimensions 2p and 2p+1 of each of its 16 keys (the pair
 * layout both instructions read); values so that row p holds keys 2p and 2p+1 of 16 columns.
 *
 * Without AVX-512 BF16 in the compiler's target (-march=native on another CPU) or without OpenMP (each
 * thread of the team loads the tile configuration), `attn_bf16_init` answers 0 and nothing else may be
 * called. Needs D % 64 == 0. It does not know what a model or a cache is.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(_OPENMP)
#define HAVE_BF16 1
#include <immintrin.h>
#include <omp.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#ifdef HAVE_BF16

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TR 16 /* rows of a tile */
#define TK 32 /* keys (or bfloat16 dimensions) a tile's rows span */

typedef uint16_t bf16;

static int use_tiles; /* attn_bf16_init's choice: 1 AMX tiles, 0 dot products */

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

static void configure_tiles(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = TR;
    }
    _tile_loadconfig(&cfg);
}
#endif

/* 32 floats (two vectors) -> 32 bfloat16 in order, rounded to nearest even */
static inline __m512i bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

/* 16 floats -> 16 bfloat16 in the low halves of 32-bit lanes */
static inline __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

/* exp(x) for x <= 0 as 2^t, t = x log2(e): 2^frac(t) by its Taylor polynomial of degree 5 (relative
 * error below 3e-6 on [-1/2, 1/2], far under the bfloat16 rounding the probabilities then take), 2^n
 * by scalef; inputs below -87 give ~1e-38 instead of subnormals. */
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558146e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* One row of scores: row[0:len] -> exp(row - max) (float32, in place); then in one pass the
 * probabilities p = exp / sum: colsum[0:len] += p when colsum is given, and p as bfloat16 into
 * prow[0:cols] with zeros from len on. */
static void softmax_row(float *row, bf16 *prow, i64 len, i64 cols, float *colsum) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (i64 j = 0; j < len; j += 16) {
        __mmask16 k = len - j >= 16 ? 0xffff : (__mmask16)((1u << (len - j)) - 1);
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, row + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (i64 j = 0; j < len; j += 16) {
        __mmask16 k = len - j >= 16 ? 0xffff : (__mmask16)((1u << (len - j)) - 1);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), m)));
        _mm512_mask_storeu_ps(row + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(len > 0 ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f);
    for (i64 j = 0; j < cols; j += 16) { /* cols is a multiple of 64 */
        __mmask16 k = j >= len ? 0 : len - j >= 16 ? 0xffff : (__mmask16)((1u << (len - j)) - 1);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, row + j), inv);
        if (colsum != NULL && k) _mm512_mask_storeu_ps(colsum + j, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, colsum + j), p));
        _mm256_storeu_si256((__m256i *)(prow + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
}

typedef struct {
    const float *q;  /* [n, Hq * D] query rows (row stride q_stride) */
    i64 q_stride;
    const i64 *pos;  /* [n] ascending positions; row i sees keys 0..pos[i] */
    i64 n;
    const bf16 *kp;  /* keys packed: [Hkv][S_pad / 16][D / 32] tiles of [16 pairs][16 keys][2] */
    const bf16 *vp;  /* values packed: [Hkv][S_pad / 32][D / 16] tiles of [16 pairs][16 columns][2] */
    i64 s_pad;       /* keys rounded up to 64 */
    i64 hkv, group, d, block;
    float scale;
    float *out;      /* [n, Hq * D] */
    i64 out_stride;
} job_t;

#ifdef HAVE_AMX
/* S, softmax and O of a work item's rows (qb: [mp, D], rows past m zero) on the tiles. */
static void tile_products(const bf16 *qb, bf16 *pb, float *s, float *acc, const bf16 *kh, const bf16 *vh,
                          const i64 *pos, i64 m, i64 g, i64 d, i64 sp, float *colsum) {
    const i64 mp = (m + TR - 1) / TR * TR, dk = d / TK, dc = d / 16;
    /* four independent accumulators per product (tiles 0-3), so a tile's multiply-adds do not wait for
     * the one before; the row tile (4), and the key or value tiles (5, 6) alternating */
    for (i64 rt = 0; rt < mp; rt += TR) {
        const i64 last = rt + TR - 1 < m ? rt + TR - 1 : m - 1;
        const i64 cols = (pos[last / g] + 1 + 63) / 64 * 64; /* keys this row tile sees, whole tiles */
        for (i64 c = 0; c < cols; c += 64) { /* S: four key tiles at a time */
            const bf16 *kc = kh + (c / 16) * dk * TR * 32;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (i64 t = 0; t < dk; t++) {
                _tile_loadd(4, qb + rt * d + t * TK, d * sizeof(bf16));
                _tile_loadd(5, kc + t * TR * 32, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, kc + (dk + t) * TR * 32, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, kc + (2 * dk + t) * TR * 32, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, kc + (3 * dk + t) * TR * 32, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
            float *sc = s + rt * sp + c;
            _tile_stored(0, sc, sp * sizeof(float));
            _tile_stored(1, sc + 16, sp * sizeof(float));
            _tile_stored(2, sc + 32, sp * sizeof(float));
            _tile_stored(3, sc + 48, sp * sizeof(float));
        }
        for (i64 r = rt; r < rt + TR; r++) /* softmax, column sums, probabilities in bfloat16 */
            softmax_row(s + r * sp, pb + r * sp, r < m ? pos[r / g] + 1 : 0, cols, r < m ? colsum : NULL);
        for (i64 c = 0; c < dc; c += 4) { /* O: four column tiles (64 columns) at a time */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (i64 k = 0; k < cols; k += TK) {
                const bf16 *vc = vh + ((k / TK) * dc + c) * TR * 32;
                _tile_loadd(4, pb + rt * sp + k, sp * sizeof(bf16));
                _tile_loadd(5, vc, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vc + TR * 32, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, vc + 2 * TR * 32, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, vc + 3 * TR * 32, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
            float *ac = acc + rt * d + c * 16;
            _tile_stored(0, ac, d * sizeof(float));
            _tile_stored(1, ac + 16, d * sizeof(float));
            _tile_stored(2, ac + 32, d * sizeof(float));
            _tile_stored(3, ac + 48, d * sizeof(float));
        }
    }
}
#endif

/* The same with AVX-512 BF16 dot products, RB rows at a time: each row's 32-bit words (two bfloat16)
 * broadcast against packed tile rows, four key tiles (64 keys) or four column tiles (64 columns) a
 * pass, so each pass keeps RB x 4 accumulators in registers. A group of rows sees the keys up to its
 * own last row's (causal), in whole 64s. */
#define RB 4
static void dot_products(const bf16 *qb, bf16 *pb, float *s, float *acc, const bf16 *kh, const bf16 *vh,
                         const i64 *pos, i64 m, i64 g, i64 d, i64 sp, float *colsum) {
    const i64 words = d / 2, dc = d / 16;
    const int32_t *kw = (const int32_t *)kh, *vw = (const int32_t *)vh;
    for (i64 r = 0; r < m; r += RB) { /* rows r .. r+RB-1 < mp: past m they are zero */
        const i64 last = r + RB - 1 < m ? r + RB - 1 : m - 1;
        const i64 cols = (pos[last / g] + 1 + 63) / 64 * 64;
        const int32_t *q = (const int32_t *)(qb + r * d);
        for (i64 c = 0; c < cols; c += 64) { /* S: a key tile is [D/2 words][16 keys] */
            const int32_t *kt = kw + (c / 16) * words * 16;
            __m512 a[RB][4];
            for (int i = 0; i < RB; i++)
                for (int t = 0; t < 4; t++) a[i][t] = _mm512_setzero_ps();
            for (i64 w = 0; w < words; w++) {
                __m512bh k[4];
                for (int t = 0; t < 4; t++) k[t] = (__m512bh)_mm512_loadu_si512(kt + (t * words + w) * 16);
                for (int i = 0; i < RB; i++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(q[i * words + w]);
                    for (int t = 0; t < 4; t++) a[i][t] = _mm512_dpbf16_ps(a[i][t], x, k[t]);
                }
            }
            for (int i = 0; i < RB; i++)
                for (int t = 0; t < 4; t++) _mm512_storeu_ps(s + (r + i) * sp + c + 16 * t, a[i][t]);
        }
        for (i64 i = r; i < r + RB; i++) /* softmax, column sums, probabilities in bfloat16 */
            softmax_row(s + i * sp, pb + i * sp, i < m ? pos[i / g] + 1 : 0, cols, i < m ? colsum : NULL);
        for (i64 ct = 0; ct < dc; ct += 4) { /* O: a value tile is [16 key pairs][16 columns], per 32 keys */
            __m512 o[RB][4];
            for (int i = 0; i < RB; i++)
                for (int t = 0; t < 4; t++) o[i][t] = _mm512_setzero_ps();
            for (i64 kc = 0; kc < cols / TK; kc++) {
                const int32_t *vt = vw + (kc * dc + ct) * TR * 16;
                for (i64 pr = 0; pr < TR; pr++) {
                    __m512bh v[4];
                    for (int t = 0; t < 4; t++) v[t] = (__m512bh)_mm512_loadu_si512(vt + (t * TR + pr) * 16);
                    for (int i = 0; i < RB; i++) {
                        const __m512bh x = (__m512bh)_mm512_set1_epi32(((const int32_t *)(pb + (r + i) * sp))[kc * TR + pr]);
                        for (int t = 0; t < 4; t++) o[i][t] = _mm512_dpbf16_ps(o[i][t], x, v[t]);
                    }
                }
            }
            for (int i = 0; i < RB; i++)
                for (int t = 0; t < 4; t++) _mm512_storeu_ps(acc + (r + i) * d + (ct + t) * 16, o[i][t]);
        }
    }
}

/* one item: KV head h, block of query rows (the dearest blocks, the last rows, first) */
static void run_item(const job_t *jb, char *scratch, float *colsum, i64 item) {
    const i64 d = jb->d, g = jb->group, sp = jb->s_pad;
    const i64 blocks = (jb->n + jb->block - 1) / jb->block;
    const i64 h = item % jb->hkv;
    const i64 r0 = (blocks - 1 - item / jb->hkv) * jb->block;
    const i64 b = jb->n - r0 < jb->block ? jb->n - r0 : jb->block;
    const i64 m = b * g, mp = (m + TR - 1) / TR * TR;
    bf16 *qb = (bf16 *)scratch;            /* [mp, D] */
    bf16 *pb = qb + mp * d;                /* [mp, S_pad] probabilities */
    float *s = (float *)(pb + mp * sp);    /* [mp, S_pad] scores */
    float *acc = s + mp * sp;              /* [mp, D] */
    const i64 *pos = jb->pos + r0;
    const __m512 scale = _mm512_set1_ps(jb->scale);
    for (i64 r = 0; r < mp; r++) {         /* the block's rows of the group's heads, scaled; zero padding */
        bf16 *dst = qb + r * d;
        if (r >= m) {
            memset(dst, 0, (size_t)d * sizeof(bf16));
            continue;
        }
        const float *src = jb->q + (r0 + r / g) * jb->q_stride + (h * g + r % g) * d;
        for (i64 c = 0; c < d; c += 32)
            _mm512_storeu_si512(dst + c, bf16x32(_mm512_mul_ps(_mm512_loadu_ps(src + c), scale),
                                                 _mm512_mul_ps(_mm512_loadu_ps(src + c + 16), scale)));
    }
    const bf16 *kh = jb->kp + h * (sp / 16) * d * 16, *vh = jb->vp + h * (sp / TK) * d * 32;
#ifdef HAVE_AMX
    if (use_tiles) {
        tile_products(qb, pb, s, acc, kh, vh, pos, m, g, d, sp, colsum);
    } else
#endif
        dot_products(qb, pb, s, acc, kh, vh, pos, m, g, d, sp, colsum);
    for (i64 r = 0; r < m; r++)
        memcpy(jb->out + (r0 + r / g) * jb->out_stride + (h * g + r % g) * d, acc + r * d, (size_t)d * sizeof(float));
}

/* Keys t*16 .. t*16+15 of head h, all dimensions, into their D/32 packed tiles (zeros past s). A key's
 * 32 dimensions of a tile are 16 pairs (32-bit words), one per tile row: word p of key jj goes to
 * word p*16 + jj of the tile. */
static void pack_keys(bf16 *kp, const float *k, i64 k_head, i64 d, i64 s, i64 sp, i64 h, i64 t) {
    int32_t *dst = (int32_t *)(kp + (h * (sp / 16) + t) * (d / TK) * TR * 32);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (i64 jj = 0; jj < 16; jj++) {
        const i64 j = t * 16 + jj;
        const float *src = k + h * k_head + j * d;
        for (i64 c = 0; c < d; c += TK) {
            __m512i w = j < s ? bf16x32(_mm512_loadu_ps(src + c), _mm512_loadu_ps(src + c + 16)) : _mm512_setzero_si512();
            _mm512_i32scatter_epi32(dst + (c / TK) * TR * 16 + jj, rows, w, 4);
        }
    }
}

/* Values of keys t*32 .. t*32+31 of head h into their D/16 packed tiles (zeros past s): tile row p is,
 * for each of 16 columns, the 32-bit word (key 2p, key 2p+1). */
static void pack_values(bf16 *vp, const float *v, i64 v_head, i64 d, i64 s, i64 sp, i64 h, i64 t) {
    int32_t *dst = (int32_t *)(vp + (h * (sp / TK) + t) * (d / 16) * TR * 32);
    for (i64 p = 0; p < TR; p++) {
        const i64 j = t * TK + 2 * p;
        const float *a = v + h * v_head + j * d, *b = a + d;
        for (i64 c = 0; c < d; c += 16) {
            __m512i lo = j < s ? bf16_lanes(_mm512_loadu_ps(a + c)) : _mm512_setzero_si512();
            __m512i hi = j + 1 < s ? bf16_lanes(_mm512_loadu_ps(b + c)) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (c / 16) * TR * 16 + p * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

#endif /* HAVE_BF16 */

/* Chooses how attn_forward_bf16 multiplies and says what it got: 2, AMX tiles (asked for with
 * `tiles` != 0, this build has the tile instructions and Linux granted the process the tile state,
 * which it refuses to a process that has not asked); 1, AVX-512 BF16 dot products; 0, neither in this
 * build: do not call attn_forward_bf16. Call it before attn_forward_bf16, not while one runs. */
int attn_bf16_init(int tiles) {
#ifdef HAVE_BF16
#ifdef HAVE_AMX
    use_tiles = tiles && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    (void)tiles;
    use_tiles = 0;
#endif
    return use_tiles ? 2 : 1;
#else
    (void)tiles;
    return 0;
#endif
}

/* Arguments as engine/attention.c's attn_forward. Returns 0, -1 when memory for the scratch cannot be
 * had, -2 when this build has no AVX-512 BF16 or D is not a multiple of 64. */
int attn_forward_bf16(const float *q, i64 q_stride, const i64 *pos, i64 n, const float *k, i64 k_head,
                      const float *v, i64 v_head, i64 hkv, i64 group, i64 d, float scale, float *out,
                      i64 out_stride, float *density, int threads) {
#ifdef HAVE_BF16
    if (n <= 0) return 0;
    if (d % 64 != 0) return -2;
    const i64 s = pos[n - 1] + 1, sp = (s + 63) / 64 * 64;
    const i64 block = 48 / group > 0 ? 48 / group : 1; /* M = block * group: ~48 rows, three row tiles */
    const i64 mp = (block * group + TR - 1) / TR * TR;
    const i64 items = (n + block - 1) / block * hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int)items;
    bf16 *kp = aligned_alloc(64, (size_t)(hkv * sp * d) * sizeof(bf16) + 64);
    bf16 *vp = aligned_alloc(64, (size_t)(hkv * sp * d) * sizeof(bf16) + 64);
    float *colsum = density ? calloc((size_t)(threads * sp), sizeof(float)) : NULL;
    const size_t per = ((size_t)(mp * d + mp * sp) * sizeof(bf16) + (size_t)(mp * sp + mp * d) * sizeof(float)
                        + 127) / 64 * 64;
    char *scratch = aligned_alloc(64, per * (size_t)threads);
    if (kp == NULL || vp == NULL || scratch == NULL || (density && colsum == NULL)) {
        free(kp);
        free(vp);
        free(colsum);
        free(scratch);
        return -1;
    }
    job_t jb = {q, q_stride, pos, n, kp, vp, sp, hkv, group, d, block, scale, out, out_stride};
    const i64 key_tiles = hkv * (sp / 16), value_tiles = hkv * (sp / TK);
    i64 next = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (i64 t = 0; t < key_tiles; t++) pack_keys(kp, k, k_head, d, s, sp, t / (sp / 16), t % (sp / 16));
#pragma omp for schedule(static)
        for (i64 t = 0; t < value_tiles; t++) pack_values(vp, v, v_head, d, s, sp, t / (sp / TK), t % (sp / TK));
        const int id = omp_get_thread_num();
        float *cs = colsum ? colsum + (size_t)id * sp : NULL;
#ifdef HAVE_AMX
        if (use_tiles) configure_tiles();
#endif
        for (;;) {
            i64 item;
#pragma omp atomic capture
            item = next++;
            if (item >= items) break;
            run_item(&jb, scratch + per * (size_t)id, cs, item);
        }
#ifdef HAVE_AMX
        if (use_tiles) _tile_release();
#endif
    }
    if (density) {
        for (int t = 0; t < threads; t++) {
            const float *cs = colsum + (size_t)t * sp;
            for (i64 j = 0; j < s; j++) density[j] += cs[j];
        }
    }
    free(kp);
    free(vp);
    free(colsum);
    free(scratch);
    return 0;
#else
    (void)q, (void)q_stride, (void)pos, (void)n, (void)k, (void)k_head, (void)v, (void)v_head, (void)hkv;
    (void)group, (void)d, (void)scale, (void)out, (void)out_stride, (void)density, (void)threads;
    return -2;
#endif
}
