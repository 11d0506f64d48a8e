/* Causal prefill attention over the paged KV cache for the CPU, tiled as flash attention is:
 * a tile of queries (QT query tokens x the query heads sharing one KV head) meets the keys in
 * tiles of KT, with a running max and sum per row (online softmax), so each key and value row
 * is widened and read once per query tile, not once per query, and nothing of size
 * queries x keys is ever held. Chunked prefill and prefix hits are the same case: a span's
 * queries sit at positions ctx_start.. and attend every key up to their own position, the
 * earlier ones (an earlier chunk, a cached prefix) read where they lie in the block cache.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [num_tokens, num_heads, head_dim]   (the step's flat stream)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]  (the step's K/V written)
 *   block_table  int32 [num_spans, max_blocks]
 *   q_starts     int32 [num_spans]  a span's first query row in q
 *   q_lens       int32 [num_spans]  its query tokens
 *   ctx_starts   int32 [num_spans]  the position of its first query (keys before it: cached)
 * window > 0: a sliding window, a query at position p attends keys p-window+1..p only (key
 * tiles wholly before a tile's windows are skipped, never read: the KV manager may have freed
 * their blocks); soft_cap > 0: scores become soft_cap * tanh(score / soft_cap) before the
 * softmax. 0 for either: as without.
 * Element type: fp32, or bf16 (kv_elements.h); accumulation in fp32.
 *
 * Written for the compiler's vectorizer: the score tile is a KT-wide row updated by
 * broadcast-multiply-adds over the key tile held transposed, and p v is a multiply-add over
 * head_dim; built per instruction-set level (cpu_isa.py), the same source runs 16-lane AVX-512,
 * 8-lane AVX2 or SSE2 code. The common head sizes get bodies with head_dim known. */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_elements.h"

#define QT 32 /* query tokens per tile */
/* Per instruction set: keys per tile (KT), head_dim elements per register chunk of p v (VC),
 * both two vectors wide, and rows per register block (RB). A block keeps 2 RB independent
 * sums in flight, and as many as the registers hold pay: AVX-512's 32 registers take 8 rows
 * (16 accumulators), AVX2's 16 take 6 (12). Fewer chains leave the code waiting on the latency
 * of its multiply-adds: 8 rows of two vectors beat 4 rows of one by 1.4-1.5x from 2048 keys on,
 * 6 rows at AVX2 by 1.1-1.6x (docs/perf-engine.md, "Prefill attention"). */
