/*
 * The paged engine's fused decode step on the CPU: score, select and attend vLLM's KV pages, reading the pages in
 * place in vLLM's CPU cache layout. Two entry points:
 *
 *   sa_paged_decode: one pass per (sequence, KV head) for the policies whose candidates are ranked by one score each
 *     and attended whole: quest (SA_BOUND: the bound sum_d max(q_d min_d, q_d max_d) of each candidate's per-channel
 *     key minimum and maximum; each query head, or the group, takes its k best) and the fixed selections (SA_FIXED:
 *     dense, streamingllm).
 *   sa_paged_split: radar+ in every form (centroid scores, the KV group's shortlist reranked exactly, any allocation
 *     of the layer's segments between heads, a merged rest), in phases (the section at its definition).
 *
 * The passes run head-major (every sequence's pass over KV head 0, then head 1, ...): under prefix caching the
 * sequences of a batch share their document's pages, and one head's pages of a long document fit in the last-level
 * cache from one sequence to the next where all heads' do not.
 *
 * The layout (sparseattn/vllm/paged.py, page_views): the cache of one layer is [N, H, bs, 2 D]; per (block, KV head)
 * the bs * 2 D elements are the page's keys *transposed*, [D, bs], then its values [bs, D]. So a page's logits are a
 * product over d of whole key rows of bs tokens (the inner loop runs over tokens, contiguous), and its values are read
 * row by row; 32 bf16 keys of one channel are a 64-byte line, the least a read of keys brings.
 *
 * Per sequence b the caller's plan says (sink_pages, n_cand, k, m): pages [0, sink_pages) are sinks, the next
 * n_cand / r pages hold the n_cand candidates (segments of bs / r tokens, r per page: r = 1, a page is a segment), the
 * rest (through the sequence's last, partial page) are the tail. Sinks and tail are always attended. Of the candidates
 * the step attends every one when k >= n_cand (dense, or a budget covering the context), none when k == 0
 * (streamingllm as a selection), else the ones the policy chooses. One softmax over every attended token of a query
 * head (float32; the running maximum starts at a finite value: built with -ffast-math).
 *
 * Summaries live in caller-owned stores indexed by physical block: summary[N, H, r, D] (centroid: mean key; bound:
 * min, then max in a second store) and state[N] (0: stale, 1: valid). A stale page is summarised before any scoring,
 * once even when prefix caching shares it between sequences.
 *
 * The Python references are sparseattn.vllm.paged.select_pages (the selection) and attend_pages (the attention);
 * tests/test_vllm_paged_kernel.py holds the kernel to them.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime, for the profile */
#include <float.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stddef.h>
#include <time.h>

#include "kernel_common.h"

/* ---- The profile: where a step's time goes, phase by phase, and the bytes each phase reads from memory. Off unless
 * sa_paged_profile(1, ...) turned it on (then two clock reads per phase and work item); each work item accumulates
 * its own and adds them to the totals once. Bytes are counted in whole 64-byte lines, as memory moves them: a
 * 4-token segment of a 32-token page's transposed keys costs its page's lines. Times are thread time (one thread:
 * the call's). sparseattn.vllm.profile reads them. */
enum {
    SA_PH_SUMMARISE, SA_PH_SCORE, SA_PH_SHORTLIST, SA_PH_RERANK, SA_PH_ALWAYS_MASS, SA_PH_ALLOCATE, SA_PH_ATTEND_ALWAYS,
    SA_PH_ATTEND_SELECTED, SA_PH_REST, SA_PH_SETUP, SA_NPHASES
};
static int sa_prof_on = 0;
static double sa_prof_totals[2 * SA_NPHASES]; /* ns, then bytes */
typedef struct {
    double t0, ns[SA_NPHASES], bytes[SA_NPHASES];
} sa_prof;
static inline double sa_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}
static inline void prof_start(sa_prof *p) {
    if (!sa_prof_on) return;
    memset(p, 0, sizeof *p);
    p->t0 = sa_now_ns();
}
/* The time since the last mark goes to `phase`, with `bytes` read in it. */
static inline void prof_mark(sa_prof *p, int phase, double bytes) {
    if (!sa_prof_on) return;
    const double t = sa_now_ns();
    p->ns[phase] += t - p->t0;
    p->t0 = t;
    p->bytes[phase] += bytes;
}
static inline void prof_flush(const sa_prof *p) {
    if (!sa_prof_on) return;
    for (int i = 0; i < SA_NPHASES; ++i) {
#pragma omp atomic
        sa_prof_totals[i] += p->ns[i];
#pragma omp atomic
        sa_prof_totals[SA_NPHASES + i] += p->bytes[i];
    }
}
/* Bytes of the 64-byte lines that [offset, offset + n) touches. */
static inline double lines_bytes(int64_t offset, int64_t n) {
    return n <= 0 ? 0.0 : (double)(((offset + n + 63) / 64 - offset / 64) * 64);
}

/* The least difference from a maximum that a vector loop of exponentials is given: e^-80 is nothing beside the
 * maximum's e^0 in any sum it joins, and glibc's vector expf leaves its fast path (for a scalar call per lane) for any
 * lane below about -87: a loop over logits far apart took 5x as long. */
#define SA_EXP_FLOOR (-80.f)
static inline float exp_arg(float x) { return x > SA_EXP_FLOOR ? x : SA_EXP_FLOOR; }

/* Turn the profile on (1) or off (0); with out, first copy the totals so far into out[2 * SA_NPHASES] (ns per phase,
 * then bytes per phase). The totals restart from zero. Returns the number of phases. */
int sa_paged_profile(int enable, double *out) {
    if (out) memcpy(out, sa_prof_totals, sizeof sa_prof_totals);
    memset(sa_prof_totals, 0, sizeof sa_prof_totals);
    sa_prof_on = enable;
    return SA_NPHASES;
}

enum { SA_CENTROID = 0, SA_BOUND = 1, SA_FIXED = 2 }; /* SA_CENTROID: the split step's summary (sa_paged_split) */
enum { SA_BAD_BLOCK = 1, SA_BAD_PLAN = 6 }; /* besides kernel_common.h's */

int sa_paged_float16_supported(void) { return sa_float16_built(); }

typedef struct {
    const char *cache;
    int dtype;
    int64_t elem, H, bs, D; /* elem: bytes per element */
    int64_t r, seg;         /* segments per page, tokens per segment (r seg = bs): candidate i is segment i % r of page i / r */
    int amx;                /* the page layout of vLLM's amx kernel (bfloat16): see "The amx layout" below */
} sa_pages;

static inline const char *page_keys(const sa_pages *c, int64_t block, int64_t h) {
    return c->cache + ((block * c->H + h) * c->bs * 2 * c->D) * c->elem;
}

static inline const char *page_values(const sa_pages *c, int64_t block, int64_t h) {
    return page_keys(c, block, h) + c->bs * c->D * c->elem;
}

/* Candidate segment i of a sequence (block table row table, sinks sink_pages): its block, its keys' first column
 * (rows of bs tokens: the segment is columns [0, seg) from there), its values' first row, its row in a store of
 * r entries per (block, head). */
static inline int64_t cand_block(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i) {
    return table[sink_pages + i / c->r];
}
/* The amx layout (vLLM's amx CPU kernel, bfloat16, pages of multiples of 32 tokens; checked against its cache-update op
 * in tests/test_vllm_plugin.py): per (block, KV head) the keys are [bs/16][D/2][16][2], groups of 16 tokens, a 64-byte
 * line per pair of channels holding each token's two keys side by side; the values [D/16][bs/2][16][2], blocks of 16
 * channels, a line per pair of tokens holding each channel's two values side by side. So a group of 16 tokens' keys is
 * one contiguous run of D/2 lines, and an even token's values start a pair in each channel block.
 * key_col / value_col: where column col's keys (a multiple of 16 in amx) or values (even in amx) start, for the loops
 * that take a pointer and a token count. */
static inline const char *key_col(const sa_pages *c, const char *keys, int64_t col) {
    return keys + (c->amx ? col * c->D : col) * c->elem;
}
static inline const char *value_col(const sa_pages *c, const char *values, int64_t col) {
    return values + (c->amx ? (col / 2) * 32 : col * c->D) * c->elem;
}
static inline const char *seg_keys(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return key_col(c, page_keys(c, cand_block(c, table, sink_pages, i), h), (i % c->r) * c->seg);
}
static inline const char *seg_values(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return value_col(c, page_values(c, cand_block(c, table, sink_pages, i), h), (i % c->r) * c->seg);
}
/* Channel d of tokens [0, n) of a page's keys, and the D channels of its token t's values, as float32 (either layout). */
static void key_row(const sa_pages *c, const char *keys, int64_t d, int64_t n, float *restrict row) {
    if (!c->amx) {
        sa_to_float(keys + d * c->bs * c->elem, c->dtype, n, row);
        return;
    }
    const uint16_t *k = (const uint16_t *)keys;
    for (int64_t t = 0; t < n; ++t) sa_bf16_to_float(row + t, k[((t / 16) * (c->D / 2) + d / 2) * 32 + (t % 16) * 2 + d % 2]);
}
static void value_row(const sa_pages *c, const char *values, int64_t t, float *restrict row) {
    if (!c->amx) {
        sa_to_float(values + t * c->D * c->elem, c->dtype, c->D, row);
        return;
    }
    const uint16_t *v = (const uint16_t *)values;
    for (int64_t d = 0; d < c->D; ++d) sa_bf16_to_float(row + d, v[((d / 16) * (c->bs / 2) + t / 2) * 32 + (d % 16) * 2 + t % 2]);
}
static inline int64_t seg_row(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return (cand_block(c, table, sink_pages, i) * c->H + h) * c->r + i % c->r;
}

/* The profile's bytes: columns [col0, col0 + n) of a page's D key rows (a row under 64 bytes counted as a line), and
 * value rows [row0, row0 + n). */
static inline double key_bytes(const sa_pages *c, int64_t col0, int64_t n) { return (double)c->D * lines_bytes(col0 * c->elem, n * c->elem); }
static inline double value_bytes(const sa_pages *c, int64_t row0, int64_t n) {
    return lines_bytes(row0 * c->D * c->elem, n * c->D * c->elem);
}

/* ---- Vector loops (SA_LANES floats wide): a page's logits and its value sums, for head dims and page sizes that are
 * multiples of the lane count (vLLM's CPU kernels take pages of multiples of 16; head dims 64, 80,
 * 128...). The vector type is GCC's, one register wide. Accumulators stay in registers for up
 * to SA_HEADS query rows at a time; the cache dtype is a compile-time constant in each copy. */
#ifdef __AVX512F__
#define SA_LANES 16 /* one AVX-512 register */
#else
#define SA_LANES 8 /* one AVX2 register (wider GCC vectors split badly there: measured 1.6x slower) */
#endif
#define SA_HEADS 4
typedef float sa_v16 __attribute__((vector_size(4 * SA_LANES)));
typedef uint16_t sa_u16x16 __attribute__((vector_size(2 * SA_LANES)));
typedef uint32_t sa_u32x16 __attribute__((vector_size(4 * SA_LANES)));
#ifndef SA_NO_FLOAT16
typedef _Float16 sa_f16x16 __attribute__((vector_size(2 * SA_LANES)));
#endif

static inline __attribute__((always_inline)) sa_v16 load16(const char *src, int dtype) {
    sa_v16 f;
    if (dtype == SA_BF16) {
#ifdef __AVX512F__
        /* one widening load (GCC's generic conversion splits it into 256-bit halves where the tuning prefers them) */
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
#else
        sa_u16x16 h;
        memcpy(&h, src, sizeof h);
        sa_u32x16 w = __builtin_convertvector(h, sa_u32x16) << 16;
#endif
        memcpy(&f, &w, sizeof f);
    }
    else if (dtype == SA_FP8_E4M3 || dtype == SA_FP8_E5M2) {
#if defined(__AVX512F__)
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
        w = dtype == SA_FP8_E5M2 ? _mm256_slli_epi16(w, 8)
                                 : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                                   _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
        const __m512 x = _mm512_cvtph_ps(w);
        memcpy(&f, &x, sizeof f);
#elif defined(__AVX2__) && defined(__F16C__)
        __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)src));
        w = dtype == SA_FP8_E5M2 ? _mm_slli_epi16(w, 8)
                                 : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                                _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
        const __m256 x = _mm256_cvtph_ps(w);
        memcpy(&f, &x, sizeof f);
#else
        for (int i = 0; i < SA_LANES; ++i) f[i] = sa_half_to_float(sa_fp8_half_bits((uint8_t)src[i], dtype));
#endif
    }
#ifndef SA_NO_FLOAT16
    else if (dtype == SA_F16) {
#ifdef __AVX512F__
        const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
        memcpy(&f, &w, sizeof f);
#else
        sa_f16x16 h;
        memcpy(&h, src, sizeof h);
        f = __builtin_convertvector(h, sa_v16);
#endif
    }
#endif
    else {
        memcpy(&f, src, sizeof f);
    }
    return f;
}

/* Ask for the lines [off, off + len) of the next block to read (pf, NULL: none) while this one is computed.
 * Pages are scattered in the cache and a page's key or value block (8-32 KB) ends before the hardware
 * prefetcher has ramped up; spread over the current block's loop, one line per line read, the next
 * block arrives in L2 as this one finishes (into L2, locality 1: it is read once, soon). */
#define SA_PREFETCH(pf, off, len)                                                                             \
    do {                                                                                                     \
        if (pf)                                                                                              \
            for (int64_t pf_o = 0; pf_o < (len); pf_o += 64) __builtin_prefetch((pf) + (off) + pf_o, 0, 1); \
    } while (0)

/* Logits of tokens [j0, j0 + 2 SA_LANES) for NG rows: keys [D, bs] (element size elem), q rows D apart.
 * Two vectors of tokens per row: twice the independent accumulators of one (the loop is bound by the
 * FMA latency otherwise), and one broadcast of q per two vectors. */
static inline __attribute__((always_inline)) void logits16(const char *keys, int64_t bs, int64_t D, int64_t elem, int dtype,
                                                           const float *q, int NG, float *lg, int64_t ld, int64_t j0,
                                                           const char *pf, int64_t pf_stride) {
    sa_v16 acc[SA_HEADS][2] = {{0}};
    for (int64_t d = 0; d < D; ++d) {
        SA_PREFETCH(pf, d * pf_stride, 2 * SA_LANES * elem);
        const char *row = keys + (d * bs + j0) * elem;
        const sa_v16 k0 = load16(row, dtype), k1 = load16(row + SA_LANES * elem, dtype);
        for (int g = 0; g < NG; ++g) {
            const float qd = q[g * D + d];
            acc[g][0] += qd * k0;
            acc[g][1] += qd * k1;
        }
    }
    for (int g = 0; g < NG; ++g) memcpy(lg + g * ld + j0, acc[g], sizeof acc[g]);
}

/* acc[row] += sum_j p[row][j] v_j over n tokens, for NG rows (indices rows[], weights p + row * pld),
 * two vectors of channels at a time (as logits16: independent accumulators, one broadcast per two). */
static inline __attribute__((always_inline)) void values16(const char *values, int n, int64_t D, int64_t elem, int dtype,
                                                           const int *rows, int NG, const float *p, int64_t pld, float *out,
                                                           const char *pf) {
    for (int64_t d0 = 0; d0 < D; d0 += 2 * SA_LANES) {
        sa_v16 acc[SA_HEADS][2];
        for (int g = 0; g < NG; ++g) memcpy(acc[g], out + rows[g] * D + d0, sizeof acc[g]);
        const char *pfd = pf ? pf + d0 * n * elem : NULL; /* this chunk's share of the next block, n * 2 SA_LANES elements */
        for (int j = 0; j < n; ++j) {
            SA_PREFETCH(pfd, (int64_t)j * 2 * SA_LANES * elem, 2 * SA_LANES * elem);
            const char *row = values + ((int64_t)j * D + d0) * elem;
            const sa_v16 v0 = load16(row, dtype), v1 = load16(row + SA_LANES * elem, dtype);
            for (int g = 0; g < NG; ++g) {
                const float w = p[rows[g] * pld + j];
                acc[g][0] += w * v0;
                acc[g][1] += w * v1;
            }
        }
        for (int g = 0; g < NG; ++g) memcpy(out + rows[g] * D + d0, acc[g], sizeof acc[g]);
    }
}

#define SA_DISPATCH_HEADS(NG_VAR, CALL) \
    switch (NG_VAR) {                   \
    case 1: CALL(1); break;             \
    case 2: CALL(2); break;             \
    case 3: CALL(3); break;             \
    default: CALL(4); break;            \
    }

