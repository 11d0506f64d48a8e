/* Paged decode attention for the CPU: one query token per sequence attends to that sequence's
 * keys and values where they lie in the block cache, without first gathering them into a
 * contiguous copy (the torch path's index_select, which moves every byte of context twice).
 *
 * Layouts (all row-major, contiguous):
 *   q, out       [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  int32 [num_seqs, max_blocks]   (only the first ceil(seq_len / block_size) read)
 *   seq_lens     int32 [num_seqs]               (keys 0..seq_len-1 are attended)
 * Each cache slot holds all KV heads back to back, so a sequence's keys (then values) are read
 * in one sequential pass per block, each row once for every query head that shares it (GQA).
 * Sequences are split over threads in contiguous runs of similar total context.
 * KV element type: fp32, or bf16 (uint16 bit patterns, widened to fp32 on load); q and out
 * share the KV type. Accumulation is in fp32.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

typedef struct {
    const void *q, *k, *v;
    const int32_t *block_table, *seq_lens;
    void *out;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, bf16;
    float scale;
    int64_t first_item, last_item; /* [first, last) of the sequences */
    int status;
} job_t;

static inline float load(const void *base, int64_t i, int bf16) {
    if (bf16) {
        uint32_t bits = ((uint32_t)((const uint16_t *)base)[i]) << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float x, int bf16) {
    if (bf16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch does */
        ((uint16_t *)base)[i] = (uint16_t)(bits >> 16);
        return;
    }
    ((float *)base)[i] = x;
}

/* widen one row of n elements to fp32 */
static inline void row_f32(const void *base, int64_t offset, int n, int bf16, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = load(base, offset + i, 1);
}

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

static void *run(void *arg) {
    job_t *j = (job_t *)arg;
    const int d = j->head_dim, heads = j->num_heads, group = heads / j->num_kv_heads;
    const int bs = j->block_size;
    const int64_t kv_row = (int64_t)j->num_kv_heads * d; /* elements per cache slot */
    int max_len = 1;
    for (int64_t s = j->first_item; s < j->last_item; s++)
        if (j->seq_lens[s] > max_len) max_len = j->seq_lens[s];
    float *scores = malloc(sizeof(float) * (size_t)heads * (size_t)max_len);
    float *qf = malloc(sizeof(float) * (size_t)heads * d);
    float *acc = malloc(sizeof(float) * (size_t)heads * d);
    float *row = malloc(sizeof(float) * (size_t)kv_row);
    if (!scores || !qf || !acc || !row) {
        j->status = 1;
        free(scores); free(qf); free(acc); free(row);
        return NULL;
    }
    for (int64_t s = j->first_item; s < j->last_item; s++) {
        const int len = j->seq_lens[s];
        const int32_t *table = j->block_table + s * j->max_blocks;
        const int64_t q0 = s * heads * d;
        row_f32(j->q, q0, heads * d, j->bf16, qf);
        for (int i = 0; i < heads * d; i++) qf[i] *= j->scale;
        /* scores = q k^T: one sequential pass over the sequence's blocks; every slot holds
         * all KV heads back to back, so each key row is read once for all query heads */
        for (int t0 = 0; t0 < len; t0 += bs) {
            const int64_t base = (int64_t)table[t0 / bs] * bs * kv_row;
            const int n = len - t0 < bs ? len - t0 : bs;
            const int64_t next = t0 + bs < len ? (int64_t)table[t0 / bs + 1] * bs * kv_row : -1;
            for (int o = 0; o < n; o++) {
                const float *krow = slot_row(j->k, base, next, o, kv_row, j->bf16, row);
                for (int qh = 0; qh < heads; qh++)
                    scores[(int64_t)qh * len + t0 + o] = dot(qf + qh * d, krow + (qh / group) * d, d);
            }
        }
        /* softmax per query head */
        for (int qh = 0; qh < heads; qh++) {
            float *sc = scores + (int64_t)qh * len, m = -FLT_MAX, sum = 0.0f;
            for (int t = 0; t < len; t++) m = sc[t] > m ? sc[t] : m;
            for (int t = 0; t < len; t++) {
                sc[t] = expf(sc[t] - m);
                sum += sc[t];
            }
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            for (int t = 0; t < len; t++) sc[t] *= inv;
        }
        /* out = p v: one sequential pass over the value blocks */
        memset(acc, 0, sizeof(float) * (size_t)heads * d);
        for (int t0 = 0; t0 < len; t0 += bs) {
            const int64_t base = (int64_t)table[t0 / bs] * bs * kv_row;
            const int n = len - t0 < bs ? len - t0 : bs;
            const int64_t next = t0 + bs < len ? (int64_t)table[t0 / bs + 1] * bs * kv_row : -1;
            for (int o = 0; o < n; o++) {
                const float *vrow = slot_row(j->v, base, next, o, kv_row, j->bf16, row);
                for (int qh = 0; qh < heads; qh++) {
                    const float p = scores[(int64_t)qh * len + t0 + o];
                    const float *vh = vrow + (qh / group) * d;
                    float *a = acc + qh * d;
                    for (int i = 0; i < d; i++) a[i] += p * vh[i];
                }
            }
        }
        for (int i = 0; i < heads * d; i++) store(j->out, q0 + i, acc[i], j->bf16);
    }
    free(scores); free(qf); free(acc); free(row);
    return NULL;
}

/* Returns 0 on success, nonzero when memory or threads could not be had. */
int stepserve_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_table, const int32_t *seq_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale, int bf16,
                           int num_threads) {
    const int64_t items = num_seqs;
    if (items == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    if (num_threads > 256) num_threads = 256;
    /* contiguous runs of sequences with similar total context per thread */
    int64_t total = 0;
    for (int s = 0; s < num_seqs; s++) total += seq_lens[s];
    job_t jobs[256];
    pthread_t threads[256];
    int64_t item = 0, done = 0;
    for (int t = 0; t < num_threads; t++) {
        job_t *j = &jobs[t];
        j->q = q; j->k = k_cache; j->v = v_cache; j->block_table = block_table;
        j->seq_lens = seq_lens; j->out = out; j->num_seqs = num_seqs; j->num_heads = num_heads;
        j->num_kv_heads = num_kv_heads; j->head_dim = head_dim; j->block_size = block_size;
        j->max_blocks = max_blocks; j->bf16 = bf16; j->scale = scale; j->status = 0;
        j->first_item = item;
        const int64_t target = total * (t + 1) / num_threads;
        while (item < items && (t == num_threads - 1 || done < target)) {
            done += seq_lens[item];
            item++;
        }
        j->last_item = item;
    }
    int started[256] = {0};
    for (int t = 1; t < num_threads; t++)
        started[t] = pthread_create(&threads[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    int status = jobs[0].status;
    for (int t = 1; t < num_threads; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else run(&jobs[t]); /* no thread to be had: do its share here */
        status |= jobs[t].status;
    }
    return status;
}
