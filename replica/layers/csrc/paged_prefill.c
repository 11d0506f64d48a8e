/* Causal prefill attention over the paged KV cache for the CPU, tiled as flash attention is:
 * a tile of queries (QT query tokens x the query heads sharing one KV head) meets the keys in
 * tiles of KT, with a running max and sum per row (online softmax), so each key and value row
 * is widened and read once per query tile, not once per query, and nothing of size
 * queries x keys is ever held. Chunked prefill and prefix hits are the same case: a span's
 * queries sit at positions ctx_start.. and attend every key up to their own position, the
 * earlier ones (an earlier chunk, a cached prefix) read where they lie in the block cache.
 *
 * Layouts (row-major):
 *   q            [num_tokens, num_heads, head_dim], q_stride elements from one token's row to
 *                the next (the query heads read where the qkv projection wrote them)
 *   out          [num_tokens, num_heads, head_dim], contiguous (the step's flat stream)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]  (the step's K/V written)
 *   block_table  int32 [num_spans, max_blocks]
 *   q_starts     int32 [num_spans]  a span's first query row in q
 *   q_lens       int32 [num_spans]  its query tokens
 *   ctx_starts   int32 [num_spans]  the position of its first query (keys before it: cached)
 * window > 0: a sliding window, a query at position p attends keys p-window+1..p only (keys
 * before a query tile's first window are never read: the KV manager may have freed their
 * blocks); soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) before the
 * softmax. 0 for either: as without.
 * Element type: fp32, or bf16 (kv_elements.h); accumulation in fp32.
 *
 * The score tile is a KT-wide row updated by broadcast-multiply-adds over the key tile held
 * transposed, and p v is a multiply-add over head_dim, both in register blocks (explicit
 * AVX-512 and AVX2 code, plain loops elsewhere); built per instruction-set level (cpu_isa.py).
 * The common head sizes get bodies with head_dim known. A key tile is transposed once per
 * worker and (span, KV head), not once per query tile that reads it (scratch_t); a tile on the
 * diagonal computes only the keys some row of a register block sees; the softmax of a row is
 * vectorized whole (AVX-512: the exponential by the exponent-scaling instruction, the blocks'
 * corrections in one vector). At 128-2048 tokens these took the kernel from 60-90 to 80-118
 * GFLOP/s on one AVX-512 core (docs/perf-engine.md, "Prefill attention, session 56"). */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_elements.h"
#include "vec_exp.h"

#define QT 32 /* query tokens per tile */
/* Per instruction set: keys per tile (KT), head_dim elements per register chunk of p v (VC),
 * and rows per register block (RB). A block keeps many independent sums in flight, as many as
 * the registers hold: AVX-512's 32 registers take 6 rows of four vectors (24 accumulators; a
 * 64-key tile halves the softmax's per-row reductions against 32 keys: 8 rows of two vectors
 * ran 1.1-1.15x slower from 512 tokens on), AVX2's 16 take 6 rows of two (12). Fewer chains
 * leave the code waiting on the latency of its multiply-adds (docs/perf-engine.md, "Prefill
 * attention"). */
#if defined(__AVX512F__)
#define KT 64
#define VC 64
#define RB 6
#elif defined(__AVX2__) && defined(__FMA__)
#define KT 16
#define VC 16
#define RB 6
#else
#define KT 16
#define VC 16
#define RB 4
#endif
/* a masked score: finite (the library is built with -ffast-math, which assumes no infinities),
 * and far enough below any real score that its exponential is 0 */
#define MASKED (-1.0e30f)

/* e^x for x <= 0 (scores minus their running max), 0 below -87: 2^n e^f with n = round(x /
 * ln 2), f = x - n ln 2 (ln 2 split in two so f is exact), e^f by its Taylor series to degree
 * 6 (|f| <= ln 2 / 2: relative error ~1e-7). Plain arithmetic, so the compiler vectorizes the
 * loops that call it (libm's expf, called per element, cost more than the dot products). */