#define SA_DEFINE_FAST(SUFFIX)                                                                                      \
    static void page_logits_##SUFFIX(const char *keys, int n, int64_t bs, int64_t D, const float *q, int G, float *lg,   \
                                     int64_t ld, const char *pf, int64_t pf_rows) {                                      \
        for (int g0 = 0; g0 < G; g0 += SA_HEADS) {                                                                       \
            const int ng = G - g0 < SA_HEADS ? G - g0 : SA_HEADS;                                                        \
            for (int64_t j0 = 0; j0 < n; j0 += 2 * SA_LANES) {                                                           \
                /* pages hold bs >= j0 + 2 SA_LANES slots: a chunk past n reads the page's own unused slots, never used */       \
                SA_DISPATCH_HEADS(ng, SA_LOGITS_CALL)                                                                    \
            }                                                                                                            \
        }                                                                                                                \
    }                                                                                                                    \
    static void page_values_##SUFFIX(const char *values, int n, int64_t D, const int *rows, int nrows, const float *p,  \
                                     int64_t pld, float *out, const char *pf) {                                          \
        for (int r0 = 0; r0 < nrows; r0 += SA_HEADS) {                                                                   \
            const int ng = nrows - r0 < SA_HEADS ? nrows - r0 : SA_HEADS;                                                \
            SA_DISPATCH_HEADS(ng, SA_VALUES_CALL)                                                                        \
        }                                                                                                                \
    }
/* The next block is prefetched on the first pass over the rows only; the logits' chunk j0 of 2 SA_LANES tokens
 * takes its D * 2 SA_LANES elements of the next key block (together: the whole block when n == bs), or with pf_rows
 * (the next block is part of a page: rows bs apart) its own columns of each of the next block's D rows. */
#define SA_LOGITS_CALL(NG)                                                                                    \
    logits16(keys, bs, D, SA_ELEM, SA_DT, q + (int64_t)g0 * D, NG, lg + (int64_t)g0 * ld, ld, j0,            \
             pf && g0 == 0 ? pf + (pf_rows ? j0 : j0 * D) * SA_ELEM : NULL, pf_rows ? bs * SA_ELEM : 2 * SA_LANES * SA_ELEM)
#define SA_VALUES_CALL(NG) values16(values, n, D, SA_ELEM, SA_DT, rows + r0, NG, p, pld, out, r0 == 0 ? pf : NULL)

#define SA_DT SA_F32
#define SA_ELEM 4
SA_DEFINE_FAST(f32)
#undef SA_DT
#undef SA_ELEM
#define SA_DT SA_BF16
#define SA_ELEM 2
SA_DEFINE_FAST(bf16)
#undef SA_DT
#undef SA_ELEM
#define SA_DT SA_FP8_E4M3
#define SA_ELEM 1
SA_DEFINE_FAST(e4m3)
#undef SA_DT
#undef SA_ELEM
#define SA_DT SA_FP8_E5M2
#define SA_ELEM 1
SA_DEFINE_FAST(e5m2)
#undef SA_DT
#undef SA_ELEM
#ifndef SA_NO_FLOAT16
#define SA_DT SA_F16
#define SA_ELEM 2
SA_DEFINE_FAST(f16)
#undef SA_DT
#undef SA_ELEM
#endif

/* Whether the vector loops apply: page size and head dim multiples of twice the lane count. */
static inline int fast_shape(const sa_pages *c) { return c->bs % (2 * SA_LANES) == 0 && c->D % (2 * SA_LANES) == 0; }

/* ---- The amx layout's vector loops (bfloat16). A line of 32-bit lanes holds bf16 pairs: lane i = (x_i, y_i), x the
 * lower half; pairs() splits SA_LANES lanes into the x's and the y's, each exact as float32 (a shift, a mask). */
static inline __attribute__((always_inline)) void pairs(const char *src, sa_v16 *x, sa_v16 *y) {
    sa_u32x16 w;
    memcpy(&w, src, sizeof w);
    const sa_u32x16 lo = w << 16, hi = w & 0xFFFF0000u;
    memcpy(x, &lo, sizeof *x);
    memcpy(y, &hi, sizeof *y);
}

/* Logits of tokens [j0, j0 + 2 SA_LANES) (j0 a multiple of 16, within the block at keys: whole groups) for NG rows:
 * per pair of channels one line per 16 tokens gives both channels' keys. pf: the next block (contiguous, as large as
 * the keys: the page's values, or the next page's keys) to ask for meanwhile, two lines per pair of channels. */
static inline __attribute__((always_inline)) void logits_amx(const char *keys, int64_t D, const float *q, int NG, float *lg,
                                                             int64_t ld, int64_t j0, const char *pf) {
    sa_v16 acc[SA_HEADS][2] = {{{0}}};
    const int64_t t1 = j0 + SA_LANES;
    const char *g0 = keys + (((j0 / 16) * (D / 2)) * 16 + j0 % 16) * 4, *g1 = keys + (((t1 / 16) * (D / 2)) * 16 + t1 % 16) * 4;
    for (int64_t p = 0; p < D / 2; ++p) {
        if (pf) { /* this chunk's share of the next block (16 KB at 128 tokens: a chunk's two groups' worth of its lines) */
            __builtin_prefetch(pf + ((j0 / 16) * (D / 2) + p) * 64, 0, 1);
            __builtin_prefetch(pf + ((j0 / 16 + 1) * (D / 2) + p) * 64, 0, 1);
        }
        sa_v16 e0, o0, e1, o1;
        pairs(g0 + p * 64, &e0, &o0);
        pairs(g1 + p * 64, &e1, &o1);
        for (int g = 0; g < NG; ++g) {
            const float qe = q[g * D + 2 * p], qo = q[g * D + 2 * p + 1];
            acc[g][0] += qe * e0 + qo * o0;
            acc[g][1] += qe * e1 + qo * o1;
        }
    }
    for (int g = 0; g < NG; ++g) memcpy(lg + g * ld + j0, acc[g], sizeof acc[g]);
}
static void page_logits_amx(const char *keys, int n, int64_t D, const float *q, int G, float *lg, int64_t ld, const char *pf) {
    for (int g0 = 0; g0 < G; g0 += SA_HEADS) {
        const int ng = G - g0 < SA_HEADS ? G - g0 : SA_HEADS;
        for (int64_t j0 = 0; j0 < n; j0 += 2 * SA_LANES) {
#define SA_AMX_LOGITS(NG) logits_amx(keys, D, q + (int64_t)g0 * D, NG, lg + (int64_t)g0 * ld, ld, j0, g0 == 0 ? pf : NULL)
            SA_DISPATCH_HEADS(ng, SA_AMX_LOGITS)
#undef SA_AMX_LOGITS
        }
    }
}

/* out[rows[g], :] += sum_j p[rows[g] * pld + j] v_j over tokens [0, n) of values starting at an even token (value_col),
 * in a page of bs tokens: a line per pair of tokens and block of 16 channels (a token past n weighs 0). Pairs run in
 * the outer loop and up to 4 vectors of channels in the inner one, accumulators in registers: the pair's weights are
 * broadcast once for all its channels (with blocks outside, each block broadcast them again: measured 2x dense's time). */
static inline __attribute__((always_inline)) void values_amx_rows(const char *values, int n, int64_t bs, int64_t D, const int *rows,
                                                                  int NG, const float *p, int64_t pld, float *out, const char *pf) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * SA_LANES) {
        const int nv = D - d0 >= 4 * SA_LANES ? 4 : (int)((D - d0) / SA_LANES);
        sa_v16 acc[SA_HEADS][4];
        int64_t off[4];
        for (int k = 0; k < nv; ++k) {
            const int64_t ch = d0 + k * SA_LANES;
            off[k] = ((ch / 16) * (bs / 2) * 16 + ch % 16) * 4;
            for (int g = 0; g < NG; ++g) memcpy(&acc[g][k], out + rows[g] * D + ch, sizeof acc[g][k]);
        }
        for (int j = 0; j < n; j += 2) {
            if (pf && d0 == 0) /* the next block (as large as the values), spread over the pairs: D / 16 lines each */
                for (int64_t x = 0; x < D / 16; ++x) __builtin_prefetch(pf + ((j / 2) * (D / 16) + x) * 64, 0, 1);
            float w0[SA_HEADS], w1[SA_HEADS];
            for (int g = 0; g < NG; ++g) w0[g] = p[rows[g] * pld + j], w1[g] = j + 1 < n ? p[rows[g] * pld + j + 1] : 0.f;
            for (int k = 0; k < nv; ++k) {
                sa_v16 x, y;
                pairs(values + off[k] + (j / 2) * 64, &x, &y);
                for (int g = 0; g < NG; ++g) acc[g][k] += w0[g] * x + w1[g] * y;
            }
        }
        for (int k = 0; k < nv; ++k)
            for (int g = 0; g < NG; ++g) memcpy(out + rows[g] * D + d0 + k * SA_LANES, &acc[g][k], sizeof acc[g][k]);
    }
}
static void page_values_amx(const char *values, int n, int64_t bs, int64_t D, const int *rows, int nrows, const float *p,
                            int64_t pld, float *out, const char *pf) {
    for (int r0 = 0; r0 < nrows; r0 += SA_HEADS) {
        const int ng = nrows - r0 < SA_HEADS ? nrows - r0 : SA_HEADS;
#define SA_AMX_VALUES(NG) values_amx_rows(values, n, bs, D, rows + r0, NG, p, pld, out, r0 == 0 ? pf : NULL)
        SA_DISPATCH_HEADS(ng, SA_AMX_VALUES)
#undef SA_AMX_VALUES
    }
}

/* Logits lg[g * ld + j] = q_g . k_j of the first n tokens of a page, for rows g < G (q is pre-scaled).
 * Keys are [D, bs]: one converted row of n tokens per channel, multiplied into every head's logits. next_keys: the
 * key block read after this one, asked for meanwhile (a whole page's, or with next_rows the same columns of its D
 * rows: part of a page), or NULL. */
static void page_logits_ahead(const sa_pages *c, const char *keys, int n, const float *restrict q, int G, float *restrict lg,
                              int64_t ld, float *restrict row, const char *next_keys, int next_rows) {
    const int64_t D = c->D, bs = c->bs;
    /* A segment smaller than a vector chunk (pages cut in r > 1) still takes the vector loops: they compute the
     * whole chunk of 2 SA_LANES tokens (the page's next columns, unused), and that is faster than the scalar loop's
     * conversion per channel (measured: 6.2 against 8.4 ms for the scores at 8k x 8 with 4-token segments). */
    if (c->amx) { /* a whole multiple of 16 tokens from a group's start (key_col); the next block is contiguous too */
        page_logits_amx(keys, n, D, q, G, lg, ld, next_keys);
        return;
    }
    if (fast_shape(c)) {
        if (c->dtype == SA_BF16) page_logits_bf16(keys, n, bs, D, q, G, lg, ld, next_keys, next_rows);
        else if (c->dtype == SA_FP8_E4M3) page_logits_e4m3(keys, n, bs, D, q, G, lg, ld, next_keys, next_rows);
        else if (c->dtype == SA_FP8_E5M2) page_logits_e5m2(keys, n, bs, D, q, G, lg, ld, next_keys, next_rows);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) page_logits_f16(keys, n, bs, D, q, G, lg, ld, next_keys, next_rows);
#endif
        else page_logits_f32(keys, n, bs, D, q, G, lg, ld, next_keys, next_rows);
        return;
    }
    for (int g = 0; g < G; ++g) memset(lg + g * ld, 0, (size_t)n * sizeof(float));
    for (int64_t d = 0; d < D; ++d) {
        key_row(c, keys, d, n, row);
        for (int g = 0; g < G; ++g) {
            const float qd = q[g * D + d];
            float *restrict lgg = lg + g * ld;
            for (int j = 0; j < n; ++j) lgg[j] += qd * row[j];
        }
    }
}
static inline void page_logits(const sa_pages *c, const char *keys, int n, const float *restrict q, int G, float *restrict lg,
                               int64_t ld, float *restrict row, const char *next_keys) {
    page_logits_ahead(c, keys, n, q, G, lg, ld, row, next_keys, 0);
}

/* Online-softmax state of G query rows. */
typedef struct {
    float *m, *l, *acc; /* [G], [G], [G, D] */
} sa_softmax;

/* Attend n tokens of a page whose logits lg[g * ld + j] are given, for the rows flagged in rows[] (NULL: all G);
 * next_values: the value block read after this one (prefetched meanwhile), or NULL. */
static void attend_logits(const sa_pages *c, const char *values, int n, const float *lg, int64_t ld, int G,
                          const uint8_t *rows, float softcap, sa_softmax *st, float *restrict p, float *restrict row,
                          const char *next_values) {
    const int64_t D = c->D;
    for (int g = 0; g < G; ++g) {
        if (rows && !rows[g]) continue;
        const float *lgg = lg + g * ld;
        float *pg = p + (int64_t)g * c->bs;
        float top = SA_NO_SCORE;
        for (int j = 0; j < n; ++j) {
            float x = lgg[j];
            if (softcap > 0.f) x = softcap * tanhf(x / softcap);
            pg[j] = x;
            top = x > top ? x : top;
        }
        SA_SOFTMAX_STEP(pg, n, top, st->m[g], st->l[g], alpha);
        if (alpha != 1.f) {
            float *ag = st->acc + (int64_t)g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        }
    }
    if (fast_shape(c)) {
        int active[64], na = 0; /* G <= 64: checked by the caller */
        for (int g = 0; g < G; ++g)
            if (!rows || rows[g]) active[na++] = g;
        if (c->amx) {
            page_values_amx(values, n, c->bs, D, active, na, p, c->bs, st->acc, next_values);
            return;
        }
        if (c->dtype == SA_BF16) page_values_bf16(values, n, D, active, na, p, c->bs, st->acc, next_values);
        else if (c->dtype == SA_FP8_E4M3) page_values_e4m3(values, n, D, active, na, p, c->bs, st->acc, next_values);
        else if (c->dtype == SA_FP8_E5M2) page_values_e5m2(values, n, D, active, na, p, c->bs, st->acc, next_values);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) page_values_f16(values, n, D, active, na, p, c->bs, st->acc, next_values);
#endif
        else page_values_f32(values, n, D, active, na, p, c->bs, st->acc, next_values);
        return;
    }
    for (int j = 0; j < n; ++j) {
        value_row(c, values, j, row);
        for (int g = 0; g < G; ++g) {
            if (rows && !rows[g]) continue;
            const float w = p[(int64_t)g * c->bs + j];
            float *restrict ag = st->acc + (int64_t)g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += w * row[d];
        }
    }
}

/* Attend the first n tokens of a page for every row (logits computed here); next: the block attended after
 * it (its keys and values are prefetched meanwhile), or -1. */
static void attend_page(const sa_pages *c, int64_t block, int64_t h, int n, const float *q, int G, float softcap,
                        sa_softmax *st, float *lg, float *p, float *row, int64_t next) {
    page_logits(c, page_keys(c, block, h), n, q, G, lg, c->bs, row, page_values(c, block, h));
    attend_logits(c, page_values(c, block, h), n, lg, c->bs, G, NULL, softcap, st, p, row,
                  next >= 0 ? page_keys(c, next, h) : NULL);
}

/* The pages every row attends: the sinks, the tail and, when the row does not select (skip_candidates 0), every
 * candidate page in [sink_pages, cand_end); each page's successor prefetched while it is attended. */
static void attend_common(const sa_pages *c, const int32_t *table, int64_t h, int64_t L, int64_t sink_pages, int64_t cand_end,
                          int skip_candidates, const float *qs, int G, float softcap, sa_softmax *st, float *lg, float *p,
                          float *row) {
    const int64_t bs = c->bs, pages = (L + bs - 1) / bs;
    const int64_t common_end = skip_candidates ? sink_pages : cand_end;
    for (int64_t pg = 0; pg < pages; ++pg) {
        if (pg >= common_end && pg < cand_end) continue;
        const int n = (int)(pg == pages - 1 ? L - pg * bs : bs);
        const int64_t after = pg + 1 >= common_end && pg + 1 < cand_end ? cand_end : pg + 1;
        attend_page(c, table[pg], h, n, qs, G, softcap, st, lg, p, row, after < pages ? table[after] : -1);
    }
}

/* Each row's output, its accumulated values over its softmax sum: out[g, D] for g < G. */
static inline uint16_t sa_float_to_bf16(float x);
/* Each row's output, its accumulated values over its softmax sum (times v_mul, an fp8 cache's value scale), in the
 * output's dtype (float32, or bfloat16 / float16 rounded to nearest even, as torch converts): the model's own, so the
 * layer needs no float32 buffer and no conversion after the call. out: the G rows' first element. */
