/* The quantized matmul kernel (replica/layers/csrc/quant_gemm.c) timed from C, without Python's
 * per-call cost: one weight of random blocks (sane fp16 scales) cycled through `copies` copies
 * (1: it stays in the caches; ~200 for a 1536x576 Q4_1: it streams from memory), best of 5 passes.
 *
 * Build at a level's flags (here avx512_bf16; -march=x86-64-v3 for avx2) and run from the root:
 *   gcc -O3 -std=c11 -march=x86-64-v4 -mavx512bf16 -mavx512vnni -mtune=native -fopenmp \
 *       -fno-fast-math -ffp-contract=off -c replica/layers/csrc/quant_gemm.c -o /tmp/qg.o
 *   gcc -O2 -fopenmp bench/probes/quant_gemm_harness.c /tmp/qg.o -o /tmp/qg_harness -lm
 *   /tmp/qg_harness TYPE N K M INT8 THREADS [COPIES [ITERS]]   e.g. 3 1536 576 1 1 1
 * TYPE: GGML id (2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K); INT8: 1 int8 activations,
 * 0 fp32. Prints us per call, GB/s of weight and ns per (block of 32, row of x). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int stepserve_quant_matmul(int qtype, const uint8_t *w, int64_t ldw, int64_t n, int64_t k,
                           const float *x, int64_t ldx, int64_t m, float *y, int64_t ldy,
                           const float *bias, int int8, int num_threads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s TYPE N K M INT8 THREADS [COPIES [ITERS]]\n", argv[0]);
        return 2;
    }
    const int t = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]), m = atoi(argv[4]);
    const int int8 = atoi(argv[5]), nt = atoi(argv[6]);
    const int copies = argc > 7 && atoi(argv[7]) > 0 ? atoi(argv[7]) : 1;
    const int iters = argc > 8 ? atoi(argv[8]) : 2000;
    const int bb = t == 2 ? 18 : t == 3 ? 20 : t == 8 ? 34 : t == 12 ? 144 : t == 13 ? 176 : 210;
    const int be = t >= 12 ? 256 : 32;
    const int64_t ldw = k / be * bb;
    const size_t wb = (size_t)n * ldw;
    uint8_t *w = malloc(wb * copies);
    for (size_t i = 0; i < wb * copies; i++) w[i] = (uint8_t)rand();
    for (size_t r = 0; r < (size_t)n * copies; r++)
        for (int b = 0; b < k / be; b++) { /* fp16 scales of 2^-7 (0x2000) */
            uint8_t *p = w + r * ldw + b * bb;
            int at = t == 14 ? 208 : 0;
            p[at] = 0x00, p[at + 1] = 0x20;
            if (t == 3 || t == 12 || t == 13) p[2] = 0x00, p[3] = 0x20;
        }
    float *x = malloc(sizeof(float) * m * k), *y = malloc(sizeof(float) * m * n);
    for (int i = 0; i < m * k; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    for (int i = 0; i < 10; i++) stepserve_quant_matmul(t, w, ldw, n, k, x, k, m, y, n, NULL, int8, nt);
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        const double s = now();
        for (int i = 0; i < iters; i++)
            stepserve_quant_matmul(t, w + (size_t)(i % copies) * wb, ldw, n, k, x, k, m, y, n, NULL,
                                   int8, nt);
        const double e = (now() - s) / iters;
        if (e < best) best = e;
    }
    printf("type %d %dx%d m=%d int8=%d threads=%d copies=%d: %.2f us  %.1f GB/s  %.2f ns/block-row\n",
           t, n, k, m, int8, nt, copies, best * 1e6, wb / best / 1e9, best * 1e9 / ((double)n * k / 32 * m));
    return 0;
}