static inline float exp_nonpositive(float x) {
    const float t = x < -87.0f ? -87.0f : x;
    const float n = floorf(t * 1.44269504088896341f + 0.5f);
    const float f = t - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const float e = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f +
                    f * (8.3333333e-3f + f * 1.3888889e-3f)))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : e * scale;
}

/* The two products of a tile, per register block of RB rows: scores = q k^T over the key tile
 * held transposed ([d, KT], so each of its rows is one or two vectors dotted with a broadcast
 * query element: no horizontal sums), and acc = acc * corr + p v over a VC-wide chunk of
 * head_dim. Explicit AVX-512 and AVX2 (with FMA) code, the accumulators in registers; a
 * portable loop elsewhere. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* scores of RB rows against the first 16 nv keys of the tile */
ALWAYS_INLINE void qk_nv(const float *q, int d, const float *kt, float sc[RB][KT], const int nv) {
    __m512 a[RB][KT / 16];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; r++)
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++) a[r][v] = _mm512_setzero_ps();
    for (int i = 0; i < d; i++) {
        __m512 k[KT / 16];
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++) k[v] = _mm512_load_ps(kt + (int64_t)i * KT + 16 * v);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RB; r++) {
            const __m512 qv = _mm512_set1_ps(q[(int64_t)r * d + i]);
            _Pragma("GCC unroll 8")
            for (int v = 0; v < nv; v++) a[r][v] = _mm512_fmadd_ps(qv, k[v], a[r][v]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; r++)
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(sc[r] + 16 * v, a[r][v]);
}
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT], int nv) {
    switch (nv) {
    case 1: qk_nv(q, d, kt, sc, 1); break;
    case 2: qk_nv(q, d, kt, sc, 2); break;
    case 3: qk_nv(q, d, kt, sc, 3); break;
    default: qk_nv(q, d, kt, sc, 4);
    }
}
/* acc = acc * corr + p v over 16 nv columns of head_dim (acc and vt offset to them) */
ALWAYS_INLINE void pv_nv(float *acc, int d, const float *corr, const float *p, int nk,
                         const float *vt, const int nv) {
    __m512 a[RB][4];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; r++) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++)
            a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)r * d + 16 * v), c);
    }
    for (int j = 0; j < nk; j++) {
        __m512 x[4];
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++) x[v] = _mm512_loadu_ps(vt + (int64_t)j * d + 16 * v);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RB; r++) {
            const __m512 pj = _mm512_set1_ps(p[r * KT + j]);
            _Pragma("GCC unroll 8")
            for (int v = 0; v < nv; v++) a[r][v] = _mm512_fmadd_ps(pj, x[v], a[r][v]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; r++)
        _Pragma("GCC unroll 8")
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + (int64_t)r * d + 16 * v, a[r][v]);
}
/* the columns of head_dim in chunks of 64, 32 and 16 held in registers; returns how many it
 * covered (a multiple of 16) */
static inline int pv_block(float *acc, int d, const float *corr, const float *p, int nk,
                           const float *vt) {
    int c = 0;
    for (; c + 64 <= d; c += 64) pv_nv(acc + c, d, corr, p, nk, vt + c, 4);
    if (c + 32 <= d) {
        pv_nv(acc + c, d, corr, p, nk, vt + c, 2);
        c += 32;
    }
    if (c + 16 <= d) {
        pv_nv(acc + c, d, corr, p, nk, vt + c, 1);
        c += 16;
    }
    return c;
}

