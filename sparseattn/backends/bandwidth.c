/*
 * The machine's read bandwidth, as the kernels read memory: chunks of `chunk` bytes at the given offsets of a
 * buffer far larger than the last-level cache, each chunk streamed with vector loads while the one `ahead` places
 * later is prefetched (a kernel that knows its block table can ask that far ahead), on `threads` OpenMP threads
 * splitting the list.
 * Offsets in order with a large chunk give the sequential figure; a shuffled list of page-sized chunks gives what
 * a paged cache's reads can reach. Every byte is summed into the result so that no read can be elided.
 * The Python side is sparseattn.bandwidth; benchmarks/bandwidth.py prints the table.
 */
#include "kernel_common.h"

typedef float sa_bw_v16 __attribute__((vector_size(64)));

double sa_read_chunks(const char *buf, int64_t chunk, const int64_t *offsets, int64_t n, int64_t ahead, int threads) {
    double total = 0.0;
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
        const char *p = buf + offsets[i];
        const char *next = i + ahead < n ? buf + offsets[i + ahead] : NULL;
        sa_bw_v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t o = 0;
        for (; o + 256 <= chunk; o += 256) {
            if (next) {
                __builtin_prefetch(next + o, 0, 1);
                __builtin_prefetch(next + o + 64, 0, 1);
                __builtin_prefetch(next + o + 128, 0, 1);
                __builtin_prefetch(next + o + 192, 0, 1);
            }
            sa_bw_v16 x0, x1, x2, x3;
            memcpy(&x0, p + o, 64), memcpy(&x1, p + o + 64, 64), memcpy(&x2, p + o + 128, 64), memcpy(&x3, p + o + 192, 64);
            a0 += x0, a1 += x1, a2 += x2, a3 += x3;
        }
        for (; o + 64 <= chunk; o += 64) {
            sa_bw_v16 x;
            memcpy(&x, p + o, 64);
            a0 += x;
        }
        const sa_bw_v16 s = a0 + a1 + a2 + a3;
        float part = 0.f;
        for (int j = 0; j < 16; ++j) part += s[j];
        total += part;
    }
    return total;
}