static void write_rows(const sa_softmax *st, int G, int64_t D, void *out, int out_dtype, float v_mul) {
    for (int64_t g = 0; g < G; ++g) {
        const float inv = st->l[g] > 0.f ? v_mul / st->l[g] : 0.f; /* v_mul: an fp8 cache's values are read unscaled */
        for (int64_t d = 0; d < D; ++d) {
            const float x = st->acc[g * D + d] * inv;
            if (out_dtype == SA_BF16) ((uint16_t *)out)[g * D + d] = sa_float_to_bf16(x);
#ifndef SA_NO_FLOAT16
            else if (out_dtype == SA_F16) ((_Float16 *)out)[g * D + d] = (_Float16)x;
#endif
            else ((float *)out)[g * D + d] = x;
        }
    }
}
static inline int64_t dtype_bytes(int dtype) { return dtype == SA_F32 ? 4 : dtype == SA_FP8_E4M3 || dtype == SA_FP8_E5M2 ? 1 : 2; }
/* A cache dtype the paged kernel reads: float32, bfloat16, float16 (where built) and the two fp8 formats. */
static inline int cache_dtype_ok(int dtype) {
#ifdef SA_NO_FLOAT16
    if (dtype == SA_F16) return 0;
#endif
    return dtype == SA_F32 || dtype == SA_BF16 || dtype == SA_F16 || dtype == SA_FP8_E4M3 || dtype == SA_FP8_E5M2;
}

/* Indices of the k largest of x[0..n) into out, best first (ties: the earlier index first; the order the pages are
 * then attended in, so the sums' rounding, is the insertion sort's this replaced): a min-heap of k (vals, out)
 * holding the best so far, then sorted, O(n log k) (the insertion was O(n k)). A NaN never displaces a number. */
static inline int heap_less(const float *vals, const int64_t *out, int64_t a, int64_t b) {
    return vals[a] < vals[b] || (vals[a] == vals[b] && out[a] > out[b]);
}
static void heap_down(float *vals, int64_t *out, int64_t n, int64_t at) {
    for (;;) {
        int64_t low = at;
        const int64_t l = 2 * at + 1, r = l + 1;
        if (l < n && heap_less(vals, out, l, low)) low = l;
        if (r < n && heap_less(vals, out, r, low)) low = r;
        if (low == at) return;
        const float v = vals[at];
        const int64_t o = out[at];
        vals[at] = vals[low], out[at] = out[low];
        vals[low] = v, out[low] = o;
        at = low;
    }
}
static void top_k(const float *x, int64_t n, int64_t k, int64_t *out, float *vals) {
    if (k <= 0) return;
    int64_t have = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        if (have < k) {
            vals[have] = v, out[have] = i;
            if (++have == k)
                for (int64_t j = k / 2 - 1; j >= 0; --j) heap_down(vals, out, k, j);
        } else if (v > vals[0]) {
            vals[0] = v, out[0] = i;
            heap_down(vals, out, k, 0);
        }
    }
    if (have < k) { /* fewer than k: a heap of them, then the same sort */
        for (int64_t j = have / 2 - 1; j >= 0; --j) heap_down(vals, out, have, j);
    }
    for (int64_t end = have - 1; end > 0; --end) { /* the smallest to the end: best first */
        const float v = vals[0];
        const int64_t o = out[0];
        vals[0] = vals[end], out[0] = out[end];
        vals[end] = v, out[end] = o;
        heap_down(vals, out, end, 0);
    }
}

/* x with a NaN read as the lowest number (a bit test: -ffast-math may fold isnan away), so that it ranks last. */
static inline float ranked(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7fffffffu) > 0x7f800000u ? -FLT_MAX : x;
}

/* x, or the lowest number for a NaN or an infinity (a head whose scores are not finite keeps its floor and takes
 * none of the layer's slots, as PooledMass ranks it). */
static inline float finite_or_lowest(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u ? -FLT_MAX : x;
}

/* The k (1 <= k <= n) largest of x[0..n) into out: the positions above the k-th value ascending, then the ties at it
 * ascending (the earlier indices), O(n): the k-th largest by a radix select on the numbers' order-preserving 32-bit
 * keys (a NaN read as -FLT_MAX: it ties with that and ranks below every other number), starting below the bits the
 * least and the largest key share (all keys share them: the shares a pooled split ranks are all negative), 8 or 11
 * bits a pass (a histogram, then the bucket holding the k-th: the numbers still in it kept, by AVX-512 compresses
 * where there are), then one pass collects. Scratch: v, w of n 32-bit words. Replaced a quickselect (3-4x the time
 * at n = 2000: its partitions swept the numbers several times). */
static inline uint32_t order_key(float x) {
    uint32_t bits;
    x = ranked(x);
    memcpy(&bits, &x, sizeof bits);
    if (bits == 0x80000000u) bits = 0; /* -0 is 0 */
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u; /* larger number, larger key */
}
/* Keep the keys of cur[0..m) whose bits under hi_mask are prefix, in order, into dst; returns how many. */
static inline int64_t keep_bucket(const uint32_t *cur, int64_t m, uint32_t hi_mask, uint32_t prefix, uint32_t *dst) {
    int64_t kept = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i vm = _mm512_set1_epi32((int)hi_mask), vp = _mm512_set1_epi32((int)prefix);
    for (; i + 16 <= m; i += 16) {
        const __m512i k = _mm512_loadu_si512(cur + i);
        const __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_and_si512(k, vm), vp);
        const int got = __builtin_popcount(in);
        _mm512_mask_storeu_epi32(dst + kept, (__mmask16)((1u << got) - 1u), _mm512_maskz_compress_epi32(in, k));
        kept += got;
    }
#endif
    for (; i < m; ++i) dst[kept] = cur[i], kept += (cur[i] & hi_mask) == prefix;
    return kept;
}
/* The positions i of keys[0..n) with keys[i] > kth, in order, into out; returns how many. */
static inline int64_t above_positions(const uint32_t *keys, int64_t n, uint32_t kth, int64_t *out) {
    int64_t have = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i vk = _mm512_set1_epi32((int)kth);
    const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 above = _mm512_cmpgt_epu32_mask(_mm512_loadu_si512(keys + i), vk);
        const __m512i base = _mm512_add_epi64(lane, _mm512_set1_epi64(i));
        const __mmask8 lo8 = (__mmask8)(above & 0xFF), hi8 = (__mmask8)(above >> 8);
        const int n_lo = __builtin_popcount(lo8), n_hi = __builtin_popcount(hi8);
        _mm512_mask_storeu_epi64(out + have, (__mmask8)((1u << n_lo) - 1u), _mm512_maskz_compress_epi64(lo8, base));
        have += n_lo;
        _mm512_mask_storeu_epi64(out + have, (__mmask8)((1u << n_hi) - 1u),
                                 _mm512_maskz_compress_epi64(hi8, _mm512_add_epi64(base, _mm512_set1_epi64(8))));
        have += n_hi;
    }
#endif
    for (; i < n; ++i) out[have] = i, have += keys[i] > kth;
    return have;
}
static void top_k_set(const float *x, int64_t n, int64_t k, int64_t *out, float *v, float *w) {
    uint32_t *keys = (uint32_t *)v, *rest = (uint32_t *)w; /* the keys, then those still in the k-th's bucket */
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int64_t i = 0; i < n; ++i) keys[i] = order_key(x[i]);
    for (int64_t i = 0; i < n; ++i) {
        lo = keys[i] < lo ? keys[i] : lo;
        hi = keys[i] > hi ? keys[i] : hi;
    }
    /* The bits every key shares (above the highest bit where the least and the largest differ) are the k-th's too. */
    uint32_t known = lo == hi ? 32u : (uint32_t)__builtin_clz(lo ^ hi);
    uint32_t prefix = known >= 32 ? hi : hi & ~(0xFFFFFFFFu >> known);
    int64_t m = n, want = k; /* the want-th largest of the m keys that share the prefix */
    const uint32_t *cur = keys;
    const int width = n < 4096 ? 8 : 11; /* bits a pass: a histogram no longer to clear and scan than the numbers */
    while (m > 1 && known < 32) {
        const int bits = 32 - (int)known < width ? 32 - (int)known : width;
        const int shift = 32 - (int)known - bits;
        uint32_t hist[2048];
        memset(hist, 0, sizeof(uint32_t) << bits);
        const uint32_t mask = (uint32_t)((1u << bits) - 1u);
        for (int64_t i = 0; i < m; ++i) hist[(cur[i] >> shift) & mask]++;
        int64_t above = 0, bucket = (int64_t)mask;
        for (; bucket > 0 && above + hist[bucket] < want; --bucket) above += hist[bucket];
        want -= above;
        prefix |= (uint32_t)bucket << shift;
        known += (uint32_t)bits;
        m = keep_bucket(cur, m, known >= 32 ? 0xFFFFFFFFu : ~(0xFFFFFFFFu >> known), prefix, rest);
        cur = rest;
    }
    const uint32_t kth = known < 32 ? cur[0] : prefix; /* one key left in the bucket: it is the k-th */
    int64_t have = above_positions(keys, n, kth, out); /* fewer than k: kth is the k-th */
    for (int64_t i = 0; i < n && have < k; ++i)
        if (keys[i] == kth) out[have++] = i;
}

/* top_k_set for tests (sparseattn.vllm.paged_kernel.top_k_positions): out[k] the positions of x[0..n)'s k largest. */
int sa_paged_top_k(const float *x, int64_t n, int64_t k, int64_t *out) {
    if (n < 1 || k < 1 || k > n) return SA_BAD_PLAN;
    float *v = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)n);
    if (v && w) top_k_set(x, n, k, out, v, w);
    free(v), free(w);
    return v && w ? SA_OK : SA_NO_MEMORY;
}

static inline float log_sum_exp(const float *x, int64_t n, int64_t stride) {
    float top = SA_NO_SCORE;
    for (int64_t i = 0; i < n; ++i) top = x[i * stride] > top ? x[i * stride] : top;
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += expf(x[i * stride] - top);
    return top + logf(sum);
}

/* float32 -> the nearest bfloat16 (ties to even), as torch's conversion rounds (finite values: a mean of keys; a NaN
 * keeps a quiet NaN's bits). */
static inline uint16_t sa_float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Summarise the r segments of one page of one head into summary (+ summary2 for the bound), r rows of D: each
 * segment's mean key, or its min and max. With s16 (SA_CENTROID) the means go there instead, as bfloat16 means of
 * the keys times key_root, exactly as Centroid(dtype=torch.bfloat16).summarize rounds them from the float32 scaled
 * keys the generic path hands it: each product in float32, their mean in float64, rounded to float32 and then to
 * bfloat16 (the float32 means: key_root 1, a product that changes nothing). */
static void summarise(const sa_pages *c, int mode, int64_t block, int64_t h, float *restrict s1, float *restrict s2,
                      uint16_t *restrict s16, float key_root, float *restrict row) {
    const int64_t D = c->D, bs = c->bs, seg = c->seg;
    const char *keys = page_keys(c, block, h);
    for (int64_t d = 0; d < D; ++d) {
        key_row(c, keys, d, bs, row);
        for (int64_t u = 0; u < c->r; ++u) {
            const float *x = row + u * seg;
            if (mode == SA_CENTROID) {
                double sum = 0.0;
                for (int64_t j = 0; j < seg; ++j) {
                    const float scaled = x[j] * key_root;
                    sum += (double)scaled;
                }
                const float mean = (float)(sum / (double)seg);
                if (s16)
                    s16[u * D + d] = sa_float_to_bf16(mean);
                else
                    s1[u * D + d] = mean;
            } else {
                float lo = x[0], hi = x[0];
                for (int64_t j = 1; j < seg; ++j) {
                    lo = x[j] < lo ? x[j] : lo;
                    hi = x[j] > hi ? x[j] : hi;
                }
                s1[u * D + d] = lo;
                s2[u * D + d] = hi;
            }
        }
    }
}

/* sa_paged_decode's arguments (sparseattn.vllm.paged_kernel.DecodeArgs mirrors it; sa_paged_decode_layout gives the
 * offsets a test holds it to). One decode token per sequence. q: [B, H, G, D] of q_dtype (unscaled); cache: [N, H, bs,
 * 2 D] of dtype; block_table: [B, bt_stride] int32 physical blocks; seq_lens: [B] int32 (the current token included);
 * plan: [B, 4] int32 (sink_pages, n_cand, k, m), n_cand in segments of bs / r tokens (r per page); shared: one
 * selection per KV group (else per query head); summary, summary2: [N, H, r, D] float32 stores (SA_BOUND: min and
 * max), state: [N] uint8; selected: [B, H, G' = shared ? 1 : G, kmax] int32 candidate indices chosen (-1 past k), or
 * NULL; out: [B, H, G, D] of out_dtype. */
typedef struct {
    const void *q, *cache;
    const int32_t *block_table, *seq_lens, *plan;
    float *summary, *summary2;
    uint8_t *state;
    int32_t *selected;
    void *out;
    int64_t N, H, bs, D, r, G, B, bt_stride, kmax;
    float scale, softcap, k_mul, v_mul; /* k_mul, v_mul: what a stored key or value is multiplied by (fp8: scale x 2^8 for e4m3) */
    int32_t dtype, q_dtype, out_dtype, mode, shared, threads, amx, unused; /* amx: the cache is in the amx layout */
} sa_decode_args;

#define SA_DECODE_FIELDS(X)                                                                                                \
    X(q) X(cache) X(block_table) X(seq_lens) X(plan) X(summary) X(summary2) X(state) X(selected) X(out) X(N) X(H) X(bs)   \
    X(D) X(r) X(G) X(B) X(bt_stride) X(kmax) X(scale) X(softcap) X(k_mul) X(v_mul) X(dtype) X(q_dtype) X(out_dtype) X(mode) \
    X(shared) X(threads) X(amx) X(unused)

int64_t sa_paged_decode_layout(int64_t *offsets) {
    int64_t i = 0;
#define SA_OFFSET(f) offsets[i++] = (int64_t)offsetof(sa_decode_args, f);
    SA_DECODE_FIELDS(SA_OFFSET)
#undef SA_OFFSET
    return (int64_t)sizeof(sa_decode_args);
}

int sa_paged_decode(const sa_decode_args *a) {
    const void *cache = a->cache;
    const int dtype = a->dtype, mode = a->mode, shared = a->shared;
    const int64_t N = a->N, H = a->H, bs = a->bs, D = a->D, r = a->r, G = a->G, B = a->B, bt_stride = a->bt_stride, kmax = a->kmax;
    const int32_t *block_table = a->block_table, *seq_lens = a->seq_lens, *plan = a->plan;
    const float scale = a->scale, softcap = a->softcap;
    float *summary = a->summary, *summary2 = a->summary2;
    uint8_t *state = a->state;
    int32_t *selected = a->selected;
    int threads = a->threads;
    if (a->q_dtype != SA_F32 && a->q_dtype != SA_BF16 && a->q_dtype != SA_F16) return SA_BAD_DTYPE;
    if (a->out_dtype != SA_F32 && a->out_dtype != SA_BF16 && a->out_dtype != SA_F16) return SA_BAD_DTYPE;
#ifdef SA_NO_FLOAT16
    if (a->q_dtype == SA_F16 || a->out_dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    if (!cache_dtype_ok(dtype)) return SA_BAD_DTYPE;
    if (mode != SA_FIXED && mode != SA_BOUND) return SA_BAD_PLAN;
    if (bs < 1 || bs > 4096 || D < 1 || G < 1 || G > 64 || H < 1 || r < 1 || bs % r) return SA_BAD_PLAN;
#ifdef SA_NO_FLOAT16
    if (dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    const int64_t elem = dtype_bytes(dtype);
    const sa_pages c = {(const char *)cache, dtype, elem, H, bs, D, r, bs / r, a->amx};
    /* the amx layout: bfloat16, pages and head dims of multiples of 32, segments whole groups of 16 tokens */
    if (a->amx && (dtype != SA_BF16 || bs % 32 || D % 32 || !fast_shape(&c) || (mode == SA_BOUND && (bs / r) % 16))) return SA_BAD_PLAN;
    /* Check the plan and the block table before any work; collect the stale candidate pages. */
    int64_t most_cand = 0, stale_n = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int32_t *pl = plan + b * 4;
        const int64_t L = seq_lens[b], pages = (L + bs - 1) / bs;
        const int64_t attended = pl[2] < pl[1] ? pl[2] : pl[1];
        if (L < 1 || pl[0] < 0 || pl[1] < 0 || pl[1] % r || pl[0] + pl[1] / r >= pages + (pl[1] == 0) || pl[2] < 0 || attended > kmax ||
            pages > bt_stride || (mode == SA_FIXED && pl[2] > 0 && pl[2] < pl[1]))
            return SA_BAD_PLAN;
        for (int64_t p = 0; p < pages; ++p)
            if (block_table[b * bt_stride + p] < 0 || block_table[b * bt_stride + p] >= N) return SA_BAD_BLOCK;
        most_cand = pl[1] > most_cand ? pl[1] : most_cand;
    }
    int64_t *stale = NULL;
    if (mode != SA_FIXED) {
        for (int64_t b = 0; b < B; ++b) {
            const int32_t *pl = plan + b * 4;
            if (pl[2] >= pl[1] || pl[2] == 0) continue; /* nothing to score */
            for (int64_t i = 0; i < pl[1] / r; ++i) {
                const int32_t blk = block_table[b * bt_stride + pl[0] + i];
                if (state[blk] != 1) {
                    if (!stale) stale = malloc(sizeof(int64_t) * (size_t)(B * most_cand + 1));
                    if (!stale) return SA_NO_MEMORY;
                    state[blk] = 1; /* listed once even when shared by several sequences */
                    stale[stale_n++] = blk;
                }
            }
        }
    }
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
    int status = SA_OK;
    sa_prof whole;
    prof_start(&whole);
    if (stale_n) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < stale_n * H; ++i) {
            float row[4096]; /* bs <= 4096: checked above */
            const int64_t blk = stale[i / H], h = i % H;
            summarise(&c, mode, blk, h, summary + (blk * H + h) * r * D, summary2 ? summary2 + (blk * H + h) * r * D : NULL, NULL, 1.f,
                      row);
        }
    }
    prof_mark(&whole, SA_PH_SUMMARISE, stale_n * H * key_bytes(&c, 0, bs));
    prof_flush(&whole);
    free(stale);
    const int64_t Gs = shared ? 1 : G;
