/*
 * The paged engine's fused decode step on the CPU: score, select and attend vLLM's KV pages in one
 * pass per (sequence, KV head), reading the pages in place in vLLM's CPU cache layout.
 * The passes run head-major (every sequence's pass over KV head 0, then head 1, ...): under prefix
 * caching the sequences of a batch share their document's pages, and one head's pages of a long
 * document fit in the last-level cache from one sequence to the next where all heads' do not.
 *
 * The layout (sparseattn/vllm/paged.py, page_views): the cache of one layer is [N, H, bs, 2 D];
 * per (block, KV head) the bs * 2 D elements are the page's keys *transposed*, [D, bs], then its
 * values [bs, D]. So a page's logits are a product over d of whole key rows of bs tokens (the inner
 * loop runs over tokens, contiguous), and its values are read row by row.
 *
 * Per sequence b the caller's plan says (sink_pages, n_cand, k, m): pages [0, sink_pages) are sinks,
 * the next n_cand / r pages hold the n_cand candidates (segments of bs / r tokens, r per page: r = 1, a page is
 * a segment), the rest (through the sequence's last, partial page) are the tail.
 * Sinks and tail are always attended. Of the candidates the step attends
 *   - every one when k >= n_cand (dense, or a budget covering the context);
 *   - none when k == 0 (streamingllm as a selection);
 *   - else the k chosen by the mode:
 *       SA_RERANK: radar+ -- every candidate is scored by its centroid, scale q.mean(k) + log(bs); the
 *         KV group's m best by the group's log-sum-exp over its query heads are shortlisted; their
 *         exact log masses logsumexp_j scale q.k_j are computed (the logits are kept) and each query
 *         head (or the group, shared) takes its k best. The kept logits are then attended: a
 *         shortlisted key is read once, for ranking and attention.
 *       SA_BOUND: quest -- every candidate is scored by the bound sum_d max(q_d min_d, q_d max_d) of
 *         its per-channel key minimum and maximum; each query head (or the group) takes its k best.
 *   One softmax over every attended token of a query head (float32; the running maximum starts at a
 *   finite value: built with -ffast-math).
 *
 * Summaries live in caller-owned stores indexed by physical block: summary[N, H, D] (centroid: mean
 * key; bound: min, then max in a second store) and state[N] (0: stale, 1: valid). A stale page is
 * summarised before any scoring, once even when prefix caching shares it between sequences.
 *
 * The Python references are sparseattn.vllm.paged.select_pages (the selection) and attend_pages
 * (the attention); tests/test_vllm_paged_kernel.py holds the kernel to them.
 */
#include <float.h>

#include "kernel_common.h"

enum { SA_RERANK = 0, SA_BOUND = 1, SA_FIXED = 2 };
enum { SA_BAD_BLOCK = 1, SA_BAD_PLAN = 6 }; /* besides kernel_common.h's */

int sa_paged_float16_supported(void) { return sa_float16_built(); }