#if defined(__AVX512F__)
#define KT 32
#define VC 32
#define RB 8
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
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT]) {
    __m512 a[RB][2];
    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int i = 0; i < d; i++) {
        const __m512 k0 = _mm512_load_ps(kt + (int64_t)i * KT);
        const __m512 k1 = _mm512_load_ps(kt + (int64_t)i * KT + 16);
        for (int r = 0; r < RB; r++) {
            const __m512 qv = _mm512_set1_ps(q[(int64_t)r * d + i]);
            a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm512_storeu_ps(sc[r], a[r][0]);
        _mm512_storeu_ps(sc[r] + 16, a[r][1]);
    }
}
static inline void pv_chunk(float *acc, int d, const float *corr, const float *p, int nk,
                            const float *vt) {
    __m512 a[RB][2];
    for (int r = 0; r < RB; r++) {
        const __m512 c = _mm512_set1_ps(corr[r]);
        a[r][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)r * d), c);
        a[r][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)r * d + 16), c);
    }
    for (int j = 0; j < nk; j++) {
        const __m512 v0 = _mm512_loadu_ps(vt + (int64_t)j * d);
        const __m512 v1 = _mm512_loadu_ps(vt + (int64_t)j * d + 16);
        for (int r = 0; r < RB; r++) {
            const __m512 pj = _mm512_set1_ps(p[r * KT + j]);
            a[r][0] = _mm512_fmadd_ps(pj, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pj, v1, a[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        _mm512_storeu_ps(acc + (int64_t)r * d, a[r][0]);
        _mm512_storeu_ps(acc + (int64_t)r * d + 16, a[r][1]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT]) {
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
#else
static inline void qk_block(const float *q, int d, const float *kt, float sc[RB][KT]) {
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
#endif

typedef struct {
    const void *q, *k, *v;
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

typedef struct {
    float *qf, *acc, *m, *l, *kt, *vt, *p; /* [R,d] [R,d] [R] [R] [d,KT] [KT,d] [RB,KT] */
} scratch_t;

static inline __attribute__((always_inline)) void tile_body(const problem_t *p, item_t it,
                                                            scratch_t *s, const int d) {
    const int heads = p->num_heads, kvh = p->num_kv_heads, group = heads / kvh;
    const int bs = p->block_size, bf16 = p->bf16, g = it.kv_head;
    const int n = p->q_lens[it.span], ctx = p->ctx_starts[it.span];
    const int q0 = it.tile * QT, nq = n - q0 < QT ? n - q0 : QT;
    const int rows = nq * group; /* row r: query q0 + r / group, head g * group + r % group */
    const int padded = (rows + RB - 1) / RB * RB;
    const int64_t kv_row = (int64_t)kvh * d;
    const int32_t *table = p->block_table + (int64_t)it.span * p->max_blocks;
    float *restrict qf = s->qf, *restrict acc = s->acc, *restrict m = s->m, *restrict l = s->l;
    float *restrict kt = s->kt, *restrict vt = s->vt, *restrict pr = s->p;

    for (int r = 0; r < padded; r++) {
        float *qr = qf + (int64_t)r * d;
        if (r < rows) {
            const int64_t row = ((int64_t)(p->q_starts[it.span] + q0 + r / group) * heads +
                                 g * group + r % group) * d;
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
        /* the key tile transposed [d, KT] and the value tile [KT, d], in fp32 */
        for (int j = 0; j < KT; j++) {
            if (j >= nk) {
                for (int i = 0; i < d; i++) kt[(int64_t)i * KT + j] = 0.0f;
                for (int i = 0; i < d; i++) vt[(int64_t)j * d + i] = 0.0f;
                continue;
            }
            const int t = t0 + j;
            const int64_t slot = ((int64_t)table[t / bs] * bs + t % bs) * kv_row + g * d;
            for (int i = 0; i < d; i++) kt[(int64_t)i * KT + j] = load(p->k, slot + i, bf16);
            row_f32(p->v, slot, d, bf16, vt + (int64_t)j * d);
        }
        /* the first row block whose queries see any key of this tile (earlier rows' keys all
         * come before t0 only once t0 > their position: rows are in position order) */
        for (int r0 = 0; r0 < padded; r0 += RB) {
            if (t0 > ctx + q0 + (r0 + RB - 1 < rows ? r0 + RB - 1 : rows - 1) / group) continue;
            /* nor a block whose every row's window starts after this tile's last key */
            if (window > 0 && t0 + nk - 1 <= ctx + q0 + (r0 < rows ? r0 : rows - 1) / group - window)
                continue;
            /* scores of RB rows x KT keys: each key row of the tile is loaded once for the RB
             * rows (register blocking) */
            float sc[RB][KT];
            qk_block(qf + (int64_t)r0 * d, d, kt, sc);
            if (p->soft_cap > 0.0f) {
                const float cap = p->soft_cap, inv = 1.0f / cap;
                for (int rr = 0; rr < RB; rr++)
                    for (int j = 0; j < KT; j++) sc[rr][j] = cap * tanhf(sc[rr][j] * inv);
            }
            float corr[RB];
            for (int rr = 0; rr < RB; rr++) {
                const int r = r0 + rr;
                const int pos = ctx + q0 + (r < rows ? r : rows - 1) / group;
                /* keys before `first` are outside the row's window (0: none are). A row may see no
                 * key of a tile; if it has seen none before either, its sums are wiped by the
                 * correction factor (0) of the first tile it does see (its own position). */
                const int first = window > 0 ? pos - window + 1 - t0 : 0; /* seen: first..last */
                const int last = pos - t0 < nk - 1 ? pos - t0 : nk - 1;
                float mx = m[r];
                for (int j = 0; j < KT; j++) {
                    if (j > last || j < first) sc[rr][j] = MASKED;
                    mx = sc[rr][j] > mx ? sc[rr][j] : mx;
                }
                corr[rr] = exp_nonpositive(m[r] - mx);
                float sum = 0.0f;
                for (int j = 0; j < KT; j++) {
                    const float e = exp_nonpositive(sc[rr][j] - mx);
                    pr[rr * KT + j] = e;
                    sum += e;
                }
                m[r] = mx;
                l[r] = l[r] * corr[rr] + sum;
            }
            /* acc = acc * corr + p v, in chunks of VC of head_dim held in registers over the
             * tile's keys: each value chunk is loaded once for the RB rows */
            for (int c = 0; c < d; c += VC) {
                const int w = d - c < VC ? d - c : VC;
                if (w == VC) {
                    pv_chunk(acc + (int64_t)r0 * d + c, d, corr, pr, nk, vt + c);
                } else { /* the tail of a head size that is not a multiple of VC */
                    for (int rr = 0; rr < RB; rr++) {
                        float *ar = acc + (int64_t)(r0 + rr) * d + c;
                        for (int i = 0; i < w; i++) ar[i] *= corr[rr];
                        for (int j = 0; j < nk; j++)
                            for (int i = 0; i < w; i++)
                                ar[i] += pr[rr * KT + j] * vt[(int64_t)j * d + c + i];
                    }
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

static int scratch_alloc(scratch_t *s, int rows, int d) {
    rows = (rows + RB - 1) / RB * RB;
    const size_t rd = (size_t)rows * d;
    s->qf = aligned_alloc(64, sizeof(float) * (rd + 15) / 16 * 16);
    s->acc = aligned_alloc(64, sizeof(float) * (rd + 15) / 16 * 16);
    s->m = malloc(sizeof(float) * (size_t)rows);
    s->l = malloc(sizeof(float) * (size_t)rows);
    s->kt = aligned_alloc(64, sizeof(float) * (size_t)KT * ((d + 15) / 16 * 16));
    s->vt = aligned_alloc(64, sizeof(float) * (size_t)KT * ((d + 15) / 16 * 16));
    s->p = aligned_alloc(64, sizeof(float) * RB * KT);
    return s->qf && s->acc && s->m && s->l && s->kt && s->vt && s->p;
}

static void scratch_free(scratch_t *s) {
    free(s->qf); free(s->acc); free(s->m); free(s->l); free(s->kt); free(s->vt); free(s->p);
}

typedef struct {
    const problem_t *p;
    const item_t *items;
    int64_t num_items;
    int worker, num_workers, status;
} worker_t;

/* items worker, worker + num_workers, ...: the items are listed latest tile first, so the
 * interleaving gives each worker a similar share */
static void *work(void *arg) {
    worker_t *w = (worker_t *)arg;
    const problem_t *p = w->p;
    scratch_t s;
    if (!scratch_alloc(&s, QT * (p->num_heads / p->num_kv_heads), p->head_dim)) {
        scratch_free(&s);
        w->status = 1;
        return NULL;
    }
    for (int64_t i = w->worker; i < w->num_items; i += w->num_workers) run_tile(p, w->items[i], &s);
    scratch_free(&s);
    return NULL;
}

/* Returns 0 on success, nonzero when memory could not be had. */
int stepserve_paged_prefill(const void *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_table, const int32_t *q_starts,
                            const int32_t *q_lens, const int32_t *ctx_starts, void *out,
                            int num_spans, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, int max_blocks, float scale, int bf16,
                            int num_threads, int window, float soft_cap) {
    const problem_t p = {q, k_cache, v_cache, block_table, q_starts, q_lens, ctx_starts, out,
                         num_heads, num_kv_heads, head_dim, block_size, max_blocks, bf16, scale,
                         window, soft_cap};
    int64_t num_items = 0;
    for (int s = 0; s < num_spans; s++) num_items += (int64_t)num_kv_heads * ((q_lens[s] + QT - 1) / QT);
    if (num_items == 0) return 0;
    item_t *items = malloc(sizeof(item_t) * (size_t)num_items);
    if (!items) return 1;
    /* latest tiles first (they see the most keys): the workers' interleaved shares even out */
    int max_tiles = 0;
    for (int s = 0; s < num_spans; s++)
        if ((q_lens[s] + QT - 1) / QT > max_tiles) max_tiles = (q_lens[s] + QT - 1) / QT;
    int64_t n = 0;
    for (int t = max_tiles - 1; t >= 0; t--)
        for (int s = 0; s < num_spans; s++)
            if (t < (q_lens[s] + QT - 1) / QT)
                for (int g = 0; g < num_kv_heads; g++) items[n++] = (item_t){s, g, t};
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_items) num_threads = (int)num_items;
    if (num_threads > 256) num_threads = 256;
    worker_t workers[256];
    for (int t = 0; t < num_threads; t++)
        workers[t] = (worker_t){&p, items, num_items, t, num_threads, 0};
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