ALWAYS_INLINE float softmax_row(float *sc, int nv, int first, int last, float m, float *p,
                                float *sum) {
    __m512 s[KT / 16];
    for (int v = 0; v < nv; v++) s[v] = _mm512_loadu_ps(sc + 16 * v);
    if (first > 0 || last < KT - 1) {
        const __m512i j0 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i lo = _mm512_set1_epi32(first), hi = _mm512_set1_epi32(last);
        const __m512 masked = _mm512_set1_ps(MASKED);
        for (int v = 0; v < nv; v++) {
            const __m512i j = _mm512_add_epi32(j0, _mm512_set1_epi32(16 * v));
            s[v] = _mm512_mask_blend_ps(
                _mm512_cmpge_epi32_mask(j, lo) & _mm512_cmple_epi32_mask(j, hi), masked, s[v]);
        }
    }
    __m512 top = s[0];
    for (int v = 1; v < nv; v++) top = _mm512_max_ps(top, s[v]);
    const float t = _mm512_reduce_max_ps(top);
    const float mx = t > m ? t : m;
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int v = 0; v < nv; v++) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(s[v], mv));
        _mm512_storeu_ps(p + 16 * v, e);
        total = _mm512_add_ps(total, e);
    }
    *sum = _mm512_reduce_add_ps(total);
    return mx;
}

static inline void exp_rows(float *v) {
    _mm512_mask_storeu_ps(v, (1u << RB) - 1,
                          exp_nonpositive16(_mm512_maskz_loadu_ps((1u << RB) - 1, v)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT], int nv) {
    (void)nv; /* every key of the tile */
    __m256 a[RB][2];
    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int i = 0; i < d; i++) {
        const __m256 k0 = _mm256_load_ps(kt + (int64_t)i * KT);
        const __m256 k1 = _mm256_load_ps(kt + (int64_t)i * KT + 8);
        for (int r = 0; r < RB; r++) {
            const __m256 qv = _mm256_broadcast_ss(q + (int64_t)r * d + i);
            a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm256_storeu_ps(sc[r], a[r][0]);
        _mm256_storeu_ps(sc[r] + 8, a[r][1]);
    }
}
static inline void pv_chunk(float *acc, int d, const float *corr, const float *p, int nk,
                            const float *vt) {
    __m256 a[RB][2];
    for (int r = 0; r < RB; r++) {
        const __m256 c = _mm256_set1_ps(corr[r]);
        a[r][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)r * d), c);
        a[r][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)r * d + 8), c);
    }
    for (int j = 0; j < nk; j++) {
        const __m256 v0 = _mm256_loadu_ps(vt + (int64_t)j * d);
        const __m256 v1 = _mm256_loadu_ps(vt + (int64_t)j * d + 8);
        for (int r = 0; r < RB; r++) {
            const __m256 pj = _mm256_broadcast_ss(p + r * KT + j);
            a[r][0] = _mm256_fmadd_ps(pj, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(pj, v1, a[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm256_storeu_ps(acc + (int64_t)r * d, a[r][0]);
        _mm256_storeu_ps(acc + (int64_t)r * d + 8, a[r][1]);
    }
}

static inline int pv_block(float *acc, int d, const float *corr, const float *p, int nk,
                           const float *vt) {
    int c = 0;
    for (; c + VC <= d; c += VC) pv_chunk(acc + c, d, corr, p, nk, vt + c);
    return c;
}
#else
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT], int nv) {
    (void)nv; /* every key of the tile */
    for (int r = 0; r < RB; r++)
        for (int j = 0; j < KT; j++) sc[r][j] = 0.0f;
    for (int i = 0; i < d; i++)
        for (int r = 0; r < RB; r++) {
            const float qv = q[(int64_t)r * d + i];
            for (int j = 0; j < KT; j++) sc[r][j] += qv * kt[(int64_t)i * KT + j];
        }
}
static inline void pv_chunk(float *acc, int d, const float *corr, const float *p, int nk,
                            const float *vt) {
    for (int r = 0; r < RB; r++) {
        float *ar = acc + (int64_t)r * d;
        for (int i = 0; i < VC; i++) ar[i] *= corr[r];
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < VC; i++) ar[i] += p[r * KT + j] * vt[(int64_t)j * d + i];
    }
}

static inline int pv_block(float *acc, int d, const float *corr, const float *p, int nk,
                           const float *vt) {
    int c = 0;
    for (; c + VC <= d; c += VC) pv_chunk(acc + c, d, corr, p, nk, vt + c);
    return c;
}
#endif

