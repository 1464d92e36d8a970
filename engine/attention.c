/* Causal grouped-query attention with the column sums of its probabilities (LLMS Eq. 1's information
 * density) in one pass per row block: the prefill kernel of engine/model.py, compiled at first use by
 * engine/native.py. float32 only. `attn_rows` (at the end) serves a few rows.
 *
 * Work is split into items (KV head h, block of b query rows). For an item the block's M = b * G query
 * rows (G query heads share a KV head) are scaled and gathered; the scores S = Q K^T of the keys the
 * block can see are computed tile by tile (6 x 16 register tiles against K transposed once per call),
 * each row's softmax is taken in place (keys after the row's position excluded), the normalised
 * probabilities are summed per key into the thread's column sums, and O = P V is computed from the
 * same tile of probabilities while it is in cache (L2 for 48 rows x 2048 keys). Nothing of size
 * n x S is ever held. Threads take items from a shared counter; each keeps its own column sums,
 * added up at the end, so the density is independent of the thread count up to rounding. Built with
 * -fopenmp the threads are the calling thread's OpenMP team (torch's own, see engine/model.py
 * attention_kernel); otherwise POSIX threads are started per call.
 *
 * Vector code uses GCC/Clang vector extensions (8 x float32), which compile to AVX2+FMA with
 * -march=native on x86 and to pairs of NEON registers on arm64; where the compiler targets AVX-512
 * the register tiles use 16 x float32 vectors and 12 rows (faster there, with the same results).
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4))); /* unaligned access */

#ifdef __AVX512F__
#define MR 12 /* rows of a register tile: twelve 16-float accumulators of the 32 registers */
#else
#define MR 6  /* rows of a register tile */
#endif
#define NR 16 /* columns of a register tile: two 8-float vectors, or one 16-float vector */
#define KB 256 /* keys per block of O = P V */

static inline v8f load8(const float *p) { return *(const v8fu *)p; }
static inline void store8(float *p, v8f v) { *(v8fu *)p = v; }
static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v8f vmax(v8f a, v8f b) {
    v8i m = a > b;
    return (v8f)(((v8i)a & m) | ((v8i)b & ~m));
}
static inline float hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = m > v[i] ? m : v[i];
    return m;
}
static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) for x <= 0 (scores minus their row maximum), Cephes' expf polynomial: relative error
 * ~1e-7; inputs below -87 give ~1e-38 instead of subnormals. */
static inline v8f vexp(v8f x) {
    x = vmax(x, splat(-87.0f));
    const v8f magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v8f t = x * splat(1.44269504088896341f) + magic;
    v8f n = t - magic;
    v8f r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    v8i e = ((v8i)t - (v8i)magic + 127) << 23; /* 2^n from the integer in t's low mantissa bits */
    return p * (v8f)e;
}

/* row[0:len] -> exp(row - max(row)) in place; returns their sum */
static float exp_row(float *row, i64 len) {
    const i64 vec = len / 8 * 8;
    v8f mx = splat(-INFINITY);
    for (i64 j = 0; j < vec; j += 8) mx = vmax(mx, load8(row + j));
    float mxs = hmax(mx);
    for (i64 j = vec; j < len; j++) mxs = mxs > row[j] ? mxs : row[j];
    v8f sum = splat(0.0f), msp = splat(mxs);
    for (i64 j = 0; j < vec; j += 8) {
        v8f e = vexp(load8(row + j) - msp);
        store8(row + j, e);
        sum += e;
    }
    float sums = hsum(sum);
    if (vec < len) {
        float tmp[8] = {0};
        for (i64 j = vec; j < len; j++) tmp[j - vec] = row[j] - mxs;
        v8f e = vexp(load8(tmp));
        for (i64 j = vec; j < len; j++) {
            row[j] = e[j - vec];
            sums += e[j - vec];
        }
    }
    return sums;
}

