/* Fused elementwise steps of a decoder layer for the CPU: each replaces several torch ops (one
 * pass over the rows instead of one per op, and one call from Python instead of several), which
 * matters in decode, where a step's rows are few and each torch op's dispatch costs about as
 * much as its arithmetic.
 *
 * fp32, or bf16 (uint16 bit patterns) where every intermediate is rounded to bf16 exactly where
 * the torch ops it replaces round it (each bf16 op computes in fp32 and rounds its result).
 * Built without contraction (-ffp-contract=off): rotary then computes exactly the products and
 * sums torch does (x * cos + swapped * sin, each rounded), so it is bitwise equal to the
 * reference. The norms reduce in a different order than torch's, within an ulp or so.
 * Rows are split over torch's OpenMP pool when there are enough of them. At AVX-512 the fp32
 * SiLU takes its exponential from vec_exp.h and a refined reciprocal (an ulp or two from
 * torch's, not bitwise); bf16 stays bitwise.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec_exp.h"

#define LANES 16
#define PARALLEL_ROWS 64 /* fewer rows than this run on the calling thread */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* fp32 rows of up to this many elements are widened on the stack */
#define MAX_WIDTH 16384

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

/* out = w * x / rms(x) for one fp32 row h (already summed and, for bf16, rounded); bf16:
 * the normalized row is rounded before the weight multiplies it, and the product after */
static inline void norm_row(const float *h, const void *w, void *out, int64_t o, int n,
                            float eps, int bf16) {
    const float inv = 1.0f / sqrtf(sum_squares(h, n) / (float)n + eps);
    if (!bf16) {
        const float *wf = (const float *)w;
        float *of = (float *)out + o;
        for (int i = 0; i < n; i++) of[i] = wf[i] * (h[i] * inv);
        return;
    }
    for (int i = 0; i < n; i++) st(out, o + i, ld(w, i, 1) * round_bf16(h[i] * inv), 1);
}

/* out = w * x / rms(x), row by row; x and out [rows, n]. With a residual (not NULL) it is
 * updated first, residual += x, and normalized instead: the residual stream's update and the
 * next norm in one pass. */
void stepserve_rms_norm(const void *x, void *residual, const void *w, void *out, int64_t rows,
                        int n, float eps, int bf16, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float h[MAX_WIDTH];
        for (int i = 0; i < n; i++) {
            if (!residual) {
                h[i] = ld(x, r * n + i, bf16);
                continue;
            }
            const float sum = ld(residual, r * n + i, bf16) + ld(x, r * n + i, bf16);
            st(residual, r * n + i, sum, bf16);
            h[i] = bf16 ? round_bf16(sum) : sum;
        }
        norm_row(h, w, out, r * n, n, eps, bf16);
    }
}

#if defined(__AVX512F__)
/* silu(g) = g * sigmoid(g) in 16 lanes: sigmoid from t = e^-|g| (at most 1, so its polynomial
 * cannot overflow) as 1 / (1 + t) for g >= 0 and t / (1 + t) below, the reciprocal from its
 * 14-bit estimate and one Newton step: within a few ulps of expf and a division, 1.02-1.18x
 * their speed (the op is bound by memory traffic; docs/perf-engine.md, "Prefill attention,
 * session 56") */
static inline __m512 silu16(__m512 g) {
    const __m512 t = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), t);
    __m512 r = _mm512_rcp14_ps(den);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(2.0f)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(g, _mm512_mask_mul_ps(r, negative, r, t));
}
#endif

/* out[r] = silu(gate[r]) * up[r] where gate_up[r] = [gate | up], each `inter` wide */
void stepserve_silu_mul(const void *gate_up, void *out, int64_t rows, int inter, int bf16,
                        int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r * 2 * (int64_t)inter, u = g + inter, o = r * (int64_t)inter;
        if (!bf16) {
            const float *gf = (const float *)gate_up + g, *uf = (const float *)gate_up + u;
            float *of = (float *)out + o;
#if defined(__AVX512F__)
            for (int i = 0; i < inter; i += 16) {
                const __mmask16 k = inter - i >= 16 ? 0xFFFF : (__mmask16)((1u << (inter - i)) - 1);
                const __m512 x = _mm512_maskz_loadu_ps(k, gf + i);
                _mm512_mask_storeu_ps(of + i, k,
                                      _mm512_mul_ps(silu16(x), _mm512_maskz_loadu_ps(k, uf + i)));
            }
#else
            for (int i = 0; i < inter; i++) { /* sigmoid from e^-|g| <= 1: no overflow */
                const float t = expf(-fabsf(gf[i]));
                of[i] = gf[i] * (gf[i] >= 0.0f ? 1.0f : t) / (1.0f + t) * uf[i];
            }
#endif
            continue;
        }
        for (int i = 0; i < inter; i++) {
            const float a = ld(gate_up, g + i, 1);
            st(out, o + i, round_bf16(a / (1.0f + expf(-a))) * ld(gate_up, u + i, 1), 1);
        }
    }
}

/* The step's new K and V rows into the paged cache: row r of k and of v (`width` elements of
 * `elem` bytes each, rows `k_stride` / `v_stride` elements apart: views of the qkv rows) to
 * slot slots[r] of k_cache and v_cache ([num_slots, width], contiguous). Returns nonzero,
 * writing nothing, when a slot is outside 0..num_slots-1. */
int stepserve_kv_write(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                       const int64_t *slots, void *k_cache, void *v_cache, int64_t rows,
                       int64_t width, int64_t num_slots, int elem, int num_threads) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    const size_t bytes = (size_t)width * (size_t)elem;
#pragma omp parallel for num_threads(num_threads) if (rows >= 4 * PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        memcpy((char *)k_cache + slots[r] * bytes, (const char *)k + r * k_stride * elem, bytes);
        memcpy((char *)v_cache + slots[r] * bytes, (const char *)v + r * v_stride * elem, bytes);
    }
    return 0;
}

/* Rotate-half rotary embedding in place on the first `heads` heads of each row of x (row
 * stride `stride` elements; a layer's query and key heads lie side by side at the start of its
 * qkv row). cos/sin: fp32 full-width tables [max_position, head_dim] with sin signed for the
 * rotated half, as torch uses them: x * cos + swap_halves(x) * sin (bf16: the tables rounded
 * to bf16 first, each product and the sum rounded). */
void stepserve_rotary(void *x, int64_t stride, const int64_t *positions, const float *cos_table,
                      const float *sin_table, int64_t rows, int heads, int head_dim, int bf16,
                      int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_table + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            const int64_t v = r * stride + (int64_t)h * head_dim;
            if (!bf16) {
                float *p = (float *)x + v;
                for (int i = 0; i < half; i++) {
                    const float a = p[i], b = p[i + half];
                    p[i] = a * c[i] + b * s[i];
                    p[i + half] = b * c[i + half] + a * s[i + half];
                }
                continue;
            }
            for (int i = 0; i < half; i++) {
                const float a = ld(x, v + i, 1), b = ld(x, v + i + half, 1);
                const float lo = round_bf16(a * round_bf16(c[i])) + round_bf16(b * round_bf16(s[i]));
                const float hi = round_bf16(b * round_bf16(c[i + half])) +
                                 round_bf16(a * round_bf16(s[i + half]));
                st(x, v + i, lo, 1);
                st(x, v + i + half, hi, 1);
            }
        }
    }
}
