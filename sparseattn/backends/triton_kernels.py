"""Triton kernels for segment-sparse decode: the split kernel and the log-sum-exp merge of splits.

Importing this module does not import triton (pytest's doctest collection imports every module,
and the first import of ``triton.language`` fixes whether triton interprets, see
:func:`sparseattn.backends.triton_backend.interpreting`). The functions are left undecorated and
their annotations stay strings (``tl.constexpr``, which triton accepts);
:func:`sparseattn.backends.triton_backend.kernels` binds ``tl`` and wraps them for the interpreter or
the compiler, whichever mode triton was imported in.

The attended tokens of one (batch, KV head, selection) are enumerated as one virtual sequence
``u in [0, n_virtual)``, ``n_virtual = sink_end + k * segment_size + tail``::

    u < sink_end                      -> position u                        (sinks)
    sink_end <= u < sel_end           -> sink_end + seg[slot] * c + offset (selected segment slot)
    sel_end <= u                      -> tail_start + (u - sel_end)        (tail)

so one block of ``BLOCK_N`` virtual tokens may span several segments (any segment size ``c``
packs the blocks densely, ``c = 1`` included) and the selected tokens are loaded straight from the
cache by segment index, never gathered into a copy. A selected token at or past ``tail_start`` is
masked out: the tail covers it.
"""

from __future__ import annotations

from types import ModuleType

#: ``triton.language``, bound by :func:`sparseattn.backends.triton_backend.kernels` before first use.
tl: ModuleType | None = None


def soft_cap_logits(s, softcap):
    """Gemma-2's ``softcap * tanh(s / softcap)``, tanh from ``exp`` (libdevice is not available in the
    interpreter); |error| ~ softcap * 2^-24."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -th, th)


def slot_logits(
    q, k_base, a_ptr, b_ptr, f_ptr, s_idx, offs_d, d_mask, last, n_slots,
    stride_ks, stride_kd, stride_ws, scale, softcap,
    WEIGHTED: tl.constexpr, HAS_FLOOR: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One block of slots for :func:`slot_attention_kernel`: ``(logits, live, a, b, f)``, float32.

    ``live[m, s]``: slot ``s`` exists, row ``m`` sees it (``s <= last[m]``) and, weighted, one of its
    weights is positive. Unweighted, ``a = b = 1``; without a floor, ``f = 0``.
    """
    s_mask = s_idx < n_slots
    kt = tl.load(
        k_base + s_idx[None, :] * stride_ks + offs_d[:, None] * stride_kd, mask=d_mask[:, None] & s_mask[None, :], other=0.0
    ).to(tl.float32)  # [BLOCK_D, BLOCK_S]
    s = tl.dot(q, kt, input_precision="ieee") * scale
    if HAS_SOFTCAP:
        s = soft_cap_logits(s, softcap)
    live = s_mask[None, :] & (s_idx[None, :] <= last[:, None])
    a = tl.full(s_idx.shape, 1.0, dtype=tl.float32)  # unweighted: a = b = 1, no floor
    bw = tl.full(s_idx.shape, 1.0, dtype=tl.float32)
    f = tl.zeros(s_idx.shape, dtype=tl.float32)
    if WEIGHTED:
        a = tl.load(a_ptr + s_idx * stride_ws, mask=s_mask, other=0.0).to(tl.float32)
        bw = tl.load(b_ptr + s_idx * stride_ws, mask=s_mask, other=0.0).to(tl.float32)
        alive = (a > 0.0) | (bw > 0.0)
        if HAS_FLOOR:
            f = tl.load(f_ptr + s_idx * stride_ws, mask=s_mask, other=0.0).to(tl.float32)
            alive = alive | (f > 0.0)
        live = live & alive[None, :]
    return s, live, a, bw, f