/* colsum[0:len] += row[0:len] * inv */
static void add_scaled(float *colsum, const float *row, i64 len, float inv) {
    const i64 vec = len / 8 * 8;
    v8f iv = splat(inv);
    for (i64 j = 0; j < vec; j += 8) store8(colsum + j, load8(colsum + j) + load8(row + j) * iv);
    for (i64 j = vec; j < len; j++) colsum[j] += row[j] * inv;
}

/* C[m, 0:16] (+)= A[m, 0:k] B[0:k, 0:16] for m < MR rows; A rows `lda` apart, B rows `ldb` apart.
 * Inlined twice by `tile`: with rows == MR known at compile time the accumulators stay in registers. */
#ifdef __AVX512F__
/* With AVX-512 a tile row is one 16-float vector: half the instructions of two 8-float ones, and twice
 * the rows a tile; each element sums the same products in the same order, so the result is the same. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4)));
static inline v16f load16(const float *p) { return *(const v16fu *)p; }
static inline void store16(float *p, v16f v) { *(v16fu *)p = v; }

static inline __attribute__((always_inline)) void tile_body(int rows, i64 k, const float *a, i64 lda,
                                                            const float *b, i64 ldb, float *c, i64 ldc,
                                                            int accumulate) {
    v16f acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = (v16f){0};
    for (i64 p = 0; p < k; p++) {
        v16f b0 = load16(b + p * ldb);
        for (int r = 0; r < rows; r++) acc[r] += a[r * lda + p] * b0;
    }
    for (int r = 0; r < rows; r++) {
        if (accumulate) acc[r] += load16(c + r * ldc);
        store16(c + r * ldc, acc[r]);
    }
}
#else
static inline __attribute__((always_inline)) void tile_body(int rows, i64 k, const float *a, i64 lda,
                                                            const float *b, i64 ldb, float *c, i64 ldc,
                                                            int accumulate) {
    v8f acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = splat(0.0f);
    for (i64 p = 0; p < k; p++) {
        v8f b0 = load8(b + p * ldb), b1 = load8(b + p * ldb + 8);
        for (int r = 0; r < rows; r++) {
            v8f x = splat(a[r * lda + p]);
            acc[r][0] += x * b0;
            acc[r][1] += x * b1;
        }
    }
    for (int r = 0; r < rows; r++) {
        if (accumulate) {
            acc[r][0] += load8(c + r * ldc);
            acc[r][1] += load8(c + r * ldc + 8);
        }
        store8(c + r * ldc, acc[r][0]);
        store8(c + r * ldc + 8, acc[r][1]);
    }
}
#endif

static void tile(int rows, i64 k, const float *a, i64 lda, const float *b, i64 ldb, float *c, i64 ldc,
                 int accumulate) {
    if (rows == MR)
        tile_body(MR, k, a, lda, b, ldb, c, ldc, accumulate);
    else
        tile_body(rows, k, a, lda, b, ldb, c, ldc, accumulate);
}

typedef struct {
    const float *q;     /* [n, Hq * D] query rows (row stride q_stride) */
    i64 q_stride;
    const i64 *pos;     /* [n] ascending positions; row i sees keys 0..pos[i] */
    i64 n;
    const float *kt;    /* [Hkv, D, S_pad] keys transposed (this call's copy) */
    const float *v;     /* [Hkv, *, D] values: row j of head h at v + h * v_head + j * D */
    i64 v_head;
    i64 s_pad;          /* columns of kt per row: S rounded up to NR */
    i64 hkv, group, d, block;
    float scale;
    float *out;         /* [n, Hq * D] */
    i64 out_stride;
    float *colsum;      /* [n_threads, s_pad] per-thread column sums, or NULL */
    atomic_long next;   /* next item to take */
    i64 items;
} job_t;

typedef struct {
    job_t *job;
    int id;
    float *scratch; /* qb [M, D] + acc [M, D] + scores [M, s_pad] + inv [M] */
} worker_t;