typedef struct {
    const char *cache;
    int dtype;
    int64_t elem, H, bs, D; /* elem: bytes per element */
    int64_t r, seg;         /* segments per page, tokens per segment (r seg = bs): candidate i is segment i % r of page i / r */
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
static inline const char *seg_keys(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return page_keys(c, cand_block(c, table, sink_pages, i), h) + (i % c->r) * c->seg * c->elem;
}
static inline const char *seg_values(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return page_values(c, cand_block(c, table, sink_pages, i), h) + (i % c->r) * c->seg * c->D * c->elem;
}
static inline int64_t seg_row(const sa_pages *c, const int32_t *table, int64_t sink_pages, int64_t i, int64_t h) {
    return (cand_block(c, table, sink_pages, i) * c->H + h) * c->r + i % c->r;
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
        sa_u16x16 h;
        memcpy(&h, src, sizeof h);
        sa_u32x16 w = __builtin_convertvector(h, sa_u32x16) << 16;
        memcpy(&f, &w, sizeof f);
    }
#ifndef SA_NO_FLOAT16
    else if (dtype == SA_F16) {
        sa_f16x16 h;
        memcpy(&h, src, sizeof h);
        f = __builtin_convertvector(h, sa_v16);
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
                                                           const char *pf) {
    sa_v16 acc[SA_HEADS][2] = {{0}};
    for (int64_t d = 0; d < D; ++d) {
        SA_PREFETCH(pf, d * 2 * SA_LANES * elem, 2 * SA_LANES * elem);
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
                                     int64_t ld, const char *pf) {                                                       \
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
 * takes its D * 2 SA_LANES elements of the next key block (together: the whole block when n == bs). */
#define SA_LOGITS_CALL(NG)                                                                                    \
    logits16(keys, bs, D, SA_ELEM, SA_DT, q + (int64_t)g0 * D, NG, lg + (int64_t)g0 * ld, ld, j0,            \
             pf && g0 == 0 ? pf + j0 * D * SA_ELEM : NULL)
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
#ifndef SA_NO_FLOAT16
#define SA_DT SA_F16
#define SA_ELEM 2
SA_DEFINE_FAST(f16)
#undef SA_DT
#undef SA_ELEM
#endif

/* Whether the vector loops apply: page size and head dim multiples of twice the lane count. */
static inline int fast_shape(const sa_pages *c) { return c->bs % (2 * SA_LANES) == 0 && c->D % (2 * SA_LANES) == 0; }

/* Logits lg[g * ld + j] = q_g . k_j of the first n tokens of a page, for rows g < G (q is pre-scaled).
 * Keys are [D, bs]: one converted row of n tokens per channel, multiplied into every head's logits. */
static void page_logits(const sa_pages *c, const char *keys, int n, const float *restrict q, int G, float *restrict lg,
                        int64_t ld, float *restrict row, const char *next_keys) {
    const int64_t D = c->D, bs = c->bs;
    /* A segment smaller than a vector chunk (pages cut in r > 1) still takes the vector loops: they compute the
     * whole chunk of 2 SA_LANES tokens (the page's next columns, unused), and that is faster than the scalar loop's
     * conversion per channel (measured: 6.2 against 8.4 ms for the scores at 8k x 8 with 4-token segments). */
    if (fast_shape(c)) {
        if (c->dtype == SA_BF16) page_logits_bf16(keys, n, bs, D, q, G, lg, ld, next_keys);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) page_logits_f16(keys, n, bs, D, q, G, lg, ld, next_keys);
#endif
        else page_logits_f32(keys, n, bs, D, q, G, lg, ld, next_keys);
        return;
    }
    for (int g = 0; g < G; ++g) memset(lg + g * ld, 0, (size_t)n * sizeof(float));
    for (int64_t d = 0; d < D; ++d) {
        sa_to_float(keys + d * bs * c->elem, c->dtype, n, row);
        for (int g = 0; g < G; ++g) {
            const float qd = q[g * D + d];
            float *restrict lgg = lg + g * ld;
            for (int j = 0; j < n; ++j) lgg[j] += qd * row[j];
        }
    }
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
        if (c->dtype == SA_BF16) page_values_bf16(values, n, D, active, na, p, c->bs, st->acc, next_values);
#ifndef SA_NO_FLOAT16
        else if (c->dtype == SA_F16) page_values_f16(values, n, D, active, na, p, c->bs, st->acc, next_values);
#endif
        else page_values_f32(values, n, D, active, na, p, c->bs, st->acc, next_values);
        return;
    }
    for (int j = 0; j < n; ++j) {
        sa_to_float(values + (int64_t)j * D * c->elem, c->dtype, D, row);
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
static void write_rows(const sa_softmax *st, int G, int64_t D, float *out) {
    for (int64_t g = 0; g < G; ++g) {
        const float inv = st->l[g] > 0.f ? 1.f / st->l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = st->acc[g * D + d] * inv;
    }
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

/* The k (1 <= k <= n) largest of x[0..n) into out, in no particular order (ties at the k-th value: the earlier
 * indices), O(n): the k-th largest by quickselect on copies (v, w: scratch of n), whose partitions are branch-free
 * stores (a branch per value mispredicts half the time on scores in no order), then one pass collects. For a
 * shortlist whose order nothing reads (the split step's: its pages are ranked by slot, its masses by place). */
static void top_k_set(const float *x, int64_t n, int64_t k, int64_t *out, float *v, float *w) {
    for (int64_t i = 0; i < n; ++i) v[i] = ranked(x[i]);
    int64_t m = n, want = k; /* the want-th largest of v[0..m) */
    float kth;
    for (;;) {
        if (m <= 16) { /* a few left: sort them, best first */
            for (int64_t i = 1; i < m; ++i)
                for (int64_t j = i; j > 0 && v[j] > v[j - 1]; --j) {
                    const float t = v[j];
                    v[j] = v[j - 1], v[j - 1] = t;
                }
            kth = v[want - 1];
            break;
        }
        const float a = v[0], b = v[m / 2], z = v[m - 1];
        const float pivot = a > b ? (b > z ? b : (a > z ? z : a)) : (a > z ? a : (b > z ? z : b)); /* median of three */
        int64_t above = 0, equal = 0;
        for (int64_t i = 0; i < m; ++i) w[above] = v[i], above += v[i] > pivot;
        if (want <= above) {
            float *t = v;
            v = w, w = t, m = above;
            continue;
        }
        for (int64_t i = 0; i < m; ++i) equal += v[i] == pivot;
        if (want <= above + equal) {
            kth = pivot;
            break;
        }
        int64_t below = 0;
        for (int64_t i = 0; i < m; ++i) w[below] = v[i], below += v[i] < pivot;
        float *t = v;
        v = w, w = t, m = below, want -= above + equal;
    }
    int64_t have = 0;
    for (int64_t i = 0; i < n; ++i) out[have] = i, have += ranked(x[i]) > kth; /* fewer than k: kth is the k-th */
    for (int64_t i = 0; i < n && have < k; ++i)
        if (ranked(x[i]) == kth) out[have++] = i;
}

static inline float log_sum_exp(const float *x, int64_t n, int64_t stride) {
    float top = SA_NO_SCORE;
    for (int64_t i = 0; i < n; ++i) top = x[i * stride] > top ? x[i * stride] : top;
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += expf(x[i * stride] - top);
    return top + logf(sum);
}

/* float32 -> the nearest bfloat16 (ties to even), as torch's conversion rounds (finite values: a mean of keys). */
static inline uint16_t sa_float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Summarise the r segments of one page of one head into summary (+ summary2 for the bound), r rows of D: each
 * segment's mean key, or its min and max. With s16 (SA_RERANK) the means go there instead, as bfloat16 means of
 * the keys times key_root, exactly as Centroid(dtype=torch.bfloat16).summarize rounds them from the float32 scaled
 * keys the generic path hands it: each product in float32, their mean in float64, rounded to float32 and then to
 * bfloat16 (the float32 means: key_root 1, a product that changes nothing). */
static void summarise(const sa_pages *c, int mode, int64_t block, int64_t h, float *restrict s1, float *restrict s2,
                      uint16_t *restrict s16, float key_root, float *restrict row) {
    const int64_t D = c->D, bs = c->bs, seg = c->seg;
    const char *keys = page_keys(c, block, h);
    for (int64_t d = 0; d < D; ++d) {
        sa_to_float(keys + d * bs * c->elem, c->dtype, bs, row);
        for (int64_t u = 0; u < c->r; ++u) {
            const float *x = row + u * seg;
            if (mode == SA_RERANK) {
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

/*
 * One decode token per sequence. q: [B, H, G, D] float32 (unscaled); cache: [N, H, bs, 2 D] of dtype;
 * block_table: [B, bt_stride] int32 physical blocks; seq_lens: [B] int32 (the current token included);
 * plan: [B, 4] int32 (sink_pages, n_cand, k, m), n_cand in segments of bs / r tokens (r per page); shared: one
 * selection per KV group (else per query head); summary, summary2: [N, H, r, D] float32 stores (summary2 only for
 * SA_BOUND), state: [N] uint8;
 * selected: [B, H, G' = shared ? 1 : G, kmax] int32 candidate indices chosen (-1 past k), or NULL;
 * out: [B, H, G, D] float32.
 */
int sa_paged_decode(const float *q, const void *cache, int dtype, int64_t N, int64_t H, int64_t bs, int64_t D, int64_t r,
                    int64_t G, int64_t B, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                    const int32_t *plan, int mode, int shared, float scale, float softcap, float *summary, float *summary2,
                    uint8_t *state, int32_t *selected, int64_t kmax, float *out, int threads) {
    if (dtype != SA_F32 && dtype != SA_BF16 && dtype != SA_F16) return SA_BAD_DTYPE;
    if (mode != SA_FIXED && mode != SA_RERANK && mode != SA_BOUND) return SA_BAD_PLAN;
    if (bs < 1 || bs > 4096 || D < 1 || G < 1 || G > 64 || H < 1 || r < 1 || bs % r) return SA_BAD_PLAN;
#ifdef SA_NO_FLOAT16
    if (dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    const int64_t elem = dtype == SA_F32 ? 4 : 2;
    const sa_pages c = {(const char *)cache, dtype, elem, H, bs, D, r, bs / r};
    /* Check the plan and the block table before any work; collect the stale candidate pages. */
    int64_t most_cand = 0, most_m = 0, stale_n = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int32_t *pl = plan + b * 4;
        const int64_t L = seq_lens[b], pages = (L + bs - 1) / bs;
        const int64_t attended = pl[2] < pl[1] ? pl[2] : pl[1];
        if (L < 1 || pl[0] < 0 || pl[1] < 0 || pl[1] % r || pl[0] + pl[1] / r >= pages + (pl[1] == 0) || pl[2] < 0 || attended > kmax ||
            pages > bt_stride || (mode == SA_FIXED && pl[2] > 0 && pl[2] < pl[1]) ||
            (mode == SA_RERANK && pl[2] > 0 && pl[2] < pl[1] && (pl[3] < pl[2] || pl[3] > pl[1])))
            return SA_BAD_PLAN;
        for (int64_t p = 0; p < pages; ++p)
            if (block_table[b * bt_stride + p] < 0 || block_table[b * bt_stride + p] >= N) return SA_BAD_BLOCK;
        most_cand = pl[1] > most_cand ? pl[1] : most_cand;
        most_m = pl[3] > most_m ? pl[3] : most_m;
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
    if (stale_n) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < stale_n * H; ++i) {
            float row[4096]; /* bs <= 4096: checked above */
            const int64_t blk = stale[i / H], h = i % H;
            summarise(&c, mode, blk, h, summary + (blk * H + h) * r * D, summary2 ? summary2 + (blk * H + h) * r * D : NULL, NULL, 1.f,
                      row);
        }
    }
    free(stale);
    const int64_t Gs = shared ? 1 : G;
#pragma omp parallel num_threads(threads)
    {
        /* Per-thread scratch: scores of the candidates, the shortlist's kept logits, one page's logits and weights. */
        const int64_t cand_cap = most_cand > 0 ? most_cand : 1, m_cap = most_m > 0 ? most_m : 1;
        float *qs = malloc(sizeof(float) * (size_t)(G * D));
        float *cs = malloc(sizeof(float) * (size_t)(G * cand_cap));
        float *gs = malloc(sizeof(float) * (size_t)cand_cap);
        float *kept = mode == SA_RERANK ? malloc(sizeof(float) * (size_t)(m_cap * G * bs)) : NULL;
        float *mass = malloc(sizeof(float) * (size_t)(G * m_cap));
        float *lg = malloc(sizeof(float) * (size_t)(G * bs));
        float *p = malloc(sizeof(float) * (size_t)(G * bs));
        float *row = malloc(sizeof(float) * (size_t)(bs > D ? bs : D));
        float *vals = malloc(sizeof(float) * (size_t)(cand_cap + 1));
        int64_t *short_ix = malloc(sizeof(int64_t) * (size_t)m_cap);
        int64_t *pick = malloc(sizeof(int64_t) * (size_t)(Gs * cand_cap));
        int64_t *npick = malloc(sizeof(int64_t) * (size_t)Gs);
        uint8_t *rows = malloc((size_t)G);
        float *m = malloc(sizeof(float) * (size_t)G), *l = malloc(sizeof(float) * (size_t)G);
        float *acc = malloc(sizeof(float) * (size_t)(G * D));
        const int ok = qs && cs && gs && (kept || mode != SA_RERANK) && mass && lg && p && row && vals && short_ix && pick &&
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
            for (int64_t i = 0; i < G * D; ++i) qs[i] = q[(b * H + h) * G * D + i] * scale;
            sa_softmax st = {m, l, acc};
            for (int64_t g = 0; g < G; ++g) m[g] = SA_NO_SCORE, l[g] = 0.f;
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            int64_t short_n = 0;
            const int select = k > 0 && k < n_cand && mode != SA_FIXED;
            if (select) {
                /* Coarse scores of every candidate, per query row. */
                for (int64_t i = 0; i < n_cand; ++i) {
                    const int64_t srow = seg_row(&c, table, sink_pages, i, h);
                    const float *s1 = summary + srow * D;
                    for (int64_t g = 0; g < G; ++g) {
                        const float *qg = qs + g * D;
                        float v = 0.f;
                        if (mode == SA_RERANK) {
                            for (int64_t d = 0; d < D; ++d) v += qg[d] * s1[d];
                        } else {
                            const float *s2 = summary2 + srow * D;
                            for (int64_t d = 0; d < D; ++d) {
                                const float a = qg[d] * s1[d], z = qg[d] * s2[d];
                                v += a > z ? a : z;
                            }
                        }
                        cs[g * n_cand + i] = v;
                    }
                }
                if (mode == SA_RERANK) {
                    /* The group's shortlist by log-sum-exp over its rows, then exact masses (logits kept). */
                    const int64_t mm = pl[3];
                    for (int64_t i = 0; i < n_cand; ++i) gs[i] = log_sum_exp(cs + i, G, n_cand);
                    top_k(gs, n_cand, mm, short_ix, vals);
                    short_n = mm;
                    for (int64_t s = 0; s < short_n; ++s) {
                        float *ks = kept + s * G * bs;
                        const char *next = s + 1 < short_n ? seg_keys(&c, table, sink_pages, short_ix[s + 1], h) : NULL;
                        page_logits(&c, seg_keys(&c, table, sink_pages, short_ix[s], h), (int)seg, qs, (int)G, ks, bs, row, next);
                        for (int64_t g = 0; g < G; ++g) mass[g * short_n + s] = log_sum_exp(ks + g * bs, seg, 1);
                    }
                    for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                        const float *src = mass + gs_i * short_n;
                        if (shared) { /* the group's mass: log-sum-exp over its rows */
                            for (int64_t s = 0; s < short_n; ++s) gs[s] = log_sum_exp(mass + s, G, short_n);
                            src = gs;
                        }
                        top_k(src, short_n, k, pick + gs_i * cand_cap, vals); /* positions in the shortlist */
                        npick[gs_i] = k;
                    }
                } else {
                    for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                        const float *src = cs + gs_i * n_cand;
                        if (shared) {
                            for (int64_t i = 0; i < n_cand; ++i) gs[i] = log_sum_exp(cs + i, G, n_cand);
                            src = gs;
                        }
                        top_k(src, n_cand, k, pick + gs_i * cand_cap, vals);
                        npick[gs_i] = k;
                    }
                }
            }
            attend_common(&c, table, h, L, sink_pages, cand_end, select || k == 0, qs, (int)G, softcap, &st, lg, p, row);
            /* The selected candidates: per selection, its rows. */
            if (select) {
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) {
                    for (int64_t g = 0; g < G; ++g) rows[g] = shared || g == gs_i;
                    for (int64_t t = 0; t < npick[gs_i]; ++t) {
                        const int64_t at = pick[gs_i * cand_cap + t];
                        const int64_t cand = mode == SA_RERANK ? short_ix[at] : at;
                        int64_t next = -1; /* the candidate attended after this one (prefetched meanwhile) */
                        if (t + 1 < npick[gs_i]) {
                            const int64_t at2 = pick[gs_i * cand_cap + t + 1];
                            next = mode == SA_RERANK ? short_ix[at2] : at2;
                        }
                        const char *vals_c = seg_values(&c, table, sink_pages, cand, h);
                        if (mode == SA_RERANK) { /* the logits are kept: only values are read */
                            attend_logits(&c, vals_c, (int)seg, kept + at * G * bs, bs, (int)G, rows, softcap, &st, p, row,
                                          next >= 0 ? seg_values(&c, table, sink_pages, next, h) : NULL);
                        } else {
                            page_logits(&c, seg_keys(&c, table, sink_pages, cand, h), (int)seg, qs, (int)G, lg, bs, row, vals_c);
                            attend_logits(&c, vals_c, (int)seg, lg, bs, (int)G, rows, softcap, &st, p, row,
                                          next >= 0 ? seg_keys(&c, table, sink_pages, next, h) : NULL);
                        }
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
            write_rows(&st, (int)G, D, out + (b * H + h) * G * D);
        }
        free(qs); free(cs); free(gs); free(kept); free(mass); free(lg); free(p); free(row); free(vals);
        free(short_ix); free(pick); free(npick); free(rows); free(m); free(l); free(acc);
    }
    return status;
}

/* ---- The split step: per-head page counts and the merged rest (sa_paged_score, then sa_paged_attend_lists).
 * A policy whose allocation splits the layer's pages between its heads (pooled mass, top-p, any allocation) needs
 * every head's scores before any head's count is known, so the step is two calls with the allocation, in Python,
 * between them: the first scores (centroids, the group's shortlist, its exact log masses, the sinks' and tail's
 * log mass) and keeps the shortlist's logits; the second attends each selection's own list of candidates (the
 * kept logits where the shortlist holds them) and, for a merged rest, one token per block of candidate pages
 * made of the pages the selection leaves out, from per-page key and value sums kept per physical block. */

/* Check a step's plan and block table (as sa_paged_decode does); most candidates and shortlist of any row. */
static int check_step(int64_t N, int64_t B, int64_t bs, int64_t r, const int32_t *block_table, int64_t bt_stride,
                      const int32_t *seq_lens, const int32_t *plan, int64_t *most_cand, int64_t *most_m) {
    *most_cand = 0, *most_m = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int32_t *pl = plan + b * 4;
        const int64_t L = seq_lens[b], pages = (L + bs - 1) / bs;
        if (L < 1 || pl[0] < 0 || pl[1] < 0 || pl[1] % r || pl[0] + pl[1] / r >= pages + (pl[1] == 0) || pl[2] < 0 || pages > bt_stride ||
            (pl[2] > 0 && pl[2] < pl[1] && (pl[3] < 1 || pl[3] > pl[1])))
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
        sa_to_float(keys + d * bs * c->elem, c->dtype, bs, row);
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
            sa_to_float(values + j * D * c->elem, c->dtype, D, row);
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
        for (int64_t i = 0; i < n; ++i) out[i] += expf(x[g * ld + i] - top[i]);
    for (int64_t i = 0; i < n; ++i) out[i] = top[i] + logf(out[i]);
}

/* The candidate pages that hold a shortlisted segment (sh[0..mm), candidate indices, r per page), each once:
 * slot[p] its place among them in ascending page order, -1 for the others; order[j] the j-th. Both calls of the
 * split step derive the same slots from the same shortlist: the kept logits are one whole page per slot (a page's
 * logits cost what one segment's do in the vector loops, which compute whole chunks), so a page holding several
 * shortlisted segments is read once and its other segments' logits come free. Returns the number of slots. */
static int64_t shortlist_slots(const int32_t *sh, int64_t mm, int64_t r, int64_t n_pages, int32_t *slot, int64_t *order) {
    for (int64_t p = 0; p < n_pages; ++p) slot[p] = -1;
    for (int64_t s = 0; s < mm; ++s) slot[sh[s] / r] = -2;
    int64_t n = 0;
    for (int64_t p = 0; p < n_pages; ++p)
        if (slot[p] == -2) order[n] = p, slot[p] = (int32_t)n++;
    return n;
}

/*
 * Scores of one decode step (first call of the split step), for the rows that select (0 < k < n_cand):
 * coarse[B, H, G, S_max] = scale q . centroid + log bs of every candidate (the centroid summary's score);
 * short_ix[B, H, M_max] the KV group's m best by log-sum-exp over its rows (m = plan[3]); exact[B, H, G, M_max]
 * their exact log masses logsumexp_j scale q . k_j, whose logits are kept in kept[B, H, M_max, G, bs], one whole
 * page per slot of shortlist_slots;
 * always[B, H, G] the log mass of the sinks' and the tail's tokens. Summaries as sa_paged_decode's (mode
 * SA_RERANK: float32 raw means, scored against q times scale), or with summary_bf16 the bfloat16 means of the keys
 * times root (summarise with s16: Centroid(dtype=torch.bfloat16)), scored in float32 against q times root (half the
 * bytes of the scoring pass, which reads every candidate's row). Entries past a row's own counts are left as they were.
 */
int sa_paged_score(const float *q, const void *cache, int dtype, int64_t N, int64_t H, int64_t bs, int64_t D, int64_t r,
                   int64_t G, int64_t B, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens, const int32_t *plan,
                   float scale, void *summary_store, int summary_bf16, float root, uint8_t *state, int64_t S_max, int64_t M_max,
                   float *coarse, int32_t *short_out, float *exact, float *always, float *kept, int threads) {
    if (dtype != SA_F32 && dtype != SA_BF16 && dtype != SA_F16) return SA_BAD_DTYPE;
    if (bs < 1 || bs > 4096 || D < 1 || D > 4096 || G < 1 || G > 64 || H < 1 || r < 1 || bs % r) return SA_BAD_PLAN;
#ifdef SA_NO_FLOAT16
    if (dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    const sa_pages c = {(const char *)cache, dtype, dtype == SA_F32 ? 4 : 2, H, bs, D, r, bs / r};
    int64_t most_cand, most_m;
    int status = check_step(N, B, bs, r, block_table, bt_stride, seq_lens, plan, &most_cand, &most_m);
    if (status) return status;
    if (most_cand > S_max || most_m > M_max) return SA_BAD_PLAN;
    int64_t *stale = NULL;
    const int64_t stale_n = stale_blocks(B, r, block_table, bt_stride, plan, most_cand, state, &stale);
    if (stale_n < 0) return SA_NO_MEMORY;
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
    float *summary = summary_bf16 ? NULL : (float *)summary_store;
    uint16_t *summary16 = summary_bf16 ? (uint16_t *)summary_store : NULL;
    const int64_t row_bytes = summary_bf16 ? 2 : (int64_t)sizeof(float);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < stale_n * H; ++i) {
        float row[4096];
        const int64_t blk = stale[i / H], h = i % H;
        if (summary_bf16)
            summarise(&c, SA_RERANK, blk, h, NULL, NULL, summary16 + (blk * H + h) * r * D, root, row);
        else
            summarise(&c, SA_RERANK, blk, h, summary + (blk * H + h) * r * D, NULL, NULL, 1.f, row);
    }
    free(stale);
    const float log_seg = logf((float)c.seg);
#pragma omp parallel num_threads(threads)
    {
        const int64_t cand_cap = most_cand > 0 ? most_cand : 1;
        float *qs = malloc(sizeof(float) * (size_t)(G * D));
        float *gs = malloc(sizeof(float) * (size_t)cand_cap);
        float *vals = malloc(sizeof(float) * (size_t)(cand_cap + 1));
        int64_t *ix = malloc(sizeof(int64_t) * (size_t)cand_cap);
        float *spare = malloc(sizeof(float) * (size_t)cand_cap);
        const int64_t m_cap = most_m > 0 ? most_m : 1;
        float *shifted = malloc(sizeof(float) * (size_t)(m_cap * G * bs)), *tops = malloc(sizeof(float) * (size_t)(m_cap * G));
        int32_t *slot = malloc(sizeof(int32_t) * (size_t)cand_cap);
        int64_t *order = malloc(sizeof(int64_t) * (size_t)cand_cap);
        float *lg = malloc(sizeof(float) * (size_t)(G * bs));
        float *row = malloc(sizeof(float) * (size_t)(bs > D ? bs : D));
        float *run = malloc(sizeof(float) * (size_t)G * 2); /* per row: running maximum, running sum */
        float *qr = malloc(sizeof(float) * (size_t)(G * D)), *wide = malloc(sizeof(float) * (size_t)D); /* bf16 centroids */
        const int ok = qs && gs && vals && spare && shifted && tops && ix && slot && order && lg && row && run && qr && wide;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * H; ++item) {
            if (!ok) continue;
            const int64_t h = item / B, b = item % B;
            const int32_t *pl = plan + b * 4;
            const int64_t sink_pages = pl[0], n_cand = pl[1], k = pl[2], mm = pl[3], L = seq_lens[b];
            if (!(k > 0 && k < n_cand)) continue;
            const int64_t pages = (L + bs - 1) / bs;
            const int32_t *table = block_table + b * bt_stride;
            for (int64_t i = 0; i < G * D; ++i) qs[i] = q[(b * H + h) * G * D + i] * scale;
            /* bf16 centroids hold the scaled keys' means: scored against the query times root (the generic path's
             * q.root . mean(k.root)); float32 ones hold the raw means, scored against the query times scale. */
            for (int64_t i = 0; i < G * D; ++i) qr[i] = q[(b * H + h) * G * D + i] * root;
            const float *qc = summary_bf16 ? qr : qs;
            const char *store = (const char *)summary_store;
            float *cs = coarse + (b * H + h) * G * S_max;
            for (int64_t i = 0; i < n_cand; ++i) {
                const float *s1;
                if (summary_bf16) {
                    const char *src = (const char *)(summary16 + seg_row(&c, table, sink_pages, i, h) * D);
                    if (D % SA_LANES == 0) {
                        for (int64_t d = 0; d < D; d += SA_LANES) {
                            const sa_v16 v = load16(src + 2 * d, SA_BF16);
                            memcpy(wide + d, &v, sizeof v);
                        }
                    } else {
                        sa_to_float(src, SA_BF16, D, wide);
                    }
                    s1 = wide;
                } else {
                    s1 = summary + seg_row(&c, table, sink_pages, i, h) * D;
                }
                if (i % r == 0 && i + 2 * r < n_cand) /* a later page's r rows (scattered blocks: the prefetcher misses them) */
                    SA_PREFETCH(store + seg_row(&c, table, sink_pages, i + 2 * r, h) * D * row_bytes, 0, r * D * row_bytes);
                for (int64_t g = 0; g < G; ++g) {
                    const float *qg = qc + g * D;
                    float v = 0.f;
                    for (int64_t d = 0; d < D; ++d) v += qg[d] * s1[d];
                    cs[g * S_max + i] = v + log_seg;
                }
            }
            lse_columns(cs, G, S_max, n_cand, gs, vals);
            top_k_set(gs, n_cand, mm, ix, vals, spare);
            int32_t *sh = short_out + (b * H + h) * M_max;
            float *ex = exact + (b * H + h) * G * M_max;
            for (int64_t s = 0; s < mm; ++s) sh[s] = (int32_t)ix[s];
            /* The shortlist's pages' logits, each page once (its successor's keys prefetched), then each
             * shortlisted segment's exact log mass from its columns. */
            const int64_t n_slots = shortlist_slots(sh, mm, r, n_cand / r, slot, order);
            float *kept_bh = kept + (b * H + h) * M_max * G * bs;
            for (int64_t j = 0; j < n_slots; ++j) {
                const char *next = j + 1 < n_slots ? page_keys(&c, table[sink_pages + order[j + 1]], h) : NULL;
                page_logits(&c, page_keys(&c, table[sink_pages + order[j]], h), (int)bs, qs, (int)G, kept_bh + j * G * bs, bs, row, next);
            }
            /* Each (segment, row)'s logits less their maximum gathered into one array, so that the exponentials
             * and the logarithms run as vector loops (libmvec) rather than one call per value. */
            const int64_t seg = c.seg;
            for (int64_t s = 0; s < mm; ++s) {
                const float *ks = kept_bh + slot[sh[s] / r] * G * bs + (sh[s] % r) * seg;
                for (int64_t g = 0; g < G; ++g) {
                    const float *x = ks + g * bs;
                    float top = x[0];
                    for (int64_t j = 1; j < seg; ++j) top = x[j] > top ? x[j] : top;
                    float *e = shifted + (s * G + g) * seg;
                    for (int64_t j = 0; j < seg; ++j) e[j] = x[j] - top;
                    tops[s * G + g] = top;
                }
            }
            for (int64_t i = 0; i < mm * G * seg; ++i) shifted[i] = expf(shifted[i]);
            for (int64_t i = 0; i < mm * G; ++i) {
                float sum = 0.f;
                for (int64_t j = 0; j < seg; ++j) sum += shifted[i * seg + j];
                tops[i] += logf(sum);
            }
            for (int64_t s = 0; s < mm; ++s)
                for (int64_t g = 0; g < G; ++g) ex[g * M_max + s] = tops[s * G + g];
            /* The sinks' and the tail's log mass: a running log-sum-exp over their pages. */
            for (int64_t g = 0; g < G; ++g) run[2 * g] = SA_NO_SCORE, run[2 * g + 1] = 0.f;
            for (int64_t pg = 0; pg < pages; ++pg) {
                if (pg >= sink_pages && pg < sink_pages + n_cand / r) continue;
                const int n = (int)(pg == pages - 1 ? L - pg * bs : bs);
                page_logits(&c, page_keys(&c, table[pg], h), n, qs, (int)G, lg, bs, row, NULL);
                for (int64_t g = 0; g < G; ++g) {
                    const float *x = lg + g * bs;
                    float top = SA_NO_SCORE;
                    for (int j = 0; j < n; ++j) top = x[j] > top ? x[j] : top;
                    const float mx = run[2 * g] > top ? run[2 * g] : top;
                    float sum = run[2 * g + 1] * expf(run[2 * g] - mx);
                    for (int j = 0; j < n; ++j) sum += expf(x[j] - mx);
                    run[2 * g] = mx, run[2 * g + 1] = sum;
                }
            }
            for (int64_t g = 0; g < G; ++g) always[(b * H + h) * G + g] = run[2 * g] + logf(run[2 * g + 1]);
        }
        free(qs); free(gs); free(vals); free(spare); free(shifted); free(tops); free(ix); free(slot); free(order); free(lg); free(row); free(run);
        free(qr); free(wide);
    }
    return status;
}

/*
 * PooledMass's split of each selecting row's candidates between its KV heads' query heads, from sa_paged_score's
 * outputs (the Python part, sparseattn.allocations.PooledMass.plan on the Shortlist's scores, is the reference;
 * the split step runs this when the policy's allocation is exactly PooledMass and each query head selects).
 * Per row b with 0 < k < n_cand and per (h, g): the Shortlist's scores are the coarse ones shifted below the
 * smallest exact mass (shift = max coarse - min exact, at least 0, plus 1) with the shortlist's exact masses in
 * place; log_total = log(sum exp(scores) + exp(always)); the w best (w <= m: the shortlist's w best exact masses)
 * are listed with their shares exact - log_total (NaN: the lowest); each (h, g) takes its `floor` best, then the
 * row the H G k largest shares of the rest (at most H G w). chosen[b, h, g, i] = 1 for each candidate taken (else
 * left as it was: the caller zeroes it). Scratch per row: shares of H G w, and a candidate's n_cand.
 */
int sa_paged_pooled_split(int64_t B, int64_t H, int64_t G, const int32_t *plan, const float *coarse, int64_t S_max,
                          const int32_t *short_ix, const float *exact, int64_t M_max, const float *always, int64_t w,
                          int64_t floor_n, uint8_t *chosen, int threads) {
    if (B < 0 || H < 1 || G < 1 || S_max < 1 || M_max < 1 || w < 1 || floor_n < 0 || floor_n > w) return SA_BAD_PLAN;
    for (int64_t b = 0; b < B; ++b) {
        const int32_t *pl = plan + b * 4;
        if (pl[2] > 0 && pl[2] < pl[1] && (pl[1] > S_max || pl[3] > M_max || w > pl[3] || (int64_t)pl[2] * H * G < 1)) return SA_BAD_PLAN;
    }
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
    int status = SA_OK;
#pragma omp parallel num_threads(threads)
    {
        const int64_t n_share = H * G * w;
        float *share = malloc(sizeof(float) * (size_t)n_share), *v = malloc(sizeof(float) * (size_t)(n_share > M_max ? n_share : M_max));
        float *spare = malloc(sizeof(float) * (size_t)(n_share > M_max ? n_share : M_max));
        int64_t *place = malloc(sizeof(int64_t) * (size_t)n_share); /* each listed share's candidate */
        int64_t *pick = malloc(sizeof(int64_t) * (size_t)(n_share > M_max ? n_share : M_max));
        uint8_t *is_short = calloc((size_t)S_max, 1);
        const int ok = share && v && spare && place && pick && is_short;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            if (!ok) continue;
            const int32_t *pl = plan + b * 4;
            const int64_t n_cand = pl[1], k = pl[2], mm = pl[3];
            if (!(k > 0 && k < n_cand)) continue;
            for (int64_t h = 0; h < H; ++h) {
                const int32_t *sh = short_ix + (b * H + h) * M_max;
                for (int64_t g = 0; g < G; ++g) {
                    const float *cs = coarse + ((b * H + h) * G + g) * S_max;
                    const float *ex = exact + ((b * H + h) * G + g) * M_max;
                    float top = -FLT_MAX, low = FLT_MAX;
                    for (int64_t i = 0; i < n_cand; ++i) top = cs[i] > top ? cs[i] : top;
                    for (int64_t s = 0; s < mm; ++s) low = ex[s] < low ? ex[s] : low;
                    const float shift = (top - low > 0.f ? top - low : 0.f) + 1.f;
                    /* log-sum-exp of the Shortlist's scores: the coarse ones shifted (the shortlisted ones' in
                     * their place are their exact masses), in float32 as torch computes it. */
                    float mx = low; /* every exact mass is above every shifted coarse score */
                    for (int64_t s = 0; s < mm; ++s) mx = ex[s] > mx ? ex[s] : mx;
                    for (int64_t s = 0; s < mm; ++s) is_short[sh[s]] = 1;
                    float sum = 0.f;
                    for (int64_t i = 0; i < n_cand; ++i) sum += is_short[i] ? 0.f : expf((cs[i] - shift) - mx);
                    for (int64_t s = 0; s < mm; ++s) sum += expf(ex[s] - mx), is_short[sh[s]] = 0;
                    float log_total = mx + logf(sum > 0.f ? sum : FLT_MIN);
                    const float al = always[(b * H + h) * G + g];
                    log_total = log_total > al ? log_total + log1pf(expf(al - log_total)) : al + log1pf(expf(log_total - al));
                    /* The w best exact masses of the shortlist (all of it when w == m), each a share. */
                    int64_t *listed = pick;
                    if (w < mm) top_k_set(ex, mm, w, listed, v, spare);
                    else
                        for (int64_t s = 0; s < mm; ++s) listed[s] = s;
                    float *row = share + (h * G + g) * w;
                    for (int64_t j = 0; j < w; ++j) {
                        row[j] = finite_or_lowest(ex[listed[j]] - log_total);
                        place[(h * G + g) * w + j] = sh[listed[j]];
                    }
                    if (floor_n > 0) { /* the row's floor best first: pushed above every share */
                        top_k_set(row, w, floor_n, listed, v, spare);
                        for (int64_t j = 0; j < floor_n; ++j) row[listed[j]] = FLT_MAX;
                    }
                }
            }
            const int64_t total = k * H * G < n_share ? k * H * G : n_share;
            top_k_set(share, n_share, total, pick, v, spare);
            for (int64_t j = 0; j < total; ++j) {
                const int64_t at = pick[j], hg = at / w;
                chosen[((b * H) * G + hg) * S_max + place[at]] = 1;
            }
        }
        free(share); free(v); free(spare); free(place); free(pick); free(is_short);
    }
    return status;
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

/*
 * Attend one decode step's own lists (second call of the split step). Per (sequence b, KV head h): the sinks
 * and the tail for every row; every candidate when the row does not select (k >= n_cand; none when k == 0);
 * else each selection gs (< G' = shared ? 1 : G) attends the candidates i with chosen[b, h, gs, i] != 0 (those in
 * the shortlist short_ix[b, h, :m] with the logits sa_paged_score kept, kept[b, h, place, :, :]), and with
 * per_block > 0 one merged token per block of per_block candidate pages of what it leaves out: logit
 * log m + scale q . (sum k) / m, value (sum v) / m, m its tokens (no token for a block it attends whole),
 * from the sums kept in sums[N, H, sums_rows(r, segment_rows), W] (page_sums; sums_state[N] as state). With coarse
 * (sa_paged_score's scores of float32 centroids, [B, H, G, S_max]) a merged token's logit is read off the scores:
 * scale q . (sum k) over a block's left-out segments is seg times the sum of their scores less log seg, and the
 * sums hold the values' alone (W = D); without (bf16 centroids, whose rounded means do not give the keys' sums),
 * keys' then values' (W = 2 D). Without segment rows (r > 1, blocks of whole pages: needs coarse) the store keeps
 * each page's total only, and a run of a page's segments leaves its block with its values' sum taken from the
 * value rows it has just attended. out: [B, H, G, D] float32.
 */
int sa_paged_attend_lists(const float *q, const void *cache, int dtype, int64_t N, int64_t H, int64_t bs, int64_t D,
                          int64_t r, int64_t G, int64_t B, const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                          const int32_t *plan, int shared, float scale, float softcap, const uint8_t *chosen,
                          int64_t S_max, const int32_t *short_ix, const float *kept, int64_t M_max, int64_t per_block,
                          float *sums, uint8_t *sums_state, int segment_rows, const float *coarse, float *out, int threads) {
    if (dtype != SA_F32 && dtype != SA_BF16 && dtype != SA_F16) return SA_BAD_DTYPE;
    if (bs < 1 || bs > 4096 || D < 1 || D > 4096 || G < 1 || G > 64 || H < 1 || S_max < 1 || M_max < 1 || per_block < 0 ||
        r < 1 || bs % r || (per_block > 0 && (!sums || !sums_state)) ||
        (per_block > 0 && r > 1 && !segment_rows && (per_block % r || !coarse)))
        return SA_BAD_PLAN;
#ifdef SA_NO_FLOAT16
    if (dtype == SA_F16) return SA_BAD_DTYPE;
#endif
    const sa_pages c = {(const char *)cache, dtype, dtype == SA_F32 ? 4 : 2, H, bs, D, r, bs / r};
    int64_t most_cand, most_m;
    int status = check_step(N, B, bs, r, block_table, bt_stride, seq_lens, plan, &most_cand, &most_m);
    if (status) return status;
    const int64_t Gs = shared ? 1 : G;
    if (most_cand > S_max || most_m > M_max) return SA_BAD_PLAN;
    for (int64_t i = 0; i < B * H * M_max; ++i) { /* the shortlists: candidates of their rows */
        const int64_t b = i / (H * M_max);
        if (i % M_max < plan[b * 4 + 3] && (short_ix[i] < 0 || short_ix[i] >= plan[b * 4 + 1])) return SA_BAD_PLAN;
    }
#ifdef _OPENMP
    if (threads < 1) threads = 1;
#endif
    /* The rest's sums below are [2 D] wide, keys' then values'; with coarse only columns [D, 2 D) are used, and the
     * store's rows are W = 2 D - k0 wide (column d of a block's sums is column d - k0 of a stored row). */
    const int64_t k0 = coarse ? D : 0, W = 2 * D - k0;
    if (per_block > 0) {
        int64_t *stale = NULL;
        const int64_t stale_n = stale_blocks(B, r, block_table, bt_stride, plan, most_cand, sums_state, &stale);
        if (stale_n < 0) return SA_NO_MEMORY;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < stale_n * H; ++i) {
            float row[4096];
            const int64_t blk = stale[i / H], h = i % H;
            page_sums(&c, blk, h, segment_rows, !coarse, sums + (blk * H + h) * sums_rows(r, segment_rows) * W, row);
        }
        free(stale);
    }
    const int64_t n_blocks_cap = per_block > 0 ? (most_cand + per_block - 1) / per_block + 1 : 1;
    const int64_t rows_s = sums_rows(r, segment_rows), page_row = rows_s - 1; /* the page's own row */
    const float log_seg = logf((float)(bs / r));
#pragma omp parallel num_threads(threads)
    {
        float *qs = malloc(sizeof(float) * (size_t)(G * D));
        float *lg = malloc(sizeof(float) * (size_t)(G * bs));
        float *p = malloc(sizeof(float) * (size_t)(G * (bs > n_blocks_cap ? bs : n_blocks_cap)));
        float *row = malloc(sizeof(float) * (size_t)(bs > D ? bs : D));
        uint8_t *rows = malloc((size_t)G);
        float *m = malloc(sizeof(float) * (size_t)G), *l = malloc(sizeof(float) * (size_t)G);
        float *acc = malloc(sizeof(float) * (size_t)(G * D));
        double *total = malloc(sizeof(double) * (size_t)(n_blocks_cap * 2 * D)); /* the blocks' sums */
        double *rest = malloc(sizeof(double) * (size_t)(Gs * n_blocks_cap * 2 * D)); /* each selection's rest */
        int64_t *left = malloc(sizeof(int64_t) * (size_t)(Gs * n_blocks_cap));
        float *mean = malloc(sizeof(float) * (size_t)(n_blocks_cap * 2 * D));
        int64_t *nonempty = malloc(sizeof(int64_t) * (size_t)n_blocks_cap), *which = malloc(sizeof(int64_t) * (size_t)n_blocks_cap);
        double *kx = malloc(sizeof(double) * (size_t)n_blocks_cap); /* with coarse: a row's left-out logits per block */
        float *vsum = malloc(sizeof(float) * (size_t)D); /* a run's values' sum (page totals only) */
        int32_t *slot = malloc(sizeof(int32_t) * (size_t)S_max); /* each candidate page's kept logits, or -1 */
        int64_t *order = malloc(sizeof(int64_t) * (size_t)S_max);
        int64_t *list = malloc(sizeof(int64_t) * (size_t)S_max); /* the candidates any selection chose, in order */
        uint64_t *chosen_by = malloc(sizeof(uint64_t) * (size_t)S_max); /* which selections chose each (bit gs) */
        const int ok = qs && lg && p && row && rows && m && l && acc && total && rest && left && mean && nonempty && slot && order &&
                       list && chosen_by && vsum && which && kx;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * H; ++item) {
            if (!ok) continue;
            const int64_t h = item / B, b = item % B;
            const int32_t *pl = plan + b * 4;
            const int64_t sink_pages = pl[0], n_cand = pl[1], k = pl[2], L = seq_lens[b];
            const int64_t cand_end = sink_pages + n_cand / r, seg = c.seg;
            const int32_t *table = block_table + b * bt_stride;
            for (int64_t i = 0; i < G * D; ++i) qs[i] = q[(b * H + h) * G * D + i] * scale;
            sa_softmax st = {m, l, acc};
            for (int64_t g = 0; g < G; ++g) m[g] = SA_NO_SCORE, l[g] = 0.f;
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            const int select = k > 0 && k < n_cand;
            attend_common(&c, table, h, L, sink_pages, cand_end, select || k == 0, qs, (int)G, softcap, &st, lg, p, row);
            int64_t n_blocks = 0;
            const int whole_pages = per_block > 0 && per_block % r == 0; /* no page across two blocks: one row per page */
            if (select && per_block > 0) { /* the blocks' sums, once for the KV head's selections */
                n_blocks = (n_cand + per_block - 1) / per_block;
                memset(total, 0, sizeof(double) * (size_t)(n_blocks * 2 * D));
                const int64_t step = whole_pages ? r : 1, ahead = 4 * step; /* rows prefetched this many candidates ahead */
                for (int64_t i = 0; i < n_cand; i += step) {
                    const int64_t row_of = whole_pages ? page_row : i % r;
                    const float *s = sums + ((cand_block(&c, table, sink_pages, i) * H + h) * rows_s + row_of) * W;
                    if (i + ahead < n_cand)
                        SA_PREFETCH((const char *)(sums + ((cand_block(&c, table, sink_pages, i + ahead) * H + h) * rows_s +
                                                           (whole_pages ? page_row : (i + ahead) % r)) * W), 0, W * (int64_t)sizeof(float));
                    double *t = total + (i / per_block) * 2 * D;
                    for (int64_t d = k0; d < 2 * D; ++d) t[d] += s[d - k0];
                }
            }
            if (select) shortlist_slots(short_ix + (b * H + h) * M_max, pl[3], r, n_cand / r, slot, order);
            const float *kept_bh = kept + (b * H + h) * M_max * G * bs;
            int64_t n_list = 0;
            for (int64_t i = 0; select && i < n_cand; ++i) { /* the union of the selections' lists */
                uint64_t by = 0;
                for (int64_t gs_i = 0; gs_i < Gs; ++gs_i) by |= (uint64_t)(chosen[((b * H + h) * Gs + gs_i) * S_max + i] != 0) << gs_i;
                if (by) list[n_list] = i, chosen_by[n_list++] = by;
            }
            for (int64_t gs_i = 0; gs_i < Gs && n_blocks; ++gs_i) { /* each selection's rest: its blocks' sums, less what it attends */
                memcpy(rest + gs_i * n_blocks_cap * 2 * D, total, sizeof(double) * (size_t)(n_blocks * 2 * D));
                for (int64_t j = 0; j < n_blocks; ++j)
                    left[gs_i * n_blocks_cap + j] = (j + 1) * per_block <= n_cand ? per_block : n_cand - j * per_block;
            }
            /* One pass over the union, one call per run of adjacent segments of a page (contiguous tokens) that the
             * same selections chose, for their rows: a segment several heads chose is read once. The logits are
             * the page's kept ones when the shortlist holds it, else computed here; then the run's sums leave each
             * choosing selection's rest (a whole page's in one row). Each row still sees its own candidates in
             * ascending order, as its own list would give them. */
            for (int64_t t = 0, end; t < n_list; t = end) {
                const int64_t first = list[t], page = first / r;
                const uint64_t by = chosen_by[t];
                for (end = t + 1; end < n_list && list[end] == list[end - 1] + 1 && list[end] / r == page && chosen_by[end] == by; ++end) {}
                for (int64_t g = 0; g < G; ++g) rows[g] = (by >> (shared ? 0 : g)) & 1;
                const int n = (int)((end - t) * seg);
                const int64_t next = end < n_list ? list[end] : -1;
                const char *vals_c = seg_values(&c, table, sink_pages, first, h);
                if (slot[page] >= 0) {
                    attend_logits(&c, vals_c, n, kept_bh + slot[page] * G * bs + (first % r) * seg, bs, (int)G, rows, softcap, &st,
                                  p, row, next >= 0 ? seg_values(&c, table, sink_pages, next, h) : NULL);
                } else {
                    page_logits(&c, seg_keys(&c, table, sink_pages, first, h), n, qs, (int)G, lg, bs, row, vals_c);
                    attend_logits(&c, vals_c, n, lg, bs, (int)G, rows, softcap, &st, p, row,
                                  next >= 0 ? seg_keys(&c, table, sink_pages, next, h) : NULL);
                }
                if (!n_blocks) continue;
                const float *page_rows = sums + (cand_block(&c, table, sink_pages, first) * H + h) * rows_s * W;
                if (next >= 0) { /* the next run's rows, through its page's own */
                    const int64_t from = rows_s > 1 ? next % r : 0;
                    SA_PREFETCH((const char *)(sums + ((cand_block(&c, table, sink_pages, next) * H + h) * rows_s + from) * W), 0,
                                (rows_s - from) * W * (int64_t)sizeof(float));
                }
                const int whole = whole_pages && r > 1 && end - t == r;
                if (!whole && r > 1 && rows_s == 1) { /* part of a page, whose total alone is kept: the run's values' sum */
                    for (int64_t d = 0; d < D; ++d) vsum[d] = 0.f;
                    for (int64_t j = 0; j < n; ++j) { /* rows just attended: in cache; at most a page's, summed in float32 */
                        sa_to_float(vals_c + j * D * c.elem, c.dtype, D, row);
                        for (int64_t d = 0; d < D; ++d) vsum[d] += row[d];
                    }
                    /* blocks of whole pages: the run is in one (its keys' side: the scores, coarse) */
                    leave_block(rest, left, by, Gs, n_blocks_cap, first / per_block, 2 * D, D, vsum, end - t);
                    continue;
                }
                for (int64_t x = t; x < (whole ? t + 1 : end); ++x)
                    leave_block(rest, left, by, Gs, n_blocks_cap, list[x] / per_block, 2 * D, k0,
                                page_rows + (whole ? page_row : list[x] % r) * W, whole ? r : 1);
            }
            for (int64_t gs_i = 0; select && gs_i < Gs; ++gs_i) {
                for (int64_t g = 0; g < G; ++g) rows[g] = shared || g == gs_i;
                const double *rest_s = rest + gs_i * n_blocks_cap * 2 * D;
                const int64_t *left_s = left + gs_i * n_blocks_cap;
                if (!n_blocks) continue;
                int64_t nn = 0;
                for (int64_t j = 0; j < n_blocks; ++j) {
                    if (left_s[j] <= 0) continue;
                    const double tokens = (double)(left_s[j] * seg);
                    for (int64_t d = k0; d < 2 * D; ++d) mean[nn * 2 * D + d] = (float)(rest_s[j * 2 * D + d] / tokens);
                    which[nn] = j, nonempty[nn++] = left_s[j] * seg;
                }
                if (!nn) continue;
                const uint8_t *mine = chosen + ((b * H + h) * Gs + gs_i) * S_max;
                for (int64_t g = 0; g < G; ++g) {
                    if (!rows[g]) continue;
                    const float *qg = qs + g * D;
                    float *pg = p + g * n_blocks_cap, top = SA_NO_SCORE;
                    if (coarse) { /* each block's left-out segments' scores less log seg: scale q . k of their mean keys */
                        const float *cs = coarse + ((b * H + h) * G + g) * S_max;
                        for (int64_t j = 0; j < n_blocks; ++j) { /* a sum per block (not one through memory: it vectorises) */
                            const int64_t hi = (j + 1) * per_block < n_cand ? (j + 1) * per_block : n_cand;
                            double sum = 0.0;
                            for (int64_t i = j * per_block; i < hi; ++i) sum += mine[i] ? 0.0 : (double)(cs[i] - log_seg);
                            kx[j] = sum;
                        }
                    }
                    for (int64_t j = 0; j < nn; ++j) {
                        float x = 0.f;
                        if (coarse) x = (float)(kx[which[j]] / (double)left_s[which[j]]);
                        else
                            for (int64_t d = 0; d < D; ++d) x += qg[d] * mean[j * 2 * D + d];
                        if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                        x += logf((float)nonempty[j]);
                        pg[j] = x;
                        top = x > top ? x : top;
                    }
                    SA_SOFTMAX_STEP(pg, nn, top, m[g], l[g], alpha);
                    float *ag = acc + g * D;
                    for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
                    for (int64_t j = 0; j < nn; ++j)
                        for (int64_t d = 0; d < D; ++d) ag[d] += pg[j] * mean[j * 2 * D + D + d];
                }
            }
            write_rows(&st, (int)G, D, out + (b * H + h) * G * D);
        }
        free(qs); free(lg); free(p); free(row); free(rows); free(m); free(l); free(acc); free(total); free(rest); free(left);
        free(mean); free(nonempty); free(which); free(kx); free(slot); free(order); free(list); free(chosen_by); free(vsum);
    }
    return status;
}

/* Mark stale the blocks written through slot_mapping ([n] int64 slots, -1: padding). */
void sa_paged_invalidate(const int64_t *slot_mapping, int64_t n, int64_t bs, uint8_t *state, int64_t N) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slot_mapping[i];
        if (s >= 0 && s / bs < N) state[s / bs] = 0;
    }
}