#pragma omp parallel num_threads(threads)
    {
        /* Per-thread scratch: scores of the candidates, the shortlist's kept logits, one page's logits and weights. */
        const int64_t cand_cap = most_cand > 0 ? most_cand : 1;
        float *qs = malloc(sizeof(float) * (size_t)(G * D));
        float *cs = malloc(sizeof(float) * (size_t)(G * cand_cap));
        float *gs = malloc(sizeof(float) * (size_t)cand_cap);
        float *lg = malloc(sizeof(float) * (size_t)(G * bs));
        float *p = malloc(sizeof(float) * (size_t)(G * bs));
        float *row = malloc(sizeof(float) * (size_t)(bs > D ? bs : D));
        float *vals = malloc(sizeof(float) * (size_t)(cand_cap + 1));
        int64_t *pick = malloc(sizeof(int64_t) * (size_t)(Gs * cand_cap));
        int64_t *npick = malloc(sizeof(int64_t) * (size_t)Gs);
        uint8_t *rows = malloc((size_t)G);
        float *m = malloc(sizeof(float) * (size_t)G), *l = malloc(sizeof(float) * (size_t)G);
        float *acc = malloc(sizeof(float) * (size_t)(G * D));
        const int ok = qs && cs && gs && lg && p && row && vals && pick &&
                       npick && rows && m && l && acc;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * H; ++item) {
            if (!ok) continue;
            const int64_t h = item / B, b = item % B; /* head-major: see the top of the file */
            const int32_t *pl = plan + b * 4;
            const int64_t sink_pages = pl[0], n_cand = pl[1], k = pl[2], L = seq_lens[b];
            const int64_t cand_end = sink_pages + n_cand / r, seg = c.seg;
            const int32_t *table = block_table + b * bt_stride;
            sa_prof prof;
            prof_start(&prof);
            sa_to_float((const char *)a->q + (b * H + h) * G * D * dtype_bytes(a->q_dtype), a->q_dtype, G * D, qs);
            for (int64_t i = 0; i < G * D; ++i) qs[i] *= scale * a->k_mul;
            sa_softmax st = {m, l, acc};
            for (int64_t g = 0; g < G; ++g) m[g] = SA_NO_SCORE, l[g] = 0.f;
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            double sel_bytes = 0.0;
            const int select = k > 0 && k < n_cand && mode != SA_FIXED;
            if (select) {
                /* Coarse scores of every candidate, per query row. */
                for (int64_t i = 0; i < n_cand; ++i) {
                    const int64_t srow = seg_row(&c, table, sink_pages, i, h);
                    const float *s1 = summary + srow * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float *qg = qs + g * D;
                        const float *s2 = summary2 + srow * D;
                        float v = 0.f;
                        for (int64_t d = 0; d < D; ++d) {
                            const float a = qg[d] * s1[d], z = qg[d] * s2[d];
                            v += a > z ? a : z;
                        }
                        cs[g * n_cand + i] = v;
                    }
                }
                prof_mark(&prof, SA_PH_SCORE, (double)n_cand * lines_bytes(0, D * (int64_t)sizeof(float)) * 2);
                {
                    for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                        const float *src = cs + gs_i * n_cand;
                        if (shared) {
                            for (int64_t i = 0; i < n_cand; ++i) gs[i] = log_sum_exp(cs + i, G, n_cand);
                            src = gs;
                        }
                        top_k(src, n_cand, k, pick + gs_i * cand_cap, vals);
                        npick[gs_i] = k;
                    }
                    prof_mark(&prof, SA_PH_SHORTLIST, 0.0);
                }
            }
            attend_common(&c, table, h, L, sink_pages, cand_end, select || k == 0, qs, (int)G, softcap, &st, lg, p, row);
            {
                const int64_t pages_all = (L + bs - 1) / bs, common = select || k == 0 ? pages_all - n_cand / r : pages_all;
                prof_mark(&prof, SA_PH_ATTEND_ALWAYS, (double)common * (key_bytes(&c, 0, bs) + value_bytes(&c, 0, bs)));
            }
            /* The selected candidates: per selection, its rows. */
            if (select) {
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                    for (int64_t g = 0; g < G; ++g) rows[g] = shared || g == gs_i;
                    for (int64_t t = 0; t < npick[gs_i]; ++t) {
                        const int64_t at = pick[gs_i * cand_cap + t];
                        const int64_t cand = at;
                        int64_t next = -1; /* the candidate attended after this one (prefetched meanwhile) */
                        if (t + 1 < npick[gs_i]) {
                            const int64_t at2 = pick[gs_i * cand_cap + t + 1];
                            next = at2;
                        }
                        const char *vals_c = seg_values(&c, table, sink_pages, cand, h);
                        sel_bytes += value_bytes(&c, (cand % r) * seg, seg) + key_bytes(&c, (cand % r) * seg, seg);
                        page_logits(&c, seg_keys(&c, table, sink_pages, cand, h), (int)seg, qs, (int)G, lg, bs, row, vals_c);
                        attend_logits(&c, vals_c, (int)seg, lg, bs, (int)G, rows, softcap, &st, p, row,
                                      next >= 0 ? seg_keys(&c, table, sink_pages, next, h) : NULL);
                        if (selected) selected[((b * H + h) * Gs + gs_i) * kmax + t] = (int32_t)cand;
                    }
                }
            }
            if (selected) { /* the rest of each list: every candidate (not selecting), or -1 */
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                    int32_t *sel = selected + ((b * H + h) * Gs + gs_i) * kmax;
                    const int64_t from = select ? npick[gs_i] : 0;
                    for (int64_t t = from; t < kmax; ++t) sel[t] = (!select && t < n_cand && k > 0) ? (int32_t)t : -1;
                }
            }
            write_rows(&st, (int)G, D, (char *)a->out + (b * H + h) * G * D * dtype_bytes(a->out_dtype), a->out_dtype, a->v_mul);
            prof_mark(&prof, SA_PH_ATTEND_SELECTED, sel_bytes);
            prof_flush(&prof);
        }
        free(qs); free(cs); free(gs); free(lg); free(p); free(row); free(vals);
        free(pick); free(npick); free(rows); free(m); free(l); free(acc);
    }
    return status;
}

/* ---- What the split step (sa_paged_split, below) builds on. */

/* Check a step's plan and block table (as sa_paged_decode does); most candidates and shortlist of any row. */
static int check_step(int64_t N, int64_t B, int64_t bs, int64_t r, const int32_t *block_table, int64_t bt_stride,
                      const int32_t *seq_lens, const int32_t *plan, int shortlist, int64_t *most_cand, int64_t *most_m) {
    *most_cand = 0, *most_m = 0;
    for (int64_t b = 0; b < B; ++b) { /* shortlist: a selecting row must shortlist (1 <= m <= n_cand), else m is 0 */
        const int32_t *pl = plan + b * 4;
        const int64_t L = seq_lens[b], pages = (L + bs - 1) / bs;
        if (L < 1 || pl[0] < 0 || pl[1] < 0 || pl[1] % r || pl[0] + pl[1] / r >= pages + (pl[1] == 0) || pl[2] < 0 || pages > bt_stride ||
            (pl[2] > 0 && pl[2] < pl[1] && (shortlist ? pl[3] < 1 || pl[3] > pl[1] : pl[3] != 0)))
            return SA_BAD_PLAN;
        for (int64_t p = 0; p < pages; ++p)
            if (block_table[b * bt_stride + p] < 0 || block_table[b * bt_stride + p] >= N) return SA_BAD_BLOCK;
        *most_cand = pl[1] > *most_cand ? pl[1] : *most_cand;
        *most_m = pl[3] > *most_m ? pl[3] : *most_m;
    }
    return SA_OK;
}

/* The candidate blocks of the selecting rows (0 < k < n_cand) whose state is not 1, each listed once and marked 1. */
static int64_t stale_blocks(int64_t B, int64_t r, const int32_t *block_table, int64_t bt_stride, const int32_t *plan,
                            int64_t most_cand, uint8_t *state, int64_t **out) {
    int64_t n = 0;
    *out = NULL;
    for (int64_t b = 0; b < B; ++b) {
        const int32_t *pl = plan + b * 4;
        if (pl[2] >= pl[1] || pl[2] == 0) continue;
        for (int64_t i = 0; i < pl[1] / r; ++i) {
            const int32_t blk = block_table[b * bt_stride + pl[0] + i];
            if (state[blk] == 1) continue;
            if (!*out) *out = malloc(sizeof(int64_t) * (size_t)(B * most_cand + 1));
            if (!*out) return -1;
            state[blk] = 1;
            (*out)[n++] = blk;
        }
    }
    return n;
}

/* Rows of [2 D] per (block, head) in a store of sums: a page cut in r > 1 segments keeps its own total after
 * the segments' rows, so a block of pages is summed from one row per page, not r. */
/* Rows of [2 D] a page keeps in the sums store: its r segments' then its own (r > 1 with segment rows), else its own. */
static inline int64_t sums_rows(int64_t r, int segment_rows) { return r > 1 && segment_rows ? r + 1 : 1; }

/* With segment_rows, each of a page's r segments' key sum then value sum, r rows of [2 D] (keys [D, bs]: each
 * channel's row summed per segment; values [bs, D]), then (r > 1) the page's, row r; without, the page's alone.
 * Without with_keys the value sums alone, rows of [D] (the step reads the keys' side off the centroid scores). */
static void page_sums(const sa_pages *c, int64_t block, int64_t h, int segment_rows, int with_keys, float *restrict out,
                      float *restrict row) {
    const int64_t D = c->D, bs = c->bs, seg = c->seg, r = c->r, own = sums_rows(r, segment_rows) - 1;
    const int64_t w = with_keys ? 2 * D : D, vo = with_keys ? D : 0; /* a row's width, its values' first column */
    const char *keys = page_keys(c, block, h), *values = page_values(c, block, h);
    for (int64_t d = 0; d < D && with_keys; ++d) {
        key_row(c, keys, d, bs, row);
        double page = 0.0;
        for (int64_t u = 0; u < r; ++u) {
            double sum = 0.0;
            for (int64_t j = 0; j < seg; ++j) sum += row[u * seg + j];
            if (own) out[u * w + d] = (float)sum;
            page += sum;
        }
        if (r > 1 || !own) out[own * w + d] = (float)page;
    }
    double acc[4096], page[4096]; /* D <= 4096: checked by the caller */
    for (int64_t d = 0; d < D; ++d) page[d] = 0.0;
    for (int64_t u = 0; u < r; ++u) {
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0;
        for (int64_t j = u * seg; j < (u + 1) * seg; ++j) {
            value_row(c, values, j, row);
            for (int64_t d = 0; d < D; ++d) acc[d] += row[d];
        }
        for (int64_t d = 0; d < D; ++d) {
            if (own) out[u * w + vo + d] = (float)acc[d];
            page[d] += acc[d];
        }
    }
    for (int64_t d = 0; d < D; ++d) out[own * w + vo + d] = (float)page[d];
}

/* out[i] = log sum_g exp x[g * ld + i] for i < n (G rows): the loops run along i, so the exponentials vectorise
 * (libmvec) where a per-candidate log_sum_exp over its G rows would call expf once per value. top: scratch [n]. */
static void lse_columns(const float *restrict x, int64_t G, int64_t ld, int64_t n, float *restrict out, float *restrict top) {
    for (int64_t i = 0; i < n; ++i) top[i] = x[i];
    for (int64_t g = 1; g < G; ++g)
        for (int64_t i = 0; i < n; ++i) top[i] = x[g * ld + i] > top[i] ? x[g * ld + i] : top[i];
    for (int64_t i = 0; i < n; ++i) out[i] = 0.f;
    for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < n; ++i) out[i] += expf(exp_arg(x[g * ld + i] - top[i]));
    for (int64_t i = 0; i < n; ++i) out[i] = top[i] + logf(out[i]);
}

/* The tokens whose logits the split step keeps together (a slot): what one read of the keys' lines brings. A page's
 * keys are rows of bs tokens per channel, so 32 bf16 tokens are a 64-byte line: a shortlisted 4- or 8-token segment
 * costs its 32 tokens' lines whatever else is read (a 16-token segment of float32 keys, its own). A unit is 32
 * tokens, or the segment where it is longer, or the page where pages are not multiples of 32. */
static inline int64_t slot_unit(int64_t bs, int64_t seg) { return seg >= 32 ? seg : (bs % 32 == 0 ? 32 : bs); }

/* The units (slot_unit tokens: cu candidates each, candidate i in unit i / cu) that hold a shortlisted segment
 * (sh[0..mm)), each once: slot[u] its place among them in ascending order, -1 for the others; order[j] the j-th.
 * Both phases of the split step derive the same slots from the same shortlist: the kept logits are one whole unit per
 * slot, so a unit holding several shortlisted segments is read once and its other segments' logits come free.
 * Returns the number of slots. */
static int64_t shortlist_slots(const int32_t *sh, int64_t mm, int64_t cu, int64_t n_units, int32_t *slot, int64_t *order) {
    for (int64_t u = 0; u < n_units; ++u) slot[u] = -1;
    for (int64_t s = 0; s < mm; ++s) slot[sh[s] / cu] = -2;
    int64_t n = 0;
    for (int64_t u = 0; u < n_units; ++u)
        if (slot[u] == -2) order[n] = u, slot[u] = (int32_t)n++;
    return n;
}

/* The keys of unit u (of `unit` tokens, bs / unit per page) of a sequence's candidates, and a request for its lines. */
static inline const char *unit_keys(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t u, int64_t unit, int64_t h) {
    const int64_t per_page = c->bs / unit;
    return key_col(c, page_keys(c, table[sink_pages + u / per_page], h), (u % per_page) * unit);
}
static inline void prefetch_unit(const sa_pages *c, const char *keys, int64_t unit) {
    if (unit == c->bs) {
        SA_PREFETCH(keys, 0, c->D * c->bs * c->elem);
        return;
    }
    for (int64_t d = 0; d < c->D; ++d) SA_PREFETCH(keys + d * c->bs * c->elem, 0, unit * c->elem);
}

/* ---- The split step: sa_paged_split(args, phases).
 *
 * A policy whose allocation splits the layer's segments between its heads (pooled mass, top-p, any allocation), or
 * that merges the rest, or that selects segments inside pages, runs in phases:
 *   SA_SPLIT_SCORE, per (sequence, KV head) that selects (0 < k < n_cand): every candidate's centroid score
 *     coarse[B, H, G, S_max] = scale q . mean k + log seg (or, with bfloat16 centroids, root q . the stored mean of
 *     the keys times root); the KV group's shortlist short_ix[B, H, M_max], its m = plan[3] best by log-sum-exp over
 *     the group's rows; the logits of the pages holding them, kept[B, H, M_max, G, bs], one whole page per slot of
 *     shortlist_slots (a page's logits cost what one segment's do: the lines are the page's), and the shortlisted
 *     segments' exact log masses exact[B, H, G, M_max]; the log mass of the sinks and the tail always[B, H, G]. With
 *     allocation SA_ALLOC_TOPK each selection then flags its k best of the shortlist by exact mass (a shared selection:
 *     by the group's log-sum-exp) in chosen[B, H, G', S_max].
 *   SA_SPLIT_ALLOCATE, with allocation SA_ALLOC_POOLED: PooledMass's split of each sequence's segments between all its
 *     query heads (every head's scores first: a phase of its own), flagged in chosen.
 *   SA_SPLIT_ATTEND, per (sequence, KV head): the sinks and the tail for every row; every candidate when the row does
 *     not select (k >= n_cand; none when k == 0); else each selection's flagged candidates, their logits the kept
 *     ones where the shortlist holds their page, and with per_block > 0 one merged token per block of per_block
 *     candidates made of what the selection leaves out (its logit off the centroid scores where the centroids are
 *     float32, else from the keys' sums the store keeps).
 * With allocation SA_ALLOC_NONE the caller flags chosen itself between a SCORE call and an ATTEND call (the policy's
 * own allocation, in Python: sparseattn.vllm.paged_kernel.split_decode). chosen is zero where nothing is flagged.
 *
 * The selection is attended in two passes over the union of the selections' candidates, one run per stretch of
 * adjacent segments of a page chosen by the same selections: first every run's logits (each row's maximum), then,
 * with one rescale per row, the weights and the values; a run's values are prefetched several runs ahead (runs are
 * a few hundred bytes: one run ahead leaves the loop waiting on memory). All scratch is per thread and kept from call
 * to call (the OpenMP threads are torch's persistent pool): no call maps fresh pages.
 */

