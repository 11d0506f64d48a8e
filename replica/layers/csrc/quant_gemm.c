/* Matrix products with weights kept in GGML's quantized block formats (what a GGUF file holds,
 * and what `--quantization int8` makes: Q8_0), for the CPU.
 *
 *   y[m, j] = sum_k x[m, k] W[j, k] (+ bias[j])
 *
 * W: N rows, each K elements as K / block blocks back to back (row stride in bytes: a caller may
 * pass a column slice of whole blocks). x: fp32 [M, K] with a row stride; y: fp32 with a row
 * stride (a caller may write a column slice of a wider output).
 *
 * Two modes:
 *  - int8 activations: each x row is quantized to int8 per block of 32 (Q4_0, Q4_1, Q8_0: an
 *    fp32 scale amax / 127 and the block's sum of int8 values) or per super-block of 256 (the
 *    K-quants: one scale and the sums of each 16), and the products are integer dot products
 *    (AVX512-VNNI vpdpbusd / vpdpwssd at the avx512_vnni and avx512_bf16 levels, maddubs + madd
 *    at avx2 and avx512, scalar at portable), scaled to fp32 once per block.
 *  - fp32 activations: each weight block is de-quantized to fp32 (exactly as the reference
 *    de-quantizer rounds) and multiplied with fp32 x (the parity mode).
 * For M > 1 each weight block is unpacked once and applied to up to MT rows of x; rows of W are
 * split over the OpenMP pool (torch's), contiguous ranges per thread (each streams its part).
 *
 * Block-32 int8 kernels work on groups of 8 blocks: the integer dot products (one vector per pair
 * of blocks, see PAIRED) reduced to one vector of 8 block sums and the 8 weight scales loaded into
 * one vector (scalar loads: faster than vpgatherdd on Zen 4), so the fp32 work is a few vector ops
 * per 8 blocks instead of several per block. AVX-512 builds take a row's whole groups of 16
 * blocks in zmm the same way (QG_Z), MTZ rows of x per pass. K-quant int8 kernels accumulate
 * scale * dot in int32 over a super-block (maddubs, then madd / VNNI vpdpwssd by the sub-block
 * scales) and convert once.
 *
 * Built without -ffast-math and without contraction: `stepserve_quant_dequantize` then returns
 * exactly what gguf's numpy de-quantizer does (same products and sums, each rounded).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_VNNI 1
#endif
#endif

#define AI static inline __attribute__((always_inline))

/* GGML type ids */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

#define QK 32   /* elements of a Q4_0 / Q4_1 / Q8_0 block */
#define QKK 256 /* elements of a K-quant super-block */
#define MT 4    /* rows of x one pass over a weight row serves */
#define ROWS_PER_TASK 8
#define PRIVATE_X_ROWS 4 /* up to this many rows of x each thread quantizes for itself */
/* below this many weight bytes (times rows of x) one thread does the product: waking the pool
 * costs more than it saves */
#define PARALLEL_BYTES (48 * 1024)

static int block_elems(int t) { return (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K) ? QKK : QK; }

static int block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef QG_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        const float f = (float)man * 5.9604644775390625e-08f; /* man * 2^-24, exact */
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* round to nearest, ties to even (as cvtps2dq and torch.round), for |v| < 2^22 */
static inline int32_t round_even(float v) {
    union {
        float f;
        int32_t i;
    } u;
    u.f = v + 12582912.0f;
    return u.i - 0x4B400000;
}

/* the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 packed bytes) */
static inline void kscale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- de-quantization of one block, exactly as gguf's numpy reference rounds ---------------- */

AI void dq_q4_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const uint8_t *qs = b + 2;
#ifdef QG_AVX2
    const __m256 dv = _mm256_set1_ps(d);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    const __m128i e8 = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), e8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4), e8);
    _mm256_storeu_ps(y, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(
                                                  _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(
                                                   _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
#else
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)((qs[i] & 0x0F) - 8);
        y[i + 16] = d * (float)((qs[i] >> 4) - 8);
    }
#endif
}

AI void dq_q4_1(const uint8_t *b, float *y) {
    const float d = f16(b), m = f16(b + 2);
    const uint8_t *qs = b + 4;
#ifdef QG_AVX2
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
#define QG_Q41_STORE(off, src)                                                                    \
    _mm256_storeu_ps(y + (off), _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(                \
                                                                    _mm256_cvtepu8_epi32(src))),   \
                                              mv))
    QG_Q41_STORE(0, lo);
    QG_Q41_STORE(8, _mm_srli_si128(lo, 8));
    QG_Q41_STORE(16, hi);
    QG_Q41_STORE(24, _mm_srli_si128(hi, 8));
#undef QG_Q41_STORE
#else
    for (int i = 0; i < 16; i++) {
        y[i] = d * (float)(qs[i] & 0x0F) + m;
        y[i + 16] = d * (float)(qs[i] >> 4) + m;
    }
#endif
}

AI void dq_q8_0(const uint8_t *b, float *y) {
    const float d = f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
#ifdef QG_AVX2
    const __m256 dv = _mm256_set1_ps(d);
    for (int i = 0; i < 32; i += 8) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(qs + i));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    }
#else
    for (int i = 0; i < 32; i++) y[i] = d * (float)qs[i];
#endif
}

#ifdef QG_AVX2
/* y[0..32) = ds * v - dm for 32 u8 values v (each product and difference rounded, as gguf) */
AI void store32_affine(__m256i v, float ds, float dm, float *y) {
    const __m256 dsv = _mm256_set1_ps(ds), dmv = _mm256_set1_ps(dm);
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_storeu_ps(y + 8 * i, _mm256_sub_ps(_mm256_mul_ps(dsv, f), dmv));
    }
}

/* y[0..16) = ds * v for 16 int8 values v */
AI void store16_scaled(__m128i v, float ds, float *y) {
    const __m256 dsv = _mm256_set1_ps(ds);
    _mm256_storeu_ps(y, _mm256_mul_ps(dsv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(dsv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_srli_si128(v, 8)))));
}
#endif

static void dq_q4_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc = b + 4, *qs = b + 16;
#ifdef QG_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        for (int h = 0; h < 2; h++) {
            int s, m;
            kscale(sc, 2 * c + h, &s, &m);
            const __m256i v = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, m4);
            store32_affine(v, d * (float)s, dmin * (float)m, y + 64 * c + 32 * h);
        }
    }
