/* Pin torch's OpenMP threads one to a CPU, as vLLM's CPU worker does (VLLM_CPU_OMP_THREADS_BIND):
 * on a host whose other processes (the serving stack) wake while a forward runs, an unpinned
 * team can be stacked two threads to one CPU by the scheduler, and every parallel region then
 * waits for the thread that shares. libgomp hands its pool's threads to a team in the same order
 * each time, so thread i of every later region of the same size runs where it was pinned.
 */
#define _GNU_SOURCE
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Set the CPUs of each thread of a team of nthreads (the calling thread is thread 0): with pin,
 * thread i runs on cpus[i] only (ncpus >= nthreads); without, every thread may run on all of
 * cpus (undoing a pin). Returns how many threads took the setting (nthreads when all did), or
 * -1 in a build without OpenMP. */
int stepserve_set_thread_cpus(const int *cpus, int ncpus, int nthreads, int pin) {
#ifdef _OPENMP
    int done = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : done)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (pin) {
            CPU_SET(cpus[omp_get_thread_num() % ncpus], &set);
        } else {
            for (int i = 0; i < ncpus; i++) CPU_SET(cpus[i], &set);
        }
        done += sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return done;
#else
    (void)cpus;
    (void)ncpus;
    (void)nthreads;
    (void)pin;
    return -1;
#endif
}
