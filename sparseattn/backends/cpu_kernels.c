/*
 * Segment-sparse decode attention on the CPU: the kernel of sparseattn's "cpu" backend.
 *
 * One decode step: every query head of a KV group attends to the sinks, to the segments its
 * selection holds and to the tail (buffer + window), reading those key/value rows in place from
 * the cache (no gathered copy). The Python reference is sparseattn.ops.attention.segment_attention_ref.
 *
 * Work plan, per (batch, KV head) row:
 *   1. spans: the attended tokens as maximal runs [start, end) that the same query heads attend
 *      (a bit per query head). Under grouped-query attention the G heads of a group may select
 *      different segments; a run is read once for every head that attends it (flash-decoding's
 *      GQA packing: the K/V rows are loaded once, the heads are the rows of the small product).
 *   2. parts: a row's tokens are split into contiguous parts so that all threads have work
 *      (flash-decoding's split-K); each part keeps an online softmax (max, sum, weighted values).
 *   3. merge: a row's parts are combined by log-sum-exp.
 *
 * Built with -ffast-math (vectorised expf/tanhf from libmvec), which assumes finite numbers: the
 * running maximum therefore starts at a finite -1e30, never at -inf.
 */
#include "kernel_common.h"

#ifndef SA_BLOCK
#define SA_BLOCK 32 /* tokens per online-softmax update */
#endif
#define SA_MIN_PART 512 /* fewest tokens worth a part of its own */
#define SA_MAX_ROWS 64  /* query heads per KV head (one bit each in a 64-bit mask) */

enum { SA_BAD_SEGMENT = 1, SA_EMPTY_HEAD = 3, SA_TOO_MANY_ROWS = 5, SA_BAD_BLOCK = 6 }; /* besides kernel_common.h's */

typedef struct {
    int64_t start, end; /* token range */
    uint64_t heads;     /* bit g: query head g of the group attends it */
} sa_span;

typedef struct {
    int64_t row, first, last; /* tokens [first, last) of the row's concatenated spans */
} sa_part;

int sa_float16_supported(void) { return sa_float16_built(); }

/* Rows [j0, j0 + n) of a cache as float32: a pointer into the cache itself for float32, else a
 * converted copy in buf (row stride D). Returns the row stride through *stride. */
static const float *load_rows(const void *base, int dtype, int64_t row_stride, int64_t j0, int n, int D,
                              float *buf, int64_t *stride) {
    if (dtype == SA_F32) {
        *stride = row_stride;
        return (const float *)base + j0 * row_stride;
    }
    *stride = D;
    for (int j = 0; j < n; ++j) {
        float *dst = buf + (int64_t)j * D;
        if (dtype == SA_BF16) {
            const uint16_t *src = (const uint16_t *)base + (j0 + j) * row_stride;
            for (int d = 0; d < D; ++d) sa_bf16_to_float(dst + d, src[d]);
        }
#ifndef SA_NO_FLOAT16
        else {
            const _Float16 *src = (const _Float16 *)base + (j0 + j) * row_stride;
            for (int d = 0; d < D; ++d) dst[d] = (float)src[d];
        }
#endif
    }
    return buf;
}

/* The rows to prefetch while a block runs: row j of k and of v (ks, vs bytes apart, `bytes` long) beside
 * row j of the block, for j < n. */
typedef struct {
    const char *k, *v;
    int64_t ks, vs;
    int n, bytes;
} sa_ahead;

/* One block of n tokens: scores of the attending heads, online-softmax update, weighted values.
 * qs: [G, D] scaled queries; m, l: [G] running max and sum; acc: [G, D]; s: [G, SA_BLOCK] scratch;
 * ahead: the next block's rows, asked for while this one is computed.
 * Token-major loops: a key or value row is read from memory once and used by every head that attends
 * it while it sits in L1 (measured faster than head-major loops that keep a head in registers). The
 * body is compiled for the common head dims (a constant D unrolls) and once for any D. */