#else
    for (int j = 0; j < 8; j++) {
        int s, m;
        kscale(sc, j, &s, &m);
        const float ds = d * (float)s, dm = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) y[32 * j + l] = ds * (float)((q[l] >> shift) & 0x0F) - dm;
    }
#endif
}

static void dq_q5_k(const uint8_t *b, float *y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
#ifdef QG_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        for (int i = 0; i < 2; i++) {
            const int j = 2 * c + i;
            int s, m;
            kscale(sc, j, &s, &m);
            const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, j), one);
            const __m256i v = _mm256_or_si256(_mm256_and_si256(i ? _mm256_srli_epi16(q, 4) : q, m4),
                                              _mm256_slli_epi16(hb, 4));
            store32_affine(v, d * (float)s, dmin * (float)m, y + 32 * j);
        }
    }
#else
    for (int j = 0; j < 8; j++) {
        int s, m;
        kscale(sc, j, &s, &m);
        const float ds = d * (float)s, dm = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4);
            y[32 * j + l] = ds * (float)v - dm;
        }
    }
#endif
}

static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
#ifdef QG_AVX2
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), e32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; n++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
        for (int g = 0; g < 4; g++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32 * (g & 1)));
            const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(l, 4) : l, m4);
            __m256i hb = h;
            if (g == 1) hb = _mm256_srli_epi16(h, 2);
            if (g == 2) hb = _mm256_srli_epi16(h, 4);
            if (g == 3) hb = _mm256_srli_epi16(h, 6);
            hb = _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4);
            const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, hb), e32);
            float *yo = y + 128 * n + 32 * g;
            store16_scaled(_mm256_castsi256_si128(v), d * (float)sc[8 * n + 2 * g], yo);
            store16_scaled(_mm256_extracti128_si256(v, 1), d * (float)sc[8 * n + 2 * g + 1], yo + 16);
        }
    }
#else
    for (int n = 0; n < 2; n++) {
        for (int g = 0; g < 4; g++) {
            const uint8_t *l4 = ql + 64 * n + 32 * (g & 1);
            const int shift = 4 * (g >> 1);
            for (int h = 0; h < 2; h++) {
                const float ds = d * (float)sc[8 * n + 2 * g + h];
                for (int l = 16 * h; l < 16 * h + 16; l++) {
                    const int v = ((l4[l] >> shift) & 0x0F) | (((qh[32 * n + l] >> (2 * g)) & 3) << 4);
                    y[128 * n + 32 * g + l] = ds * (float)(v - 32);
                }
            }
        }
    }
#endif
}

/* de-quantize `nblk` consecutive blocks of type t starting at b into y */
AI void dq_blocks(int t, const uint8_t *b, int nblk, float *y) {
    const int bb = block_bytes(t), be = block_elems(t);
    for (int i = 0; i < nblk; i++, b += bb, y += be) {
        switch (t) {
        case T_Q4_0: dq_q4_0(b, y); break;
        case T_Q4_1: dq_q4_1(b, y); break;
        case T_Q8_0: dq_q8_0(b, y); break;
        case T_Q4_K: dq_q4_k(b, y); break;
        case T_Q5_K: dq_q5_k(b, y); break;
        case T_Q6_K: dq_q6_k(b, y); break;
        }
    }
}

/* ---- horizontal sums ------------------------------------------------------------------------ */
#ifdef QG_AVX2
AI float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

#endif

/* ---- fp32 activations: de-quantize a chunk of blocks, multiply with fp32 x ------------------ */

#define CHUNK 256 /* elements de-quantized at a time */

/* sums[r] = W row (wrow, k elements) . x row r, for R rows of x (R constant at each call site) */
AI void row_f32(int t, const uint8_t *wrow, int64_t k, const float *x, int64_t ldx, int R,
                float *sums) {
    float buf[CHUNK] __attribute__((aligned(64)));
    const int bb = block_bytes(t), be = block_elems(t);
#ifdef QG_AVX2
    /* four independent sums per row of x: the FMA latency, not its throughput, bounds one */
    __m256 acc[MT][4];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_ps();
#else
    float acc[MT][8];
    for (int r = 0; r < R; r++)
        for (int l = 0; l < 8; l++) acc[r][l] = 0.0f;
#endif
    for (int64_t c = 0; c < k; c += CHUNK) {
        const int len = (int)(k - c < CHUNK ? k - c : CHUNK);
        dq_blocks(t, wrow + c / be * bb, len / be, buf);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + c;
#ifdef QG_AVX2
            __m256 a0 = acc[r][0], a1 = acc[r][1], a2 = acc[r][2], a3 = acc[r][3];
            for (int i = 0; i < len; i += 32) {
                a0 = _mm256_fmadd_ps(_mm256_load_ps(buf + i), _mm256_loadu_ps(xr + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_load_ps(buf + i + 8), _mm256_loadu_ps(xr + i + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_load_ps(buf + i + 16), _mm256_loadu_ps(xr + i + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_load_ps(buf + i + 24), _mm256_loadu_ps(xr + i + 24), a3);
            }
            acc[r][0] = a0;
            acc[r][1] = a1;
            acc[r][2] = a2;
            acc[r][3] = a3;
#else
            for (int i = 0; i < len; i += 8)
                for (int l = 0; l < 8; l++) acc[r][l] += buf[i + l] * xr[i + l];
#endif
        }
    }
    for (int r = 0; r < R; r++) {
#ifdef QG_AVX2
        sums[r] = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                        _mm256_add_ps(acc[r][2], acc[r][3])));
#else
        float s = 0.0f;
        for (int l = 0; l < 8; l++) s += acc[r][l];
        sums[r] = s;
#endif
    }
}

/* ---- int8 activations ----------------------------------------------------------------------- */

/* x rows quantized for the int8 kernels: q [M, K]; per block of 32: d (scale), s (d * sum q),
 * si (sum q); per super-block of 256: d and bs (sums of each 16, int16) */
typedef struct {
    int8_t *q;
    float *d;
    float *s;
    int32_t *si;
    int16_t *bs;
    int64_t nb; /* blocks (or super-blocks) per row */
    int64_t qk; /* bytes of q per row */
    int quads;  /* block-32: whole groups of 16 in the zmm quad layout (QG_Z, enough rows of x) */
} xquant;

/* x rows of the block-32 types on the SIMD paths are laid out per pair of blocks A, B as the
 * unpacked nibbles of two Q4 blocks come out of one 32-byte load: [A 0-15, B 0-15, A 16-31,
 * B 16-31] (a last odd block: B zero); Q8_0 blocks are loaded the same way. A pair then takes two
 * dot products and gives one vector, lanes 0-3 block A, 4-7 block B: half the reduction of one
 * vector per block. */