enum { SA_SPLIT_SCORE = 1, SA_SPLIT_ALLOCATE = 2, SA_SPLIT_ATTEND = 4 };
enum { SA_ALLOC_NONE = 0, SA_ALLOC_TOPK = 1, SA_ALLOC_POOLED = 2, SA_ALLOC_TOPK_COARSE = 3 };

/* The split step's arguments (sparseattn.vllm.paged_kernel.SplitArgs mirrors it field by field; sa_paged_split_layout
 * gives the offsets a test holds it to). Pointers, then 64-bit integers, then 32-bit numbers: no padding between. */
typedef struct {
    const void *q;              /* [B, H, G, D] of q_dtype (float32, bfloat16, float16), unscaled */
    const void *cache;          /* [N, H, bs, 2 D] of dtype */
    const int32_t *block_table; /* [B, bt_stride] physical blocks */
    const int32_t *seq_lens;    /* [B], the current token included */
    const int32_t *plan;        /* [B, 4]: sink_pages, n_cand (segments, r per page), k, m */
    const int32_t *pool;        /* [B, 2] with SA_ALLOC_POOLED: the most segments a query head takes, and its floor */
    void *summary;              /* [N, H, r, D]: float32 raw means, or (summary_bf16) bfloat16 means of the keys times root;
                                 * with bound: each segment's per-channel key minimum */
    float *summary2;            /* [N, H, r, D] float32 with bound: the maximum (quest's bound summary), else NULL */
    uint8_t *state;             /* [N]: 1 while a block's summaries are valid */
    float *sums;                /* [N, H, sums_rows, W] the merged rest's sums (per_block > 0), or NULL */
    uint8_t *sums_state;        /* [N] */
    float *coarse;              /* [B, H, G, S_max] */
    int32_t *short_ix;          /* [B, H, M_max] */
    float *exact;               /* [B, H, G, M_max] */
    float *always;              /* [B, H, G] */
    float *kept;                /* [B, H, M_max, G, bs] */
    uint8_t *chosen;            /* [B, H, G', S_max] */
    void *out;                  /* [B, H, G, D] of out_dtype */
    int64_t N, H, bs, D, r, G, B, bt_stride, S_max, M_max;
    int64_t per_block;          /* candidates per merged block; 0: no merged rest */
    float scale, softcap, root, k_mul, v_mul; /* k_mul, v_mul: what a stored key or value is multiplied by (fp8) */
    int32_t dtype, q_dtype, out_dtype, shared, summary_bf16, segment_rows, allocation, threads, amx;
    int32_t bound; /* quest: candidates scored by the bound of their keys' minimum and maximum, no shortlist */
} sa_split_args;

#define SA_SPLIT_FIELDS(X)                                                                                                 \
    X(q) X(cache) X(block_table) X(seq_lens) X(plan) X(pool) X(summary) X(summary2) X(state) X(sums) X(sums_state) X(coarse) X(short_ix)      \
    X(exact) X(always) X(kept) X(chosen) X(out) X(N) X(H) X(bs) X(D) X(r) X(G) X(B) X(bt_stride) X(S_max) X(M_max)         \
    X(per_block) X(scale) X(softcap) X(root) X(k_mul) X(v_mul) X(dtype) X(q_dtype) X(out_dtype) X(shared) X(summary_bf16) \
    X(segment_rows) X(allocation) X(threads) X(amx) X(bound)

/* offsets[i] = the offset of the struct's i-th field (in SA_SPLIT_FIELDS order); returns its size. */
int64_t sa_paged_split_layout(int64_t *offsets) {
    int64_t i = 0;
#define SA_OFFSET(f) offsets[i++] = (int64_t)offsetof(sa_split_args, f);
    SA_SPLIT_FIELDS(SA_OFFSET)
#undef SA_OFFSET
    return (int64_t)sizeof(sa_split_args);
}

/* Per-thread scratch kept from call to call: one block that grows to the largest step seen, carved per phase. */
static __thread char *sa_scratch_base;
static __thread size_t sa_scratch_cap;
typedef struct {
    char *base;
    size_t used, cap;
} sa_carver;
static inline sa_carver scratch_begin(size_t need) {
    if (need > sa_scratch_cap) {
        free(sa_scratch_base);
        sa_scratch_cap = need + need / 4;
        sa_scratch_base = malloc(sa_scratch_cap);
        if (!sa_scratch_base) sa_scratch_cap = 0;
    }
    return (sa_carver){sa_scratch_base, 0, sa_scratch_cap};
}
static inline void *carve(sa_carver *c, size_t bytes) {
    void *p = c->base + c->used;
    c->used += (bytes + 63) & ~(size_t)63;
    return p;
}
/* Bytes carve takes for these sizes (each rounded to a line). */
#define SA_LINE(x) ((((size_t)(x)) + 63) & ~(size_t)63)

/* The k best of x[0..n) (positions) into out, any order, k <= n: top_k_set, or all of them when k == n. */
static void best_positions(const float *x, int64_t n, int64_t k, int64_t *out, float *v, float *w) {
    if (k >= n) {
        for (int64_t i = 0; i < n; ++i) out[i] = i;
        return;
    }
    top_k_set(x, n, k, out, v, w);
}

typedef struct {
    float *qs, *qr, *wide, *gs, *v, *w, *shifted, *tops, *lg, *row, *run, *ex_s;
    int64_t *ix, *order, *pick;
    int32_t *slot;
} sa_score_scratch;

static size_t score_scratch_bytes(int64_t G, int64_t D, int64_t bs, int64_t S, int64_t M, int64_t seg) {
    return 2 * SA_LINE(4 * G * D) + SA_LINE(4 * D) + 3 * SA_LINE(4 * (S + 1)) + SA_LINE(4 * M * G * seg) + SA_LINE(4 * M * G) +
           SA_LINE(4 * G * bs) + SA_LINE(4 * (bs > D ? bs : D)) + SA_LINE(8 * G) + SA_LINE(4 * (M + 1)) + 3 * SA_LINE(8 * (S + 1)) +
           SA_LINE(4 * (S + 1));
}

static sa_score_scratch score_scratch(sa_carver *cv, int64_t G, int64_t D, int64_t bs, int64_t S, int64_t M, int64_t seg) {
    sa_score_scratch s;
    s.qs = carve(cv, 4 * G * D), s.qr = carve(cv, 4 * G * D);
    s.wide = carve(cv, 4 * D);
    s.gs = carve(cv, 4 * (S + 1)), s.v = carve(cv, 4 * (S + 1)), s.w = carve(cv, 4 * (S + 1));
    s.shifted = carve(cv, 4 * M * G * seg), s.tops = carve(cv, 4 * M * G);
    s.lg = carve(cv, 4 * G * bs), s.row = carve(cv, 4 * (bs > D ? bs : D)), s.run = carve(cv, 8 * G);
    s.ex_s = carve(cv, 4 * (M + 1));
    s.ix = carve(cv, 8 * (S + 1)), s.order = carve(cv, 8 * (S + 1)), s.pick = carve(cv, 8 * (S + 1));
    s.slot = carve(cv, 4 * (S + 1));
    return s;
}

/* Each selection's k best of n scores, flagged in chosen (G' rows of S_max): per query head a row of scores (rows
 * stride apart), or with shared one per KV group, the group's log-sum-exp over its G rows (into lse). A position p
 * flags map[p] (map NULL: p itself: a shortlist's rows name their candidates through it). */
static void flag_best(const float *scores, int64_t n, int64_t stride, int64_t G, int shared, int64_t k, const int32_t *map,
                      float *lse, sa_score_scratch *s, uint8_t *chosen, int64_t S_max) {
    const int64_t Gs = shared ? 1 : G;
    for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
        const float *src = scores + gs_i * stride;
        if (shared) {
            for (int64_t i = 0; i < n; ++i) lse[i] = log_sum_exp(scores + i, G, stride);
            src = lse;
        }
        best_positions(src, n, k, s->pick, s->v, s->w);
        uint8_t *flags = chosen + gs_i * S_max;
        for (int64_t t = 0; t < k; ++t) flags[map ? map[s->pick[t]] : s->pick[t]] = 1;
    }
}

/* out[g * ld] = qc_g . s1 + add for the G rows of qc [G, D]. */
static inline __attribute__((always_inline)) void score_row(const float *restrict qc, int64_t G, const float *restrict s1, int64_t D,
                                                            float *restrict out, int64_t ld, float add) {
    for (int64_t g = 0; g < G; ++g) {
        const float *qg = qc + g * D;
        float x = 0.f;
        for (int64_t d = 0; d < D; ++d) x += qg[d] * s1[d];
        out[g * ld] = x + add;
    }
}

/* The scoring phase of one (sequence b, KV head h) that selects: see the top of this section. */
static void split_score_item(const sa_split_args *a, const sa_pages *c, int64_t b, int64_t h, const sa_score_scratch *s) {
    const int64_t H = a->H, G = a->G, D = a->D, bs = a->bs, r = a->r, seg = c->seg, S_max = a->S_max, M_max = a->M_max;
    const int32_t *pl = a->plan + b * 4;
    const int64_t sink_pages = pl[0], n_cand = pl[1], k = pl[2], mm = pl[3], L = a->seq_lens[b];
    sa_prof prof;
    prof_start(&prof);
    const int64_t pages = (L + bs - 1) / bs, n_pc = n_cand / r;
    const int32_t *table = a->block_table + b * a->bt_stride;
    const int64_t q_elem = dtype_bytes(a->q_dtype);
    sa_to_float((const char *)a->q + (b * H + h) * G * D * q_elem, a->q_dtype, G * D, s->qr); /* qr: the raw query first */
    for (int64_t i = 0; i < G * D; ++i) s->qs[i] = s->qr[i] * a->scale * a->k_mul; /* keys are read as stored */
    if (a->bound) { /* quest: the bound sum_d max(q_d min_d, q_d max_d) of every candidate, then each selection's k best */
        float *cs = a->coarse + (b * H + h) * G * S_max;
        const int64_t page_bytes = r * D * 4, ahead = 1 + (8192 + page_bytes - 1) / page_bytes;
        const char *lo_store = (const char *)a->summary, *hi_store = (const char *)a->summary2;
        for (int64_t p = 0; p < n_pc; ++p) {
            const int64_t at = (table[sink_pages + p] * H + h) * page_bytes;
            if (p + ahead < n_pc) {
                const int64_t later = (table[sink_pages + p + ahead] * H + h) * page_bytes;
                SA_PREFETCH(lo_store + later, 0, page_bytes);
                SA_PREFETCH(hi_store + later, 0, page_bytes);
            }
            for (int64_t u = 0; u < r; ++u) {
                const float *lo = (const float *)(lo_store + at) + u * D, *hi = (const float *)(hi_store + at) + u * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = s->qs + g * D;
                    float v = 0.f;
                    for (int64_t d = 0; d < D; ++d) {
                        const float x = qg[d] * lo[d], z = qg[d] * hi[d];
                        v += x > z ? x : z;
                    }
                    cs[g * S_max + p * r + u] = v;
                }
            }
        }
        prof_mark(&prof, SA_PH_SCORE, 2.0 * (double)n_pc * lines_bytes(0, page_bytes));
        flag_best(cs, n_cand, S_max, G, a->shared, k, NULL, s->gs, s, a->chosen + (b * H + h) * (a->shared ? 1 : G) * S_max, S_max);
        prof_mark(&prof, SA_PH_SHORTLIST, 0.0);
        prof_flush(&prof);
        return;
    }
    /* bf16 centroids hold the scaled keys' means: scored against the query times root (the generic path's
     * q.root . mean(k.root)); float32 ones hold the raw means, scored against the query times scale. */
    for (int64_t i = 0; i < G * D; ++i) s->qr[i] *= a->root;
    const float *qc = a->summary_bf16 ? s->qr : s->qs;
    const int64_t row_bytes = a->summary_bf16 ? 2 : 4, page_bytes = r * D * row_bytes;
    const char *store = (const char *)a->summary;
    const float log_seg = logf((float)seg);
    float *cs = a->coarse + (b * H + h) * G * S_max;
    /* Every candidate's score, page by page (no division per candidate): a page's r rows are one scattered chunk of
     * r D row_bytes; chunks at least 8 KB ahead are asked for (fewer leave the loop waiting on memory), a row's lines
     * per row scored (a burst of a chunk's lines at once measured slower). */
    const int64_t ahead = 1 + (8192 + page_bytes - 1) / page_bytes;
    for (int64_t p = 0; p < n_pc && p < ahead; ++p) SA_PREFETCH(store + (table[sink_pages + p] * H + h) * page_bytes, 0, page_bytes);
    const int64_t row_b = D * row_bytes;
    for (int64_t p = 0; p < n_pc; ++p) {
        const char *later = p + ahead < n_pc ? store + (table[sink_pages + p + ahead] * H + h) * page_bytes : NULL;
        const char *rows = store + (table[sink_pages + p] * H + h) * page_bytes;
        for (int64_t u = 0; u < r; ++u) {
            SA_PREFETCH(later, u * row_b, row_b); /* a later page's row per row scored: spread, not a burst */
            const float *s1;
            if (a->summary_bf16) {
                const char *src = rows + u * D * 2;
                if (D % SA_LANES == 0) {
                    for (int64_t d = 0; d < D; d += SA_LANES) {
                        const sa_v16 x = load16(src + 2 * d, SA_BF16);
                        memcpy(s->wide + d, &x, sizeof x);
                    }
                } else {
                    sa_to_float(src, SA_BF16, D, s->wide);
                }
                s1 = s->wide;
            } else {
                s1 = (const float *)rows + u * D;
            }
            /* the common head dims as constants: the dot products compile to straight vector code */
            if (D == 64) score_row(qc, G, s1, 64, cs + p * r + u, S_max, log_seg);
            else if (D == 128) score_row(qc, G, s1, 128, cs + p * r + u, S_max, log_seg);
            else score_row(qc, G, s1, D, cs + p * r + u, S_max, log_seg);
        }
    }
    prof_mark(&prof, SA_PH_SCORE, (double)n_pc * lines_bytes(0, page_bytes));
    lse_columns(cs, G, S_max, n_cand, s->gs, s->v);
    best_positions(s->gs, n_cand, mm, s->ix, s->v, s->w);
    int32_t *sh = a->short_ix + (b * H + h) * M_max;
    float *ex = a->exact + (b * H + h) * G * M_max;
    for (int64_t i = 0; i < mm; ++i) sh[i] = (int32_t)s->ix[i];
    prof_mark(&prof, SA_PH_SHORTLIST, 0.0);
    /* The shortlist's units' logits, each unit once, two units' keys asked for ahead; then each shortlisted
     * segment's exact log mass from its columns. */
    const int64_t unit = slot_unit(bs, seg), cu = unit / seg;
    const int64_t n_slots = shortlist_slots(sh, mm, cu, n_cand / cu, s->slot, s->order);
    float *kept_bh = a->kept + (b * H + h) * M_max * G * bs;
    for (int64_t j = 0; j < n_slots && j < 2; ++j) prefetch_unit(c, unit_keys(c, table, sink_pages, s->order[j], unit, h), unit);
    for (int64_t j = 0; j < n_slots; ++j) {
        /* the unit two slots on asked for line by line inside the loop (a burst of its 64 lines at once measured 2x slower) */
        const char *next = j + 2 < n_slots ? unit_keys(c, table, sink_pages, s->order[j + 2], unit, h) : NULL;
        page_logits_ahead(c, unit_keys(c, table, sink_pages, s->order[j], unit, h), (int)unit, s->qs, (int)G, kept_bh + j * G * unit,
                          unit, s->row, next, unit != bs);
    }
    /* Each (segment, row)'s logits less their maximum gathered into one array, so that the exponentials and the
     * logarithms run as vector loops (libmvec) rather than one call per value. */
    for (int64_t i = 0; i < mm; ++i) {
        const float *ks = kept_bh + s->slot[sh[i] / cu] * G * unit + (sh[i] % cu) * seg;
        for (int64_t g = 0; g < G; ++g) {
            const float *x = ks + g * unit;
            float top = x[0];
            for (int64_t j = 1; j < seg; ++j) top = x[j] > top ? x[j] : top;
            float *e = s->shifted + (i * G + g) * seg;
            for (int64_t j = 0; j < seg; ++j) e[j] = exp_arg(x[j] - top);
            s->tops[i * G + g] = top;
        }
    }
    for (int64_t i = 0; i < mm * G * seg; ++i) s->shifted[i] = expf(s->shifted[i]);
    for (int64_t i = 0; i < mm * G; ++i) { /* each segment's sum, in place (row i's terms lie at i seg and after) */
        float sum = 0.f;
        for (int64_t j = 0; j < seg; ++j) sum += s->shifted[i * seg + j];
        s->shifted[i] = sum;
    }
    for (int64_t i = 0; i < mm * G; ++i) s->tops[i] += logf(s->shifted[i]); /* alone: a loop of vector logarithms */
    for (int64_t i = 0; i < mm; ++i)
        for (int64_t g = 0; g < G; ++g) ex[g * M_max + i] = s->tops[i * G + g];
    prof_mark(&prof, SA_PH_RERANK, n_slots * key_bytes(c, 0, unit));
    /* The sinks' and the tail's log mass: a running log-sum-exp over their pages. */
    float *run = s->run;
    for (int64_t g = 0; g < G; ++g) run[2 * g] = SA_NO_SCORE, run[2 * g + 1] = 0.f;
    for (int64_t pg = 0; pg < pages; ++pg) {
        if (pg >= sink_pages && pg < sink_pages + n_pc) continue;
        const int n = (int)(pg == pages - 1 ? L - pg * bs : bs);
        page_logits(c, page_keys(c, table[pg], h), n, s->qs, (int)G, s->lg, bs, s->row, NULL);
        for (int64_t g = 0; g < G; ++g) {
            const float *x = s->lg + g * bs;
            float top = SA_NO_SCORE;
            for (int j = 0; j < n; ++j) top = x[j] > top ? x[j] : top;
            const float mx = run[2 * g] > top ? run[2 * g] : top;
            float sum = run[2 * g + 1] * expf(run[2 * g] - mx);
            for (int j = 0; j < n; ++j) sum += expf(x[j] - mx);
            run[2 * g] = mx, run[2 * g + 1] = sum;
        }
    }
    for (int64_t g = 0; g < G; ++g) a->always[(b * H + h) * G + g] = run[2 * g] + logf(run[2 * g + 1]);
    prof_mark(&prof, SA_PH_ALWAYS_MASS, (double)(pages - n_pc) * key_bytes(c, 0, bs));
    if (a->allocation == SA_ALLOC_TOPK) { /* each selection's k best of the shortlist (k <= m: checked by the caller) */
        flag_best(ex, mm, M_max, G, a->shared, k, sh, s->ex_s, s, a->chosen + (b * H + h) * (a->shared ? 1 : G) * S_max, S_max);
        prof_mark(&prof, SA_PH_ALLOCATE, 0.0);
    }
    prof_flush(&prof);
}