static void run_item(job_t *jb, float *scratch, float *colsum, i64 item) {
    const i64 d = jb->d, g = jb->group, sp = jb->s_pad;
    const i64 blocks = (jb->n + jb->block - 1) / jb->block;
    const i64 h = item % jb->hkv;
    const i64 r0 = (blocks - 1 - item / jb->hkv) * jb->block; /* the dearest blocks (last rows) first */
    const i64 b = jb->n - r0 < jb->block ? jb->n - r0 : jb->block;
    const i64 m = b * g;
    float *qb = scratch, *acc = qb + m * d, *s = acc + m * d, *inv = s + m * sp;
    /* gather the block's rows of the group's heads, scaled: row (i, j) = query row r0 + i, head h*g + j */
    for (i64 i = 0; i < b; i++)
        for (i64 j = 0; j < g; j++) {
            const float *src = jb->q + (r0 + i) * jb->q_stride + (h * g + j) * d;
            float *dst = qb + (i * g + j) * d;
            for (i64 c = 0; c < d; c++) dst[c] = src[c] * jb->scale;
        }
    const i64 *pos = jb->pos + r0;
    const i64 last = pos[b - 1] + 1;            /* keys any row of the block sees */
    const i64 cols = (last + NR - 1) / NR * NR; /* rounded to whole tiles */
    const float *kt = jb->kt + h * d * sp;
    /* scores, tile by tile: a [D, 16] panel of keys (4 KB) serves every row tile from L1; a row tile
     * skips the columns past its last row's position */
    for (i64 c = 0; c < cols; c += NR)
        for (i64 r = 0; r < m; r += MR) {
            int rows = m - r < MR ? (int)(m - r) : MR;
            if (c <= pos[(r + rows - 1) / g])
                tile(rows, d, qb + r * d, d, kt + c, sp, s + r * sp + c, sp, 0);
        }
    /* softmax per row in place (unnormalised exp), zeros up to the tile edge; column sums */
    for (i64 r = 0; r < m; r++) {
        float *row = s + r * sp;
        const i64 len = pos[r / g] + 1;
        const float sums = exp_row(row, len);
        for (i64 j = len; j < cols; j++) row[j] = 0.0f;
        inv[r] = 1.0f / sums;
        if (colsum != NULL) add_scaled(colsum, row, len, inv[r]);
    }
    /* O = P V over blocks of KB keys: a [KB, 16] panel of values (16 KB) serves every row tile from L1,
     * the block's probabilities stay in L2; each row is scaled by its 1/sum at the end */
    const float *vh = jb->v + h * jb->v_head;
    for (i64 kb = 0; kb < last; kb += KB)
        for (i64 c = 0; c < d; c += NR)
            for (i64 r = 0; r < m; r += MR) {
                int rows = m - r < MR ? (int)(m - r) : MR;
                i64 len = pos[(r + rows - 1) / g] + 1 - kb;
                if (len <= 0) continue;
                if (len > KB) len = KB;
                tile(rows, len, s + r * sp + kb, sp, vh + kb * d + c, d, acc + r * d + c, d, kb > 0);
            }
    for (i64 row = 0; row < m; row++) {
        const i64 qi = r0 + row / g, head = h * g + row % g;
        float *dst = jb->out + qi * jb->out_stride + head * d;
        v8f iv = splat(inv[row]);
        for (i64 c = 0; c < d; c += 8) store8(dst + c, load8(acc + row * d + c) * iv);
    }
}

/* Keys j0..j0+NR-1 of KV head h into kt, the keys transposed ([D, S_pad] per head); keys at or past s
 * (padding) are zero. The NR source rows (NR * D floats) stay in L1 while D output runs are written. */
static void transpose_panel(float *kt, const float *k, i64 k_head, i64 d, i64 s, i64 sp, i64 h, i64 j0) {
    const float *src = k + h * k_head + j0 * d;
    const i64 live = s - j0 < NR ? s - j0 : NR;
    for (i64 c = 0; c < d; c++) {
        float *dst = kt + (h * d + c) * sp + j0;
        for (i64 j = 0; j < live; j++) dst[j] = src[j * d + c];
        for (i64 j = live; j < NR; j++) dst[j] = 0.0f;
    }
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    job_t *jb = w->job;
    float *colsum = jb->colsum ? jb->colsum + w->id * jb->s_pad : NULL;
    for (;;) {
        i64 item = atomic_fetch_add(&jb->next, 1);
        if (item >= jb->items) break;
        run_item(jb, w->scratch, colsum, item);
    }
    return NULL;
}

