"""Attention over weighted slots, and the attention each slot receives: the ops of the evicting methods.

An evicting method stores at most ``budget`` slots per (batch row, KV head), each KV head its own
tokens (keys after RoPE, so a slot's position travels with its key and slot order does not matter).
:func:`slot_attention` answers queries over such slots, with per-slot weights for sketches (SubGen);
:func:`causal_probability_sums` is the attention each slot receives from a block of queries (H2O's
accumulated scores, SnapKV's votes). Each has a float64 reference beside it.

Shapes: ``q: [B, H_kv, G, T, D]`` (``G`` query heads per KV head, ``T`` queries: the last ``T``
slots), ``keys, values: [B, H_kv, S, D]``.
"""

from __future__ import annotations

import torch

from sparseattn.ops.attention import compute_dtype, soft_cap

# Elements of one [B, H, G, rows, S] probability chunk when summing prefill attention (bounds memory).
_PROBABILITY_CHUNK = 1 << 23


def _visible(T: int, S: int, rows: range, device: torch.device) -> torch.Tensor:
    """``[len(rows), S]``: query ``i`` of the last ``T`` of ``S`` slots sees slots ``[0, S - T + i]``."""
    r = torch.arange(rows.start, rows.stop, device=device).view(-1, 1)
    return torch.arange(S, device=device).view(1, S) <= S - T + r