#ifdef QG_AVX2
#define PAIRED(t) ((t) == T_Q4_0 || (t) == T_Q4_1 || (t) == T_Q8_0)
#else
#define PAIRED(t) 0
#endif

/* AVX-512 builds (QG_Z): a row's whole groups of 16 blocks go through zmm, laid out in x as 4
 * quads of 128 bytes; quad j holds blocks j, j + 4, j + 8, j + 12: [elements 0-15 of each | 16-31
 * of each]. One quad's dot products give 16 lanes, 4 per block, and 4 quads reduce to the 16
 * block sums in order. The last nb % 16 blocks keep the pair layout and the ymm kernel. */
#if defined(QG_AVX2) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QG_Z 1
#ifdef __AVX512VNNI__
#define QG_ZVNNI 1
#endif
#define ZG 16 /* blocks per zmm group */
#ifndef MTZ
#define MTZ 16 /* rows of x one pass over a weight row serves on the zmm path (then 8, then MT) */
#endif
#ifndef ZMIN
#define ZMIN 4 /* rows of x from which the zmm path is taken */
#endif
#define MAXR MTZ
#else
#define MAXR MT
#endif

#ifdef QG_AVX2
/* 32 int32 (4 vectors) -> 32 int8 in element order */
AI __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AI float amax32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x)),
                             _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8)));
    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 16)),
                                       _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 24))));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* quantize 32 values with inverse scale id into q; returns the 4 int32 vectors' sum vector and
 * the sums of the two halves of 16 */
AI __m256i quant32(const float *x, float id, int8_t *q, int32_t *half_sums) {
    const __m256 iv = _mm256_set1_ps(id);
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), iv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), iv));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), iv));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), iv));
    _mm256_storeu_si256((__m256i *)q, pack32(a, b, c, d));
    if (half_sums) {
        half_sums[0] = hsum_epi32(_mm256_add_epi32(a, b));
        half_sums[1] = hsum_epi32(_mm256_add_epi32(c, d));
    }
    return _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
}
#endif

/* one x row (k elements) per block of 32; paired: the layout above */
static void quantize_row_b32(const float *x, int64_t k, int8_t *q, float *ds, float *ss,
                             int32_t *si, int paired, int quads) {
    (void)quads;
    const int64_t nb = k / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
#ifdef QG_AVX2
        const float amax = amax32(xb);
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
#endif
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum;
#ifdef QG_AVX2
        int8_t tmp[QK];
        int8_t *qb = paired ? tmp : q + b * QK;
        sum = hsum_epi32(quant32(xb, id, qb, NULL));
#ifdef QG_Z
        if (quads && b < nb / ZG * ZG) { /* the quad layout */
            const int64_t i = b % ZG;
            int8_t *lo = q + (b - i) * QK + (i % 4) * 128 + (i / 4) * 16;
            memcpy(lo, tmp, 16);
            memcpy(lo + 64, tmp + 16, 16);
        } else
#endif
        if (paired) {
            int8_t *pair = q + (b / 2) * 2 * QK + (b & 1) * 16;
            memcpy(pair, tmp, 16);
            memcpy(pair + 32, tmp + 16, 16);
            if ((b & 1) == 0 && b == nb - 1) { /* a last odd block: its partner is zero */
                memset(pair + 16, 0, 16);
                memset(pair + 48, 0, 16);
            }
        }
#else
        (void)paired, (void)quads;
        int8_t *qb = q + b * QK;
        sum = 0;
        for (int i = 0; i < QK; i++) {
            qb[i] = (int8_t)round_even(xb[i] * id);
            sum += qb[i];
        }
#endif
        ds[b] = d;
        si[b] = sum;
        ss[b] = d * (float)sum;
    }
}

/* one x row per super-block of 256: one scale, the sums of each 16 */
static void quantize_row_k(const float *x, int64_t k, int8_t *q, float *ds, int16_t *bs) {
    for (int64_t b = 0; b < k / QKK; b++) {
        const float *xb = x + b * QKK;
        int8_t *qb = q + b * QKK;
        float amax = 0.0f;
#ifdef QG_AVX2
        for (int i = 0; i < QKK; i += QK) amax = fmaxf(amax, amax32(xb + i));
#else
        for (int i = 0; i < QKK; i++) amax = fmaxf(amax, fabsf(xb[i]));
#endif
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
#ifdef QG_AVX2
        for (int i = 0; i < QKK; i += QK) {
            int32_t h[2];
            quant32(xb + i, id, qb + i, h);
            bs[b * 16 + i / 16] = (int16_t)h[0];
            bs[b * 16 + i / 16 + 1] = (int16_t)h[1];
        }
#else
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 16 * g; i < 16 * g + 16; i++) {
                qb[i] = (int8_t)round_even(xb[i] * id);
                sum += qb[i];
            }
            bs[b * 16 + g] = (int16_t)sum;
        }
#endif
        ds[b] = d;
    }
}

#ifdef QG_AVX2
AI __m256i sum2(__m256i a, __m256i b) { /* [a0+a2, b0+b2, a1+a3, b1+b3 | same, upper] */
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

AI __m256i sum2q(__m256i a, __m256i b) { /* [a0+a2, a1+a3, b0+b2, b1+b3 | same, upper] */
    return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}


/* 4 pair vectors (lanes 0-3 block 2i, 4-7 block 2i+1) -> the 8 block sums in order */
AI __m256i reduce_pairs(const __m256i *p) {
    const __m256i s = sum2q(sum2(p[0], p[1]), sum2(p[2], p[3])); /* blocks 0 2 4 6 | 1 3 5 7 */
    return _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* two 16-byte halves (A at a, B at a + bb; B absent: zero) in one vector */
AI __m256i load_pair(const uint8_t *a, int bb, int has_b) {
    const __m128i qa = _mm_loadu_si128((const __m128i *)a);
    return has_b ? _mm256_inserti128_si256(_mm256_castsi128_si256(qa),
                                           _mm_loadu_si128((const __m128i *)(a + bb)), 1)
                 : _mm256_zextsi128_si256(qa);
}

/* a pair of blocks from the one at b (the next absent: zero) as the dot products take them:
 * elements 0-15 of both in lo, 16-31 in hi. Q4: the nibbles; Q8_0: the int8 values, offset by
 * 128 with VNNI (u8 x s8) */
AI void prep_pair(int t, const uint8_t *b, int bb, int has_b, __m256i *lo, __m256i *hi) {
    if (t == T_Q8_0) {
        *lo = load_pair(b + 2, bb, has_b);
        *hi = load_pair(b + 18, bb, has_b);
#ifdef QG_VNNI
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *lo = _mm256_xor_si256(*lo, flip);
        *hi = _mm256_xor_si256(*hi, flip);
#endif
        return;
    }
    const __m256i v = load_pair(b + (t == T_Q4_1 ? 4 : 2), bb, has_b);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

/* the dot products of a prepared pair with x laid out paired (64 bytes) */
AI __m256i dot_pair(int t, __m256i lo, __m256i hi, const int8_t *x) {
    const __m256i xl = _mm256_loadu_si256((const __m256i *)x);
    const __m256i xh = _mm256_loadu_si256((const __m256i *)(x + 32));
#ifdef QG_VNNI
    (void)t;
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (t == T_Q8_0) /* |w| x sign-adjusted x: pairs of products can reach 2 * 128 * 127 */
        return _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)), ones),
            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi)), ones));
    /* nibbles: two pairs of products stay within int16 (2 * 2 * 15 * 127) */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), ones);
