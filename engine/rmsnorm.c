/* RMSNorm of float32 rows in one pass per row, for engine/norm.py (`compiled_rms_norm`): y = x / sqrt(mean(x^2)
 * + eps) * w. Torch takes about six operators for it (pow, mean, add, rsqrt, two products), each a
 * dispatch of 2-5 us and a pass over the rows; a decode step runs it 61 times on one row of the
 * default model, where that dispatch, not the arithmetic, is the cost (docs/benchmarks.md,
 * "Quantized weights"). Results match torch's up to float32 summation order (the tests bound it).
 *
 * Rows are split over the calling thread's OpenMP team (torch's, see engine/threads.py) when there
 * are enough of them to pay for it (prefill); without OpenMP one thread runs them all.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef int64_t i64;
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4))); /* unaligned access */

#define PARALLEL_MIN (1 << 16) /* elements from which the rows are split over threads */

static void norm_row(const float *x, i64 d, const float *w, float eps, float *y) {
    v16f s0 = {0}, s1 = {0};
    i64 i = 0;
    for (; i + 32 <= d; i += 32) {
        const v16f a = *(const v16fu *)(x + i), b = *(const v16fu *)(x + i + 16);
        s0 += a * a;
        s1 += b * b;
    }
    float s = 0.0f;
    for (int t = 0; t < 16; t++) s += s0[t] + s1[t];
    for (; i < d; i++) s += x[i] * x[i];
    const float r = 1.0f / sqrtf(s / (float)d + eps);
    i = 0;
    for (; i + 16 <= d; i += 16)
        *(v16fu *)(y + i) = (*(const v16fu *)(x + i) * r) * *(const v16fu *)(w + i);
    for (; i < d; i++) y[i] = (x[i] * r) * w[i];
}

/* y[r, :d] = rmsnorm(x[r, :d]) * w for n rows (strides ldx, ldy in floats; y may be x). Returns 0. */
int rms_norm_rows(const float *x, i64 n, i64 ldx, i64 d, const float *w, float eps, float *y, i64 ldy,
                  int threads) {
#ifdef _OPENMP
    if (threads > 1 && n > 1 && n * d >= PARALLEL_MIN) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (i64 r = 0; r < n; r++) norm_row(x + r * ldx, d, w, eps, y + r * ldy);
        return 0;
    }
#else
    (void)threads;
#endif
    for (i64 r = 0; r < n; r++) norm_row(x + r * ldx, d, w, eps, y + r * ldy);
    return 0;
}