/* 1 when this build runs its threads on OpenMP (-fopenmp), 0 when it starts POSIX threads per call. */
int attn_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Attention of n query rows at ascending positions `pos` against keys and values 0..pos[n-1].
 *   q [n, Hq*D] (row stride q_stride), k/v: head h, key j at k + h*k_head + j*D (same for v),
 *   out [n, Hq*D] (row stride out_stride), density [>= pos[n-1]+1]: += column sums of the
 *   probabilities over all rows and heads (NULL: not computed).
 * Needs D % 16 == 0. Returns 0, or -1 when memory for the scratch cannot be had. */
int attn_forward(const float *q, i64 q_stride, const i64 *pos, i64 n, const float *k, i64 k_head,
                 const float *v, i64 v_head, i64 hkv, i64 group, i64 d, float scale, float *out,
                 i64 out_stride, float *density, int threads) {
    if (n <= 0) return 0;
    const i64 s = pos[n - 1] + 1, sp = (s + NR - 1) / NR * NR;
    i64 block = 48 / group > 0 ? 48 / group : 1; /* M = block * group: ~48 rows, 8 register tiles */
    const i64 m = block * group;
    const i64 items = (n + block - 1) / block * hkv;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int)items;
    if (threads > 16) threads = 16;
    float *kt = aligned_alloc(64, (size_t)(hkv * d * sp) * sizeof(float) + 64);
    float *colsum = density ? calloc((size_t)(threads * sp), sizeof(float)) : NULL;
    const size_t per = (size_t)(2 * m * d + m * sp + m) + 16;
    float *scratch = malloc(per * sizeof(float) * (size_t)threads);
    if (kt == NULL || scratch == NULL || (density && colsum == NULL)) {
        free(kt);
        free(colsum);
        free(scratch);
        return -1;
    }
    job_t jb = {q, q_stride, pos, n, kt, v, v_head, sp, hkv, group, d, block, scale, out, out_stride,
                colsum, 0, items};
    atomic_init(&jb.next, 0);
    worker_t ws[16];
    for (int t = 0; t < threads; t++) {
        ws[t] = (worker_t){&jb, t, scratch + per * (size_t)t};
    }
    const i64 panels = hkv * (sp / NR); /* keys transposed NR at a time, per KV head */
#ifdef _OPENMP
    /* the calling thread's OpenMP team (torch's, when torch runs on the same libgomp); a smaller team
     * than asked for (nested call, thread limit) just takes more items per thread */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (i64 p = 0; p < panels; p++) transpose_panel(kt, k, k_head, d, s, sp, p / (sp / NR), p % (sp / NR) * NR);
        worker_main(&ws[omp_get_thread_num()]);
    }
#else
    for (i64 p = 0; p < panels; p++) transpose_panel(kt, k, k_head, d, s, sp, p / (sp / NR), p % (sp / NR) * NR);
    pthread_t tids[16];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, worker_main, &ws[t]) == 0) started |= 1 << t;
    }
    worker_main(&ws[0]); /* this thread works too; items left by a thread that failed to start are taken here */
    for (int t = 1; t < threads; t++)
        if (started & (1 << t)) pthread_join(tids[t], NULL);
#endif
    if (density) {
        for (int t = 0; t < threads; t++) {
            const float *cs = colsum + (size_t)t * sp;
            for (i64 j = 0; j < s; j++) density[j] += cs[j];
        }
    }
    free(kt);
    free(colsum);
    free(scratch);
    return 0;
}

/* ---- few rows (decode, short turns) ------------------------------------------------------------- */

