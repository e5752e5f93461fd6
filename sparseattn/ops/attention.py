"""Decode attention over a segment selection, and its dense-mask reference.

Shapes: queries are grouped by KV head, ``q: [B, H_kv, G, D]`` (query head ``h`` uses KV head
``h // G``, as transformers' ``repeat_kv`` does); ``keys, values: [B, H_kv, t, D]``;
``segments: [B, H_kv, G', k]`` with ``G' = G`` (one selection per query head) or ``G' = 1``
(one selection shared by the KV group).
"""

from __future__ import annotations

import torch

from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax run in float32 (float64 when the inputs are float64): fp16/bf16 never overflow."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_positions(layout: SegmentLayout, segments: torch.Tensor) -> torch.Tensor:
    """Token positions of the selected segments: ``[..., k] -> [..., k, segment_size]``."""
    offsets = torch.arange(layout.segment_size, device=segments.device)
    return layout.sink_end + segments.unsqueeze(-1) * layout.segment_size + offsets


def segment_mask(layout: SegmentLayout, segments: torch.Tensor, group: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The attended set as a dense boolean mask ``[B, H_kv, G, t]`` (for tests and pictures).

    ``valid: [B, H_kv, G', k]`` (optional) marks which listed segments are attended (a budget
    allocation lists more than a head attends).
    """
    B, H, _, _ = segments.shape
    pos = torch.arange(layout.length, device=segments.device)
    selected = torch.zeros(B, H, segments.shape[2], layout.length, dtype=torch.bool, device=segments.device)
    if segments.shape[-1] > 0:
        positions = segment_positions(layout, segments)
        src = True if valid is None else valid.unsqueeze(-1).expand(positions.shape).flatten(-2)
        selected.scatter_(-1, positions.flatten(-2), src)
    always = (pos < layout.sink_end) | (pos >= layout.tail_start)
    return (always | (selected & (pos < layout.tail_start))).expand(B, H, group, layout.length)


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's logit soft-capping ``softcap * tanh(logits / softcap)`` (identity when ``softcap`` is None)."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def attention_logits_ref(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """The logits of :func:`attention_ref` in float64: ``[B, H_kv, G, t]``, scaled, soft-capped, ``-inf`` where ``mask`` is False."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = soft_cap(torch.einsum("bhgd,bhtd->bhgt", q.double(), keys.double()) * scale, softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits


def attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None,
    scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Naive softmax attention in float64 over the tokens where ``mask`` is True.

    Args:
        q: ``[B, H_kv, G, D]``; keys, values: ``[B, H_kv, t, D]``; mask: ``[B, H_kv, G, t]`` bool or None.
        softcap: optional logit soft-capping, applied after scaling.
    Returns:
        ``[B, H_kv, G, D]`` float64.
    """
    logits = attention_logits_ref(q, keys, mask, scale, softcap)
    return torch.einsum("bhgt,bhtd->bhgd", torch.softmax(logits, dim=-1), values.double())


def segment_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference for :func:`segment_attention`: materialise the mask, then run dense float64 attention."""
    return segment_attention_masked_ref(q, keys, values, layout, segments, None, scale, softcap)


def segment_attention_masked_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    valid: torch.Tensor | None, scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference for a backend's ``segment_attention_masked``: selection ``(b, h, s)`` attends sinks, tail and
    its listed segments flagged in ``valid: [B, H_kv, G', k]`` (None: every one), as a dense mask in float64."""
    mask = segment_mask(layout, segments, q.shape[2], valid)
    return attention_ref(q, keys[:, :, : layout.length], values[:, :, : layout.length], mask, scale, softcap)


def segment_attention_lse_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    valid: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reference for a backend's ``segment_attention_lse``: :func:`segment_attention_masked_ref` and each query
    head's ``log sum_j exp(logit_j)`` over the tokens it attends, ``([B, H_kv, G, D], [B, H_kv, G])`` float64."""
    mask = segment_mask(layout, segments, q.shape[2], valid)
    keys, values = keys[:, :, : layout.length], values[:, :, : layout.length]
    lse = torch.logsumexp(attention_logits_ref(q, keys, mask, scale, softcap), dim=-1)
    return attention_ref(q, keys, values, mask, scale, softcap), lse


def _token_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x: [B, H, T, D]`` as a ``[R, D]`` view of its storage and each ``(b, h)``'s first row ``[B, H]``.

    Needs tokens stored as contiguous rows (true for a capacity buffer's view); None otherwise.
    """
    B, H, T, D = x.shape
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != D or s0 % D or s1 % D:
        return None
    first = (torch.arange(B, device=x.device).view(B, 1) * (s0 // D) + torch.arange(H, device=x.device) * (s1 // D))
    rows = int(first.max()) + T
    return x.as_strided((rows, D), (D, 1)), first


def gather_tokens(x: torch.Tensor, index: torch.Tensor, workspace: Workspace | None = None, name: str = "") -> torch.Tensor:
    """``x[b, h, index[b, h, l]]``: ``[B, H, T, D], [B, H, L] -> [B, H, L, D]``, a copy of those rows only.

    Rows are copied with one ``index_select`` into a reused ``workspace`` buffer when given.
    """
    B, H, L = index.shape
    D = x.shape[-1]
    view = _token_rows(x)
    if view is None:
        return x.gather(2, index.unsqueeze(-1).expand(B, H, L, D))
    rows, first = view
    flat = (first.unsqueeze(-1) + index).reshape(-1)
    if workspace is None or (x.requires_grad and torch.is_grad_enabled()):  # out= cannot record autograd
        return rows.index_select(0, flat).view(B, H, L, D)
    out = workspace.get(name, (B * H * L, D), x.dtype, x.device)
    return torch.index_select(rows, 0, flat, out=out).view(B, H, L, D)


def segment_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    scale: float | None = None, softcap: float | None = None, workspace: Workspace | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of one decode query over sinks, the selected segments and the tail.

    Reads only the attended tokens: O(sinks + k * segment_size + tail) work, whatever ``t`` is.
    Segment indices must be distinct and in ``[0, n_segments)`` (the decode state checks this).

    Under grouped-query attention the G query heads of a KV group may select different segments;
    the *union* of their selections is gathered once per KV head (a copy of those tokens only, never
    more than G x k segments, often far fewer since heads of a group tend to agree) and each head
    masks out the segments it did not select. Logits of sinks, segments and tail are softmaxed
    jointly, so no partial-state merge is needed. When every segment is selected this is dense
    attention and runs as one SDPA call over the stored tokens, without a gather. ``workspace``
    (kept by the decode state) makes the gather write into reused memory.

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
    n_sel, n_seg, c = segments.shape[-1], layout.n_segments, layout.segment_size
    if segments.shape[2] not in (1, G):
        raise ValueError(f"segments must have 1 or {G} selections per KV head, got shape {tuple(segments.shape)}")
    if layout.sink_end + layout.tail_size == 0 and (n_sel == 0 or n_seg == 0):
        raise ValueError(f"nothing to attend: the layout {layout} holds no token")
    t = layout.length
    if n_seg > 0 and n_sel == n_seg:
        # Every segment selected: dense attention over [0, t), without a gather.
        return dense_decode_attention(q, keys[:, :, :t], values[:, :, :t], scale, softcap)
    device = q.device
    parts = [torch.arange(layout.sink_end, device=device).expand(B, H, -1)]
    head_mask = None  # [B, H, G', U * c]: which gathered segment tokens each selection attends
    if n_sel > 0 and n_seg > 0:
        chosen = torch.zeros(B, H, segments.shape[2], n_seg, dtype=torch.bool, device=device)
        chosen.scatter_(-1, segments, True)
        union = chosen.any(2)  # [B, H, S]
        width = int(union.sum(-1).max())  # the largest union among the KV heads
        # Selected segments first (True sorts above False); rows with a smaller union pad with unselected ones.
        picked = union.to(torch.int8).topk(width, dim=-1, sorted=False).indices  # [B, H, U]
        offsets = torch.arange(c, device=device)
        positions = (layout.sink_end + picked.unsqueeze(-1) * c + offsets).reshape(B, H, width * c)
        parts.append(positions)
        if segments.shape[2] > 1 or width > n_sel:
            selected = chosen.gather(-1, picked.unsqueeze(2).expand(-1, -1, chosen.shape[2], -1))  # [B, H, G', U]
            head_mask = selected.repeat_interleave(c, dim=-1)
        if layout.segment_end > layout.tail_start:  # the window reaches back into the last segments
            in_front = (positions < layout.tail_start).unsqueeze(2)
            head_mask = in_front if head_mask is None else head_mask & in_front
    parts.append(torch.arange(layout.tail_start, t, device=device).expand(B, H, -1))
    index = torch.cat(parts, dim=-1)  # [B, H, L] token positions to read
    L = index.shape[-1]
    k_att = gather_tokens(keys, index, workspace, "keys").to(cd)
    v_att = gather_tokens(values, index, workspace, "values").to(cd)
    mask = None
    if head_mask is not None:
        sinks, tail = layout.sink_end, layout.tail_size
        mask = torch.ones(B, H, head_mask.shape[2], L, dtype=torch.bool, device=device)
        mask[..., sinks : L - tail] = head_mask  # [B, H, G' in {1, G}] broadcasts over G
    return _attend(q.to(cd), k_att, v_att, scale, softcap, mask)


def _attend(q, k, v, scale, softcap, mask):
    """Attention of ``q: [B, H, G, D]`` (G rows) over ``k, v: [B, H, L, D]`` where ``mask`` (broadcast) is True."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    logits = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v)


def dense_decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """One decode step over every stored token: ``q: [B, H_kv, G, D]``, ``keys, values: [B, H_kv, t, D]``.

    The G query heads of a KV group are the rows of one SDPA call on that KV head, so nothing is
    repeated for grouped-query attention. Returns ``[B, H_kv, G, D]`` in the compute dtype.

    On CUDA a half-precision cache is attended as it is stored (SDPA's fused kernels accumulate in
    float32): converting it to float32 first would read and write the whole cache three times per step
    (measured: 2.2 against 16.6 tokens/s for an 8B model at 128k). On the CPU it is converted, as before.
    """
    cd = compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda and softcap is None and q.dtype in (torch.float16, torch.bfloat16) and keys.dtype == q.dtype:
        return _attend(q, keys, values, scale, None, None).to(cd)
    return _attend(q.to(cd), keys.to(cd), values.to(cd), scale, softcap, None)


def dense_decode_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Reference for :func:`dense_decode_attention`: :func:`attention_ref` without a mask, in float64."""
    return attention_ref(q, keys, values, None, scale, softcap)


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
    visible = torch.arange(L, device=q.device).view(1, L) <= (L - T + torch.arange(T, device=q.device)).view(T, 1)
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
