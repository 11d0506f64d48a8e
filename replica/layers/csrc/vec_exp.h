/* e^x for x <= 0 in 16 AVX-512 lanes, for the kernels' softmax and SiLU: 2^n e^f with
 * n = round(x / ln 2), f = x - n ln 2 (ln 2 split in two so f is exact), e^f by its Taylor
 * series to degree 6 (|f| <= ln 2 / 2: relative error ~1e-7), 2^n by the exponent-scaling
 * instruction; lanes below -87 are exactly 0 (a masked score). */
#ifndef STEPSERVE_VEC_EXP_H
#define STEPSERVE_VEC_EXP_H
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp_nonpositive16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(1.3888889e-3f), f, _mm512_set1_ps(8.3333333e-3f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(4.1666668e-2f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.6666667e-1f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, e, n);
}

#endif
#endif