/* Attention of a few query rows without the transposed copy of the keys (which pays off only when
 * many rows share it): one item per (row, query head) computes its scores as dot products with each
 * key row, the softmax, the column sums and P V, in one pass over the keys for the scores and one
 * for the values. Arguments as attn_forward's. With `kv8` set, keys and values are rows of D + 4
 * bytes (engine/kvformat.py: int8 keys or fp8 e4m3 values, then the row's float32 scale), de-quantized
 * as they are read, once for the query heads that share them (`rows_item_kv8`): `k_head`, `v_head`
 * count bytes then. */
typedef struct {
    const float *q;
    i64 q_stride;
    const i64 *pos;
    i64 n;
    const void *k, *v;
    i64 k_head, v_head, hkv, group, d;
    float scale;
    float *out;
    i64 out_stride;
    i64 s_pad;
    int kv8;
} rows_job_t;

typedef int8_t v8b __attribute__((vector_size(8)));
typedef uint8_t v8ub __attribute__((vector_size(8)));

/* 8 int8 keys as floats */
static inline v8f load8_i8(const uint8_t *p) {
    v8b b;
    memcpy(&b, p, 8);
    return __builtin_convertvector(b, v8f);
}

/* 8 fp8 e4m3fn values as floats, exactly (NaN, 0x7f, is never stored). The 7 bits of exponent and
 * mantissa go to a float's exponent and mantissa with the bias moved from 7 to 127; a subnormal (zero
 * exponent field) then reads 2^-7 + m 2^-10 instead of m 2^-9, which the select undoes without
 * producing a float subnormal (which a flush-to-zero mode would lose). */
static inline v8f load8_e4m3(const uint8_t *p) {
    v8ub b;
    memcpy(&b, p, 8);
    const v8i x = __builtin_convertvector(b, v8i);
    const v8i mag = ((x & 0x7f) << 20) + (120 << 23), sign = (x & 0x80) << 24;
    const v8f normal = (v8f)mag;
    const v8f sub = (normal - splat(0x1p-7f)) * splat(2.0f);
    const v8i is_sub = (x & 0x78) == 0;
    return (v8f)((((v8i)sub & is_sub) | ((v8i)normal & ~is_sub)) | sign);
}

static inline float row_scale(const uint8_t *row, i64 d) {
    float s;
    memcpy(&s, row + d, sizeof s);
    return s;
}

/* One item of a kv8 job: row r against KV head h for its `group` query heads, so each key and value
 * row is de-quantized once for all of them, KB rows at a time into `buf` (64 KiB for a 64-wide head,
 * in L2). `scores` holds the group's rows of scores (`s_pad` apart), `qa` the scaled queries and then
 * the outputs' accumulators. */
