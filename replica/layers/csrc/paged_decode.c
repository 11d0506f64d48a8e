/* Paged decode attention for the CPU: one query token per sequence attends to that sequence's
 * keys and values where they lie in the block cache, without first gathering them into a
 * contiguous copy (the torch path's index_select, which moves every byte of context twice).
 *
 * Layouts (all row-major, contiguous):
 *   q, out       [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  int32 [num_seqs, max_blocks]   (only the first ceil(seq_len / block_size) read)
 *   seq_lens     int32 [num_seqs]               (keys 0..seq_len-1 are attended)
 * window > 0: a sliding window, only keys seq_len-window..seq_len-1 are attended (the blocks
 * before them are never read: the KV manager may have freed them). soft_cap > 0: scores become
 * soft_cap * tanh(score / soft_cap) before the softmax. 0 for either: as without.
 * Each cache slot holds all KV heads back to back, so a sequence's keys (then values) are read
 * in one sequential pass per block, each row once for every query head that shares it (GQA).
 * Sequences are split over threads in contiguous runs of similar total context.
 * KV element type: fp32, or bf16 (uint16 bit patterns, widened to fp32 on load); q and out
 * share the KV type. Accumulation is in fp32.
 */
#include <float.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_elements.h"

#define LANES 16

typedef struct {
    const void *q, *k, *v;
    const int32_t *block_table, *seq_lens;
    void *out;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, bf16, window;
    float scale, soft_cap;
    int64_t first_item, last_item; /* [first, last) of the sequences */
    int status;
    void *parts; /* vector path: [heads, 16] partial-sum vectors of one key tile */
} job_t;

/* ask for the same row of the sequence's next block while this one is computed: blocks lie
 * anywhere in the pool, so the hardware prefetcher cannot see the jump coming */