#endif
}

/* the 8 block sums less what the weight's offset adds: Q4_0 nibbles are q + 8, Q8_0 with VNNI
 * q + 128 */
AI __m256i unoffset(int t, __m256i s, __m256i si) {
    if (t == T_Q4_0) return _mm256_sub_epi32(s, _mm256_slli_epi32(si, 3));
#ifdef QG_VNNI
    if (t == T_Q8_0) return _mm256_sub_epi32(s, _mm256_slli_epi32(si, 7));
#endif
    return s;
}

AI uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* the fp16 scales (and Q4_1's mins: the upper halves) of n (<= 8) consecutive blocks from b;
 * absent ones 0 */
AI __m256 block_scales(int t, const uint8_t *b, int n, __m256 *mins) {
    const int bb = block_bytes(t);
    uint32_t v[8];
    for (int i = 0; i < 8; i++) v[i] = i < n ? load32(b + i * bb) : 0;
    const __m256i g = _mm256_setr_epi32((int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4],
                                        (int)v[5], (int)v[6], (int)v[7]);
    /* per 128-bit lane: the low halves of the 4 dwords, then the high halves */
    const __m256i ctl = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0,
                                         1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, ctl), 0xD8);
    if (mins) *mins = _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

/* acc[i][r] += the products of n (<= 8) blocks from block g of weight rows b + i * ldw (i < RW)
 * with x rows r0 + r (r < R); Q4_1's mins go to accm */
AI void group_b32(int t, const uint8_t *b, int64_t ldw, int RW, const xquant *xq, int64_t r0,
                  int64_t g, int n, int R, __m256 acc[2][MAXR], __m256 accm[2][MAXR]) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    __m256i w[2][4], w2[2][4];
    __m256 dw[2], mins[2];
    for (int i = 0; i < RW; i++) {
        const uint8_t *bi = b + i * ldw;
        for (int q = 0; q < 4; q++) {
            w[i][q] = w2[i][q] = _mm256_setzero_si256();
            if (2 * q < n) prep_pair(t, bi + 2 * q * bb, bb, 2 * q + 1 < n, &w[i][q], &w2[i][q]);
        }
        mins[i] = _mm256_setzero_ps();
        dw[i] = block_scales(t, bi, n, t == T_Q4_1 ? &mins[i] : NULL);
    }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; r++) {
        const int64_t row = (r0 + r) * nb + g;
        const int8_t *x = xq->q + (r0 + r) * xq->qk + g * QK;
        __m256 dx, sx = _mm256_setzero_ps();
        __m256i si = _mm256_setzero_si256();
        if (n == 8) {
            dx = _mm256_loadu_ps(xq->d + row);
            if (t == T_Q4_1) sx = _mm256_loadu_ps(xq->s + row);
            else si = _mm256_loadu_si256((const __m256i *)(xq->si + row));
        } else { /* beyond the row's blocks: zeros */
            dx = _mm256_maskload_ps(xq->d + row, mask);
            if (t == T_Q4_1) sx = _mm256_maskload_ps(xq->s + row, mask);
            else si = _mm256_maskload_epi32((const int *)(xq->si + row), mask);
        }
        for (int i = 0; i < RW; i++) {
            __m256i p[4];
            for (int q = 0; q < 4; q++)
                p[q] = 2 * q < n ? dot_pair(t, w[i][q], w2[i][q], x + 2 * q * QK) : _mm256_setzero_si256();
            const __m256i s = unoffset(t, reduce_pairs(p), si);
            acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[i], dx), acc[i][r]);
            if (t == T_Q4_1) accm[i][r] = _mm256_fmadd_ps(mins[i], sx, accm[i][r]);
        }
    }
}

#ifdef QG_Z
/* 16 bytes from each of the blocks at b, b + 4 bb, b + 8 bb, b + 12 bb (128-bit lanes 0-3) */
AI __m512i load_quad(const uint8_t *b, int bb) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)b));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 4 * bb)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 8 * bb)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 12 * bb)), 3);
}

/* quad j of a group from its block j at b, as prep_pair does a pair */
AI void prep_quad(int t, const uint8_t *b, int bb, __m512i *lo, __m512i *hi) {
    if (t == T_Q8_0) {
        *lo = load_quad(b + 2, bb);
        *hi = load_quad(b + 18, bb);
#ifdef QG_ZVNNI
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        *lo = _mm512_xor_si512(*lo, flip);
        *hi = _mm512_xor_si512(*hi, flip);
#endif
        return;
    }
    const __m512i v = load_quad(b + (t == T_Q4_1 ? 4 : 2), bb);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(v, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

/* the dot products of a prepared quad with x laid out in quads (128 bytes) */
AI __m512i dot_quad(int t, __m512i lo, __m512i hi, const int8_t *x) {
    const __m512i xl = _mm512_loadu_si512(x), xh = _mm512_loadu_si512(x + 64);
#ifdef QG_ZVNNI
    (void)t;
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
#else
    const __m512i ones = _mm512_set1_epi16(1);
    if (t == T_Q8_0) { /* |w| x (x negated where w < 0), as dot_pair; no vpsignb in AVX-512 */
        const __m512i z = _mm512_setzero_si512();
        const __m512i pl = _mm512_maddubs_epi16(
            _mm512_abs_epi8(lo), _mm512_mask_sub_epi8(xl, _mm512_movepi8_mask(lo), z, xl));
        const __m512i ph = _mm512_maddubs_epi16(
            _mm512_abs_epi8(hi), _mm512_mask_sub_epi8(xh, _mm512_movepi8_mask(hi), z, xh));
        return _mm512_add_epi32(_mm512_madd_epi16(pl, ones), _mm512_madd_epi16(ph, ones));
    }
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh)), ones);
#endif
}

