/* Fused elementwise steps of a decoder layer for the CPU, fp32 only: each replaces several torch
 * ops (one pass over the rows instead of one per op, and one call from Python instead of
 * several), which matters in decode, where a step's rows are few and each torch op's dispatch
 * costs about as much as its arithmetic.
 *
 * Built without contraction (-ffp-contract=off): rotary then computes exactly the products and
 * sums torch does (x * cos + swapped * sin, each rounded), so it is bitwise equal to the
 * reference. The norms reduce in a different order than torch's, within an ulp or so.
 * Rows are split over torch's OpenMP pool when there are enough of them.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define PARALLEL_ROWS 64 /* fewer rows than this run on the calling thread */

static inline float sum_squares(const float *x, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * x[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline void norm_row(const float *x, const float *w, float *out, int n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = w * x / rms(x), row by row; x and out [rows, n] */
void stepserve_rms_norm(const float *x, const float *w, float *out, int64_t rows, int n,
                        float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

/* residual += x, then out = w * residual / rms(residual): the residual stream's update and the
 * next norm in one pass */
void stepserve_add_rms_norm(const float *x, float *residual, const float *w, float *out,
                            int64_t rows, int n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        const float *a = x + r * n;
        for (int i = 0; i < n; i++) h[i] = h[i] + a[i];
        norm_row(h, w, out + r * n, n, eps);
    }
}

/* out[r] = silu(gate[r]) * up[r] where gate_up[r] = [gate | up], each `inter` wide */
void stepserve_silu_mul(const float *gate_up, float *out, int64_t rows, int inter,
                        int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * (int64_t)inter, *u = g + inter;
        float *o = out + r * (int64_t)inter;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half rotary embedding in place on the first `heads` heads of each row of x (row
 * stride `stride` elements; a layer's query and key heads lie side by side at the start of its
 * qkv row). cos/sin: full-width tables [max_position, head_dim] with sin signed for the
 * rotated half, as torch uses them: x * cos + swap_halves(x) * sin. */
void stepserve_rotary(float *x, int64_t stride, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t rows, int heads, int head_dim,
                      int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_table + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + r * stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
