/* A/B of two builds of the quantized matmul kernel (replica/layers/csrc/quant_gemm.c) on one
 * thread, by this thread's CPU time (fair on a shared host): the old build's symbols are renamed
 * old_*. Interleaved old/new passes per case; min over passes of the mean per call.
 * Build and run with bench/probes/quant_gemm_ab.sh (it says how). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*mm_fn)(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t,
                     int64_t, float *, int64_t, const float *, int, int);
int stepserve_quant_matmul(int, const uint8_t *, int64_t, int64_t, int64_t, const float *,
                           int64_t, int64_t, float *, int64_t, const float *, int, int);
int old_quant_matmul(int, const uint8_t *, int64_t, int64_t, int64_t, const float *, int64_t,
                     int64_t, float *, int64_t, const float *, int, int);

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double pass(mm_fn f, int t, const uint8_t *w, int64_t ldw, int n, int k, const float *x,
                   int m, float *y, int iters) {
    const double s = cpu_now();
    for (int i = 0; i < iters; i++) f(t, w, ldw, n, k, x, k, m, y, n, NULL, 1, 1);
    return (cpu_now() - s) / iters;
}

int main(int argc, char **argv) {
    const char *types = argc > 1 ? argv[1] : "3,8";
    const char *ms = argc > 2 ? argv[2] : "1,8,16,32,63";
    const int passes = argc > 3 ? atoi(argv[3]) : 7;
    const double budget = argc > 4 ? atof(argv[4]) : 0.02; /* CPU seconds per pass */
    static const int shapes[][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    char tbuf[64], mbuf[128];
    printf("%-5s %4s %10s %10s %10s %8s %6s\n", "type", "M", "NxK", "old_us", "new_us", "speedup",
           "maxdiff");
    snprintf(tbuf, sizeof tbuf, "%s", types);
    for (char *ts = strtok(tbuf, ","); ts; ts = strtok(NULL, ",")) {
        const int t = atoi(ts);
        const int bb = t == 2 ? 18 : t == 3 ? 20 : 34;
        snprintf(mbuf, sizeof mbuf, "%s", ms);
        char *msave;
        for (char *mstr = strtok_r(mbuf, ",", &msave); mstr; mstr = strtok_r(NULL, ",", &msave)) {
            const int m = atoi(mstr);
            double old_sum = 0, new_sum = 0;
            for (int si = 0; si < 4; si++) {
                const int n = shapes[si][0], k = shapes[si][1];
                const int64_t ldw = k / 32 * bb;
                uint8_t *w = malloc((size_t)n * ldw);
                srand(1);
                for (size_t i = 0; i < (size_t)n * ldw; i++) w[i] = (uint8_t)rand();
                for (int r = 0; r < n; r++)
                    for (int b = 0; b < k / 32; b++) { /* fp16 scales (and mins) of 2^-7 */
                        uint8_t *p = w + r * ldw + b * bb;
                        p[0] = 0x00, p[1] = 0x20;
                        if (t == 3) p[2] = 0x00, p[3] = 0xA0;
                    }
                float *x = malloc(sizeof(float) * m * k), *y0 = malloc(sizeof(float) * m * n),
                      *y1 = malloc(sizeof(float) * m * n);
                for (int i = 0; i < m * k; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
                old_quant_matmul(t, w, ldw, n, k, x, k, m, y0, n, NULL, 1, 1);
                stepserve_quant_matmul(t, w, ldw, n, k, x, k, m, y1, n, NULL, 1, 1);
                double diff = 0, mag = 0;
                for (int i = 0; i < m * n; i++) {
                    const double d = y0[i] > y1[i] ? y0[i] - y1[i] : y1[i] - y0[i];
                    if (d > diff) diff = d;
                    if ((y0[i] > 0 ? y0[i] : -y0[i]) > mag) mag = y0[i] > 0 ? y0[i] : -y0[i];
                }
                const double one = pass(old_quant_matmul, t, w, ldw, n, k, x, m, y0, 3) + 1e-9;
                int iters = (int)(budget / one);
                if (iters < 1) iters = 1;
                double bo = 1e9, bn = 1e9;
                for (int p = 0; p < passes; p++) {
                    const double a = pass(old_quant_matmul, t, w, ldw, n, k, x, m, y0, iters);
                    const double b = pass(stepserve_quant_matmul, t, w, ldw, n, k, x, m, y1, iters);
                    if (a < bo) bo = a;
                    if (b < bn) bn = b;
                }
                printf("%-5s %4d %5dx%-4d %10.1f %10.1f %8.2f %6.1e\n",
                       t == 2 ? "Q4_0" : t == 3 ? "Q4_1" : "Q8_0", m, n, k, bo * 1e6, bn * 1e6,
                       bo / bn, mag > 0 ? diff / mag : diff);
                old_sum += bo;
                new_sum += bn;
                free(w), free(x), free(y0), free(y1);
            }
            printf("%-5s %4d %10s %10.1f %10.1f %8.2f   (the 4 shapes)\n",
                   t == 2 ? "Q4_0" : t == 3 ? "Q4_1" : "Q8_0", m, "sum", old_sum * 1e6,
                   new_sum * 1e6, old_sum / new_sum);
            fflush(stdout);
        }
    }
    return 0;
}
