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


def segment_decode_kernel(
    Q, K, V, SEG, OUT, LSE,
    stride_qb, stride_qh, stride_qg, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_sb, stride_sh, stride_sg, stride_sk,
    stride_ob, stride_oh, stride_og, stride_os, stride_od,
    stride_lb, stride_lh, stride_lg, stride_ls,
    n_kv_heads, n_selections, rows, head_dim,
    sink_end, seg_size, n_sel, tail_start, n_virtual, tokens_per_split,
    scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One split of one (batch, KV head, selection): the ``rows`` query heads sharing that selection.

    Grid ``(B * H_kv * G', n_splits)``. Writes the split's normalised output ``OUT[b, h, g, split, :]``
    (float32) and the log-sum-exp of its logits ``LSE[b, h, g, split]`` (``-inf`` and a zero output
    when the split saw no token), for :func:`merge_partials_kernel`.
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
    sel_end = sink_end + n_sel * seg_size

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, n_virtual)
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
            # tanh from exp (libdevice is not available in the interpreter); |error| ~ softcap * 2^-24.
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -th, th)
        s = tl.where(valid[None, :], s, float("-inf"))

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