def slot_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, den_weight: torch.Tensor | None = None,
    num_weight: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
    floor_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of ``q: [B, H_kv, G, T, D]`` over weighted slots ``keys, values: [B, H_kv, S, D]``.

    The last ``T`` slots are the queries' own tokens (query ``i`` sees slots ``[0, S - T + i]``; a
    decode query, ``T = 1``, sees every slot). With ``e_s = exp(logit_s)``::

        out = sum_s e_s b_s v_s / sum_s e_s a_s,   a = den_weight, b = num_weight  ([B, H_kv, S], ones if None)

    which is softmax attention when ``a = b = 1``; SubGen's sketch gives sampled slots other weights.
    Slots with ``a = b = 0`` are empty. Scores run in float32 (float64 for float64 inputs).

    ``floor_weight`` (``f``, ``[B, H_kv, S]``) floors the normaliser: ``max(sum_s e_s a_s, sum_s e_s f_s)``.
    With ``f = b`` every output is a sub-convex combination of the values (``|out| <= max |v_s|``
    over the slots with ``b_s > 0``): SubGen's guard against a normaliser estimate far below its numerator's.

    Returns:
        ``out: [B, H_kv, G, T, D]`` and ``probs: [B, H_kv, G, T, S] = e a / sum e a`` (the attention
        weights), both in the compute dtype.

    Example (unit weights are plain attention):
        >>> from sparseattn.ops.attention import attention_ref
        >>> q, k, v = torch.randn(1, 2, 3, 1, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
        >>> out, _ = slot_attention(q, k, v, torch.ones(1, 2, 9), torch.ones(1, 2, 9))
        >>> torch.allclose(out[:, :, :, 0].double(), attention_ref(q[:, :, :, 0], k, v), atol=1e-6)
        True
    """
    B, H, G, T, D = q.shape
    S = keys.shape[2]
    if T > S:
        raise ValueError(f"slot_attention: {T} queries but only {S} slots")
    cd = compute_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    logits = soft_cap(torch.einsum("bhgtd,bhsd->bhgts", q.to(cd), keys.to(cd)) * scale, softcap)
    mask = _visible(T, S, range(T), q.device) if T > 1 else None
    if den_weight is None and num_weight is None:
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.einsum("bhgts,bhsd->bhgtd", probs, values.to(cd)), probs
    a = torch.ones(B, H, S, dtype=cd, device=q.device) if den_weight is None else den_weight.to(cd)
    b = torch.ones(B, H, S, dtype=cd, device=q.device) if num_weight is None else num_weight.to(cd)
    live = (a > 0) | (b > 0)
    if floor_weight is not None:
        live = live | (floor_weight > 0)
    live = live.view(B, H, 1, 1, S)
    live = live if mask is None else live & mask
    top = logits.masked_fill(~live, float("-inf")).amax(-1, keepdim=True)  # no overflow in exp
    e = torch.exp(logits - top).masked_fill(~live, 0.0)
    den = (e * a.view(B, H, 1, 1, S)).sum(-1, keepdim=True)
    if floor_weight is not None:
        den = torch.maximum(den, (e * floor_weight.to(cd).view(B, H, 1, 1, S)).sum(-1, keepdim=True))
    out = torch.einsum("bhgts,bhsd->bhgtd", e * b.view(B, H, 1, 1, S), values.to(cd)) / den
    return out, e * a.view(B, H, 1, 1, S) / den


def slot_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, den_weight: torch.Tensor | None = None,
    num_weight: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
    floor_weight: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference for :func:`slot_attention`: the formula itself in float64 (no max subtraction). Returns ``out``."""
    B, H, G, T, D = q.shape
    S = keys.shape[2]
    scale = D**-0.5 if scale is None else scale
    e = torch.exp(soft_cap(torch.einsum("bhgtd,bhsd->bhgts", q.double(), keys.double()) * scale, softcap))
    visible = torch.arange(S, device=q.device).view(1, S) <= S - T + torch.arange(T, device=q.device).view(T, 1)
    e = e * visible.double()
    a = torch.ones(B, H, S, dtype=torch.float64, device=q.device) if den_weight is None else den_weight.double()
    b = torch.ones(B, H, S, dtype=torch.float64, device=q.device) if num_weight is None else num_weight.double()
    num = torch.einsum("bhgts,bhs,bhsd->bhgtd", e, b, values.double())
    den = torch.einsum("bhgts,bhs->bhgt", e, a)
    if floor_weight is not None:
        den = torch.maximum(den, torch.einsum("bhgts,bhs->bhgt", e, floor_weight.double()))
    return num / den.unsqueeze(-1)


def causal_probability_sums(
    q: torch.Tensor, keys: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Attention each stored token receives from a block of queries, summed over the block and the group.

    ``q: [B, H_kv, G, T, D]`` are the queries of the last ``T`` of the ``S`` slots ``keys: [B, H_kv, S, D]``
    (causal: query ``i`` sees slots ``[0, S - T + i]``). Returns ``[B, H_kv, S]`` in the compute dtype:
    the column sums of the causal softmax matrix, H2O's accumulated attention and SnapKV's votes.
    Computed in chunks of query rows so the ``[B, H, G, rows, S]`` temporary stays bounded.
    """
    B, H, G, T, D = q.shape
    S = keys.shape[2]
    cd = compute_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    k = keys.to(cd)
    total = torch.zeros(B, H, S, dtype=cd, device=q.device)
    rows = max(1, _PROBABILITY_CHUNK // max(1, B * H * G * S))
    for start in range(0, T, rows):
        block = range(start, min(T, start + rows))
        seen = S - T + block.stop  # the chunk's queries see no slot beyond this one
        rows_q = q[:, :, :, block.start : block.stop].to(cd)
        logits = soft_cap(torch.einsum("bhgtd,bhsd->bhgts", rows_q, k[:, :, :seen]) * scale, softcap)
        logits = logits.masked_fill(~_visible(T, S, block, q.device)[:, :seen], float("-inf"))
        total[:, :, :seen] += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return total


def causal_probability_sums_ref(
    q: torch.Tensor, keys: torch.Tensor, scale: float | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Reference for :func:`causal_probability_sums`: the whole causal softmax matrix in float64."""
    T, S = q.shape[3], keys.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = soft_cap(torch.einsum("bhgtd,bhsd->bhgts", q.double(), keys.double()) * scale, softcap)
    visible = torch.arange(S, device=q.device).view(1, S) <= S - T + torch.arange(T, device=q.device).view(T, 1)
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).sum(dim=(2, 3))