static void rows_item_kv8(const rows_job_t *jb, float *scores, float *colsum, float *buf, float *qa, i64 item) {
    const i64 d = jb->d, g_n = jb->group, w = d + 4, sp = jb->s_pad;
    const i64 r = item / jb->hkv, h = item % jb->hkv;
    const i64 len = jb->pos[r] + 1;
    const uint8_t *kh = (const uint8_t *)jb->k + h * jb->k_head, *vh = (const uint8_t *)jb->v + h * jb->v_head;
    for (i64 g = 0; g < g_n; g++) {
        const float *qr = jb->q + r * jb->q_stride + (h * g_n + g) * d;
        for (i64 c = 0; c < d; c++) qa[g * d + c] = qr[c] * jb->scale; /* the query scaled first */
    }
    for (i64 j0 = 0; j0 < len; j0 += KB) {
        const i64 nb = len - j0 < KB ? len - j0 : KB;
        for (i64 j = 0; j < nb; j++) {
            const uint8_t *kj = kh + (j0 + j) * w;
            const v8f sc = splat(row_scale(kj, d));
            for (i64 c = 0; c < d; c += 8) store8(buf + j * d + c, load8_i8(kj + c) * sc);
        }
        for (i64 g = 0; g < g_n; g++) {
            const float *qs = qa + g * d;
            float *sg = scores + g * sp + j0;
            for (i64 j = 0; j < nb; j++) {
                v8f a = splat(0.0f);
                for (i64 c = 0; c < d; c += 8) a += load8(qs + c) * load8(buf + j * d + c);
                sg[j] = hsum(a);
            }
        }
    }
    float inv[64];
    for (i64 g = 0; g < g_n; g++) {
        inv[g] = 1.0f / exp_row(scores + g * sp, len);
        if (colsum != NULL) add_scaled(colsum, scores + g * sp, len, inv[g]);
    }
    memset(qa, 0, (size_t)(g_n * d) * sizeof(float)); /* now the accumulators of P V */
    for (i64 j0 = 0; j0 < len; j0 += KB) {
        const i64 nb = len - j0 < KB ? len - j0 : KB;
        for (i64 j = 0; j < nb; j++) {
            const uint8_t *vj = vh + (j0 + j) * w;
            const v8f sc = splat(row_scale(vj, d));
            for (i64 c = 0; c < d; c += 8) store8(buf + j * d + c, load8_e4m3(vj + c) * sc);
        }
        for (i64 g = 0; g < g_n; g++) {
            const float *sg = scores + g * sp + j0;
            v8f acc[32];
            for (i64 c = 0; c < d / 8; c++) acc[c] = load8(qa + g * d + 8 * c);
            for (i64 j = 0; j < nb; j++) {
                const v8f p = splat(sg[j]);
                for (i64 c = 0; c < d / 8; c++) acc[c] += p * load8(buf + j * d + 8 * c);
            }
            for (i64 c = 0; c < d / 8; c++) store8(qa + g * d + 8 * c, acc[c]);
        }
    }
    for (i64 g = 0; g < g_n; g++) {
        float *dst = jb->out + r * jb->out_stride + (h * g_n + g) * d;
        const v8f iv = splat(inv[g]);
        for (i64 c = 0; c < d / 8; c++) store8(dst + 8 * c, load8(qa + g * d + 8 * c) * iv);
    }
}

static void rows_item(const rows_job_t *jb, float *scores, float *colsum, i64 item) {
    const i64 d = jb->d, heads = jb->hkv * jb->group;
    const i64 r = item / heads, hq = item % heads, h = hq / jb->group;
    const i64 len = jb->pos[r] + 1;
    float qs[256];
    const float *qr = jb->q + r * jb->q_stride + hq * d;
    for (i64 c = 0; c < d; c++) qs[c] = qr[c] * jb->scale; /* the query scaled first, as the torch kernel */
    const float *kh = (const float *)jb->k + h * jb->k_head, *vh = (const float *)jb->v + h * jb->v_head;
    for (i64 j = 0; j < len; j++) {
        const float *kj = kh + j * d;
        v8f a = splat(0.0f);
        for (i64 c = 0; c < d; c += 8) a += load8(qs + c) * load8(kj + c);
        scores[j] = hsum(a);
    }
    const float inv = 1.0f / exp_row(scores, len);
    if (colsum != NULL) add_scaled(colsum, scores, len, inv);
    v8f acc[32];
    for (i64 c = 0; c < d / 8; c++) acc[c] = splat(0.0f);
    for (i64 j = 0; j < len; j++) {
        const v8f p = splat(scores[j]);
        const float *vj = vh + j * d;
        for (i64 c = 0; c < d / 8; c++) acc[c] += p * load8(vj + 8 * c);
    }
    float *dst = jb->out + r * jb->out_stride + hq * d;
    const v8f iv = splat(inv);
    for (i64 c = 0; c < d / 8; c++) store8(dst + 8 * c, acc[c] * iv);
}

typedef struct {
    const rows_job_t *job;
    float *scores, *colsum;
    int id, parts;
} rows_part_t;

/* items of a job: (row, query head), or (row, KV head) in kv8 */
static i64 rows_items(const rows_job_t *jb) { return jb->n * jb->hkv * (jb->kv8 ? 1 : jb->group); }