/* 4 quad vectors -> the 16 block sums in order (lane L of quad j: block 4 L + j) */
AI __m512i reduce_quads(const __m512i *p) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, c), _mm512_unpackhi_epi64(a, c));
}

AI __m512 join_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                               _mm256_castps_pd(hi), 1));
}

/* acc[i][r] += the products of the 16 blocks from block g (a multiple of 16) of weight rows
 * b + i * ldw (i < RW) with x rows r0 + r (r < R), Q4_1's mins included */
AI void group16(int t, const uint8_t *b, int64_t ldw, int RW, const xquant *xq, int64_t r0,
                int64_t g, int R, __m512 acc[2][MAXR]) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    __m512i w[2][4], w2[2][4];
    __m512 dw[2], mins[2];
    for (int i = 0; i < RW; i++) {
        const uint8_t *bi = b + i * ldw;
        for (int q = 0; q < 4; q++) prep_quad(t, bi + q * bb, bb, &w[i][q], &w2[i][q]);
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        const int q41 = t == T_Q4_1;
        const __m256 d0 = block_scales(t, bi, 8, q41 ? &m0 : NULL);
        const __m256 d1 = block_scales(t, bi + 8 * bb, 8, q41 ? &m1 : NULL);
        dw[i] = join_ps(d0, d1);
        mins[i] = join_ps(m0, m1);
    }
    for (int r = 0; r < R; r++) {
        const int64_t row = (r0 + r) * nb + g;
        const int8_t *x = xq->q + (r0 + r) * xq->qk + g * QK;
        const __m512 dx = _mm512_loadu_ps(xq->d + row);
        __m512 sx = _mm512_setzero_ps();
        __m512i si = _mm512_setzero_si512();
        if (t == T_Q4_1) sx = _mm512_loadu_ps(xq->s + row);
        else si = _mm512_loadu_si512(xq->si + row);
        for (int i = 0; i < RW; i++) {
            __m512i p[4];
            for (int q = 0; q < 4; q++) p[q] = dot_quad(t, w[i][q], w2[i][q], x + q * 128);
            __m512i s = reduce_quads(p);
            if (t == T_Q4_0) s = _mm512_sub_epi32(s, _mm512_slli_epi32(si, 3));
#ifdef QG_ZVNNI
            if (t == T_Q8_0) s = _mm512_sub_epi32(s, _mm512_slli_epi32(si, 7));
#endif
            acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[i], dx), acc[i][r]);
            if (t == T_Q4_1) acc[i][r] = _mm512_fmadd_ps(mins[i], sx, acc[i][r]);
        }
    }
}
#endif

/* y[r * ldy + i] = W row i . x row r0 + r (+ bias[i]) for RW weight rows from wrow and R rows of
 * x (int8), block-32 types: groups of 8 blocks, the last one partial; z (a constant): whole
 * groups of 16 first in zmm (x in the quad layout) */
AI void row_i8_b32(int t, const uint8_t *wrow, int64_t ldw, int RW, const xquant *xq, int64_t r0,
                   int R, float *y, int64_t ldy, const float *bias, int z) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    __m256 acc[2][MAXR], accm[2][MAXR];
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) acc[i][r] = accm[i][r] = _mm256_setzero_ps();
    int64_t g = 0;
    (void)z;
#ifdef QG_Z
    if (z && nb >= ZG) { /* whole groups of 16 in zmm, then the rest as below */
        __m512 az[2][MAXR];
        for (int i = 0; i < RW; i++)
            for (int r = 0; r < R; r++) az[i][r] = _mm512_setzero_ps();
        for (; g + ZG <= nb; g += ZG) group16(t, wrow + g * bb, ldw, RW, xq, r0, g, R, az);
        for (int i = 0; i < RW; i++)
            for (int r = 0; r < R; r++)
                acc[i][r] = _mm256_add_ps(_mm512_castps512_ps256(az[i][r]),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(az[i][r]), 1)));
    }
#endif
    for (; g + 8 <= nb; g += 8) group_b32(t, wrow + g * bb, ldw, RW, xq, r0, g, 8, R, acc, accm);
    /* the last group's size is a constant in each case: its masks and loads fold */
    const uint8_t *b = wrow + g * bb;
    switch (nb - g) {
    case 1: group_b32(t, b, ldw, RW, xq, r0, g, 1, R, acc, accm); break;
    case 2: group_b32(t, b, ldw, RW, xq, r0, g, 2, R, acc, accm); break;
    case 3: group_b32(t, b, ldw, RW, xq, r0, g, 3, R, acc, accm); break;
    case 4: group_b32(t, b, ldw, RW, xq, r0, g, 4, R, acc, accm); break;
    case 5: group_b32(t, b, ldw, RW, xq, r0, g, 5, R, acc, accm); break;
    case 6: group_b32(t, b, ldw, RW, xq, r0, g, 6, R, acc, accm); break;
    case 7: group_b32(t, b, ldw, RW, xq, r0, g, 7, R, acc, accm); break;
    default: break;
    }
    for (int i = 0; i < RW; i++)
        for (int r = 0; r < R; r++) {
            const __m256 a = t == T_Q4_1 ? _mm256_add_ps(acc[i][r], accm[i][r]) : acc[i][r];
            y[r * ldy + i] = hsum_ps(a) + (bias ? bias[i] : 0.0f);
        }
}

/* 8 int16 scales [s0..s7] as dwords [s0 s0, s1 s1, ..., s7 s7]: permutevar8x32 then gives any
 * scale in every int16 lane of a half, in one instruction */
AI __m256i dword_pairs(__m128i s16) {
    return _mm256_set_m128i(_mm_unpackhi_epi16(s16, s16), _mm_unpacklo_epi16(s16, s16));
}

AI __m256i pick(__m256i pairs, int lo, int hi) { /* int16 lanes 0-7: scale lo, 8-15: scale hi */
    return _mm256_permutevar8x32_epi32(pairs, _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi));
}