typedef struct {
    float *share, *v, *spare;
    int64_t *place, *pick;
    uint8_t *is_short;
} sa_pool_scratch;

static size_t pool_scratch_bytes(int64_t H, int64_t G, int64_t w, int64_t S, int64_t M) {
    const int64_t n_share = H * G * w, most = n_share > M ? n_share : M;
    return SA_LINE(4 * n_share) + 2 * SA_LINE(4 * most) + SA_LINE(8 * n_share) + SA_LINE(8 * most) + SA_LINE(S);
}

static sa_pool_scratch pool_scratch(sa_carver *cv, int64_t H, int64_t G, int64_t w, int64_t S, int64_t M) {
    const int64_t n_share = H * G * w, most = n_share > M ? n_share : M;
    sa_pool_scratch s;
    s.share = carve(cv, 4 * n_share), s.v = carve(cv, 4 * most), s.spare = carve(cv, 4 * most);
    s.place = carve(cv, 8 * n_share), s.pick = carve(cv, 8 * most);
    s.is_short = carve(cv, S);
    memset(s.is_short, 0, (size_t)S);
    return s;
}

/*
 * PooledMass's split of one selecting sequence b's candidates between its KV heads' query heads (the Python part,
 * sparseattn.allocations.PooledMass.plan on the Shortlist's scores, is the reference; the split step runs this when
 * the policy's allocation is exactly PooledMass and each query head selects). Per (h, g): the Shortlist's scores
 * are the coarse ones shifted below the smallest exact mass (shift = max coarse - min exact, at least 0, plus 1)
 * with the shortlist's exact masses in place; log_total = log(sum exp(scores) + exp(always)); the w best (w <= m:
 * the shortlist's w best exact masses) are listed with their shares exact - log_total (NaN: the lowest); each (h, g)
 * takes its `floor` best, then the sequence the H G k largest shares of the rest (at most H G w).
 */
static void split_pooled_row(const sa_split_args *a, int64_t b, const sa_pool_scratch *s) {
    const int64_t H = a->H, G = a->G, S_max = a->S_max, M_max = a->M_max, w = a->pool[2 * b], floor_n = a->pool[2 * b + 1];
    const int32_t *pl = a->plan + b * 4;
    const int64_t n_cand = pl[1], k = pl[2], mm = pl[3];
    const int64_t n_share = H * G * w;
    for (int64_t h = 0; h < H; ++h) {
        const int32_t *sh = a->short_ix + (b * H + h) * M_max;
        for (int64_t g = 0; g < G; ++g) {
            const float *cs = a->coarse + ((b * H + h) * G + g) * S_max;
            const float *ex = a->exact + ((b * H + h) * G + g) * M_max;
            float top = -FLT_MAX, low = FLT_MAX;
            for (int64_t i = 0; i < n_cand; ++i) top = cs[i] > top ? cs[i] : top;
            for (int64_t i = 0; i < mm; ++i) low = ex[i] < low ? ex[i] : low;
            const float shift = (top - low > 0.f ? top - low : 0.f) + 1.f;
            /* log-sum-exp of the Shortlist's scores: the coarse ones shifted (the shortlisted ones' in their place
             * are their exact masses), in float32 as torch computes it. */
            float mx = low; /* every exact mass is above every shifted coarse score */
            for (int64_t i = 0; i < mm; ++i) mx = ex[i] > mx ? ex[i] : mx;
            for (int64_t i = 0; i < mm; ++i) s->is_short[sh[i]] = 1;
            float sum = 0.f;
            /* a shortlisted candidate's term is e^-80 here (its exact mass is added below): the select goes before the
             * exponential, so the loop runs as vector exps (e^-80 beside the largest term's e^0 is nothing) */
            for (int64_t i = 0; i < n_cand; ++i) sum += expf(s->is_short[i] ? SA_EXP_FLOOR : exp_arg((cs[i] - shift) - mx));
            for (int64_t i = 0; i < mm; ++i) sum += expf(exp_arg(ex[i] - mx)); /* alone: a loop of vector exps */
            for (int64_t i = 0; i < mm; ++i) s->is_short[sh[i]] = 0;
            float log_total = mx + logf(sum > 0.f ? sum : FLT_MIN);
            const float al = a->always[(b * H + h) * G + g];
            log_total = log_total > al ? log_total + log1pf(expf(al - log_total)) : al + log1pf(expf(log_total - al));
            /* The w best exact masses of the shortlist (all of it when w == m), each a share. */
            int64_t *listed = s->pick;
            best_positions(ex, mm, w, listed, s->v, s->spare);
            float *share_row = s->share + (h * G + g) * w;
            for (int64_t j = 0; j < w; ++j) {
                share_row[j] = finite_or_lowest(ex[listed[j]] - log_total);
                s->place[(h * G + g) * w + j] = ((b * H + h) * G + g) * S_max + sh[listed[j]]; /* where chosen flags it */
            }
            if (floor_n > 0) { /* the row's floor best first: pushed above every share */
                best_positions(share_row, w, floor_n, listed, s->v, s->spare);
                for (int64_t j = 0; j < floor_n; ++j) share_row[listed[j]] = FLT_MAX;
            }
        }
    }
    const int64_t total = k * H * G < n_share ? k * H * G : n_share;
    best_positions(s->share, n_share, total, s->pick, s->v, s->spare);
    for (int64_t j = 0; j < total; ++j) a->chosen[s->place[s->pick[j]]] = 1;
}

/* What a run of attended segments takes out of block j's rest, for each selection that chose it (bit gs of by):
 * its sums sf, columns [from, n2) of the rest's rows n2 wide (sf starts at column from), and its count of segments. */
static inline void leave_block(double *restrict rest, int64_t *restrict left, uint64_t by, int64_t Gs, int64_t cap, int64_t j,
                               int64_t n2, int64_t from, const float *sf, int64_t count) {
    for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
        if (!((by >> gs_i) & 1)) continue;
        double *rx = rest + (gs_i * cap + j) * n2;
        for (int64_t d = from; d < n2; ++d) rx[d] -= sf[d - from];
        left[gs_i * cap + j] -= count;
    }
}

/* One run of the selection: `n` tokens from candidate `first` on (one page), chosen by the selections of `by`; its
 * logits lie at `off` in the runs' buffer, G rows of n (a row not in by left unused). */
typedef struct {
    int64_t first, off;
    uint64_t by;
    const char *values; /* the run's first value row */
    int32_t n, unit;    /* the run's unit (slot_unit tokens: a run never crosses one) */
} sa_run;

/* acc[g, :] += sum over the runs and their tokens j of w_g[j] v_j, the weights row-major in buf (row g's of a run at
 * buf[g T + run->off]; 0 where a row does not take the run): accumulators in registers for a block of up to 4 rows
 * and SA_RUN_CH = 4 SA_LANES channels (64 with AVX-512), one pass over the runs per block, so no run loads and stores
 * them (with runs of 4-8 tokens that traffic was most of the loop). A pass reads its own channels of each value row:
 * the passes together read each line once. The first pass asks for the values `ahead` runs on. With `sums`, the
 * first pass of each channel block also adds each run's values to sums[(run's block of per_block candidates) Gs + gs]
 * for every selection gs that chose it (the merged rest then takes them out of its blocks: no second read). */
#define SA_RUN_CH (4 * SA_LANES)
static inline __attribute__((always_inline)) void runs_block(const sa_run *runs, int64_t n_runs, const float *buf, int64_t T,
                                                             int64_t D, int64_t bs, int64_t elem, int dtype, int amx, int g0, int NG,
                                                             int64_t d0, float *acc, int64_t ahead, float *sums, int64_t per_block,
                                                             int64_t Gs) {
    sa_v16 a[4][4];
    for (int g = 0; g < NG; ++g)
        for (int k = 0; k < 4; ++k) memcpy(&a[g][k], acc + (int64_t)(g0 + g) * D + d0 + k * SA_LANES, sizeof(sa_v16));
    /* amx (bfloat16, runs of whole token pairs from value_col): each vector's channels are lanes of a line in their
     * block of 16, the blocks bs / 2 lines apart; a line holds a pair of tokens */
    int64_t off[4];
    for (int k = 0; k < 4; ++k) {
        const int64_t ch = d0 + k * SA_LANES;
        off[k] = amx ? ((ch / 16) * (bs / 2) * 16 + ch % 16) * 4 : ch * elem;
    }
    for (int64_t t = 0; t < n_runs; ++t) {
        const sa_run *run = runs + t;
        if (ahead && t + ahead < n_runs) {
            if (amx)
                for (int k = 0; k < 4; k += 16 / SA_LANES) SA_PREFETCH(runs[t + ahead].values + off[k], 0, runs[t + ahead].n / 2 * 64);
            else
                SA_PREFETCH(runs[t + ahead].values, 0, runs[t + ahead].n * D * elem);
        }
        const float *w = buf + (int64_t)g0 * T + run->off;
        sa_v16 vs[4] = {{0}};
        for (int j = 0; j < run->n; j += amx ? 2 : 1) {
            sa_v16 x[4], y[4];
            if (amx) {
                for (int k = 0; k < 4; ++k) pairs(run->values + off[k] + (j / 2) * 64, &x[k], &y[k]);
            } else {
                const char *row = run->values + (int64_t)j * D * elem;
                for (int k = 0; k < 4; ++k) x[k] = load16(row + off[k], dtype);
            }
            for (int g = 0; g < NG; ++g) {
                const float w0 = w[g * T + j], w1 = amx ? w[g * T + j + 1] : 0.f;
                for (int k = 0; k < 4; ++k) a[g][k] += amx ? w0 * x[k] + w1 * y[k] : w0 * x[k];
            }
            if (sums)
                for (int k = 0; k < 4; ++k) vs[k] += amx ? x[k] + y[k] : x[k];
        }
        if (sums) { /* the run's values into its block's sums, for each selection that chose it */
            float *blk = sums + (run->first / per_block) * Gs * D + d0;
            for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                if (!((run->by >> gs_i) & 1)) continue;
                for (int k = 0; k < 4; ++k) {
                    sa_v16 x;
                    memcpy(&x, blk + gs_i * D + k * SA_LANES, sizeof x);
                    x += vs[k];
                    memcpy(blk + gs_i * D + k * SA_LANES, &x, sizeof x);
                }
            }
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int k = 0; k < 4; ++k) memcpy(acc + (int64_t)(g0 + g) * D + d0 + k * SA_LANES, &a[g][k], sizeof(sa_v16));
}
#define SA_DEFINE_RUNS(SUFFIX, DT, ELEM, AMX)                                                                              \
    static void runs_values_##SUFFIX(const sa_run *runs, int64_t n_runs, const float *buf, int64_t T, int64_t D, int64_t bs, \
                                     int G, float *acc, int64_t ahead, float *sums, int64_t per_block, int64_t Gs) {         \
        for (int64_t d0 = 0; d0 < D; d0 += SA_RUN_CH)                                                                        \
            for (int g0 = 0; g0 < G; g0 += 4) {                                                                              \
                const int64_t pf = d0 == 0 && g0 == 0 ? ahead : 0;                                                         \
                float *sm = g0 == 0 ? sums : NULL;                                                                           \
                switch (G - g0 < 4 ? G - g0 : 4) {                                                                          \
                case 1: runs_block(runs, n_runs, buf, T, D, bs, ELEM, DT, AMX, g0, 1, d0, acc, pf, sm, per_block, Gs); break; \
                case 2: runs_block(runs, n_runs, buf, T, D, bs, ELEM, DT, AMX, g0, 2, d0, acc, pf, sm, per_block, Gs); break; \
                case 3: runs_block(runs, n_runs, buf, T, D, bs, ELEM, DT, AMX, g0, 3, d0, acc, pf, sm, per_block, Gs); break; \
                default: runs_block(runs, n_runs, buf, T, D, bs, ELEM, DT, AMX, g0, 4, d0, acc, pf, sm, per_block, Gs); break; \
                }                                                                                                            \
            }                                                                                                                \
    }
SA_DEFINE_RUNS(f32, SA_F32, 4, 0)
SA_DEFINE_RUNS(bf16, SA_BF16, 2, 0)
SA_DEFINE_RUNS(e4m3, SA_FP8_E4M3, 1, 0)
SA_DEFINE_RUNS(e5m2, SA_FP8_E5M2, 1, 0)
SA_DEFINE_RUNS(amx, SA_BF16, 2, 1)
#ifndef SA_NO_FLOAT16
SA_DEFINE_RUNS(f16, SA_F16, 2, 0)
#endif

typedef struct {
    float *qs, *lg, *p, *row, *m, *l, *acc, *mean, *vsum, *buf, *top, *taken;
    double *total, *rest, *kx;
    int64_t *left, *nonempty, *which, *list, *order;
    uint64_t *chosen_by;
    int32_t *slot, *pos_of;
    uint8_t *rows;
    sa_run *runs;
} sa_attend_scratch;

static size_t attend_scratch_bytes(int64_t G, int64_t D, int64_t bs, int64_t S, int64_t seg, int64_t nbc) {
    const int64_t Gs_cap = G; /* selections: G at most */
    return SA_LINE(4 * G * D) + SA_LINE(4 * G * bs) + SA_LINE(4 * G * (bs > nbc ? bs : nbc)) + SA_LINE(4 * (bs > D ? bs : D)) +
           3 * SA_LINE(4 * G) + SA_LINE(4 * G * D) + SA_LINE(4 * nbc * 2 * D) + SA_LINE(4 * D) + SA_LINE(4 * G * (S * seg + 1)) +
           SA_LINE(8 * nbc * 2 * D) + SA_LINE(8 * Gs_cap * nbc * 2 * D) + SA_LINE(8 * nbc) + SA_LINE(8 * Gs_cap * nbc) +
           2 * SA_LINE(8 * nbc) + 2 * SA_LINE(8 * (S + 1)) + SA_LINE(8 * (S + 1)) + 2 * SA_LINE(4 * (S + 1)) + SA_LINE(G) +
           SA_LINE(sizeof(sa_run) * (S + 1)) + SA_LINE(4 * nbc * G * D);
}