#if !defined(__AVX512F__)
/* One row of a tile's scores: keys outside first..last masked; returns the row's running max
 * (at least m), writes p = exp(score - max) and their sum. */
static inline float softmax_row(float *sc, int nv, int first, int last, float m, float *p,
                                float *sum) {
    (void)nv;
    float mx = m;
    for (int j = 0; j < KT; j++) {
        if (j > last || j < first) sc[j] = MASKED;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    float s = 0.0f;
    for (int j = 0; j < KT; j++) {
        const float e = exp_nonpositive(sc[j] - mx);
        p[j] = e;
        s += e;
    }
    *sum = s;
    return mx;
}

/* v = exp(v) for RB values <= 0 */
static inline void exp_rows(float *v) {
    for (int r = 0; r < RB; r++) v[r] = exp_nonpositive(v[r]);
}
#endif

typedef struct {
    const void *q, *k, *v;
    int64_t q_stride; /* elements from one token's query row to the next */
    const int32_t *block_table, *q_starts, *q_lens, *ctx_starts;
    void *out;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, bf16;
    float scale;
    int window;
    float soft_cap;
} problem_t;

typedef struct {
    int span, kv_head, tile; /* the tile-th QT queries of the span, one KV head */
} item_t;

/* A worker's scratch. Its key and value tiles are kept for the (span, KV head) it last worked on:
 * the items of one (span, head) come in a row (latest query tile first), and each reads the
 * key tiles up to its own, so a tile is transposed and widened once per worker, not once per
 * query tile that reads it (at 512 tokens the per-item transposes were 8% of the kernel). The
 * first `cap` tiles of a span are kept; tiles past them go through one spare slot, refilled at
 * each use. */
typedef struct {
    float *qf, *acc, *m, *l, *p; /* [R,d] [R,d] [R] [R] [RB,KT] */
    float *kc, *vc;              /* cap + 1 tiles: K^T [d, KT] and V [KT, d] each */
    int32_t *from;               /* [cap]: tile t of (span, g) is in kc/vc from this key on */
    int cap, span, g;
    int64_t tile_floats;
} scratch_t;

/* Key tile `tile` of (span, g) transposed to [d, KT] and its value tile [KT, d], in fp32, from
 * key `lo` on (the first key the item reads: a sliding window's queries never reach the keys
 * before it, whose blocks the KV manager may have freed, so they are not read but zeroed),
 * zero past the span's last key (keys past a query's own position are masked by its scores).
 * A kept tile read from `from[tile]` on serves any item that reads from there or later. */
static inline void tile_kv(const problem_t *p, scratch_t *s, int span, int g, int tile, int lo,
                           const int d, const float **kt_out, const float **vt_out) {
    if (s->span != span || s->g != g) {
        for (int t = 0; t < s->cap; t++) s->from[t] = INT32_MAX;
        s->span = span;
        s->g = g;
    }
    const int slot = tile < s->cap ? tile : s->cap;
    float *restrict kt = s->kc + (int64_t)slot * s->tile_floats;
    float *restrict vt = s->vc + (int64_t)slot * s->tile_floats;
    *kt_out = kt;
    *vt_out = vt;
    if (tile < s->cap && s->from[tile] <= lo) return;
    const int bs = p->block_size, bf16 = p->bf16, t0 = tile * KT;
    const int total = p->ctx_starts[span] + p->q_lens[span];
    const int nk = total - t0 < KT ? total - t0 : KT;
    const int64_t kv_row = (int64_t)p->num_kv_heads * d;
    const int32_t *table = p->block_table + (int64_t)span * p->max_blocks;
    for (int j = 0; j < KT; j++) {
        if (j >= nk || t0 + j < lo) {
            for (int i = 0; i < d; i++) kt[(int64_t)i * KT + j] = 0.0f;
            for (int i = 0; i < d; i++) vt[(int64_t)j * d + i] = 0.0f;
            continue;
        }
        const int t = t0 + j;
        const int64_t at = ((int64_t)table[t / bs] * bs + t % bs) * kv_row + (int64_t)g * d;
        for (int i = 0; i < d; i++) kt[(int64_t)i * KT + j] = load(p->k, at + i, bf16);
        row_f32(p->v, at, d, bf16, vt + (int64_t)j * d);
    }
    if (tile < s->cap) s->from[tile] = lo;
}

static inline __attribute__((always_inline)) void tile_body(const problem_t *p, item_t it,
                                                            scratch_t *s, const int d) {
    const int heads = p->num_heads, kvh = p->num_kv_heads, group = heads / kvh;
    const int bf16 = p->bf16, g = it.kv_head;
    const int n = p->q_lens[it.span], ctx = p->ctx_starts[it.span];
    const int q0 = it.tile * QT, nq = n - q0 < QT ? n - q0 : QT;
    const int rows = nq * group; /* row r: query q0 + r / group, head g * group + r % group */
    const int padded = (rows + RB - 1) / RB * RB;
    (void)kvh;
    float *restrict qf = s->qf, *restrict acc = s->acc, *restrict m = s->m, *restrict l = s->l;
    float *restrict pr = s->p;

    for (int r = 0; r < padded; r++) {
        float *qr = qf + (int64_t)r * d;
        if (r < rows) {
            const int64_t row = (int64_t)(p->q_starts[it.span] + q0 + r / group) * p->q_stride +
                                (int64_t)(g * group + r % group) * d;
            row_f32(p->q, row, d, bf16, qr);
            for (int i = 0; i < d; i++) qr[i] *= p->scale;
        } else {
            for (int i = 0; i < d; i++) qr[i] = 0.0f; /* padding rows: computed, never stored */
        }
        for (int i = 0; i < d; i++) acc[(int64_t)r * d + i] = 0.0f;
        m[r] = MASKED;
        l[r] = 0.0f;
    }
    const int last_key = ctx + q0 + nq - 1; /* the tile's last query sees keys 0..last_key */
    const int window = p->window;
    /* the tile's first query sees keys from first_key on: earlier key tiles are skipped */
    const int first_key = window > 0 && ctx + q0 - window + 1 > 0 ? ctx + q0 - window + 1 : 0;
    for (int t0 = first_key / KT * KT; t0 <= last_key; t0 += KT) {
        const int nk = last_key + 1 - t0 < KT ? last_key + 1 - t0 : KT;
        const float *kt, *vt;
        tile_kv(p, s, it.span, g, t0 / KT, first_key > t0 ? first_key : t0, d, &kt, &vt);
        /* the first row block whose queries see any key of this tile (earlier rows' keys all
         * come before t0 only once t0 > their position: rows are in position order) */
        for (int r0 = 0; r0 < padded; r0 += RB) {
            /* the block's last row's query position: rows are in position order */
            const int last_pos = ctx + q0 + (r0 + RB - 1 < rows ? r0 + RB - 1 : rows - 1) / group;
            if (t0 > last_pos) continue; /* no row of the block sees a key of this tile */
            /* nor a block whose every row's window starts after this tile's last key */
            if (window > 0 && t0 + nk - 1 <= ctx + q0 + (r0 < rows ? r0 : rows - 1) / group - window)
                continue;
            /* the tile's keys some row of the block sees, in vectors of 16 (a tile on the
             * diagonal: the rest are masked for every row, so neither product computes them) */
            const int kb = last_pos - t0 + 1 < nk ? last_pos - t0 + 1 : nk;
            const int nv = (kb + 15) / 16;
            /* scores of RB rows x KT keys: each key row of the tile is loaded once for the RB
             * rows (register blocking) */
            float sc[RB][KT];
            qk_block(qf + (int64_t)r0 * d, d, kt, sc, nv);
            if (p->soft_cap > 0.0f) {
                const float cap = p->soft_cap, inv = 1.0f / cap;
                for (int rr = 0; rr < RB; rr++)
                    for (int j = 0; j < KT; j++) sc[rr][j] = cap * tanhf(sc[rr][j] * inv);
            }
            float corr[RB], mx[RB], sum[RB];
            for (int rr = 0; rr < RB; rr++) {
                const int r = r0 + rr;
                const int pos = ctx + q0 + (r < rows ? r : rows - 1) / group;
                /* keys before `first` are outside the row's window (0: none are). A row may see no
                 * key of a tile; if it has seen none before either, its sums are wiped by the
                 * correction factor (0) of the first tile it does see (its own position). */
                const int first = window > 0 ? pos - window + 1 - t0 : 0; /* seen: first..last */
                const int last = pos - t0 < kb - 1 ? pos - t0 : kb - 1;
                mx[rr] = nv == KT / 16 /* the whole tile: loops of known length */
                             ? softmax_row(sc[rr], KT / 16, first, last, m[r], pr + rr * KT, &sum[rr])
                             : softmax_row(sc[rr], nv, first, last, m[r], pr + rr * KT, &sum[rr]);
                corr[rr] = m[r] - mx[rr];
            }
            exp_rows(corr); /* exp(old max - new max) of the RB rows at once */
            for (int rr = 0; rr < RB; rr++) {
                m[r0 + rr] = mx[rr];
                l[r0 + rr] = l[r0 + rr] * corr[rr] + sum[rr];
            }
            /* acc = acc * corr + p v, in chunks of head_dim held in registers over the tile's
             * keys: each value chunk is loaded once for the RB rows */
            const int c = pv_block(acc + (int64_t)r0 * d, d, corr, pr, kb, vt);
            if (c < d) { /* the tail of a head size the chunks do not cover */
                for (int rr = 0; rr < RB; rr++) {
                    float *ar = acc + (int64_t)(r0 + rr) * d;
                    for (int i = c; i < d; i++) ar[i] *= corr[rr];
                    for (int j = 0; j < kb; j++)
                        for (int i = c; i < d; i++) ar[i] += pr[rr * KT + j] * vt[(int64_t)j * d + i];
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t row = ((int64_t)(p->q_starts[it.span] + q0 + r / group) * heads +
                             g * group + r % group) * d;
        const float inv = 1.0f / l[r]; /* l >= 1: the row's largest score contributes exp(0) */
        for (int i = 0; i < d; i++) store(p->out, row + i, acc[(int64_t)r * d + i] * inv, bf16);
    }
}

static void run_tile(const problem_t *p, item_t it, scratch_t *s) {
    switch (p->head_dim) { /* the common head sizes: loops of known length unroll */
    case 64: tile_body(p, it, s, 64); break;
    case 128: tile_body(p, it, s, 128); break;
    default: tile_body(p, it, s, p->head_dim);
    }
}

/* per worker: the bytes of key and value tiles it keeps (d = 64: 128 tiles, 4096 keys) */
#define TILE_CACHE_BYTES (2 << 20)

static int scratch_alloc(scratch_t *s, int rows, int d, int cap) {
    rows = (rows + RB - 1) / RB * RB;
    const size_t rd = (size_t)rows * d;
    memset(s, 0, sizeof *s);
    s->tile_floats = (int64_t)KT * ((d + 15) / 16 * 16);
    s->cap = cap;
    s->span = s->g = -1;
    s->qf = aligned_alloc(64, sizeof(float) * (rd + 15) / 16 * 16);
    s->acc = aligned_alloc(64, sizeof(float) * (rd + 15) / 16 * 16);
    s->m = malloc(sizeof(float) * (size_t)rows);
    s->l = malloc(sizeof(float) * (size_t)rows);
    s->kc = aligned_alloc(64, sizeof(float) * (size_t)(cap + 1) * (size_t)s->tile_floats);
    s->vc = aligned_alloc(64, sizeof(float) * (size_t)(cap + 1) * (size_t)s->tile_floats);
    s->from = malloc(sizeof(int32_t) * ((size_t)cap + 1));
    s->p = aligned_alloc(64, sizeof(float) * RB * KT);
    return s->qf && s->acc && s->m && s->l && s->kc && s->vc && s->from && s->p;
}

static void scratch_free(scratch_t *s) {
    free(s->qf); free(s->acc); free(s->m); free(s->l); free(s->kc); free(s->vc); free(s->from);
    free(s->p);
}

typedef struct {
    const problem_t *p;
    const item_t *items;
    int64_t num_items;
    int64_t *next; /* the next item to take, shared */
    int cap, status;
} worker_t;

/* Each worker takes the next item until none is left: the items of a (span, KV head) in a row,
 * latest query tile first, so a worker's tile cache serves its next items, and the smallest
 * items come last, evening out the workers' shares. */
static void *work(void *arg) {
    worker_t *w = (worker_t *)arg;
    const problem_t *p = w->p;
    scratch_t s;
    if (!scratch_alloc(&s, QT * (p->num_heads / p->num_kv_heads), p->head_dim, w->cap)) {
        scratch_free(&s);
        w->status = 1;
        return NULL;
    }
    for (;;) {
        const int64_t i = __atomic_fetch_add(w->next, 1, __ATOMIC_RELAXED);
        if (i >= w->num_items) break;
        run_tile(p, w->items[i], &s);
    }
    scratch_free(&s);
    return NULL;
}

/* Returns 0 on success, nonzero when memory could not be had. */
int stepserve_paged_prefill(const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int32_t *block_table,
                            const int32_t *q_starts, const int32_t *q_lens,
                            const int32_t *ctx_starts, void *out, int num_spans, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, int max_blocks,
                            float scale, int bf16, int num_threads, int window, float soft_cap) {
    const problem_t p = {q, k_cache, v_cache, q_stride, block_table, q_starts, q_lens,
                         ctx_starts, out, num_heads, num_kv_heads, head_dim, block_size,
                         max_blocks, bf16, scale, window, soft_cap};
    int64_t num_items = 0;
    int key_tiles = 0; /* the most key tiles a span has */
    for (int s = 0; s < num_spans; s++) {
        num_items += (int64_t)num_kv_heads * ((q_lens[s] + QT - 1) / QT);
        const int tiles = (ctx_starts[s] + q_lens[s] + KT - 1) / KT;
        key_tiles = tiles > key_tiles ? tiles : key_tiles;
    }
    if (num_items == 0) return 0;
    item_t *items = malloc(sizeof(item_t) * (size_t)num_items);
    if (!items) return 1;
    int64_t n = 0;
    for (int s = 0; s < num_spans; s++)
        for (int g = 0; g < num_kv_heads; g++)
            for (int t = (q_lens[s] + QT - 1) / QT - 1; t >= 0; t--) items[n++] = (item_t){s, g, t};
    const int64_t tile_bytes = 2 * (int64_t)sizeof(float) * KT * ((head_dim + 15) / 16 * 16);
    const int64_t fit = TILE_CACHE_BYTES / tile_bytes;
    const int cap = key_tiles < fit ? key_tiles : (int)fit;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_items) num_threads = (int)num_items;
    if (num_threads > 256) num_threads = 256;
    int64_t next = 0;
    worker_t workers[256];
    for (int t = 0; t < num_threads; t++)
        workers[t] = (worker_t){&p, items, num_items, &next, cap, 0};
    int status = 0;
#ifdef _OPENMP
    /* torch's OpenMP pool, as the decode kernel uses (paged_decode.c) */
#pragma omp parallel num_threads(num_threads)
    for (int t = omp_get_thread_num(); t < num_threads; t += omp_get_num_threads()) work(&workers[t]);
#else
    pthread_t threads[256];
    int started[256] = {0};
    for (int t = 1; t < num_threads; t++)
        started[t] = pthread_create(&threads[t], NULL, work, &workers[t]) == 0;
    work(&workers[0]);
    for (int t = 1; t < num_threads; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else work(&workers[t]);
    }
#endif
    for (int t = 0; t < num_threads; t++) status |= workers[t].status;
    free(items);
    return status;
}