/* acc += (u8 x s8 pair sums) * int16 scales, into int32 */
AI __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i scale) {
    const __m256i p = _mm256_maddubs_epi16(u, s);
#ifdef QG_VNNI
    return _mm256_dpwssd_epi32(acc, p, scale);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

/* the 8 six-bit scales and mins of a Q4_K / Q5_K super-block (12 packed bytes), as bytes:
 * four at a time in 32-bit words */
AI void kscales8(const uint8_t *p, __m128i *sc, __m128i *mn) {
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)((uint64_t)sc_hi << 32 | sc_lo)));
    *mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)((uint64_t)mn_hi << 32 | mn_lo)));
}

/* sums[r] = W row . x row r (int8 per 256), K-quants, R rows of x */
AI void row_i8_k(int t, const uint8_t *wrow, const xquant *xq, int64_t r0, int R, float *sums) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT], accm[MT];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb; sb++) {
        const uint8_t *b = wrow + sb * bb;
        __m256i w[8], sc[8], mpairs = _mm256_setzero_si256(), s16 = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if (t == T_Q6_K) {
            d = f16(b + 208);
            const uint8_t *ql = b, *qh = b + 128;
            s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            for (int n = 0; n < 2; n++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
                const __m256i m30 = _mm256_set1_epi8(0x30);
                w[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                w[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
                w[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                               _mm256_and_si256(h, m30));
                w[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
                /* the scales of this half's 8 groups of 16 */
                const __m256i pairs = dword_pairs(n ? _mm256_extracti128_si256(s16, 1)
                                                    : _mm256_castsi256_si128(s16));
                for (int g = 0; g < 4; g++) sc[4 * n + g] = pick(pairs, 2 * g, 2 * g + 1);
            }
        } else {
            d = f16(b);
            dmin = f16(b + 2);
            const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16);
            __m128i sc8, mn8;
            kscales8(b + 4, &sc8, &mn8);
            const __m256i pairs = dword_pairs(sc8);
            for (int j = 0; j < 8; j++) sc[j] = pick(pairs, j, j);
            mpairs = dword_pairs(mn8); /* mins, twice each: against the sums of each 16 of x */
            __m256i h = _mm256_setzero_si256();
            if (t == T_Q5_K) h = _mm256_loadu_si256((const __m256i *)(b + 16));
            for (int c = 0; c < 4; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                w[2 * c] = _mm256_and_si256(q, m4);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                if (t == T_Q5_K) { /* bit j of qh[l] is bit 4 of element l of sub-block j */
                    const __m256i b1 = _mm256_set1_epi8(1);
                    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), b1);
                    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), b1);
                    w[2 * c] = _mm256_or_si256(w[2 * c], _mm256_slli_epi16(h0, 4));
                    w[2 * c + 1] = _mm256_or_si256(w[2 * c + 1], _mm256_slli_epi16(h1, 4));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t row = (r0 + r) * nb + sb;
            const int8_t *x = xq->q + row * QKK;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(xq->bs + row * 16));
            __m256i isum = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++)
                isum = dot_scaled(isum, w[i], _mm256_loadu_si256((const __m256i *)(x + 32 * i)), sc[i]);
            const float dx = xq->d[row];
            if (t == T_Q6_K) { /* the values are q + 32: less 32 * sum(scale * bsum) */
                isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(bs, s16), 5));
            } else { /* the mins: dmin * sum(min_j * sum of x over sub-block j) */
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mpairs)),
                                          _mm256_set1_ps(dmin * dx), accm[r]);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dx), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum_ps(_mm256_sub_ps(acc[r], accm[r]));
}

#else /* portable: scalar */

AI void row1_i8_b32(int t, const uint8_t *wrow, const xquant *xq, int64_t r0, int R, float *sums) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    for (int r = 0; r < R; r++) sums[r] = 0.0f;
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *b = wrow + g * bb;
        int8_t w[QK];
        float dw = f16(b), mw = 0.0f;
        if (t == T_Q8_0) {
            memcpy(w, b + 2, QK);
        } else {
            const uint8_t *qs = b + (t == T_Q4_1 ? 4 : 2);
            const int off = t == T_Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) {
                w[i] = (int8_t)((qs[i] & 0x0F) - off);
                w[i + 16] = (int8_t)((qs[i] >> 4) - off);
            }
            if (t == T_Q4_1) mw = f16(b + 2);
        }
        for (int r = 0; r < R; r++) {
            const int64_t row = (r0 + r) * nb + g;
            const int8_t *x = xq->q + row * QK;
            int32_t s = 0;
            for (int i = 0; i < QK; i++) s += w[i] * x[i];
            sums[r] += dw * xq->d[row] * (float)s + mw * xq->s[row];
        }
    }
}

AI void row_i8_b32(int t, const uint8_t *wrow, int64_t ldw, int RW, const xquant *xq, int64_t r0,
                   int R, float *y, int64_t ldy, const float *bias, int z) {
    (void)z;
    for (int i = 0; i < RW; i++) {
        float sums[MT];
        row1_i8_b32(t, wrow + i * ldw, xq, r0, R, sums);
        for (int r = 0; r < R; r++) y[r * ldy + i] = sums[r] + (bias ? bias[i] : 0.0f);
    }
}