static sa_attend_scratch attend_scratch(sa_carver *cv, int64_t G, int64_t D, int64_t bs, int64_t S, int64_t seg, int64_t nbc) {
    sa_attend_scratch s;
    s.qs = carve(cv, 4 * G * D), s.lg = carve(cv, 4 * G * bs), s.p = carve(cv, 4 * G * (bs > nbc ? bs : nbc));
    s.row = carve(cv, 4 * (bs > D ? bs : D));
    s.m = carve(cv, 4 * G), s.l = carve(cv, 4 * G), s.top = carve(cv, 4 * G), s.acc = carve(cv, 4 * G * D);
    s.mean = carve(cv, 4 * nbc * 2 * D), s.vsum = carve(cv, 4 * D), s.buf = carve(cv, 4 * G * (S * seg + 1));
    s.total = carve(cv, 8 * nbc * 2 * D), s.rest = carve(cv, 8 * G * nbc * 2 * D), s.kx = carve(cv, 8 * nbc);
    s.left = carve(cv, 8 * G * nbc), s.nonempty = carve(cv, 8 * nbc), s.which = carve(cv, 8 * nbc);
    s.list = carve(cv, 8 * (S + 1)), s.order = carve(cv, 8 * (S + 1)), s.chosen_by = carve(cv, 8 * (S + 1));
    s.slot = carve(cv, 4 * (S + 1)), s.pos_of = carve(cv, 4 * (S + 1)), s.rows = carve(cv, G);
    s.runs = carve(cv, sizeof(sa_run) * (S + 1)), s.taken = carve(cv, 4 * nbc * G * D);
    return s;
}

/* acc[g] += sum_j p_g[j] v_j over a run's n tokens for the rows of `by`, p_g = w + g * T (the runs' buffer, row-major). */
static void run_values(const sa_pages *c, const char *values, int n, const float *w, int64_t T, uint64_t by, int shared, int G,
                       float *acc, int *active) {
    int na = 0;
    for (int g = 0; g < G; ++g)
        if ((by >> (shared ? 0 : g)) & 1) active[na++] = g;
    if (c->amx) {
        page_values_amx(values, n, c->bs, c->D, active, na, w, T, acc, NULL);
        return;
    }
    if (fast_shape(c)) {
        if (c->dtype == SA_BF16) page_values_bf16(values, n, c->D, active, na, w, T, acc, NULL);
        else if (c->dtype == SA_FP8_E4M3) page_values_e4m3(values, n, c->D, active, na, w, T, acc, NULL);
        else if (c->dtype == SA_FP8_E5M2) page_values_e5m2(values, n, c->D, active, na, w, T, acc, NULL);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) page_values_f16(values, n, c->D, active, na, w, T, acc, NULL);
#endif
        else page_values_f32(values, n, c->D, active, na, w, T, acc, NULL);
        return;
    }
    float row[4096];
    for (int j = 0; j < n; ++j) {
        value_row(c, values, j, row);
        for (int x = 0; x < na; ++x) {
            const float wt = w[active[x] * T + j];
            float *restrict ag = acc + (int64_t)active[x] * c->D;
            for (int64_t d = 0; d < c->D; ++d) ag[d] += wt * row[d];
        }
    }
}

