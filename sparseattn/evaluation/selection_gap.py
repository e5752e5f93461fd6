"""Where a selection loses against the exact pooled oracle: one decode step's attention mass, decomposed.

Given exact attention ``probs [B, H_q, t]`` (float64) and what a method's step attended (``mask [B, H_q, t]``,
its stored tokens; ``spent [B, H_q]``, those plus any merged stand-ins, i.e. its budget), the mass it keeps
is bounded by a chain of ceilings, each one choice looser than the next:

* ``pooled``: the exact top tokens of the layer, pooled over its query heads, ``spent.sum()`` of them (the
  report's ``oracle-tokens:split=pooled`` at the same budget);
* ``per_head``: each head's exact top ``n_h`` tokens, ``n_h`` the tokens the method attended for it (the
  method's split between heads kept, and its merged tokens' budget spent on nothing);
* ``grid_pooled`` / ``grid_per_head`` (segment methods): whole segments of the method's grid ranked by their
  exact mass, pooled over the heads at the method's total segment count, or at each head's own count; the
  sinks and tail the method attended are kept as they are;
* ``method``: the method's own selection.

So ``pooled - per_head`` is what the split between heads (and the merged rest's budget) costs,
``per_head - grid_per_head`` what the grid costs, ``grid_per_head - method`` what the ranking (the coarse
score and its shortlist) costs. ``missed`` sorts the mass the pooled oracle keeps and the method leaves out
by where it lies (:data:`WHERE`).
"""

from __future__ import annotations

import torch

from sparseattn.ops.layout import SegmentLayout

CEILINGS = ("pooled", "per_head", "grid_pooled", "grid_per_head", "method")
#: Where a token lies: the first 4 positions, the last 64, the 448 before those, and everything older.
WHERE = ("sinks", "recent", "near", "far")
SINK_TOKENS, RECENT, NEAR = 4, 64, 512


def top_mass(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The sum of the ``counts[..., 0]`` largest entries of ``values [..., n]`` along the last dim: ``[...]``."""
    ranked = values.sort(dim=-1, descending=True).values.cumsum(-1)
    picked = ranked.gather(-1, (counts.clamp(1, values.shape[-1]) - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(counts > 0, picked, torch.zeros_like(picked))


def pooled_mask(values: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The ``total[b]`` largest entries of each row ``values[b]`` (all heads and positions at once), as a mask."""
    B = values.shape[0]
    flat = values.reshape(B, -1)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for b in range(B):  # the totals differ per row; B is small here
        count = int(min(int(total[b]), flat.shape[-1]))
        if count > 0:
            mask[b, flat[b].topk(count).indices] = True
    return mask.reshape(values.shape)


def where_masks(t: int, device: torch.device | None = None) -> torch.Tensor:
    """``[len(WHERE), t]`` booleans: which of ``t`` positions are sinks, recent, near and far (first match wins)."""
    pos = torch.arange(t, device=device)
    age = t - 1 - pos
    sinks = pos < SINK_TOKENS
    recent = ~sinks & (age < RECENT)
    near = ~sinks & ~recent & (age < NEAR)
    return torch.stack([sinks, recent, near, ~(sinks | recent | near)])


def selection_ceilings(
    probs: torch.Tensor, mask: torch.Tensor, spent: torch.Tensor, layout: SegmentLayout | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The ceilings of one step (module docstring), each ``[B, H_q]`` mass kept per query head; the mass the pooled
    oracle keeps and the method misses, ``[B, H_q, len(WHERE)]``; and the pooled oracle's mask ``[B, H_q, t]``.

    ``grid_*`` are NaN without a ``layout`` (or with no segments on it).
    """
    probs = probs.double()
    B, Hq, t = probs.shape
    kept = probs * mask
    stored = mask.sum(-1)
    oracle = pooled_mask(probs, spent.sum(-1))
    out = {"pooled": (probs * oracle).sum(-1), "per_head": top_mass(probs, stored), "method": kept.sum(-1)}
    nan = torch.full((B, Hq), float("nan"), dtype=torch.float64, device=probs.device)
    out["grid_pooled"] = out["grid_per_head"] = nan
    if layout is not None and layout.n_segments > 0:
        S, c, lo, hi = layout.n_segments, layout.segment_size, layout.sink_end, layout.segment_end
        seg_mass = probs[..., lo:hi].reshape(B, Hq, S, c).sum(-1)
        picked = mask[..., lo:hi].reshape(B, Hq, S, c).any(-1)
        outside = kept.sum(-1) - kept[..., lo:hi].sum(-1)  # sinks and tail as the method attended them
        n_seg = picked.sum(-1)
        out["grid_per_head"] = outside + top_mass(seg_mass, n_seg)
        out["grid_pooled"] = outside + (seg_mass * pooled_mask(seg_mass, n_seg.sum(-1))).sum(-1)
    missed_mass = probs * (oracle & ~mask.bool())
    missed = torch.einsum("bht,wt->bhw", missed_mass, where_masks(t, probs.device).double())
    return out, missed, oracle
