"""Attention over the pages the selection listed (the generic path's, in torch float32), and the float64 references
the fused step and vLLM's kernel are checked against. No vLLM import.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sparseattn.vllm.cache_format import KVFormat, page_views
from sparseattn.vllm.policy import PagedPolicy
from sparseattn.vllm.selection import MergedPages, PageSummaries, choose_pages

__all__ = ["attend_pages", "merged_pages_ref", "paged_decode", "paged_decode_ref"]


def attend_pages(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, pages: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, softcap: float | None = None, fmt: KVFormat = KVFormat(),
    merged: MergedPages | None = None, tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 softmax attention of ``query: [B, H_q, D]`` over the listed logical pages ``[B, H_kv, G', P]`` (-1: none).

    The torch path (and the reference of a kernel's): one gather of whole pages for the batch (rows
    of the ``[N * H_kv, ...]`` views: indexing the bf16 cache per head then converting was ~20x
    slower), one product per page with the query rows broadcast, one softmax over every page of a
    row, the last page masked past the sequence's length. Returns ``[B, H_q, D]`` in the query's dtype.
    An fp8 cache (``fmt``) is dequantised page by page as it is gathered. ``merged``: a merged rest's
    tokens per list, in the same softmax with logit ``log m + scale q . mean k`` (soft-capped as the
    others) and value ``mean v`` (:class:`~sparseattn.methods.rest.MergedRest`). ``tokens [B, H_kv, G', P, bs]``:
    which tokens of each listed page are attended (segments smaller than a page; None: all).
    """
    keys_t, values = page_views(kv_cache, fmt)
    B, H_q, D = query.shape
    H, bs = keys_t.shape[1], keys_t.shape[-1]
    Gs, P = pages.shape[2], pages.shape[3]
    g = H_q // H // Gs  # query rows sharing one page list
    phys = block_table.long().gather(1, pages.clamp(min=0).view(B, -1)).view(B, H, Gs, P)
    rows = (phys * H + torch.arange(H).view(1, H, 1, 1)).flatten()
    k = keys_t.flatten(0, 1).index_select(0, rows).view(B, H, Gs, P, D, bs).float()
    v = values.flatten(0, 1).index_select(0, rows).view(B, H, Gs, P, bs, D).float()
    if fmt.fp8 is not None:
        k, v = k.mul_(fmt.k_scale), v.mul_(fmt.v_scale)
    positions = pages.unsqueeze(-1) * bs + torch.arange(bs)  # [B, H, G', P, bs]
    valid = (pages.unsqueeze(-1) >= 0) & (positions < seq_lens.view(B, 1, 1, 1, 1))
    if tokens is not None:
        valid = valid & tokens
    q = query.float().reshape(B, H, Gs, 1, g, D)
    logits = torch.matmul(q, k) * scale  # [B, H, G', P, g, bs]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    flat = logits.transpose(3, 4).reshape(B, H, Gs, g, P * bs)
    if merged is None:
        probs = torch.softmax(flat, dim=-1).view(B, H, Gs, g, P, bs).transpose(3, 4)  # [B, H, G', P, g, bs]
        return torch.matmul(probs, v).sum(3).reshape(B, H_q, D).to(query.dtype)
    extra = torch.matmul(q.squeeze(3), merged.keys.transpose(-1, -2)) * scale  # [B, H, G', g, n]
    if softcap:
        extra = torch.tanh(extra / softcap) * softcap
    extra = extra + merged.log_counts.unsqueeze(3)
    both = torch.softmax(torch.cat([flat, extra], dim=-1), dim=-1)
    probs = both[..., : P * bs].reshape(B, H, Gs, g, P, bs).transpose(3, 4)
    out = torch.matmul(probs, v).sum(3) + torch.matmul(both[..., P * bs :], merged.values)  # [B, H, G', g, D]
    return out.reshape(B, H_q, D).to(query.dtype)