/* The attend phase of one (sequence b, KV head h): see the top of this section. */
static void split_attend_item(const sa_split_args *a, const sa_pages *c, int64_t b, int64_t h, const sa_attend_scratch *s,
                              int64_t nbc) {
    const int64_t H = a->H, G = a->G, D = a->D, bs = a->bs, r = a->r, seg = c->seg, S_max = a->S_max, M_max = a->M_max;
    const int64_t Gs = a->shared ? 1 : G, per_block = a->per_block;
    const int32_t *pl = a->plan + b * 4;
    const int64_t sink_pages = pl[0], n_cand = pl[1], k = pl[2], L = a->seq_lens[b];
    const int64_t cand_end = sink_pages + n_cand / r, n_pc = n_cand / r;
    const int32_t *table = a->block_table + b * a->bt_stride;
    const int from_scores = !a->summary_bf16; /* the merged tokens' logits off the float32 centroids' scores */
    const int64_t k0 = from_scores ? D : 0, W = 2 * D - k0, rows_s = sums_rows(r, a->segment_rows), page_row = rows_s - 1;
    const float log_seg = logf((float)seg);
    sa_prof prof;
    prof_start(&prof);
    const int64_t q_elem = dtype_bytes(a->q_dtype);
    sa_to_float((const char *)a->q + (b * H + h) * G * D * q_elem, a->q_dtype, G * D, s->qs);
    for (int64_t i = 0; i < G * D; ++i) s->qs[i] *= a->scale * a->k_mul;
    sa_softmax st = {s->m, s->l, s->acc};
    for (int64_t g = 0; g < G; ++g) s->m[g] = SA_NO_SCORE, s->l[g] = 0.f;
    memset(s->acc, 0, sizeof(float) * (size_t)(G * D));
    const int select = k > 0 && k < n_cand;
    prof_mark(&prof, SA_PH_SETUP, 0.0);
    attend_common(c, table, h, L, sink_pages, cand_end, select || k == 0, s->qs, (int)G, a->softcap, &st, s->lg, s->p, s->row);
    {
        const int64_t pages_all = (L + bs - 1) / bs, common = select || k == 0 ? pages_all - n_pc : pages_all;
        prof_mark(&prof, SA_PH_ATTEND_ALWAYS, (double)common * (key_bytes(c, 0, bs) + value_bytes(c, 0, bs)));
    }
    if (!select) {
        write_rows(&st, (int)G, D, (char *)a->out + (b * H + h) * G * D * dtype_bytes(a->out_dtype), a->out_dtype, a->v_mul);
        prof_flush(&prof);
        return;
    }
    /* The merged rest's blocks: each block's sums once for the KV head's selections. */
    int64_t n_blocks = 0;
    const int whole_pages = per_block > 0 && per_block % r == 0; /* no page across two blocks: one row per page */
    double rest_bytes = 0.0, sel_bytes = 0.0;
    if (per_block > 0) {
        n_blocks = (n_cand + per_block - 1) / per_block;
        memset(s->total, 0, sizeof(double) * (size_t)(n_blocks * 2 * D));
        const int64_t step = whole_pages ? r : 1, ahead = 16 * step; /* rows prefetched this many candidates ahead */
        for (int64_t i = 0; i < n_cand; i += step) {
            const int64_t row_of = whole_pages ? page_row : i % r;
            const float *src = a->sums + ((cand_block(c, table, sink_pages, i) * H + h) * rows_s + row_of) * W;
            if (i + ahead < n_cand)
                SA_PREFETCH((const char *)(a->sums + ((cand_block(c, table, sink_pages, i + ahead) * H + h) * rows_s +
                                                      (whole_pages ? page_row : (i + ahead) % r)) * W), 0, W * (int64_t)sizeof(float));
            double *t = s->total + (i / per_block) * 2 * D;
            for (int64_t d = k0; d < 2 * D; ++d) t[d] += src[d - k0];
        }
        rest_bytes += (double)((n_cand + step - 1) / step) * lines_bytes(0, W * (int64_t)sizeof(float));
        for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) { /* each selection's rest: its blocks' sums, less what it attends */
            memcpy(s->rest + gs_i * nbc * 2 * D, s->total, sizeof(double) * (size_t)(n_blocks * 2 * D));
            for (int64_t j = 0; j < n_blocks; ++j)
                s->left[gs_i * nbc + j] = (j + 1) * per_block <= n_cand ? per_block : n_cand - j * per_block;
        }
    }
    prof_mark(&prof, SA_PH_REST, rest_bytes);
    const int64_t unit = slot_unit(bs, seg), cu = unit / seg;
    shortlist_slots(a->short_ix + (b * H + h) * M_max, pl[3], cu, n_cand / cu, s->slot, s->order);
    const float *kept_bh = a->kept + (b * H + h) * M_max * G * bs;
    /* The union of the selections' lists, cut into runs (adjacent segments of one page chosen by the same selections:
     * contiguous tokens, read once for all their rows). Eight candidates' flags at a time where G' <= 8: a word whose
     * byte x is candidate i0 + x's selections (flags are 0 or 1). */
    const uint8_t *chosen_bh = a->chosen + (b * H + h) * Gs * S_max;
    int64_t n_runs = 0, T = 0;
    sa_run *runs = s->runs;
    for (int64_t i0 = 0; i0 < n_cand; i0 += 8) {
        uint8_t by_of[8] = {0};
        const int64_t n8 = n_cand - i0 < 8 ? n_cand - i0 : 8;
        if (Gs <= 8 && n8 == 8) {
            uint64_t word = 0;
            for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                uint64_t f;
                memcpy(&f, chosen_bh + gs_i * S_max + i0, 8);
                word |= (f & 0x0101010101010101ull) << gs_i;
            }
            if (!word) continue;
            memcpy(by_of, &word, 8);
        } else {
            for (int64_t x = 0; x < n8; ++x)
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) by_of[x] |= (uint8_t)((chosen_bh[gs_i * S_max + i0 + x] != 0) << gs_i);
        }
        for (int64_t x = 0; x < n8; ++x) {
            uint64_t by = by_of[x];
            if (Gs > 8) { /* more selections than bits in a byte: the flags one by one */
                by = 0;
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) by |= (uint64_t)(chosen_bh[gs_i * S_max + i0 + x] != 0) << gs_i;
            }
            if (!by) continue;
            const int64_t i = i0 + x, p = i / r, u = i - p * r;
            sa_run *last = n_runs ? runs + n_runs - 1 : NULL;
            if (last && last->first / cu == i / cu && last->by == by && last->first + last->n / seg == i) { /* one unit: one page */
                last->n += (int32_t)seg;
                continue;
            }
            runs[n_runs++] = (sa_run){i, 0, by, value_col(c, page_values(c, table[sink_pages + p], h), u * seg), (int32_t)seg,
                                      (int32_t)(i / cu)};
        }
    }
    for (int64_t t = 0; t < n_runs; ++t) runs[t].off = T, T += runs[t].n;
    /* Each row's shift. Where every run lies in the shortlist's pages and there is no softcap, the largest exact log
     * mass among the row's chosen segments: a segment's log mass is at least its largest logit and at most log seg
     * above it, so the weights exp(x - shift) neither overflow nor all underflow, and the logits are read once, from
     * the kept ones. Else (a page past the shortlist, a softcap) a first pass computes the logits into the runs'
     * buffer and finds each row's largest. */
    float *top = s->top;
    for (int64_t g = 0; g < G; ++g) top[g] = SA_NO_SCORE;
    int one_pass = a->softcap <= 0.f;
    if (one_pass) {
        const int32_t *sh = a->short_ix + (b * H + h) * M_max;
        const float *ex = a->exact + (b * H + h) * G * M_max;
        int32_t *pos_of = s->pos_of;
        for (int64_t i = 0; i < n_cand; ++i) pos_of[i] = -1;
        for (int64_t i = 0; i < pl[3]; ++i) pos_of[sh[i]] = (int32_t)i;
        for (int64_t t = 0; t < n_runs && one_pass; ++t) {
            const sa_run *run = runs + t;
            for (int64_t x = 0; x < run->n / seg; ++x) {
                const int32_t at = pos_of[run->first + x];
                if (at < 0) {
                    one_pass = 0;
                    break;
                }
                for (int64_t g = 0; g < G; ++g)
                    if ((run->by >> (a->shared ? 0 : g)) & 1) top[g] = ex[g * M_max + at] > top[g] ? ex[g * M_max + at] : top[g];
            }
        }
        if (!one_pass)
            for (int64_t g = 0; g < G; ++g) top[g] = SA_NO_SCORE;
    }
    if (!one_pass) { /* Pass 1: every run's logits (kept, or computed from the run's keys), and each row's largest. */
        int64_t computed = -1; /* the unit whose logits s->lg holds: the runs of one unit are adjacent, computed once */
        for (int64_t t = 0; t < n_runs; ++t) {
            const sa_run *run = runs + t;
            const int64_t col = (run->first % r) * seg; /* the run's first token within its page */
            const float *src;
            int64_t ld;
            if (s->slot[run->unit] >= 0) {
                src = kept_bh + s->slot[run->unit] * G * unit + (run->first % cu) * seg, ld = unit;
            } else { /* a unit the shortlist does not hold (quest, an allocation past the shortlist): its logits computed here */
                const int64_t from = col - col % unit; /* the unit's lines are read whatever part of it the run is */
                if (computed != run->unit) {
                    int64_t after = t + 1; /* the next unit computed here: its keys asked for meanwhile */
                    while (after < n_runs && (runs[after].unit == run->unit || s->slot[runs[after].unit] >= 0)) ++after;
                    const char *next = NULL;
                    if (after < n_runs) {
                        const int64_t next_col = (runs[after].first % r) * seg;
                        next = key_col(c, page_keys(c, table[sink_pages + runs[after].first / r], h), next_col - next_col % unit);
                    }
                    page_logits_ahead(c, key_col(c, page_keys(c, table[sink_pages + run->first / r], h), from), (int)unit, s->qs,
                                      (int)G, s->lg, bs, s->row, next, unit != bs);
                    computed = run->unit;
                    sel_bytes += key_bytes(c, from, unit);
                }
                src = s->lg + (col - from), ld = bs;
            }
            for (int64_t g = 0; g < G; ++g) {
                if (!((run->by >> (a->shared ? 0 : g)) & 1)) continue;
                float mx = top[g], *dst = s->buf + g * T + run->off;
                for (int j = 0; j < run->n; ++j) {
                    float x = src[g * ld + j];
                    if (a->softcap > 0.f) x = a->softcap * tanhf(x / a->softcap);
                    dst[j] = x;
                    mx = x > mx ? x : mx;
                }
                top[g] = mx;
            }
        }
    }
    /* One rescale per row to its shift. */
    for (int64_t g = 0; g < G; ++g) {
        const float mx = s->m[g] > top[g] ? s->m[g] : top[g];
        const float alpha = expf(s->m[g] - mx);
        s->l[g] *= alpha;
        for (int64_t d = 0; d < D; ++d) s->acc[g * D + d] *= alpha;
        s->m[g] = mx;
    }
    /* Every run's logits less its rows' shifts, row-major in the runs' buffer ([G, T]), then one flat pass of
     * exponentials over it (vector exps, not a short loop per run and row) and one sum per row. The differences are
     * held at SA_EXP_FLOOR or above: a row a run does not serve gets it (weight e^-80, nothing beside the row's own
     * of about 1). */
    for (int64_t t = 0; t < n_runs; ++t) {
        const sa_run *run = runs + t;
        const float *src = one_pass ? kept_bh + s->slot[run->unit] * G * unit + (run->first % cu) * seg : NULL;
        for (int64_t g = 0; g < G; ++g) {
            float *dg = s->buf + g * T + run->off;
            if (!((run->by >> (a->shared ? 0 : g)) & 1)) {
                for (int j = 0; j < run->n; ++j) dg[j] = SA_EXP_FLOOR;
                continue;
            }
            const float *xg = one_pass ? src + g * unit : dg, mx = s->m[g];
            for (int j = 0; j < run->n; ++j) dg[j] = exp_arg(xg[j] - mx);
        }
    }
    for (int64_t i = 0; i < G * T; ++i) s->buf[i] = expf(s->buf[i]);
    for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        for (int64_t i = 0; i < T; ++i) sum += s->buf[g * T + i];
        s->l[g] += sum;
    }
    /* The values: every run's rows at once, in registers (runs_values_*) where the head dim is a multiple of
     * SA_RUN_CH, else run by run; several runs' values asked for ahead. A merged rest over blocks of whole pages with
     * float32 centroids (its logits off the scores, its store one value row per page) takes each selection's
     * attended values out of its blocks from sums the register pass adds up as it reads them. */
    const int64_t run_bytes = seg * D * c->elem, ahead = 1 + (8192 + run_bytes - 1) / run_bytes;
    for (int64_t t = 0; t < n_runs && t < ahead; ++t) SA_PREFETCH(runs[t].values, 0, runs[t].n * D * c->elem);
    const int in_registers = D % SA_RUN_CH == 0;
    const int sums_in_pass = n_blocks && in_registers && from_scores && whole_pages;
    float *taken = sums_in_pass ? s->taken : NULL; /* [n_blocks, G', D] */
    if (taken) memset(taken, 0, sizeof(float) * (size_t)(n_blocks * Gs * D));
    if (in_registers) {
        if (c->amx) runs_values_amx(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
        else if (c->dtype == SA_BF16) runs_values_bf16(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
        else if (c->dtype == SA_FP8_E4M3) runs_values_e4m3(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
        else if (c->dtype == SA_FP8_E5M2) runs_values_e5m2(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) runs_values_f16(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
#endif
        else runs_values_f32(runs, n_runs, s->buf, T, D, bs, (int)G, s->acc, ahead, taken, per_block, Gs);
    }
    if (sums_in_pass) {
        for (int64_t t = 0; t < n_runs; ++t) { /* each selection's attended segments leave its blocks' counts */
            const int64_t j = runs[t].first / per_block, n_segs = runs[t].n / seg;
            for (int64_t gs_i = 0; gs_i < Gs; ++gs_i)
                if ((runs[t].by >> gs_i) & 1) s->left[gs_i * nbc + j] -= n_segs;
        }
        for (int64_t j = 0; j < n_blocks; ++j)
            for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                double *rx = s->rest + (gs_i * nbc + j) * 2 * D + D;
                const float *tx = taken + (j * Gs + gs_i) * D;
                for (int64_t d = 0; d < D; ++d) rx[d] -= tx[d];
            }
    }
    /* Run by run: the values where they are not in registers; the merged rest's bookkeeping where the pass did not do
     * it (what each selection's run takes out of its block, from the store's rows). */
    int active[64];
    for (int64_t t = 0; t < n_runs && (!in_registers || (n_blocks && !sums_in_pass)); ++t) {
        const sa_run *run = runs + t;
        if (!in_registers && t + ahead < n_runs) SA_PREFETCH(runs[t + ahead].values, 0, runs[t + ahead].n * D * c->elem);
        const char *vals_c = run->values;
        if (!in_registers) run_values(c, vals_c, run->n, s->buf + run->off, T, run->by, a->shared, (int)G, s->acc, active);
        if (!n_blocks) continue;
        const int64_t n_segs = run->n / seg;
        const float *page_rows = a->sums + (cand_block(c, table, sink_pages, run->first) * H + h) * rows_s * W;
        const int whole = whole_pages && r > 1 && n_segs == r;
        if (!whole && r > 1 && rows_s == 1) { /* part of a page, whose total alone is kept: the run's values' sum */
            for (int64_t d = 0; d < D; ++d) s->vsum[d] = 0.f;
            for (int64_t j = 0; j < run->n; ++j) { /* rows just attended: in cache; at most a page's, summed in float32 */
                value_row(c, vals_c, j, s->row);
                for (int64_t d = 0; d < D; ++d) s->vsum[d] += s->row[d];
            }
            /* blocks of whole pages: the run is in one (its keys' side: the scores) */
            leave_block(s->rest, s->left, run->by, Gs, nbc, run->first / per_block, 2 * D, D, s->vsum, n_segs);
            continue;
        }
        for (int64_t x = 0; x < (whole ? 1 : n_segs); ++x)
            leave_block(s->rest, s->left, run->by, Gs, nbc, (run->first + x) / per_block, 2 * D, k0,
                        page_rows + (whole ? page_row : (run->first + x) % r) * W, whole ? r : 1);
        rest_bytes += (whole ? 1 : n_segs) * lines_bytes(0, W * (int64_t)sizeof(float));
    }
    for (int64_t t = 0; t < n_runs; ++t) sel_bytes += value_bytes(c, (runs[t].first % r) * seg, runs[t].n);
    prof_mark(&prof, SA_PH_ATTEND_SELECTED, sel_bytes);
    /* The merged rest: per selection, one token per block of what it leaves out. */
    for (int64_t gs_i = 0; n_blocks && gs_i < Gs; ++gs_i) {
        const double *rest_s = s->rest + gs_i * nbc * 2 * D;
        const int64_t *left_s = s->left + gs_i * nbc;
        int64_t nn = 0;
        for (int64_t j = 0; j < n_blocks; ++j) {
            if (left_s[j] <= 0) continue;
            const double tokens = (double)(left_s[j] * seg);
            for (int64_t d = k0; d < 2 * D; ++d) s->mean[nn * 2 * D + d] = (float)(rest_s[j * 2 * D + d] / tokens);
            s->which[nn] = j, s->nonempty[nn++] = left_s[j] * seg;
        }
        if (!nn) continue;
        const uint8_t *mine = chosen_bh + gs_i * S_max;
        for (int64_t g = 0; g < G; ++g) {
            if (!(a->shared || g == gs_i)) continue;
            const float *qg = s->qs + g * D;
            float *pg = s->p + g * nbc, mx = SA_NO_SCORE;
            if (from_scores) { /* each block's left-out segments' scores less log seg: scale q . k of their mean keys */
                const float *cs = a->coarse + ((b * H + h) * G + g) * S_max;
                for (int64_t j = 0; j < n_blocks; ++j) { /* a sum per block (not one through memory: it vectorises) */
                    const int64_t hi = (j + 1) * per_block < n_cand ? (j + 1) * per_block : n_cand;
                    double sum = 0.0;
                    for (int64_t i = j * per_block; i < hi; ++i) sum += mine[i] ? 0.0 : (double)(cs[i] - log_seg);
                    s->kx[j] = sum;
                }
            }
            for (int64_t j = 0; j < nn; ++j) {
                float x = 0.f;
                if (from_scores) x = (float)(s->kx[s->which[j]] / (double)left_s[s->which[j]]);
                else
                    for (int64_t d = 0; d < D; ++d) x += qg[d] * s->mean[j * 2 * D + d];
                if (a->softcap > 0.f) x = a->softcap * tanhf(x / a->softcap);
                x += logf((float)s->nonempty[j]);
                pg[j] = x;
                mx = x > mx ? x : mx;
            }
            SA_SOFTMAX_STEP(pg, nn, mx, s->m[g], s->l[g], alpha);
            float *ag = s->acc + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
            for (int64_t j = 0; j < nn; ++j)
                for (int64_t d = 0; d < D; ++d) ag[d] += pg[j] * s->mean[j * 2 * D + D + d];
        }
    }
    prof_mark(&prof, SA_PH_REST, 0.0);
    write_rows(&st, (int)G, D, (char *)a->out + (b * H + h) * G * D * dtype_bytes(a->out_dtype), a->out_dtype, a->v_mul);
    prof_mark(&prof, SA_PH_SETUP, 0.0);
    prof_flush(&prof);
}

/* The split step's phases (see the top of this section) for the sequences of args; returns a status. */
int sa_paged_split(const sa_split_args *a, int phases) {
    const int64_t N = a->N, H = a->H, bs = a->bs, D = a->D, r = a->r, G = a->G, B = a->B;
    if (!cache_dtype_ok(a->dtype)) return SA_BAD_DTYPE;
    if (a->q_dtype != SA_F32 && a->q_dtype != SA_BF16 && a->q_dtype != SA_F16) return SA_BAD_DTYPE;
    if (a->out_dtype != SA_F32 && a->out_dtype != SA_BF16 && a->out_dtype != SA_F16) return SA_BAD_DTYPE;
    if (bs < 1 || bs > 4096 || D < 1 || D > 4096 || G < 1 || G > 64 || H < 1 || r < 1 || bs % r || a->S_max < 1 || a->M_max < 1 ||
        a->per_block < 0 || phases < 1 || phases > 7 || a->allocation < SA_ALLOC_NONE || a->allocation > SA_ALLOC_TOPK_COARSE)
        return SA_BAD_PLAN;
    if (a->per_block > 0 && (!a->sums || !a->sums_state || (r > 1 && !a->segment_rows && (a->per_block % r || a->summary_bf16))))
        return SA_BAD_PLAN;
    if ((a->allocation == SA_ALLOC_POOLED && !a->pool) || !a->chosen || !a->summary || !a->state || !a->out) return SA_BAD_PLAN;
    /* quest: its bound summary (two float32 stores), each selection's top k of every candidate, nothing merged */
    if (a->bound && (!a->summary2 || a->summary_bf16 || a->allocation != SA_ALLOC_TOPK_COARSE || a->per_block > 0)) return SA_BAD_PLAN;
    if (!a->bound && a->allocation == SA_ALLOC_TOPK_COARSE) return SA_BAD_PLAN;
#ifdef SA_NO_FLOAT16
    if (a->dtype == SA_F16 || a->q_dtype == SA_F16 || a->out_dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    const sa_pages c = {(const char *)a->cache, a->dtype, dtype_bytes(a->dtype), H, bs, D, r, bs / r, a->amx};
    /* the amx layout: bfloat16, pages and head dims of multiples of 32, segments of an even number of tokens */
    if (a->amx && (a->dtype != SA_BF16 || bs % 32 || D % 32 || !fast_shape(&c) || (bs / r) % 2)) return SA_BAD_PLAN;
    int64_t most_cand, most_m;
    int status = check_step(N, B, bs, r, a->block_table, a->bt_stride, a->seq_lens, a->plan, !a->bound, &most_cand, &most_m);
    if (status) return status;
    if (most_cand > a->S_max || most_m > a->M_max) return SA_BAD_PLAN;
    const int64_t Gs = a->shared ? 1 : G;
    int64_t most_w = 1;
    for (int64_t b = 0; b < B; ++b) { /* what the allocations in C rely on */
        const int32_t *pl = a->plan + b * 4;
        if (!(pl[2] > 0 && pl[2] < pl[1])) continue;
        if (a->allocation == SA_ALLOC_TOPK && pl[2] > pl[3]) return SA_BAD_PLAN;
        if (a->allocation == SA_ALLOC_POOLED) {
            const int32_t *pw = a->pool + 2 * b;
            if (a->shared || pw[0] < 1 || pw[0] > pl[3] || pw[1] < 0 || pw[1] > pw[0]) return SA_BAD_PLAN;
            most_w = pw[0] > most_w ? pw[0] : most_w;
        }
    }
    if (phases & SA_SPLIT_SCORE) /* the selections' flags start empty (the allocation sets them) */
        memset(a->chosen, 0, (size_t)(B * H * Gs * a->S_max));
    if (!(phases & SA_SPLIT_SCORE)) /* the shortlists a later phase reads: candidates of their rows */
        for (int64_t i = 0; i < B * H * a->M_max; ++i) {
            const int64_t b = i / (H * a->M_max);
            if (i % a->M_max < a->plan[b * 4 + 3] && (a->short_ix[i] < 0 || a->short_ix[i] >= a->plan[b * 4 + 1])) return SA_BAD_PLAN;
        }
    int threads = a->threads;
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
    sa_prof whole;
    prof_start(&whole);
    double summarised = 0.0;
    if (phases & SA_SPLIT_SCORE) { /* stale pages' centroids */
        int64_t *stale = NULL;
        const int64_t stale_n = stale_blocks(B, r, a->block_table, a->bt_stride, a->plan, most_cand, a->state, &stale);
        if (stale_n < 0) return SA_NO_MEMORY;
        float *summary = a->summary_bf16 ? NULL : (float *)a->summary;
        uint16_t *summary16 = a->summary_bf16 ? (uint16_t *)a->summary : NULL;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < stale_n * H; ++i) {
            float row[4096];
            const int64_t blk = stale[i / H], h = i % H;
            if (a->bound) /* minimum and maximum as stored (k_mul > 0 scales both alike: folded into the query) */
                summarise(&c, SA_BOUND, blk, h, summary + (blk * H + h) * r * D, a->summary2 + (blk * H + h) * r * D, NULL, 1.f, row);
            else if (summary16) /* the means of the keys times root, dequantised (k_mul) as the generic path's are */
                summarise(&c, SA_CENTROID, blk, h, NULL, NULL, summary16 + (blk * H + h) * r * D, a->root * a->k_mul, row);
            else
                summarise(&c, SA_CENTROID, blk, h, summary + (blk * H + h) * r * D, NULL, NULL, 1.f, row);
        }
        summarised += stale_n * H * key_bytes(&c, 0, bs);
        free(stale);
    }
    if ((phases & SA_SPLIT_ATTEND) && a->per_block > 0) { /* stale pages' sums */
        int64_t *stale = NULL;
        const int64_t stale_n = stale_blocks(B, r, a->block_table, a->bt_stride, a->plan, most_cand, a->sums_state, &stale);
        if (stale_n < 0) return SA_NO_MEMORY;
        const int64_t W = a->summary_bf16 ? 2 * D : D;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < stale_n * H; ++i) {
            float row[4096];
            const int64_t blk = stale[i / H], h = i % H;
            page_sums(&c, blk, h, a->segment_rows, a->summary_bf16, a->sums + (blk * H + h) * sums_rows(r, a->segment_rows) * W, row);
        }
        summarised += stale_n * H * (value_bytes(&c, 0, bs) + (a->summary_bf16 ? key_bytes(&c, 0, bs) : 0.0));
        free(stale);
    }
    prof_mark(&whole, SA_PH_SUMMARISE, summarised);
    prof_flush(&whole);
    const int64_t seg = bs / r, nbc = a->per_block > 0 ? (most_cand + a->per_block - 1) / a->per_block + 1 : 1;
    const int64_t w = most_w;
    const size_t need_score = score_scratch_bytes(G, D, bs, most_cand, most_m, seg);
    const size_t need_pool = pool_scratch_bytes(H, G, w, most_cand, most_m);
    const size_t need_attend = attend_scratch_bytes(G, D, bs, most_cand, seg, nbc);
    /* With its allocation in C, a whole step runs each work item's phases back to back: the kept logits the
     * attention reads are then still in this core's cache (a (sequence, KV head)'s, or a sequence's under the pooled
     * split, whose heads are allocated together), not fetched back from memory after every item was scored. */
    const int together = phases == (SA_SPLIT_SCORE | SA_SPLIT_ALLOCATE | SA_SPLIT_ATTEND) && a->allocation != SA_ALLOC_NONE;
    size_t need = need_score > need_pool ? need_score : need_pool;
    need = need > need_attend ? need : need_attend;
    if (together) need = need_score + need_pool + need_attend;
#pragma omp parallel num_threads(threads)
    {
        sa_carver cv = scratch_begin(need);
        const int ok = cv.base != NULL;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
        if (together) {
            sa_carver at = cv;
            const sa_score_scratch ss = ok ? score_scratch(&at, G, D, bs, most_cand, most_m, seg) : (sa_score_scratch){0};
            const sa_pool_scratch ps = ok ? pool_scratch(&at, H, G, w, most_cand, most_m) : (sa_pool_scratch){0};
            const sa_attend_scratch as = ok ? attend_scratch(&at, G, D, bs, most_cand, seg, nbc) : (sa_attend_scratch){0};
            if (a->allocation == SA_ALLOC_TOPK || a->allocation == SA_ALLOC_TOPK_COARSE) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t item = 0; item < B * H; ++item) {
                    const int64_t h = item / B, b = item % B; /* head-major: see the top of the file */
                    const int32_t *pl = a->plan + b * 4;
                    if (!ok) continue;
                    if (pl[2] > 0 && pl[2] < pl[1]) split_score_item(a, &c, b, h, &ss);
                    split_attend_item(a, &c, b, h, &as, nbc);
                }
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t b = 0; b < B; ++b) {
                    const int32_t *pl = a->plan + b * 4;
                    const int selects = pl[2] > 0 && pl[2] < pl[1];
                    if (!ok) continue;
                    for (int64_t h = 0; h < H && selects; ++h) split_score_item(a, &c, b, h, &ss);
                    if (selects) {
                        sa_prof prof;
                        prof_start(&prof);
                        split_pooled_row(a, b, &ps);
                        prof_mark(&prof, SA_PH_ALLOCATE, 0.0);
                        prof_flush(&prof);
                    }
                    for (int64_t h = 0; h < H; ++h) split_attend_item(a, &c, b, h, &as, nbc);
                }
            }
        }
        if (!together && (phases & SA_SPLIT_SCORE)) {
            sa_carver at = cv;
            const sa_score_scratch s = ok ? score_scratch(&at, G, D, bs, most_cand, most_m, seg) : (sa_score_scratch){0};
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < B * H; ++item) {
                const int64_t h = item / B, b = item % B; /* head-major: see the top of the file */
                const int32_t *pl = a->plan + b * 4;
                if (ok && pl[2] > 0 && pl[2] < pl[1]) split_score_item(a, &c, b, h, &s);
            }
        }
        if (!together && (phases & SA_SPLIT_ALLOCATE) && a->allocation == SA_ALLOC_POOLED) {
            sa_carver at = cv;
            const sa_pool_scratch s = ok ? pool_scratch(&at, H, G, w, most_cand, most_m) : (sa_pool_scratch){0};
            sa_prof prof;
            prof_start(&prof);
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < B; ++b) {
                const int32_t *pl = a->plan + b * 4;
                if (ok && pl[2] > 0 && pl[2] < pl[1]) split_pooled_row(a, b, &s);
            }
            prof_mark(&prof, SA_PH_ALLOCATE, 0.0);
            prof_flush(&prof);
        }
        if (!together && (phases & SA_SPLIT_ATTEND)) {
            sa_carver at = cv;
            const sa_attend_scratch s = ok ? attend_scratch(&at, G, D, bs, most_cand, seg, nbc) : (sa_attend_scratch){0};
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < B * H; ++item) {
                const int64_t h = item / B, b = item % B;
                if (ok) split_attend_item(a, &c, b, h, &s, nbc);
            }
        }
    }
    (void)Gs;
    return status;
}

/* Mark stale the blocks written through slot_mapping ([n] int64 slots, -1: padding). */
void sa_paged_invalidate(const int64_t *slot_mapping, int64_t n, int64_t bs, uint8_t *state, int64_t N) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slot_mapping[i];
        if (s >= 0 && s / bs < N) state[s / bs] = 0;
    }
}