#define SA_DEFINE_ATTEND_BLOCK(NAME, DIM)                                                                        \
    static void NAME(const float *restrict qs, int D_, uint64_t heads, const float *restrict k, int64_t ks,     \
                     const float *restrict v, int64_t vs, int n, float softcap, float *restrict m,               \
                     float *restrict l, float *restrict acc, float *restrict s, const sa_ahead *ahead) {         \
        const int D = DIM > 0 ? DIM : D_;                                                                      \
        for (int j = 0; j < n; ++j) {                                                                          \
            const float *kj = k + j * ks;                                                                      \
            if (j < ahead->n)                                                                                  \
                for (int off = 0; off < ahead->bytes; off += 64) __builtin_prefetch(ahead->k + j * ahead->ks + off, 0, 1); \
            for (uint64_t b = heads; b; b &= b - 1) {                                                          \
                const int g = __builtin_ctzll(b);                                                              \
                const float *qg = qs + (int64_t)g * D;                                                         \
                float dot = 0.f;                                                                               \
                for (int d = 0; d < D; ++d) dot += qg[d] * kj[d];                                              \
                s[g * SA_BLOCK + j] = dot;                                                                     \
            }                                                                                                  \
        }                                                                                                      \
        for (uint64_t b = heads; b; b &= b - 1) {                                                              \
            const int g = __builtin_ctzll(b);                                                                  \
            float *sg = s + g * SA_BLOCK;                                                                      \
            if (softcap > 0.f) {                                                                               \
                const float inv = 1.f / softcap;                                                               \
                for (int j = 0; j < n; ++j) sg[j] = softcap * tanhf(sg[j] * inv);                              \
            }                                                                                                  \
            float top = SA_NO_SCORE;                                                                           \
            for (int j = 0; j < n; ++j) top = sg[j] > top ? sg[j] : top;                                       \
            SA_SOFTMAX_STEP(sg, n, top, m[g], l[g], alpha);                                                    \
            if (alpha != 1.f) {                                                                                \
                float *ag = acc + (int64_t)g * D;                                                              \
                for (int d = 0; d < D; ++d) ag[d] *= alpha;                                                    \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 0; j < n; ++j) {                                                                          \
            const float *vj = v + j * vs;                                                                      \
            if (j < ahead->n)                                                                                  \
                for (int off = 0; off < ahead->bytes; off += 64) __builtin_prefetch(ahead->v + j * ahead->vs + off, 0, 1); \
            for (uint64_t b = heads; b; b &= b - 1) {                                                          \
                const int g = __builtin_ctzll(b);                                                              \
                const float p = s[g * SA_BLOCK + j];                                                           \
                float *ag = acc + (int64_t)g * D;                                                              \
                for (int d = 0; d < D; ++d) ag[d] += p * vj[d];                                                \
            }                                                                                                  \
        }                                                                                                      \
    }

SA_DEFINE_ATTEND_BLOCK(attend_block_64, 64)
SA_DEFINE_ATTEND_BLOCK(attend_block_128, 128)
SA_DEFINE_ATTEND_BLOCK(attend_block_any, 0)

typedef void (*sa_block_fn)(const float *, int, uint64_t, const float *, int64_t, const float *, int64_t, int, float,
                            float *, float *, float *, float *, const sa_ahead *);

static int sa_cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The attended spans of one row (sorted, disjoint, maximal). Returns the count, or -1 for a bad index.
 * valid (NULL: all) flags which of each set's k listed segments are attended; the others are not read.
 * mask: n_segments zeros on entry, zeros again on return; listed: room for sets * k indices. The distinct
 * listed segments are walked in order by sorting them when they are few against the grid, else by a
 * scan of the grid (an O(n_segments) scan per row was most of a small call's time at 128k). */
static int64_t row_spans(const int64_t *sel, const uint8_t *valid, int64_t sets, int64_t k, int64_t G, int64_t sink_end,
                         int64_t seg_size, int64_t n_segments, int64_t tail_start, int64_t length, uint64_t *mask,
                         int64_t *listed, sa_span *out) {
    const uint64_t all = G == 64 ? ~(uint64_t)0 : (((uint64_t)1 << G) - 1);
    int64_t n = 0, distinct = 0;
    if (sink_end > 0) out[n++] = (sa_span){0, sink_end, all};
    for (int64_t set = 0; set < sets; ++set) {
        uint64_t bits = sets == 1 ? all : (uint64_t)1 << set;
        for (int64_t i = 0; i < k; ++i) {
            if (valid && !valid[set * k + i]) continue;
            int64_t seg = sel[set * k + i];
            if (seg < 0 || seg >= n_segments) {
                for (int64_t j = 0; j < distinct; ++j) mask[listed[j]] = 0;
                return -1;
            }
            if (!mask[seg]) listed[distinct++] = seg;
            mask[seg] |= bits;
        }
    }
    const int sorted = distinct * 16 < n_segments; /* few: sort them; many: scan the grid */
    if (sorted) qsort(listed, (size_t)distinct, sizeof(int64_t), sa_cmp_i64);
    const int64_t walk = sorted ? distinct : n_segments;
    for (int64_t it = 0; it < walk; ++it) {
        const int64_t seg = sorted ? listed[it] : it;
        if (!mask[seg]) continue;
        int64_t start = sink_end + seg * seg_size, end = start + seg_size;
        if (end > tail_start) end = tail_start; /* the window reaches back into this segment */
        if (end <= start) continue;
        if (n > 0 && out[n - 1].end == start && out[n - 1].heads == mask[seg])
            out[n - 1].end = end;
        else
            out[n++] = (sa_span){start, end, mask[seg]};
    }
    for (int64_t j = 0; j < distinct; ++j) mask[listed[j]] = 0;
    if (length > tail_start) {
        if (n > 0 && out[n - 1].end == tail_start && out[n - 1].heads == all)
            out[n - 1].end = length;
        else
            out[n++] = (sa_span){tail_start, length, all};
    }
    return n;
}

/*
 * out[b, h, g, :] = softmax over the attended tokens of (scale * q . k_j, soft-capped) applied to v_j.
 *
 * q:        [B, H, G, D] float32, contiguous.
 * keys:     element (b, h, j, d) at keys[b * ksb + h * ksh + j * kst + d] (d contiguous); values alike.
 * segments: [B, H, sets, k] int64, contiguous; sets = 1 (shared by the group) or G (one per query head).
 * valid:    NULL, or [B, H, sets, k] uint8, contiguous: each set attends only its listed segments flagged
 *           non-zero (a budget allocation gives heads different numbers of segments).
 * layout:   sinks [0, sink_end), segment i = [sink_end + i * seg_size, + seg_size) clipped at tail_start,
 *           tail [tail_start, length).
 * softcap:  <= 0 for none. out: [B, H, G, D] float32, contiguous.
 * lse:      NULL, or [B, H, G] float32: each query head's log sum of exp(logit) over its attended tokens
 *           (the output's normaliser, so a caller can merge it with more tokens by log-sum-exp).
 */
int sa_segment_attention(const float *q, const void *keys, const void *values, int dtype, int64_t ksb, int64_t ksh,
                         int64_t kst, int64_t vsb, int64_t vsh, int64_t vst, int64_t B, int64_t H, int64_t G,
                         int64_t D, const int64_t *segments, const uint8_t *valid, int64_t sets, int64_t k,
                         int64_t sink_end, int64_t seg_size, int64_t n_segments, int64_t tail_start, int64_t length,
                         float scale, float softcap, float *out, float *lse, int threads) {
    if (dtype != SA_F32 && dtype != SA_BF16 && !(dtype == SA_F16 && sa_float16_supported())) return SA_BAD_DTYPE;
    if (G > SA_MAX_ROWS) return SA_TOO_MANY_ROWS;
    /* at most: the sinks, one per distinct listed segment, the tail (sized by the listing, not the grid: a
     * grid-sized array per row was a megabyte to allocate at 128k for a few hundred spans) */
    const int64_t rows = B * H, max_spans = (sets * k < n_segments ? sets * k : n_segments) + 2;
    const size_t esize = dtype == SA_F32 ? 4 : 2;
    int status = SA_OK;
    sa_span *spans = malloc((size_t)rows * max_spans * sizeof(sa_span));
    int64_t *n_spans = malloc((size_t)rows * sizeof(int64_t));
    int64_t *tokens = malloc((size_t)rows * sizeof(int64_t));
    uint64_t *mask = calloc((size_t)(n_segments > 0 ? n_segments : 1), sizeof(uint64_t));
    int64_t *listed = malloc((size_t)(sets * k > 0 ? sets * k : 1) * sizeof(int64_t));
    if (!spans || !n_spans || !tokens || !mask || !listed) status = SA_NO_MEMORY;

    /* 1. spans and token counts per row */
    for (int64_t r = 0; r < rows && status == SA_OK; ++r) {
        sa_span *sp = spans + r * max_spans;
        int64_t n = row_spans(segments + r * sets * k, valid ? valid + r * sets * k : NULL, sets, k, G, sink_end,
                              seg_size, n_segments, tail_start, length, mask, listed, sp);
        if (n < 0) {
            status = SA_BAD_SEGMENT;
            break;
        }
        n_spans[r] = n;
        tokens[r] = 0;
        for (int64_t i = 0; i < n; ++i) tokens[r] += sp[i].end - sp[i].start;
    }
    free(mask);
    free(listed);

    /* 2. parts: about four per thread overall, none smaller than SA_MIN_PART tokens */
    int64_t want = (4 * (int64_t)threads + rows - 1) / rows, n_parts = 0;
    sa_part *parts = NULL;
    if (status == SA_OK) {
        parts = malloc((size_t)(rows * (want > 0 ? want : 1)) * sizeof(sa_part));
        if (!parts) status = SA_NO_MEMORY;
    }
    int64_t *first_part = malloc((size_t)(rows + 1) * sizeof(int64_t));
    if (!first_part) status = SA_NO_MEMORY;
    for (int64_t r = 0; r < rows && status == SA_OK; ++r) {
        int64_t p = tokens[r] / SA_MIN_PART;
        p = p < 1 ? 1 : (p > want ? want : p);
        first_part[r] = n_parts;
        for (int64_t i = 0; i < p; ++i) parts[n_parts++] = (sa_part){r, tokens[r] * i / p, tokens[r] * (i + 1) / p};
    }
    if (status == SA_OK) first_part[rows] = n_parts;

    float *pm = NULL, *pl = NULL, *pacc = NULL;
    if (status == SA_OK) {
        pm = malloc((size_t)(n_parts * G) * sizeof(float));
        pl = malloc((size_t)(n_parts * G) * sizeof(float));
        pacc = malloc((size_t)(n_parts * G * D) * sizeof(float));
        if (!pm || !pl || !pacc) status = SA_NO_MEMORY;
    }

    /* 3. each part: an online softmax over its tokens */
    const sa_block_fn attend = D == 64 ? attend_block_64 : D == 128 ? attend_block_128 : attend_block_any;
    if (status == SA_OK) {
#pragma omp parallel num_threads(threads)
        {
            float *qs = malloc((size_t)(G * D) * sizeof(float));
            float *s = malloc((size_t)(G * SA_BLOCK) * sizeof(float));
            float *kbuf = esize == 4 ? NULL : malloc((size_t)(SA_BLOCK * D) * sizeof(float));
            float *vbuf = esize == 4 ? NULL : malloc((size_t)(SA_BLOCK * D) * sizeof(float));
            int ok = qs && s && (esize == 4 || (kbuf && vbuf));
            if (!ok) {
#pragma omp atomic write
                status = SA_NO_MEMORY;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_parts; ++it) {
                if (!ok) continue;
                const sa_part part = parts[it];
                const int64_t r = part.row, b = r / H, h = r % H;
                const float *qr = q + r * G * D;
                for (int64_t i = 0; i < G * D; ++i) qs[i] = qr[i] * scale;
                float *m = pm + it * G, *l = pl + it * G, *acc = pacc + it * G * D;
                for (int64_t g = 0; g < G; ++g) m[g] = SA_NO_SCORE, l[g] = 0.f;
                memset(acc, 0, (size_t)(G * D) * sizeof(float));
                const char *kr = (const char *)keys + (b * ksb + h * ksh) * esize;
                const char *vr = (const char *)values + (b * vsb + h * vsh) * esize;
                const sa_span *sp = spans + r * max_spans;
                int64_t before = 0; /* tokens of the row's spans before span i */
                for (int64_t i = 0; i < n_spans[r]; ++i) {
                    int64_t len = sp[i].end - sp[i].start;
                    int64_t lo = part.first > before ? part.first - before : 0;
                    int64_t hi = part.last - before < len ? part.last - before : len;
                    for (int64_t j0 = lo; j0 < hi; j0 += SA_BLOCK) {
                        int n = (int)(hi - j0 < SA_BLOCK ? hi - j0 : SA_BLOCK);
                        /* The block after this one (in this span or the next): its rows are asked for one per
                         * row computed here. Spans are scattered and short; spreading the requests keeps the
                         * misses in flight steady (faster than asking for a whole span at its start). */
                        int64_t next = -1, next_n = 0;
                        if (j0 + SA_BLOCK < hi) {
                            next = sp[i].start + j0 + SA_BLOCK, next_n = hi - j0 - SA_BLOCK;
                        } else if (i + 1 < n_spans[r] && before + len < part.last) {
                            next = sp[i + 1].start, next_n = sp[i + 1].end - sp[i + 1].start;
                            if (next_n > part.last - before - len) next_n = part.last - before - len;
                        }
                        const sa_ahead ahead = {
                            kr + (next < 0 ? 0 : next) * kst * (int64_t)esize, vr + (next < 0 ? 0 : next) * vst * (int64_t)esize,
                            kst * (int64_t)esize, vst * (int64_t)esize, (int)(next_n < SA_BLOCK ? next_n : SA_BLOCK), (int)(D * esize)};
                        int64_t kstride, vstride;
                        const float *kb = load_rows(kr, dtype, kst, sp[i].start + j0, n, (int)D, kbuf, &kstride);
                        const float *vb = load_rows(vr, dtype, vst, sp[i].start + j0, n, (int)D, vbuf, &vstride);
                        attend(qs, (int)D, sp[i].heads, kb, kstride, vb, vstride, n, softcap, m, l, acc, s, &ahead);
                    }
                    before += len;
                    if (before >= part.last) break;
                }
            }
            free(qs);
            free(s);
            free(kbuf);
            free(vbuf);
        }
    }

    /* 4. merge a row's parts by log-sum-exp */
    if (status == SA_OK) {
        for (int64_t r = 0; r < rows && status == SA_OK; ++r) {
            for (int64_t g = 0; g < G; ++g) {
                float top = SA_NO_SCORE, norm = 0.f;
                for (int64_t p = first_part[r]; p < first_part[r + 1]; ++p) top = pm[p * G + g] > top ? pm[p * G + g] : top;
                float *o = out + (r * G + g) * D;
                memset(o, 0, (size_t)D * sizeof(float));
                for (int64_t p = first_part[r]; p < first_part[r + 1]; ++p) {
                    float w = expf(pm[p * G + g] - top);
                    norm += w * pl[p * G + g];
                    const float *a = pacc + (p * G + g) * D;
                    for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
                }
                if (!(norm > 0.f)) {
                    status = SA_EMPTY_HEAD;
                    break;
                }
                float inv = 1.f / norm;
                for (int64_t d = 0; d < D; ++d) o[d] *= inv;
                if (lse) lse[r * G + g] = top + logf(norm);
            }
        }
    }
    free(spans);
    free(n_spans);
    free(tokens);
    free(parts);
    free(first_part);
    free(pm);
    free(pl);
    free(pacc);
    return status;
}

/* Logits of a block of n keys for `rows` query rows: s[r * SA_BLOCK + j] = factor * q_r . k_j. Key-major:
 * each key row is read once for every query row while it sits in L1. With pf, row j of the block at pf
 * (rows pf_stride bytes apart, pf_bytes long) is prefetched beside key j. Compiled for the common head dims
 * (a constant D unrolls and vectorises without a loop-carried horizontal sum per element). */
#define SA_DEFINE_BLOCK_LOGITS(NAME, DIM)                                                                       \
    static void NAME(const float *restrict qr, int rows, const float *restrict kb, int64_t stride, int n,       \
                     int D_, float factor, float *restrict s, const char *pf, int64_t pf_stride, int pf_bytes) { \
        const int D = DIM > 0 ? DIM : D_;                                                                      \
        for (int j = 0; j < n; ++j) {                                                                          \
            const float *kj = kb + j * stride;                                                                 \
            if (pf)                                                                                            \
                for (int off = 0; off < pf_bytes; off += 64) __builtin_prefetch(pf + j * pf_stride + off, 0, 1); \
            for (int r = 0; r < rows; ++r) {                                                                   \
                const float *qv = qr + (int64_t)r * D;                                                         \
                float dot = 0.f;                                                                               \
                for (int d = 0; d < D; ++d) dot += qv[d] * kj[d];                                              \
                s[r * SA_BLOCK + j] = dot * factor;                                                            \
            }                                                                                                  \
        }                                                                                                      \
    }

SA_DEFINE_BLOCK_LOGITS(block_logits_64, 64)
SA_DEFINE_BLOCK_LOGITS(block_logits_128, 128)
SA_DEFINE_BLOCK_LOGITS(block_logits_any, 0)

/*
 * Exact log attention masses of listed segments (the rerank of sparseattn.summaries.Rerank):
 * out[b, h, r, i] = log sum_{j in segment segments[b, h, set(r), i]} exp(factor * q[b, h, r] . k_j),
 * the keys read in place. set(r) = 0 when sets == 1 (one list shared by the R query rows: each
 * segment's keys are read once for all of them), else r.
 *
 * q: [B, H, R, D] float32 contiguous; key (b, h, segment s, token j, d) at
 * keys[b * ksb + h * ksh + s * kss + j * kst + d]; segments: [B, H, sets, m] int64 contiguous;
 * out: [B, H, R, m] float32 contiguous.
 */
int sa_segment_log_mass(const float *q, const void *keys, int dtype, int64_t ksb, int64_t ksh, int64_t kss, int64_t kst,
                        int64_t B, int64_t H, int64_t R, int64_t D, const int64_t *segments, int64_t sets, int64_t m,
                        int64_t seg_size, int64_t n_segments, float factor, float *out, int threads) {
    if (dtype != SA_F32 && dtype != SA_BF16 && !(dtype == SA_F16 && sa_float16_supported())) return SA_BAD_DTYPE;
    if (R > SA_MAX_ROWS) return SA_TOO_MANY_ROWS;
    const size_t esize = dtype == SA_F32 ? 4 : 2;
    const int64_t items = B * H * sets * m;
    int status = SA_OK;
#pragma omp parallel num_threads(threads)
    {
        float *kbuf = esize == 4 ? NULL : malloc((size_t)(SA_BLOCK * D) * sizeof(float));
        if (esize != 4 && !kbuf) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 8)
        for (int64_t it = 0; it < items; ++it) {
            if (esize != 4 && !kbuf) continue;
            const int64_t i = it % m, set = (it / m) % sets, h = (it / (m * sets)) % H, b = it / (m * sets * H);
            const int64_t seg = segments[it];
            if (seg < 0 || seg >= n_segments) {
#pragma omp atomic write
                status = SA_BAD_SEGMENT;
                continue;
            }
            const int64_t r0 = sets == 1 ? 0 : set, rows = sets == 1 ? R : 1;
            const char *base = (const char *)keys + (b * ksb + h * ksh + seg * kss) * esize;
            /* The next item's segment is scattered and, when short, would end before the hardware prefetcher
             * ramped up on it: its rows are asked for one per key computed here (spread over the item, so
             * the misses in flight stay steady: 1.5x faster than asking for the whole segment at once). */
            const char *pf = NULL;
            if (it + 1 < items) {
                const int64_t next = segments[it + 1];
                const int64_t nh = ((it + 1) / (m * sets)) % H, nb = (it + 1) / (m * sets * H);
                if (next >= 0 && next < n_segments) pf = (const char *)keys + (nb * ksb + nh * ksh + next * kss) * esize;
            }
            const float *qr = q + ((b * H + h) * R + r0) * D;
            float top[SA_MAX_ROWS], sum[SA_MAX_ROWS], s[SA_MAX_ROWS * SA_BLOCK];
            for (int64_t r = 0; r < rows; ++r) top[r] = SA_NO_SCORE, sum[r] = 0.f;
            for (int64_t j0 = 0; j0 < seg_size; j0 += SA_BLOCK) {
                const int n = (int)(seg_size - j0 < SA_BLOCK ? seg_size - j0 : SA_BLOCK);
                int64_t stride;
                const float *kb = load_rows(base, dtype, kst, j0, n, (int)D, kbuf, &stride);
                const int64_t row = kst * (int64_t)esize; /* bytes between key rows */
                const char *pfb = pf ? pf + j0 * row : NULL;
                if (D == 128) block_logits_128(qr, (int)rows, kb, stride, n, (int)D, factor, s, pfb, row, (int)(D * esize));
                else if (D == 64) block_logits_64(qr, (int)rows, kb, stride, n, (int)D, factor, s, pfb, row, (int)(D * esize));
                else block_logits_any(qr, (int)rows, kb, stride, n, (int)D, factor, s, pfb, row, (int)(D * esize));
                for (int64_t r = 0; r < rows; ++r) {
                    const float *sr = s + r * SA_BLOCK;
                    float block_top = SA_NO_SCORE, block_sum = 0.f;
                    for (int j = 0; j < n; ++j) block_top = sr[j] > block_top ? sr[j] : block_top;
                    const float new_top = top[r] > block_top ? top[r] : block_top;
                    for (int j = 0; j < n; ++j) block_sum += expf(sr[j] - new_top);
                    sum[r] = sum[r] * expf(top[r] - new_top) + block_sum;
                    top[r] = new_top;
                }
            }
            for (int64_t r = 0; r < rows; ++r) out[((b * H + h) * R + r0 + r) * m + i] = top[r] + logf(sum[r]);
        }
        free(kbuf);
    }
    return status;
}

/*
 * The merged rest (sparseattn.methods.rest.MergedRest) added to a selection's attention, in place: the
 * torch form and its documentation are sparseattn.methods.rest.add_merged_rest, the float64 reference
 * merged_attention_ref. Per query head, block b of `per_block` segments enters the softmax as one token
 * with logit log m_b + cap(scale q . (K_b - A_b) / m_b) and value (V_b - W_b) / m_b, where K_b, V_b are the
 * block's key and value sums, A_b, W_b the sums of the head's attended segments in it and m_b its tokens
 * left out. Only the attended segments' sums are read (one row of seg_kv each), never their tokens.
 *
 * Needs every segment whole below the tail (the window reaches into no segment); the caller checks that.
 * q: [B, H, G, D] float32; out: [B, H, G, D] float32, the selection's attention, overwritten with the
 * merged one; lse: [B, H, G] float32 the selection's log-sum-exp (sa_segment_attention's);
 * segments, valid: as sa_segment_attention (valid may be NULL); seg_kv: [B, H, n_segments, 2 D] float32,
 * each segment's key sum then value sum, rows contiguous, row (b, h, s) at seg_kv + b * kvsb + h * kvsh + s * 2 D
 * (a view of a capacity buffer is read in place); block_k, block_v: [B, H, n_blocks, D] float64, rows
 * contiguous, row (b, h, i) at block_k + b * bksb + h * bksh + i * D (block_v likewise). q, out, lse,
 * segments and valid are contiguous.
 */
#define SA_REST_AHEAD 16 /* rows asked for ahead of use: a row's few dot products take less than a miss's latency */

int sa_merged_rest(const float *q, float *out, const float *lse, const int64_t *segments, const uint8_t *valid,
                   int64_t sets, int64_t w, const float *seg_kv, int64_t kvsb, int64_t kvsh, const double *block_k,
                   int64_t bksb, int64_t bksh, const double *block_v, int64_t bvsb, int64_t bvsh, int64_t B,
                   int64_t H, int64_t G, int64_t D, int64_t n_segments, int64_t seg_size, int64_t per_block,
                   float scale, float softcap, int threads) {
    if (per_block < 1) return SA_BAD_BLOCK;
    const int64_t rows = B * H, n = (n_segments + per_block - 1) / per_block;
    if (n == 0) return SA_OK;
    int status = SA_OK;
#pragma omp parallel num_threads(threads)
    {
        /* per query head and block: q . A_b, then the weight p_b / m_b; tokens taken; the rest's value sum */
        double *q_taken = malloc((size_t)(G * n) * sizeof(double));
        double *taken = malloc((size_t)(G * n) * sizeof(double));
        double *rest_v = malloc((size_t)(G * D) * sizeof(double));
        double *first_w = malloc((size_t)G * sizeof(double)), *denom = malloc((size_t)G * sizeof(double));
        const int ok = q_taken && taken && rest_v && first_w && denom;
        if (!ok) {
#pragma omp atomic write
            status = SA_NO_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) {
            if (!ok) continue;
            const float *qr = q + r * G * D;
            const int64_t *sel = segments + r * sets * w;
            const uint8_t *flag = valid ? valid + r * sets * w : NULL;
            const float *kv = seg_kv + (r / H) * kvsb + (r % H) * kvsh;
            memset(q_taken, 0, (size_t)(G * n) * sizeof(double));
            memset(taken, 0, (size_t)(G * n) * sizeof(double));
            int bad = 0;
            for (int64_t j = 0; j < w && j < SA_REST_AHEAD; ++j)
                if (sel[j] >= 0 && sel[j] < n_segments)
                    for (int64_t off = 0; off < 2 * D; off += 16) __builtin_prefetch(kv + sel[j] * 2 * D + off, 0, 1);
            /* 1. what each head attends in each block: q . (the attended segments' key sums), and tokens.
             * Slot-major, so a listing shared by the group's heads reads each row once for all of them. */
            for (int64_t j = 0; j < w && !bad; ++j) {
                if (j + SA_REST_AHEAD < w) { /* a later slot's row, scattered: ask for it now */
                    const int64_t next = sel[j + SA_REST_AHEAD];
                    if (next >= 0 && next < n_segments)
                        for (int64_t off = 0; off < 2 * D; off += 16) __builtin_prefetch(kv + next * 2 * D + off, 0, 1);
                }
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t set = sets == 1 ? 0 : g, s = sel[set * w + j];
                    if (flag && !flag[set * w + j]) continue;
                    if (s < 0 || s >= n_segments) {
                        bad = 1;
                        break;
                    }
                    const float *ks = kv + s * 2 * D, *qv = qr + g * D;
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; ++d) dot += qv[d] * ks[d];
                    q_taken[g * n + s / per_block] += dot;
                    taken[g * n + s / per_block] += (double)seg_size;
                }
            }
            if (bad) {
#pragma omp atomic write
                status = SA_BAD_SEGMENT;
                continue;
            }
            /* 2. each block's merged token, joined to the selection's softmax by log-sum-exp */
            const double *bk = block_k + (r / H) * bksb + (r % H) * bksh, *bv = block_v + (r / H) * bvsb + (r % H) * bvsh;
            for (int64_t g = 0; g < G; ++g) {
                const float *qv = qr + g * D;
                double *wt = q_taken + g * n; /* becomes p_b / m_b (up to the common normaliser) */
                double top = lse[r * G + g];
                for (int64_t b = 0; b < n; ++b) {
                    const double count = (double)(b + 1 < n ? per_block : n_segments - (n - 1) * per_block) * seg_size;
                    const double m = count - taken[g * n + b];
                    if (m < 0.5) { /* nothing left out of this block */
                        wt[b] = 0.0, taken[g * n + b] = 0.0;
                        continue;
                    }
                    double dot = 0.0;
                    for (int64_t d = 0; d < D; ++d) dot += (double)qv[d] * bk[b * D + d];
                    double x = scale * (dot - wt[b]) / m;
                    if (softcap > 0.f) x = softcap * tanh(x / softcap);
                    wt[b] = x + log(m), taken[g * n + b] = m;
                    top = wt[b] > top ? wt[b] : top;
                }
                first_w[g] = exp(lse[r * G + g] - top), denom[g] = first_w[g];
                double *rv = rest_v + g * D;
                memset(rv, 0, (size_t)D * sizeof(double));
                for (int64_t b = 0; b < n; ++b) {
                    if (taken[g * n + b] == 0.0) {
                        wt[b] = 0.0;
                        continue;
                    }
                    const double p = exp(wt[b] - top);
                    denom[g] += p, wt[b] = p / taken[g * n + b];
                    for (int64_t d = 0; d < D; ++d) rv[d] += wt[b] * bv[b * D + d];
                }
            }
            /* 3. less the attended segments' value sums, weighted by their block's p_b / m_b (rows now cached) */
            for (int64_t j = 0; j < w; ++j) {
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t set = sets == 1 ? 0 : g, s = sel[set * w + j];
                    if (flag && !flag[set * w + j]) continue;
                    const double c = q_taken[g * n + s / per_block];
                    if (c == 0.0) continue;
                    const float *vs = kv + s * 2 * D + D;
                    double *rv = rest_v + g * D;
                    for (int64_t d = 0; d < D; ++d) rv[d] -= c * vs[d];
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float *o = out + (r * G + g) * D;
                const double *rv = rest_v + g * D;
                for (int64_t d = 0; d < D; ++d) o[d] = (float)((first_w[g] * o[d] + rv[d]) / denom[g]);
            }
        }
        free(q_taken);
        free(taken);
        free(rest_v);
        free(first_w);
        free(denom);
    }
    return status;
}