def paged_decode(
    policy: PagedPolicy, params: Any, generator: torch.Generator, kv_cache: torch.Tensor, query: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, softcap: float | None = None,
    summaries: PageSummaries | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """One decode token per sequence: ``query: [B, H_q, D]`` over the paged cache -> ``[B, H_q, D]`` (query's dtype).

    ``kv_cache: [N, H_kv, bs, 2 D]`` (the CPU layout, :func:`page_views`); ``block_table: [B, >= ceil(L/bs)]``
    physical block ids; ``seq_lens: [B]`` tokens per sequence, the current one included (already in the cache).
    Per sequence: sink pages + the selected candidate pages + the tail pages (+ a merged rest's
    tokens), one float32 softmax: :func:`choose_pages` then :func:`attend_pages` (the vLLM backend
    runs vLLM's own paged kernel over the same page lists instead, when there is no merged rest).
    ``summaries`` keeps page summaries (and sums) between steps (None: computed every step).
    """
    chosen = choose_pages(policy, params, generator, kv_cache, query, block_table, seq_lens, scale, summaries, fmt)
    return attend_pages(query, kv_cache, block_table, chosen.pages, seq_lens, scale, softcap, fmt, chosen.merged, chosen.tokens)


def merged_pages_ref(
    kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    pages: torch.Tensor, sink_pages: list[int], n_cand: list[int], per_block: int, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """Reference of a merged step over a paged cache, float64, one loop per sequence, query head and block.

    Each query head attends the tokens of its list's pages (``pages [B, H_kv, G', P]``) plus, for every
    block of ``per_block`` consecutive candidate pages (``n_cand[i]`` of them after ``sink_pages[i]``), one
    token made of the block's tokens in pages it does not list: logit ``log m + scale q . mean k``, value
    ``mean v`` (none when the block is wholly listed). Returns ``[B, H_q, D]`` float64.
    """
    keys_t, values = page_views(kv_cache, fmt)
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    B, H_q = query.shape[:2]
    Gs = pages.shape[2]
    G = H_q // H_kv
    out = torch.zeros(B, H_q, D, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-length // bs)].long()
        K = keys_t[blocks].permute(1, 0, 3, 2).double() * fmt.k_scale  # [H, P_all, bs, D]
        V = values[blocks].permute(1, 0, 2, 3).double() * fmt.v_scale
        for hq in range(H_q):
            h, g = divmod(hq, G)
            listed = {int(p) for p in pages[i, h, g if Gs > 1 else 0] if p >= 0}
            qv = query[i, hq].double()
            logits, vals = [], []
            for p in sorted(listed):
                n = min(bs, length - p * bs)
                logits.append(K[h, p, :n] @ qv * scale)
                vals.append(V[h, p, :n])
            first = sink_pages[i]
            for b0 in range(first, first + n_cand[i], per_block):
                left = [p for p in range(b0, min(b0 + per_block, first + n_cand[i])) if p not in listed]
                if left:
                    mk = K[h, left].reshape(-1, D).mean(0)
                    mv = V[h, left].reshape(-1, D).mean(0)
                    logits.append((mk @ qv * scale + math.log(len(left) * bs)).view(1))
                    vals.append(mv.view(1, D))
            p_all = torch.softmax(torch.cat(logits), dim=0)
            out[i, hq] = p_all @ torch.cat(vals)
    return out


def paged_decode_ref(
    kv_cache: torch.Tensor, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    mask: list[torch.Tensor] | None = None, fmt: KVFormat = KVFormat(),
) -> torch.Tensor:
    """Reference: gather each sequence's tokens contiguously and attend in float64 (``mask[i]: [H_q, L]`` optional),
    an fp8 cache dequantised (stored number times scale) in float64."""
    keys_t, values = page_views(kv_cache, fmt)
    H_kv, D, bs = keys_t.shape[1], keys_t.shape[2], keys_t.shape[3]
    H_q = query.shape[1]
    out = torch.empty_like(query)
    for i, length in enumerate(seq_lens.tolist()):
        blocks = block_table[i, : -(-length // bs)].long()
        k = keys_t[blocks].permute(1, 0, 3, 2).reshape(H_kv, -1, D)[:, :length].double() * fmt.k_scale
        v = values[blocks].permute(1, 0, 2, 3).reshape(H_kv, -1, D)[:, :length].double() * fmt.v_scale
        k = k.repeat_interleave(H_q // H_kv, dim=0)
        v = v.repeat_interleave(H_q // H_kv, dim=0)
        logits = torch.einsum("hd,htd->ht", query[i].double(), k) * scale
        if mask is not None:
            logits = logits.masked_fill(~mask[i], float("-inf"))
        out[i] = torch.einsum("ht,htd->hd", torch.softmax(logits, dim=-1), v).to(query.dtype)
    return out
