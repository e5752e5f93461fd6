"""Attention over listed tokens: the op behind "always attend these tokens too" on top of a segment selection.

A segment search attends contiguous ranges (sinks, selected segments, tail); an always-kept part
such as heavy hitters adds scattered tokens. :func:`token_attention` gathers exactly the listed
tokens (each KV head its own list, each query head its own validity mask) and returns the output and
the weights each listed token received, which the decode state adds to its attention record.
:func:`token_attention_ref` is the float64 reference: dense attention under the equivalent mask.

Shapes: ``q: [B, H_kv, G, D]``; ``keys, values: [B, H_kv, t, D]``; ``index: [B, H_kv, L]`` token
positions (distinct where valid); ``valid: [B, H_kv, G', L]`` with ``G'`` in ``{1, G}`` (None: all).
"""

from __future__ import annotations

import torch

from sparseattn.ops.attention import attention_ref, compute_dtype, gather_tokens, soft_cap
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.layout import SegmentLayout


def segment_index(
    layout: SegmentLayout, segments: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a segment selection attends, as a token list and a per-head mask.

    ``segments: [B, H_kv, G', k]`` -> ``index: [B, H_kv, L]`` (sinks, ``min(S, G' k)`` segments'
    tokens holding the union over the ``G'`` selections, the tail) and ``mask: [B, H_kv, G', L]`` of the
    tokens each selection attends (None when every listed token is attended by every head). A
    segment reaching into the tail attends only its tokens before ``tail_start`` (the tail has them).
    ``valid: [B, H_kv, G', k]`` (optional) marks the listed segments that are attended; the others
    are listed but masked out (a budget allocation gives heads different numbers of segments).

    Example:
        >>> lay = SegmentLayout(length=12, sinks=1, segment_size=3, n_segments=3, window=2)
        >>> index, mask = segment_index(lay, torch.tensor([[[[2]]]]))
        >>> index.tolist(), mask
        ([[[0, 7, 8, 9, 10, 11]]], None)
    """
    B, H, sets, k = segments.shape
    device, c = segments.device, layout.segment_size
    parts = [torch.arange(layout.sink_end, device=device).expand(B, H, -1)]
    mask = None
    if k > 0 and layout.n_segments > 0:
        chosen = torch.zeros(B, H, sets, layout.n_segments, dtype=torch.bool, device=device)
        chosen.scatter_(-1, segments, True if valid is None else valid)
        union = chosen.any(2)  # [B, H, S]
        # A width fixed by the shapes (not the largest union), so what one row selects never changes the
        # arithmetic of another (and no device sync). Selected segments first (True sorts above False);
        # the rest pads with unselected ones, masked out.
        width = min(layout.n_segments, sets * k)
        picked = union.to(torch.int8).topk(width, dim=-1, sorted=False).indices  # [B, H, U]
        positions = (layout.sink_end + picked.unsqueeze(-1) * c + torch.arange(c, device=device)).reshape(B, H, width * c)
        parts.append(positions)
        head = None
        if sets > 1 or width > k or valid is not None:
            head = chosen.gather(-1, picked.unsqueeze(2).expand(-1, -1, sets, -1)).repeat_interleave(c, dim=-1)
        if layout.segment_end > layout.tail_start:  # the window reaches back into the last segments
            in_front = (positions < layout.tail_start).unsqueeze(2)
            head = in_front if head is None else head & in_front
        if head is not None:
            mask = torch.ones(B, H, head.shape[2], layout.sink_end + width * c + layout.tail_size, dtype=torch.bool, device=device)
            mask[..., layout.sink_end : layout.sink_end + width * c] = head
    parts.append(torch.arange(layout.tail_start, layout.length, device=device).expand(B, H, -1))
    return torch.cat(parts, dim=-1), mask


def token_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
    valid: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax attention of ``q`` over the tokens ``index`` lists (where ``valid``): O(L) reads, whatever ``t`` is.

    Returns ``out: [B, H_kv, G, D]`` and ``probs: [B, H_kv, G, L]`` (0 where invalid), in the compute
    dtype (float32; float64 for float64 inputs). Every query head needs at least one valid token.

    Example (listing every token is dense attention):
        >>> q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
        >>> out, probs = token_attention(q, k, v, torch.arange(10).view(1, 1, 10))
        >>> torch.allclose(out.double(), attention_ref(q, k, v), atol=1e-6), probs.shape
        (True, torch.Size([1, 1, 2, 10]))
    """
    B, H, G, D = q.shape
    if index.dim() != 3 or index.shape[:2] != (B, H):
        raise ValueError(f"index must be [B={B}, H_kv={H}, L], got {tuple(index.shape)}")
    if valid is not None and (valid.dim() != 4 or valid.shape[:2] != (B, H) or valid.shape[2] not in (1, G) or valid.shape[3] != index.shape[2]):
        raise ValueError(f"valid must be [B={B}, H_kv={H}, 1 or {G}, L={index.shape[2]}], got {tuple(valid.shape)}")
    cd = compute_dtype(q.dtype)
    scale = D**-0.5 if scale is None else scale
    k = gather_tokens(keys, index, workspace, "token_keys").to(cd)
    v = gather_tokens(values, index, workspace, "token_values").to(cd)
    logits = soft_cap(torch.matmul(q.to(cd), k.transpose(-1, -2)) * scale, softcap)  # [B, H, G, L]
    if valid is not None:
        logits = logits.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v), probs


def token_attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
    valid: torch.Tensor | None = None, scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference for :func:`token_attention`: the listed tokens as a dense ``[B, H_kv, G, t]`` mask, float64 attention."""
    B, H, G, D = q.shape
    t = keys.shape[2]
    L = index.shape[-1]
    valid = torch.ones(B, H, 1, L, dtype=torch.bool, device=q.device) if valid is None else valid
    mask = torch.zeros(B, H, G, t, dtype=torch.bool, device=q.device)
    for b in range(B):
        for h in range(H):
            for g in range(G):
                rows = valid[b, h, g if valid.shape[2] == G else 0]
                mask[b, h, g, index[b, h][rows]] = True
    return attention_ref(q, keys, values, mask, scale, softcap)