def segment_decode_kernel(
    Q, K, V, SEG, VALID, COUNT, OUT, LSE,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_sb, stride_sh, stride_sg, stride_sk,
    stride_fb, stride_fh, stride_fg, stride_fk,
    stride_ob, stride_oh, stride_og, stride_os, stride_od,
    stride_lb, stride_lh, stride_lg, stride_ls,
    n_kv_heads, n_selections, rows, head_dim,
    sink_end, seg_size, n_sel, tail_start, n_virtual, tokens_per_split,
    scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
    ROW_BITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One split of one (batch, KV head, selection): the ``rows`` query heads sharing that selection.

    Grid ``(B * H_kv * G', n_splits)``. Writes the split's normalised output ``OUT[b, h, g, split, :]``
    (float32) and the log-sum-exp of its logits ``LSE[b, h, g, split]`` (``-inf`` and a zero output
    when the split saw no token), for :func:`merge_partials_kernel`. ``MASKED``: listed segment ``i``
    is attended only where ``VALID[b, h, sel, i]`` is nonzero (a budget allocation lists more than a
    head attends); the others are not read. ``ROW_BITS`` (with ``MASKED``): ``VALID`` holds int32 bit sets
    instead, bit ``r`` for the selection's row ``r``: a listed segment is read once and attended by the rows
    whose bit is set (the union of a KV group's per-head selections, :func:`~sparseattn.backends.triton_backend.union_selection`),
    and only the first ``COUNT[b, h]`` listed segments are walked (the others carry no bit): the tail follows
    them in the virtual sequence. Without ``ROW_BITS`` ``COUNT`` is not read.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    sel = pid % n_selections
    bh = pid // n_selections
    # int64 base offsets: B * H_kv * t_cap * D overflows int32 for long contexts.
    h = (bh % n_kv_heads).to(tl.int64)
    b = (bh // n_kv_heads).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g = sel * rows + offs_g
    g_mask = offs_g < rows
    d_mask = offs_d < head_dim

    # All query heads of the selection in one tile, so each K/V block is loaded once for all of them.
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    seg_base = SEG + b * stride_sb + h * stride_sh + sel * stride_sg
    valid_base = VALID + b * stride_fb + h * stride_fh + sel * stride_fg
    if ROW_BITS:  # the union's segments in use: the virtual sequence ends earlier by the unused ones
        n_used = tl.load(COUNT + b * n_kv_heads + h)
    else:
        n_used = n_sel
    sel_end = sink_end + n_used * seg_size
    n_live = n_virtual - (n_sel - n_used) * seg_size

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, n_live)
    for start in range(lo, hi, BLOCK_N):
        u = start + offs_n
        in_sel = (u >= sink_end) & (u < sel_end)
        v_off = tl.where(in_sel, u - sink_end, 0)
        slot = v_off // seg_size
        seg = tl.load(seg_base + slot * stride_sk, mask=in_sel, other=0)
        pos_sel = sink_end + seg * seg_size + (v_off - slot * seg_size)
        pos = tl.where(u < sink_end, u, tl.where(in_sel, pos_sel, tail_start + (u - sel_end))).to(tl.int64)
        # sinks lie before tail_start, tail tokens past sel_end: only selected tokens can be cut.
        valid = (u < hi) & ((pos < tail_start) | (u >= sel_end))
        if MASKED:
            if ROW_BITS:  # int32 bit sets; the sinks and the tail: every row
                flagged = tl.load(valid_base + slot * stride_fk, mask=in_sel, other=-1)
            else:
                flagged = tl.load(valid_base + slot * stride_fk, mask=in_sel, other=1)
            valid = valid & (flagged != 0)
        # Which rows attend each token: all of them, or (ROW_BITS) those whose bit its segment carries.
        if ROW_BITS:
            row_ok = ((flagged[None, :] >> offs_g[:, None]) & 1) != 0
        else:
            row_ok = offs_g[:, None] >= 0

        kt = tl.load(
            k_base + pos[None, :] * stride_kt + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & valid[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, kt, input_precision="ieee")  # fp16/bf16 use tensor cores; fp32 stays exact
        s = s * scale
        if HAS_SOFTCAP:
            s = soft_cap_logits(s, softcap)
        s = tl.where(valid[None, :] & row_ok, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no valid token yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_base + pos[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptr = OUT + b * stride_ob + h * stride_oh + g[:, None] * stride_og + split * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptr, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + g * stride_lg + split * stride_ls, lse, mask=g_mask)


def merge_partials_kernel(
    OUTS, LSES, OUT, LSE_OUT,
    stride_or, stride_os, stride_od,
    stride_lr, stride_ls,
    stride_xr, stride_xd,
    stride_yr,
    n_splits, head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the ``n_splits`` states of one row by log-sum-exp. Grid ``(rows,)``.

    ``OUTS: [R, S, D]``, ``LSES: [R, S]`` -> ``OUT: [R, D]``, ``LSE_OUT: [R]`` (float32). A state with
    ``lse = -inf`` is skipped without reading its output.
    """
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < n_splits
    d_mask = offs_d < head_dim
    lse = tl.load(LSES + r * stride_lr + offs_s * stride_ls, mask=s_mask, other=float("-inf")).to(tl.float32)
    seen = lse > float("-inf")
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(seen, tl.exp(lse - m_safe), 0.0)
    total = tl.sum(w, axis=0)
    o = tl.load(
        OUTS + r * stride_or + offs_s[:, None] * stride_os + offs_d[None, :] * stride_od,
        mask=(s_mask & seen)[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + r * stride_xr + offs_d * stride_xd, out, mask=d_mask)
    tl.store(LSE_OUT + r * stride_yr, tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf")))


def segment_log_mass_kernel(
    Q, K, IDX, OUT,
    stride_qb, stride_qh, stride_qr, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kc, stride_kd,
    stride_ib, stride_ih, stride_ir, stride_im,
    stride_ob, stride_oh, stride_or, stride_om,
    n_heads, n_lists, rows, n_segments, seg_size, head_dim, n_listed,
    factor,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SEGS: tl.constexpr,
):  # fmt: skip
    """``logsumexp_{j in segment} q . (factor k_j)`` of listed segments for the ``rows`` query rows of their list.

    Grid ``(B * H * R', ceil(m / SEGS))``: program ``(list, p)`` takes the list's slots ``p SEGS`` to
    ``p SEGS + SEGS - 1`` below ``n_listed = m`` (unrolled: their key loads are in flight together, and the
    query rows are loaded once for them), reads the ``c`` keys of each segment ``IDX[b, h, list, slot]``
    once (in place, through the cache's strides) for every row the list serves (all ``R`` rows of a shared
    list, ``R' = 1``; row ``list`` alone otherwise) and writes ``OUT[b, h, row, slot]`` (float32). An index
    outside ``[0, n_segments)`` reads nothing and writes NaN: a wrong list shows, it is never a read out of
    bounds.

    The logits are float32 products summed over the head dim (``[rows, c, d]`` in registers), not a
    ``tl.dot``: a float32 dot runs on the FMA units through shared memory, and with a handful of rows
    it made this kernel 7x slower than the attention that follows it (an H200, 128k tokens, batch 8).
    """
    pid = tl.program_id(0)
    first = tl.program_id(1) * SEGS
    lst = pid % n_lists
    bh = pid // n_lists
    h = (bh % n_heads).to(tl.int64)
    b = (bh // n_heads).to(tl.int64)

    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    r = lst * rows + offs_r  # the query rows this list serves: lst * rows + i, i < rows
    r_mask = offs_r < rows
    d_mask = offs_d < head_dim
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + r[:, None] * stride_qr + offs_d[None, :] * stride_qd,
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32) * factor  # [BLOCK_R, BLOCK_D]
    for i in tl.static_range(SEGS):
        slot = first + i
        listed = slot < n_listed
        at = tl.minimum(slot, n_listed - 1)  # a slot past the list reads the last listed index, and stores nothing
        seg = tl.load(IDX + b * stride_ib + h * stride_ih + lst * stride_ir + at * stride_im).to(tl.int64)
        in_range = (seg >= 0) & (seg < n_segments)
        k_base = K + b * stride_kb + h * stride_kh + tl.where(in_range, seg, 0) * stride_ks
        n_read = tl.where(in_range & listed, seg_size, 0)  # a bad index, or a slot past the list, reads no key

        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, seg_size, BLOCK_C):
            c = start + offs_c
            c_mask = c < n_read
            k = tl.load(
                k_base + c[:, None] * stride_kc + offs_d[None, :] * stride_kd,
                mask=c_mask[:, None] & d_mask[None, :],
                other=0.0,
            ).to(tl.float32)  # [BLOCK_C, BLOCK_D], the head dim contiguous
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_R, BLOCK_C]
            s = tl.where(c_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        lse = tl.where(in_range, lse, float("nan"))
        tl.store(OUT + b * stride_ob + h * stride_oh + r * stride_or + at * stride_om, lse, mask=r_mask & (offs_r * 0 + slot < n_listed))


def bound_scores_kernel(
    Q, LOW, HIGH, OUT,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_lb, stride_lh, stride_ls, stride_ld,
    stride_hb, stride_hh, stride_hs, stride_hd,
    stride_ob, stride_oh, stride_og, stride_os,
    n_heads, rows, n_segments, head_dim,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Quest's bound ``sum_i max(q_i low_i, q_i high_i)`` of ``BLOCK_S`` segments for a KV group's query rows.

    Grid ``(B * H, cdiv(S, BLOCK_S))``. Since ``high >= low`` channel by channel, the bound is
    ``max(q, 0) . high + min(q, 0) . low``, each summary row read once for the group's rows (float32
    products summed over the head dim in registers; a float32 ``tl.dot`` ran 5x slower on an H200).
    Writes ``OUT[b, h, g, s]`` (float32).
    """
    bh = tl.program_id(0)
    block = tl.program_id(1)
    h = (bh % n_heads).to(tl.int64)
    b = (bh // n_heads).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < rows
    s_mask = offs_s < n_segments
    d_mask = offs_d < head_dim
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    tile = s_mask[:, None] & d_mask[None, :]
    high = tl.load(
        HIGH + b * stride_hb + h * stride_hh + offs_s[:, None] * stride_hs + offs_d[None, :] * stride_hd, mask=tile, other=0.0
    ).to(tl.float32)  # [BLOCK_S, BLOCK_D], the head dim contiguous
    low = tl.load(
        LOW + b * stride_lb + h * stride_lh + offs_s[:, None] * stride_ls + offs_d[None, :] * stride_ld, mask=tile, other=0.0
    ).to(tl.float32)
    positive = tl.maximum(q, 0.0)[:, None, :]
    negative = tl.minimum(q, 0.0)[:, None, :]
    bound = tl.sum(positive * high[None, :, :] + negative * low[None, :, :], axis=2)  # [BLOCK_G, BLOCK_S]
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_g[:, None] * stride_og + offs_s[None, :] * stride_os,
        bound,
        mask=g_mask[:, None] & s_mask[None, :],
    )


def slot_attention_kernel(
    Q, K, V, A, BW, F, OUT, PROBS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_wb, stride_wh, stride_ws,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_pb, stride_ph, stride_pm, stride_ps,
    n_heads, n_rows, n_queries, n_slots, head_dim,
    scale, softcap,
    WEIGHTED: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Attention of ``BLOCK_M`` query rows of one (batch, KV head) over weighted slots, and its weights.

    Grid ``(B * H, cdiv(G * T, BLOCK_M))``; row ``m = g * T + t`` (query ``t`` of query head ``g``) sees
    slots ``[0, S - T + t]``. With ``e_s = exp(logit_s - max)`` over the live slots (weighted: ``a``,
    ``b`` or ``f`` > 0; unweighted: every visible slot)::

        OUT = sum_s e_s b_s v_s / den,  den = max(sum_s e_s a_s, sum_s e_s f_s),  PROBS = e_s a_s / den

    (``a = b = 1`` and no floor unweighted: the softmax). The first pass keeps the running max, the
    two sums and the numerator (online softmax, float32); the second recomputes each logit and writes
    the weights, so nothing of size ``S`` lives between the passes.
    """
    bh = tl.program_id(0)
    block = tl.program_id(1)
    h = (bh % n_heads).to(tl.int64)
    b = (bh // n_heads).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < n_rows
    d_mask = offs_d < head_dim
    last = n_slots - n_queries + offs_m % n_queries  # the last slot each row sees
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    w_off = b * stride_wb + h * stride_wh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    floor_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, n_slots, BLOCK_S):
        s_idx = start + offs_s
        s_mask = s_idx < n_slots
        s, live, a, bw, f = slot_logits(
            q, k_base, A + w_off, BW + w_off, F + w_off, s_idx, offs_d, d_mask, last, n_slots,
            stride_ks, stride_kd, stride_ws, scale, softcap, WEIGHTED, HAS_FLOOR, HAS_SOFTCAP,
        )  # fmt: skip
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        e = tl.where(live, tl.exp(s - m_safe[:, None]), 0.0)
        v = tl.load(
            v_base + s_idx[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=s_mask[:, None] & d_mask[None, :], other=0.0
        ).to(tl.float32)
        den_i = den_i * alpha + tl.sum(e * a[None, :], axis=1)
        acc = acc * alpha[:, None] + tl.dot(e * bw[None, :], v, input_precision="ieee")
        if HAS_FLOOR:
            floor_i = floor_i * alpha + tl.sum(e * f[None, :], axis=1)
        m_i = m_new
    if HAS_FLOOR:
        den_i = tl.maximum(den_i, floor_i)
    out = acc / den_i[:, None]  # 0/0 = NaN for a row with no live slot, as the torch op gives
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
        out,
        mask=m_mask[:, None] & d_mask[None, :],
    )
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    for start in range(0, n_slots, BLOCK_S):
        s_idx = start + offs_s
        s_mask = s_idx < n_slots
        s, live, a, bw, f = slot_logits(
            q, k_base, A + w_off, BW + w_off, F + w_off, s_idx, offs_d, d_mask, last, n_slots,
            stride_ks, stride_kd, stride_ws, scale, softcap, WEIGHTED, HAS_FLOOR, HAS_SOFTCAP,
        )  # fmt: skip
        p = tl.where(live, tl.exp(s - m_safe[:, None]), 0.0) * a[None, :] / den_i[:, None]
        tl.store(
            PROBS + b * stride_pb + h * stride_ph + offs_m[:, None] * stride_pm + s_idx[None, :] * stride_ps,
            p,
            mask=m_mask[:, None] & s_mask[None, :],
        )