static void *rows_main(void *arg) {
    rows_part_t *p = arg;
    const rows_job_t *jb = p->job;
    const i64 items = rows_items(jb);
    if (jb->kv8) {  /* the part's scratch: group rows of scores, then KB rows of K or V, then queries */
        float *buf = p->scores + jb->group * jb->s_pad, *qa = buf + KB * jb->d;
        for (i64 item = p->id; item < items; item += p->parts) rows_item_kv8(jb, p->scores, p->colsum, buf, qa, item);
    } else {
        for (i64 item = p->id; item < items; item += p->parts) rows_item(jb, p->scores, p->colsum, item);
    }
    return NULL;
}

static int rows_run(rows_job_t jb, float *density, int threads) {
    const i64 n = jb.n;
    if (n <= 0) return 0;
    if (jb.d % 8 || jb.d > 256 || (jb.kv8 && jb.group > 64)) return -1;
    const i64 s = jb.pos[n - 1] + 1, sp = (s + 15) / 16 * 16, items = rows_items(&jb);
    jb.s_pad = sp;
    /* floats of scratch per part: a row of scores; in kv8 a group's rows, KB de-quantized rows, queries */
    const i64 per = jb.kv8 ? jb.group * sp + (KB + jb.group) * jb.d : sp;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int)items;
    if (threads > 16) threads = 16;
    float *scratch = malloc((size_t)(threads * (per + sp)) * sizeof(float));
    if (scratch == NULL) return -1;
    float *colsums = scratch + (size_t)threads * per;
    if (density) memset(colsums, 0, (size_t)(threads * sp) * sizeof(float));
    rows_part_t parts[16];
    for (int t = 0; t < threads; t++)
        parts[t] = (rows_part_t){&jb, scratch + (size_t)t * per, density ? colsums + (size_t)t * sp : NULL, t, threads};
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), got = omp_get_num_threads();
        if (got == threads) {
            rows_main(&parts[t]);
        } else if (t == 0) { /* a smaller team than asked for: this thread does every part */
            for (int p = 0; p < threads; p++) rows_main(&parts[p]);
        }
    }
#else
    pthread_t tids[16];
    int started = 0;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&tids[t], NULL, rows_main, &parts[t]) == 0) started |= 1 << t;
    rows_main(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started & (1 << t)) pthread_join(tids[t], NULL);
        else rows_main(&parts[t]);
    }
#endif
    if (density) {
        for (int t = 0; t < threads; t++) {
            const float *cs = colsums + (size_t)t * sp;
            for (i64 j = 0; j < s; j++) density[j] += cs[j];
        }
    }
    free(scratch);
    return 0;
}

/* attn_forward for a few rows (Hq * D <= 256 * heads; D % 8 == 0, D <= 256). Returns 0, or -1 when
 * memory for the scratch cannot be had or D is out of range. */
int attn_rows(const float *q, i64 q_stride, const i64 *pos, i64 n, const float *k, i64 k_head,
              const float *v, i64 v_head, i64 hkv, i64 group, i64 d, float scale, float *out,
              i64 out_stride, float *density, int threads) {
    rows_job_t jb = {q, q_stride, pos, n, k, v, k_head, v_head, hkv, group, d, scale, out, out_stride, 0, 0};
    return rows_run(jb, density, threads);
}

/* attn_rows over a kv8 working set: `k`, `v` point at rows of D + 4 bytes; `k_head`, `v_head` in bytes. */
int attn_rows_kv8(const float *q, i64 q_stride, const i64 *pos, i64 n, const uint8_t *k, i64 k_head,
                  const uint8_t *v, i64 v_head, i64 hkv, i64 group, i64 d, float scale, float *out,
                  i64 out_stride, float *density, int threads) {
    rows_job_t jb = {q, q_stride, pos, n, k, v, k_head, v_head, hkv, group, d, scale, out, out_stride, 0, 1};
    return rows_run(jb, density, threads);
}