static inline void prefetch_row(const void *base, int64_t offset, int64_t elements, int bf16) {
    const char *p = (const char *)base + offset * (bf16 ? 2 : 4);
    const int64_t bytes = elements * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

/* Slot `o` of the block starting at element `base` of a cache, as fp32 (bf16 rows widened into
 * `scratch`); the same slot of the sequence's next block (at `next`, -1 for none) is
 * prefetched. */
static inline const float *slot_row(const void *cache, int64_t base, int64_t next, int o,
                                    int64_t kv_row, int bf16, float *scratch) {
    const int64_t offset = base + (int64_t)o * kv_row;
    if (next >= 0) prefetch_row(cache, next + (int64_t)o * kv_row, kv_row, bf16);
    if (!bf16) return (const float *)cache + offset;
    row_f32(cache, offset, (int)kv_row, 1, scratch);
    return scratch;
}

static inline float dot(const float *a, const float *b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* the first key a sequence of `len` keys attends to under the job's window */
static inline int first_key(const job_t *j, int len) {
    return j->window > 0 && len > j->window ? len - j->window : 0;
}

/* soft cap of `n` scores, in place */
static void cap_scores(float *scores, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    for (int64_t i = 0; i < n; i++) scores[i] = cap * tanhf(scores[i] * inv);
}

/* softmax of each of `rows` rows of `len` scores, in place */
static void softmax_rows(float *scores, int rows, int len) {
    for (int r = 0; r < rows; r++) {
        float *sc = scores + (int64_t)r * len, m = -FLT_MAX, sum = 0.0f;
        for (int t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
        for (int t = 0; t < len; t++) {
            sc[t] = expf(sc[t] - m);
            sum += sc[t];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int t = 0; t < len; t++) sc[t] *= inv;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
#define MAX_CHUNKS 16 /* head_dim up to 256 on the vector path */

/* 16 elements (fewer under the mask) of a row at element i, widened to fp32 */
static inline __m512 vload(const void *base, int64_t i, int bf16, __mmask16 m) {
    if (bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

/* One sequence on the vector path: head_dim is split in chunks of 16 lanes (the last one
 * masked). For each slot and KV head the key chunks are loaded once into registers and dotted
 * with every query head of the group; values are accumulated with the probability broadcast.
 * qf: the scaled query in fp32; scores: [heads, len]; acc: [heads, d]. */
/* lane i of the result = the sum of all lanes of r[i] */
static inline __m512 hsum16(const __m512 *r) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                             _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) void sequence_body(
    const job_t *j, int64_t s, const float *qf, float *scores, float *acc, const int nch) {
    const int d = j->head_dim, heads = j->num_heads, kvh = j->num_kv_heads;
    const int group = heads / kvh, bs = j->block_size, bf16 = j->bf16;
    const __mmask16 tail = (__mmask16)((d % 16) ? ((1u << (d % 16)) - 1) : 0xFFFF);
    const int64_t kv_row = (int64_t)kvh * d;
    const int len = j->seq_lens[s], lo = first_key(j, len), nk = len - lo; /* keys lo..len-1 */
    const int32_t *table = j->block_table + s * j->max_blocks;
    __m512 kc[MAX_CHUNKS];
    /* scores = q k^T in tiles of 16 keys: each key's chunks are loaded once per KV head and
     * dotted with every query head of its group into a vector of partial sums (parts, in L1);
     * the 16 partial vectors of a head are then summed across lanes together (hsum16). */
    __m512 *parts = (__m512 *)j->parts;
    for (int t0 = lo; t0 < len; t0 += 16) {
        const int n = len - t0 < 16 ? len - t0 : 16;
        for (int o = 0; o < 16; o++) {
            const int t = t0 + o;
            if (o >= n) {
                for (int qh = 0; qh < heads; qh++) parts[qh * 16 + o] = _mm512_setzero_ps();
                continue;
            }
            const int64_t row = ((int64_t)table[t / bs] * bs + t % bs) * kv_row;
            /* the same slot of the next block (blocks lie anywhere in the pool: the hardware
             * prefetcher cannot see the jump coming) */
            if ((t / bs + 1) * bs < len)
                prefetch_row(j->k, ((int64_t)table[t / bs + 1] * bs + t % bs) * kv_row, kv_row,
                             bf16);
            for (int g = 0; g < kvh; g++) {
                for (int c = 0; c < nch; c++)
                    kc[c] = vload(j->k, row + g * d + c * 16, bf16, c == nch - 1 ? tail : 0xFFFF);
                for (int qh = g * group; qh < (g + 1) * group; qh++) {
                    const float *qrow = qf + (int64_t)qh * d;
                    __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(nch == 1 ? tail : 0xFFFF, qrow), kc[0]);
                    for (int c = 1; c < nch; c++)
                        a = _mm512_fmadd_ps(
                            _mm512_maskz_loadu_ps(c == nch - 1 ? tail : 0xFFFF, qrow + c * 16),
                            kc[c], a);
                    parts[qh * 16 + o] = a;
                }
            }
        }
        const __mmask16 keep = (__mmask16)(n == 16 ? 0xFFFF : (1u << n) - 1);
        for (int qh = 0; qh < heads; qh++)
            _mm512_mask_storeu_ps(scores + (int64_t)qh * nk + t0 - lo, keep, hsum16(parts + qh * 16));
    }
    if (j->soft_cap > 0.0f) cap_scores(scores, (int64_t)heads * nk, j->soft_cap);
    softmax_rows(scores, heads, nk);
    /* out = p v, per KV head and per run of its query heads whose accumulators fit in
     * registers (GS heads x nch chunks <= 16 vectors) */
    const int gs_max = nch >= 16 ? 1 : 16 / nch;
    for (int g = 0; g < kvh; g++) {
        for (int j0 = 0; j0 < group; j0 += gs_max) {
            const int gs = group - j0 < gs_max ? group - j0 : gs_max;
            const float *sc0 = scores + (int64_t)(g * group + j0) * nk;
            __m512 a[16];
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            /* runs of keys within one block: whole blocks, except a window's first */
            for (int t0 = lo, n; t0 < len; t0 += n) {
                const int o0 = t0 % bs;
                n = len - t0 < bs - o0 ? len - t0 : bs - o0;
                const int64_t base = (int64_t)table[t0 / bs] * bs * kv_row + g * d;
                /* the first pass brings whole rows of the next block (all KV heads): the later
                 * passes over this sequence then read from cache */
                const int64_t next =
                    g == 0 && j0 == 0 && t0 + n < len ? (int64_t)table[t0 / bs + 1] * bs * kv_row : -1;
                for (int o = o0; o < o0 + n; o++) {
                    const int64_t row = base + (int64_t)o * kv_row;
                    if (next >= 0) prefetch_row(j->v, next + (int64_t)o * kv_row, kv_row, bf16);
                    for (int c = 0; c < nch; c++)
                        kc[c] = vload(j->v, row + c * 16, bf16, c == nch - 1 ? tail : 0xFFFF);
                    for (int jj = 0; jj < 16; jj++) {
                        if (jj >= gs || jj * nch >= 16) break;
                        const __m512 p = _mm512_set1_ps(sc0[(int64_t)jj * nk + t0 - o0 + o - lo]);
                        for (int c = 0; c < nch; c++)
                            a[jj * nch + c] = _mm512_fmadd_ps(p, kc[c], a[jj * nch + c]);
                    }
                }
            }
            for (int jj = 0; jj < gs; jj++) {
                float *out = acc + (int64_t)(g * group + j0 + jj) * d;
                for (int c = 0; c < nch; c++)
                    _mm512_mask_storeu_ps(out + c * 16, c == nch - 1 ? tail : 0xFFFF,
                                          a[jj * nch + c]);
            }
        }
    }
}

/* the common head sizes get a body with the chunk count known, so chunk loops unroll and the
 * key/value chunks stay in registers */
static void sequence_avx512(const job_t *j, int64_t s, const float *qf, float *scores,
                            float *acc) {
    switch ((j->head_dim + 15) / 16) {
    case 2: sequence_body(j, s, qf, scores, acc, 2); break;
    case 4: sequence_body(j, s, qf, scores, acc, 4); break;
    case 8: sequence_body(j, s, qf, scores, acc, 8); break;
    default: sequence_body(j, s, qf, scores, acc, (j->head_dim + 15) / 16);
    }
}
#endif

/* One sequence on the portable path (any head size): scores, softmax and p v into acc. */
static void sequence_scalar(const job_t *j, int64_t s, const float *qf, float *scores,
                            float *acc, float *row) {
    const int d = j->head_dim, heads = j->num_heads, group = heads / j->num_kv_heads;
    const int bs = j->block_size;
    const int64_t kv_row = (int64_t)j->num_kv_heads * d;
    const int len = j->seq_lens[s], lo = first_key(j, len), nk = len - lo; /* keys lo..len-1 */
    const int32_t *table = j->block_table + s * j->max_blocks;
    /* scores = q k^T: one sequential pass over the sequence's blocks (runs of keys within one
     * block: whole blocks, except a window's first); every slot holds all KV heads back to
     * back, so each key row is read once for all query heads */
    for (int t0 = lo, n; t0 < len; t0 += n) {
        const int o0 = t0 % bs;
        n = len - t0 < bs - o0 ? len - t0 : bs - o0;
        const int64_t base = (int64_t)table[t0 / bs] * bs * kv_row;
        const int64_t next = t0 + n < len ? (int64_t)table[t0 / bs + 1] * bs * kv_row : -1;
        for (int o = o0; o < o0 + n; o++) {
            const float *krow = slot_row(j->k, base, next, o, kv_row, j->bf16, row);
            for (int qh = 0; qh < heads; qh++)
                scores[(int64_t)qh * nk + t0 - o0 + o - lo] =
                    dot(qf + qh * d, krow + (qh / group) * d, d);
        }
    }
    if (j->soft_cap > 0.0f) cap_scores(scores, (int64_t)heads * nk, j->soft_cap);
    softmax_rows(scores, heads, nk);
    /* out = p v: one sequential pass over the value blocks */
    memset(acc, 0, sizeof(float) * (size_t)heads * d);
    for (int t0 = lo, n; t0 < len; t0 += n) {
        const int o0 = t0 % bs;
        n = len - t0 < bs - o0 ? len - t0 : bs - o0;
        const int64_t base = (int64_t)table[t0 / bs] * bs * kv_row;
        const int64_t next = t0 + n < len ? (int64_t)table[t0 / bs + 1] * bs * kv_row : -1;
        for (int o = o0; o < o0 + n; o++) {
            const float *vrow = slot_row(j->v, base, next, o, kv_row, j->bf16, row);
            for (int qh = 0; qh < heads; qh++) {
                const float p = scores[(int64_t)qh * nk + t0 - o0 + o - lo];
                const float *vh = vrow + (qh / group) * d;
                float *a = acc + qh * d;
                for (int i = 0; i < d; i++) a[i] += p * vh[i];
            }
        }
    }
}

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int d = j->head_dim, heads = j->num_heads;
    const int64_t kv_row = (int64_t)j->num_kv_heads * d; /* elements per cache slot */
    int max_len = 1;
    for (int64_t s = j->first_item; s < j->last_item; s++)
        if (j->seq_lens[s] > max_len) max_len = j->seq_lens[s];
    float *scores = malloc(sizeof(float) * (size_t)heads * (size_t)max_len);
    float *qf = malloc(sizeof(float) * (size_t)heads * d);
    float *acc = malloc(sizeof(float) * (size_t)heads * d);
    float *row = malloc(sizeof(float) * (size_t)kv_row);
    /* 16 vectors of 16 floats per head, 64-byte aligned */
    float *parts = aligned_alloc(64, sizeof(float) * 256 * (size_t)heads);
    j->parts = parts;
    if (!scores || !qf || !acc || !row || !parts) {
        j->status = 1;
        free(scores); free(qf); free(acc); free(row); free(parts);
        return NULL;
    }
    for (int64_t s = j->first_item; s < j->last_item; s++) {
        const int64_t q0 = s * heads * d;
        row_f32(j->q, q0, heads * d, j->bf16, qf);
        for (int i = 0; i < heads * d; i++) qf[i] *= j->scale;
#ifdef HAVE_AVX512
        if (d <= 16 * MAX_CHUNKS)
            sequence_avx512(j, s, qf, scores, acc);
        else
#endif
            sequence_scalar(j, s, qf, scores, acc, row);
        for (int i = 0; i < heads * d; i++) store(j->out, q0 + i, acc[i], j->bf16);
    }
    free(scores); free(qf); free(acc); free(row); free(parts);
    return NULL;
}

/* Returns 0 on success, nonzero when memory or threads could not be had. */
int stepserve_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_table, const int32_t *seq_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int bf16,
                           int num_threads, int window, float soft_cap) {
    const int64_t items = num_seqs;
    if (items == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    if (num_threads > 256) num_threads = 256;
    /* contiguous runs of sequences with similar total context per thread */
    int64_t total = 0; /* keys attended: a window bounds them */
#define KEYS(len) (window > 0 && (len) > window ? window : (len))
    for (int s = 0; s < num_seqs; s++) total += KEYS(seq_lens[s]);
    job_t jobs[256];
    pthread_t threads[256];
    int64_t item = 0, done = 0;
    for (int t = 0; t < num_threads; t++) {
        job_t *j = &jobs[t];
        j->q = q; j->k = k_cache; j->v = v_cache; j->block_table = block_table;
        j->seq_lens = seq_lens; j->out = out; j->num_seqs = num_seqs; j->num_heads = num_heads;
        j->num_kv_heads = num_kv_heads; j->head_dim = head_dim; j->block_size = block_size;
        j->max_blocks = max_blocks; j->bf16 = bf16; j->scale = scale; j->status = 0;
        j->window = window; j->soft_cap = soft_cap;
        j->first_item = item;
        const int64_t target = total * (t + 1) / num_threads;
        while (item < items && (t == num_threads - 1 || done < target)) {
            done += KEYS(seq_lens[item]);
            item++;
        }
        j->last_item = item;
    }
    int status = 0;
#ifdef _OPENMP
    /* torch's own OpenMP pool (the library links libgomp.so.1, which resolves to the copy torch
     * already loaded): its workers are awake between torch's ops, where threads started here
     * would first have to win a core from them. A team smaller than asked still runs every job. */
    (void)threads;
#pragma omp parallel num_threads(num_threads)
    for (int t = omp_get_thread_num(); t < num_threads; t += omp_get_num_threads()) run(&jobs[t]);
#else
    int started[256] = {0};
    for (int t = 1; t < num_threads; t++)
        started[t] = pthread_create(&threads[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < num_threads; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else run(&jobs[t]); /* no thread to be had: do its share here */
    }
#endif
    for (int t = 0; t < num_threads; t++) status |= jobs[t].status;
    return status;
}
