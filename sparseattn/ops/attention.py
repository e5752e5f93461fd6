"""Decode attention over a segment selection, and its dense-mask reference.

Shapes: queries are grouped by KV head, ``q: [B, H_kv, G, D]`` (query head ``h`` uses KV head
``h // G``, as transformers' ``repeat_kv`` does); ``keys, values: [B, H_kv, t, D]``;
``segments: [B, H_kv, G', k]`` with ``G' = G`` (one selection per query head) or ``G' = 1``
(one selection shared by the KV group).
"""

from __future__ import annotations

import torch

from sparseattn.ops.layout import SegmentLayout


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax run in float32 (float64 when the inputs are float64): fp16/bf16 never overflow."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_positions(layout: SegmentLayout, segments: torch.Tensor) -> torch.Tensor:
    """Token positions of the selected segments: ``[..., k] -> [..., k, segment_size]``."""
    offsets = torch.arange(layout.segment_size, device=segments.device)
    return layout.sink_end + segments.unsqueeze(-1) * layout.segment_size + offsets


def segment_mask(layout: SegmentLayout, segments: torch.Tensor, group: int) -> torch.Tensor:
    """The attended set as a dense boolean mask ``[B, H_kv, G, t]`` (for tests and pictures)."""
    B, H, _, _ = segments.shape
    pos = torch.arange(layout.length, device=segments.device)
    selected = torch.zeros(B, H, segments.shape[2], layout.length, dtype=torch.bool, device=segments.device)
    if segments.shape[-1] > 0:
        selected.scatter_(-1, segment_positions(layout, segments).flatten(-2), True)
    always = (pos < layout.sink_end) | (pos >= layout.tail_start)
    return (always | (selected & (pos < layout.tail_start))).expand(B, H, group, layout.length)


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's logit soft-capping ``softcap * tanh(logits / softcap)`` (identity when ``softcap`` is None)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Naive softmax attention in float64 over the tokens where ``mask`` is True.

    Args:
        q: ``[B, H_kv, G, D]``; keys, values: ``[B, H_kv, t, D]``; mask: ``[B, H_kv, G, t]`` bool or None.
        softcap: optional logit soft-capping, applied after scaling.
    Returns:
        ``[B, H_kv, G, D]`` float64.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = soft_cap(torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * scale, softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhgt,bhtd->bhgd", torch.softmax(logits, dim=-1), values.double())


def segment_attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference for :func:`segment_attention`: materialise the mask, then run dense float64 attention."""
    mask = segment_mask(layout, segments, q.shape[2])
    return attention_ref(q, keys[:, :, : layout.length], values[:, :, : layout.length], mask, scale, softcap)


def segment_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: SegmentLayout,
    segments: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one decode query over sinks, the selected segments and the tail.

    Reads only the attended tokens: O(sinks + k * segment_size + tail) work, whatever ``t`` is.
    Segment indices must be distinct and in ``[0, n_segments)`` (the decode state checks this).
    The selected segments' keys and values are gathered (a copy of the selected tokens only);
    logits of the three parts are softmaxed jointly, so no partial-state merge is needed.

    ``softcap`` applies Gemma-2's logit soft-capping after scaling.

    Returns ``[B, H_kv, G, D]`` in the compute dtype (float32, or float64 for float64 inputs).

    Example (full selection equals dense attention):
        >>> from sparseattn.ops.layout import SegmentLayout
        >>> q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
        >>> lay = SegmentLayout(length=10, sinks=1, segment_size=3, n_segments=3)
        >>> out = segment_attention(q, k, v, lay, torch.arange(3).view(1, 1, 1, 3))
        >>> torch.allclose(out.double(), attention_ref(q, k, v), atol=1e-6)
        True
    """
    B, H, G, D = q.shape
    cd = compute_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    # Everything is a 3-D bmm over rows = (batch, KV head[, selection group]): one GEMM with the
    # group's query heads as M where tokens are shared, a matrix-vector product per head otherwise.
    q_kv = (q.to(cd) * scale).reshape(B * H, G, D)
    logits: list[torch.Tensor] = []  # each [B*H, G, L]
    vals: list[torch.Tensor] = []  # each [B*H*G'', L, D] with the matching query rows

    def dense_part(start: int, end: int) -> None:
        if end > start:
            k_part = keys[:, :, start:end].to(cd).reshape(B * H, end - start, D)
            logits.append(soft_cap(torch.bmm(q_kv, k_part.transpose(1, 2)), softcap))
            vals.append(values[:, :, start:end].to(cd).reshape(B * H, end - start, D))

    if segments.shape[2] not in (1, G):
        raise ValueError(f"segments must have 1 or {G} selections per KV head, got shape {tuple(segments.shape)}")
    dense_part(0, layout.sink_end)
    n_sel = segments.shape[-1]
    if n_sel > 0 and layout.n_segments > 0:
        c = layout.segment_size
        shared = segments.shape[2]
        rows = G // shared  # query heads per selection
        seg_k = keys[:, :, layout.sink_end : layout.segment_end].view(B, H, layout.n_segments, c, D)
        seg_v = values[:, :, layout.sink_end : layout.segment_end].view(B, H, layout.n_segments, c, D)
        b_idx = torch.arange(B, device=q.device).view(B, 1, 1)
        h_idx = torch.arange(H, device=q.device).view(1, H, 1)
        flat = segments.reshape(B, H, shared * n_sel)
        k_sel = seg_k[b_idx, h_idx, flat].to(cd).reshape(B * H * shared, n_sel * c, D)
        v_sel = seg_v[b_idx, h_idx, flat].to(cd).reshape(B * H * shared, n_sel * c, D)
        sel_logits = soft_cap(torch.bmm(q_kv.reshape(B * H * shared, rows, D), k_sel.transpose(1, 2)), softcap)
        beyond = segment_positions(layout, segments).reshape(B * H * shared, 1, n_sel * c) >= layout.tail_start
        logits.append(sel_logits.masked_fill(beyond, float("-inf")).reshape(B * H, G, n_sel * c))
        vals.append(v_sel)
    dense_part(layout.tail_start, layout.length)
    if not logits:
        raise ValueError(f"nothing to attend: the layout {layout} holds no token")

    weights = torch.softmax(torch.cat(logits, dim=-1), dim=-1)  # [B*H, G, total]
    out = torch.zeros(B * H, G, D, dtype=cd, device=q.device)
    start = 0
    for part_logits, part_values in zip(logits, vals):
        n = part_logits.shape[-1]
        w = weights[..., start : start + n]
        rows = G * B * H // part_values.shape[0]
        out += torch.bmm(w.reshape(part_values.shape[0], rows, n), part_values).reshape(B * H, G, D)
        start += n
    return out.reshape(B, H, G, D)


# Query rows per chunk in block attention: bounds the [B, H, rows, L] logits of the math path.
_BLOCK_ROWS = 512


def causal_block_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Reference for :func:`causal_block_attention`, in float64 with an explicit mask.

    ``q: [B, H_kv, G, T, D]`` are the queries of the last ``T`` of the ``L`` stored tokens
    ``keys, values: [B, H_kv, L, D]``; query ``i`` sees keys ``[0, L - T + i]``. Returns float64.
    """
    T, L = q.shape[-2], keys.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = soft_cap(torch.einsum("bhgtd,bhld->bhgtl", q.double(), keys.double()) * scale, softcap)
    visible = torch.arange(L).view(1, L) <= (L - T + torch.arange(T)).view(T, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhgtl,bhld->bhgtd", torch.softmax(logits, dim=-1), values.double())


def causal_block_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Dense causal attention of a block of new queries over everything stored (prefill, chunked prefill).

    ``q: [B, H_kv, G, T, D]`` belong to the last ``T`` of the ``L`` stored tokens ``keys, values:
    [B, H_kv, L, D]`` (bottom-right aligned: query ``i`` sees keys ``[0, L - T + i]``). Without soft-capping
    this is torch's SDPA in the input dtype, called the way transformers' ``sdpa`` attention calls it, so a
    one-block prefill gives the same numbers as the model's own dense path; a chunked prefill masks per
    chunk of query rows. With ``softcap`` it runs the math in float32. Returns ``[B, H_kv, G, T, D]`` in
    the input dtype.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
        >>> out = causal_block_attention(q, k, v)
        >>> torch.allclose(out.double(), causal_block_attention_ref(q, k, v), atol=1e-5)
        True
    """
    B, H, G, T, D = q.shape
    L = keys.shape[-2]
    if L < T:
        raise ValueError(f"causal_block_attention: {T} queries but only {L} stored tokens")
    scale = D**-0.5 if scale is None else scale
    flat_q = q.reshape(B, H * G, T, D)
    out = torch.empty_like(flat_q)
    if softcap is None and T == L:
        out = torch.nn.functional.scaled_dot_product_attention(
            flat_q, keys, values, is_causal=True, scale=scale, enable_gqa=G > 1
        )
        return out.view(B, H, G, T, D)
    cd = torch.float32 if q.dtype != torch.float64 else torch.float64
    for start in range(0, T, _BLOCK_ROWS):
        end = min(T, start + _BLOCK_ROWS)
        rows = torch.arange(start, end, device=q.device).view(-1, 1)
        visible = torch.arange(L, device=q.device).view(1, L) <= L - T + rows  # [rows, L]
        if softcap is None:
            out[:, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
                flat_q[:, :, start:end], keys, values, attn_mask=visible, scale=scale, enable_gqa=G > 1
            )
            continue
        qc = flat_q[:, :, start:end].to(cd).reshape(B, H, G * (end - start), D)
        logits = soft_cap(qc @ keys.to(cd).transpose(-1, -2) * scale, softcap)  # [B, H, G*rows, L]
        logits = logits.view(B, H, G, end - start, L).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(B, H, G * (end - start), L)
        out[:, :, start:end] = (probs @ values.to(cd)).view(B, H * G, end - start, D).to(q.dtype)
    return out.view(B, H, G, T, D)