AI void row_i8_k(int t, const uint8_t *wrow, const xquant *xq, int64_t r0, int R, float *sums) {
    const int bb = block_bytes(t);
    const int64_t nb = xq->nb;
    for (int r = 0; r < R; r++) sums[r] = 0.0f;
    for (int64_t sb = 0; sb < nb; sb++) {
        const uint8_t *b = wrow + sb * bb;
        int8_t w[QKK];
        int sc[16], mn[8] = {0}, per; /* scales per `per` elements */
        float d, dmin = 0.0f;
        if (t == T_Q6_K) {
            const uint8_t *ql = b, *qh = b + 128;
            d = f16(b + 208);
            per = 16;
            for (int i = 0; i < 16; i++) sc[i] = ((const int8_t *)(b + 192))[i];
            for (int n = 0; n < 2; n++)
                for (int g = 0; g < 4; g++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t lq = ql[64 * n + 32 * (g & 1) + l];
                        const int v = ((lq >> (4 * (g >> 1))) & 0x0F) | (((qh[32 * n + l] >> (2 * g)) & 3) << 4);
                        w[128 * n + 32 * g + l] = (int8_t)(v - 32);
                    }
        } else {
            const uint8_t *qs = b + (t == T_Q5_K ? 48 : 16), *qh = b + 16;
            d = f16(b);
            dmin = f16(b + 2);
            per = 32;
            for (int j = 0; j < 8; j++) {
                kscale(b + 4, j, &sc[j], &mn[j]);
                for (int l = 0; l < 32; l++) {
                    int v = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0x0F;
                    if (t == T_Q5_K) v |= ((qh[l] >> j) & 1) << 4;
                    w[32 * j + l] = (int8_t)v;
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t row = (r0 + r) * nb + sb;
            const int8_t *x = xq->q + row * QKK;
            const int16_t *bs = xq->bs + row * 16;
            int32_t isum = 0, msum = 0;
            for (int g = 0; g < QKK / per; g++) {
                int32_t s = 0;
                for (int i = g * per; i < g * per + per; i++) s += w[i] * x[i];
                isum += sc[g] * s;
            }
            for (int j = 0; j < 8; j++) msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
            sums[r] += d * xq->d[row] * (float)isum - dmin * xq->d[row] * (float)msum;
        }
    }
}
#endif

/* ---- the product ---------------------------------------------------------------------------- */

static int is_k(int t) { return t == T_Q4_K || t == T_Q5_K || t == T_Q6_K; }

/* y[r * ldy + i] = W row i . x row r0 + r (+ bias[i]) for RW (constant) weight rows from wrow
 * and R (constant) rows of x */
AI void row_any(int t, int int8, const uint8_t *wrow, int64_t ldw, int RW, int64_t k,
                const float *x, int64_t ldx, const xquant *xq, int64_t r0, int R, float *y,
                int64_t ldy, const float *bias) {
    if (int8 && !is_k(t)) {
#ifdef QG_Z
        if (xq->quads) {
            row_i8_b32(t, wrow, ldw, RW, xq, r0, R, y, ldy, bias, 1);
            return;
        }
#endif
        row_i8_b32(t, wrow, ldw, RW, xq, r0, R, y, ldy, bias, 0);
        return;
    }
    for (int i = 0; i < RW; i++) {
        float sums[MT];
        if (!int8) row_f32(t, wrow + i * ldw, k, x + r0 * ldx, ldx, R, sums);
        else row_i8_k(t, wrow + i * ldw, xq, r0, R, sums);
        for (int r = 0; r < R; r++) y[r * ldy + i] = sums[r] + (bias ? bias[i] : 0.0f);
    }
}

/* rows [j0, j1) of W against all m rows of x, for one type (constant at each call): MT rows of x
 * per pass over a weight row (first MTZ at a time on the zmm path), the last 1-3 rows of x two
 * weight rows at a time */
AI void rows_typed(int t, int int8, const uint8_t *w, int64_t ldw, int64_t j0, int64_t j1,
                   int64_t k, const float *x, int64_t ldx, int64_t m, const xquant *xq, float *y,
                   int64_t ldy, const float *bias) {
    int64_t done = 0;
#ifdef QG_Z
    if (int8 && xq->quads) { /* more rows of x per unpacked block: 32 zmm registers hold them */
        done = m / MTZ * MTZ;
        for (int64_t j = j0; j < j1; j++)
            for (int64_t r = 0; r < done; r += MTZ)
                row_i8_b32(t, w + j * ldw, ldw, 1, xq, r, MTZ, y + r * ldy + j, ldy,
                           bias ? bias + j : NULL, 1);
        if (MTZ > 8 && m - done >= 8) {
            for (int64_t j = j0; j < j1; j++)
                row_i8_b32(t, w + j * ldw, ldw, 1, xq, done, 8, y + done * ldy + j, ldy,
                           bias ? bias + j : NULL, 1);
            done += 8;
        }
    }
#endif
    const int64_t full = done + (m - done) / MT * MT;
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r = done; r < full; r += MT)
            row_any(t, int8, w + j * ldw, ldw, 1, k, x, ldx, xq, r, MT, y + r * ldy + j, ldy,
                    bias ? bias + j : NULL);
    if (full == m) return;
    float *yr = y + full * ldy;
    int64_t j = j0;
#define QG_REST(RW)                                                                              \
    switch (m - full) {                                                                          \
    case 3: row_any(t, int8, w + j * ldw, ldw, RW, k, x, ldx, xq, full, 3, yr + j, ldy, bias ? bias + j : NULL); break; \
    case 2: row_any(t, int8, w + j * ldw, ldw, RW, k, x, ldx, xq, full, 2, yr + j, ldy, bias ? bias + j : NULL); break; \
    default: row_any(t, int8, w + j * ldw, ldw, RW, k, x, ldx, xq, full, 1, yr + j, ldy, bias ? bias + j : NULL); break; \
    }
    for (; j + 2 <= j1; j += 2) QG_REST(2)
    if (j < j1) QG_REST(1)
#undef QG_REST
}

#define QG_ROWS_CASE(T, int8)                                                                    \
    case T: rows_typed(T, int8, w, ldw, j0, j1, k, x, ldx, m, xq, y, ldy, bias); break;
#define QG_TYPE_CASES(int8)                                                                      \
    QG_ROWS_CASE(T_Q4_0, int8) QG_ROWS_CASE(T_Q4_1, int8) QG_ROWS_CASE(T_Q8_0, int8)            \
    QG_ROWS_CASE(T_Q4_K, int8) QG_ROWS_CASE(T_Q5_K, int8) QG_ROWS_CASE(T_Q6_K, int8)

/* The int8 rows are compiled in translation units of their own, the block-32 types' and the
 * K-quants' (quant_gemm_int8_b32.c and quant_gemm_int8_k.c include this file with QG_INT8_UNIT
 * set to 1 or 2): built as one function with the rest, the file took 85 s at -march=x86-64-v4 on
 * a Zen 4; in three units on two cores, ~30 s. */
#define QG_INT8_ROWS(name)                                                                        \
    __attribute__((visibility("hidden"))) void name(                                             \
        int t, const uint8_t *w, int64_t ldw, int64_t j0, int64_t j1, int64_t k, const float *x, \
        int64_t ldx, int64_t m, const xquant *xq, float *y, int64_t ldy, const float *bias)
QG_INT8_ROWS(stepserve_qg_rows_int8_b32);
QG_INT8_ROWS(stepserve_qg_rows_int8_k);

#if defined(QG_INT8_UNIT) && QG_INT8_UNIT == 1
QG_INT8_ROWS(stepserve_qg_rows_int8_b32) {
    switch (t) { QG_ROWS_CASE(T_Q4_0, 1) QG_ROWS_CASE(T_Q4_1, 1) QG_ROWS_CASE(T_Q8_0, 1) }
}
#elif defined(QG_INT8_UNIT) && QG_INT8_UNIT == 2
QG_INT8_ROWS(stepserve_qg_rows_int8_k) {
    switch (t) { QG_ROWS_CASE(T_Q4_K, 1) QG_ROWS_CASE(T_Q5_K, 1) QG_ROWS_CASE(T_Q6_K, 1) }
}
#else
static void rows(int t, int int8, const uint8_t *w, int64_t ldw, int64_t j0, int64_t j1, int64_t k,
                 const float *x, int64_t ldx, int64_t m, const xquant *xq, float *y, int64_t ldy,
                 const float *bias) {
    if (int8 && is_k(t)) {
        stepserve_qg_rows_int8_k(t, w, ldw, j0, j1, k, x, ldx, m, xq, y, ldy, bias);
    } else if (int8) {
        stepserve_qg_rows_int8_b32(t, w, ldw, j0, j1, k, x, ldx, m, xq, y, ldy, bias);
    } else {
        switch (t) { QG_TYPE_CASES(0) }
    }
}

static void quantize_x(int t, const float *x, int64_t ldx, int64_t r, int64_t k, xquant *xq) {
    const int64_t nb = xq->nb;
    if (is_k(t)) quantize_row_k(x + r * ldx, k, xq->q + r * xq->qk, xq->d + r * nb, xq->bs + r * nb * 16);
    else
        quantize_row_b32(x + r * ldx, k, xq->q + r * xq->qk, xq->d + r * nb, xq->s + r * nb,
                         xq->si + r * nb, PAIRED(t), xq->quads);
}

static int threads_for(int64_t bytes, int64_t units, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (bytes < PARALLEL_BYTES) return 1;
    return units < num_threads ? (int)(units > 0 ? units : 1) : num_threads;
}

/* Which SIMD path this build has: 0 scalar, 1 AVX2 (maddubs), 2 AVX-512 build of the AVX2 path,
 * 3 AVX512-VNNI. */
int stepserve_quant_isa(void) {
#if defined(QG_VNNI)
    return 3;
#elif defined(QG_AVX2) && defined(__AVX512BW__)
    return 2;
#elif defined(QG_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y[m, j] = x[m, :] . W[j, :] (+ bias[j]) for W of n rows (row stride ldw bytes) and k columns of
 * type qtype; x fp32 [m, k] (row stride ldx), y fp32 (row stride ldy). int8: quantize x and
 * take integer products, else de-quantize W in registers. Returns 0, -1 for a type or shape it
 * does not take, -2 when its scratch cannot be allocated. */
int stepserve_quant_matmul(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                           const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                           const float *bias, int int8, int num_threads) {
    const int bb = block_bytes(qtype);
    if (!bb || k % block_elems(qtype) || n < 0 || m < 0) return -1;
    if (n == 0 || m == 0) return 0;
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int nt = threads_for(n * ldw * (m < 8 ? m : 8), tasks, num_threads);
    /* few rows of x: every thread quantizes them into its own copy (no barrier between the
     * quantization and the products); more: the threads share the work and one copy */
    const int private_x = int8 && m <= PRIVATE_X_ROWS;
    const int copies = private_x ? nt : 1;
    const int64_t nb = k / block_elems(qtype);
    const int64_t qk = PAIRED(qtype) ? (nb + 1) / 2 * 2 * QK : k;
    const size_t qbytes = ((size_t)(m * qk) + 63) / 64 * 64;
    const size_t per = is_k(qtype) ? sizeof(float) + 16 * sizeof(int16_t)
                                   : 2 * sizeof(float) + sizeof(int32_t);
    const size_t copy_bytes = qbytes + ((size_t)(m * nb) * per + 63) / 64 * 64;
    void *scratch = NULL;
    if (int8 && !(scratch = aligned_alloc(64, copy_bytes * copies))) return -2;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = 0, team = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        xquant xq = {0};
        if (int8) {
            char *base = (char *)scratch + (private_x ? (size_t)tid * copy_bytes : 0);
            xq.nb = nb;
            xq.qk = qk;
#ifdef QG_Z
            /* few rows of x: the ymm kernel, which unpacks a weight block for less */
            xq.quads = PAIRED(qtype) && m >= ZMIN;
#endif
            xq.q = (int8_t *)base;
            xq.d = (float *)(base + qbytes);
            if (is_k(qtype)) {
                xq.bs = (int16_t *)(xq.d + m * nb);
            } else {
                xq.s = xq.d + m * nb;
                xq.si = (int32_t *)(xq.s + m * nb);
            }
            if (private_x) {
                for (int64_t r = 0; r < m; r++) quantize_x(qtype, x, ldx, r, k, &xq);
            } else {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < m; r++) quantize_x(qtype, x, ldx, r, k, &xq);
            }
        }
        /* contiguous ranges of rows, one per thread: each streams its own part of W */
        const int64_t t0 = tasks * tid / team, t1 = tasks * (tid + 1) / team;
        const int64_t j0 = t0 * ROWS_PER_TASK, j1 = t1 * ROWS_PER_TASK < n ? t1 * ROWS_PER_TASK : n;
        if (j0 < j1) rows(qtype, int8, w, ldw, j0, j1, k, x, ldx, m, &xq, y, ldy, bias);
    }
    free(scratch);
    return 0;
}

/* out[i, :] = W[ids[i], :] de-quantized (ids NULL: rows 0..nrows-1), out row stride ldo floats.
 * Exactly gguf's reference values. Returns 0, -1 for a type or shape it does not take, -3 for a
 * row id out of [0, n). */
int stepserve_quant_dequantize(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                               const int64_t *ids, int64_t nrows, float *out, int64_t ldo,
                               int num_threads) {
    const int bb = block_bytes(qtype);
    if (!bb || k % block_elems(qtype)) return -1;
    if (ids)
        for (int64_t i = 0; i < nrows; i++)
            if (ids[i] < 0 || ids[i] >= n) return -3;
    const int64_t nblk = k / block_elems(qtype);
    const int nt = threads_for(nrows * ldw, nrows, num_threads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t j = ids ? ids[i] : i;
        dq_blocks(qtype, w + j * ldw, (int)nblk, out + i * ldo);
    }
    return 0;
}
#endif /* the int8 units */
