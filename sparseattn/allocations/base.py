"""The select stage of a segment search: the ``Selection`` it hands the attend stage, the ``SelectStage``
hook, the ``Allocation`` protocol (a select stage that splits a layer's segments between its heads), and
the naive reference of the pooled split.

A :class:`~sparseattn.methods.segment_state.SegmentSearchState` runs a decode step as stages: *plan*
(the layout and the ``k`` segments the budget buys), *score* and *select* (one part's
:meth:`SelectStage.select_segments`, which asks the step for scores and picks as it needs them), *keep*
(the always-kept part's tokens) and *attend* (one backend op, chosen by what the selection needs). The
state calls the select stage of ``refine`` when the method has one, else of ``allocation``; a new part
type extends the state by implementing that one method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.tokens import segment_index

if TYPE_CHECKING:
    from sparseattn.allocations.step import SearchStep


@dataclass(frozen=True)
class Selection:
    """What a step's select stage chose, and so what its attend stage needs.

    Shapes: ``B`` batch rows, ``H_kv`` KV heads, ``G'`` selections per KV head (``G``, or 1 when a KV
    group shares one), ``G''`` in ``{1, G'}``.

    * ``segments: [B, H_kv, G', w]`` long, the listed segments (distinct per selection);
    * ``valid: [B, H_kv, G', w]`` bool, which listed segments each selection attends (None: all);
    * ``extra: [B, H_kv, n]`` long, token positions attended on top of the sinks, the tail and the
      attended segments, with ``extra_valid: [B, H_kv, G'', n]`` bool, which of them each selection
      attends (None: no such token);
    * ``listed: [B, H_kv, L]``, ``attended: [B, H_kv, G'', L]``, ``runs``: the step's own token listing,
      sinks and tail included, when it attends tokens rather than whole segments (token refinement);
      ``runs = (first, count, length)`` says the entries ``[first, first + count x length)`` are
      ``count`` whole segments of ``length`` tokens (a merged rest sums them per segment). None: the
      listing is built from the segments (:meth:`listing`).

    The sinks and the tail are always attended and never listed here (except inside ``listed``).
    """

    segments: torch.Tensor
    valid: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    extra_valid: torch.Tensor | None = None
    listed: torch.Tensor | None = None
    attended: torch.Tensor | None = None
    runs: tuple[int, int, int] | None = None

    @property
    def need(self) -> str:
        """What the attend stage needs: ``"segments"`` (whole segments, every selection all it lists),
        ``"masked"`` (whole segments, ``valid`` says which) or ``"tokens"`` (a token listing: gathered)."""
        if self.listed is not None or self.extra is not None:
            return "tokens"
        return "segments" if self.valid is None else "masked"

    def listing(self, layout: SegmentLayout) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, int]]:
        """``(listed [B, H_kv, L], attended [B, H_kv, G'', L] or None (all), runs)``: every token the
        selection attends, as the gather path reads them: the sinks, the listed segments' tokens, the
        tail, then ``extra`` (or ``listed`` itself when the selection has its own listing)."""
        if self.listed is not None:
            return self.listed, self.attended, self.runs
        index, mask = segment_index(layout, self.segments, self.valid)
        B, H = index.shape[:2]
        extra, extra_valid = self.extra, self.extra_valid
        sets = max(1 if extra_valid is None else extra_valid.shape[2], 1 if mask is None else mask.shape[2])
        listed = index if extra is None else torch.cat([index, extra], dim=-1)
        attended = None
        if mask is not None or extra_valid is not None:
            main = torch.ones(B, H, sets, index.shape[-1], dtype=torch.bool, device=index.device) if mask is None else mask.expand(B, H, sets, -1)
            attended = main if extra_valid is None else torch.cat([main, extra_valid.expand(B, H, sets, -1)], dim=-1)
        runs = (layout.sink_end, (index.shape[-1] - layout.sink_end - layout.tail_size) // layout.segment_size, layout.segment_size)
        return listed, attended, runs

    def with_tokens(self, tokens: torch.Tensor, valid: torch.Tensor, layout: SegmentLayout) -> Selection:
        """This selection plus ``tokens: [B, H_kv, n]`` where ``valid: [B, H_kv, 1 or G', n]``, each token
        attended once: one in the sinks or the tail, in an attended listed segment, or already among the
        ``extra`` tokens is dropped from ``valid`` (a repeat would count it twice in the softmax)."""
        B, H, sets, k = self.segments.shape
        n = tokens.shape[-1]
        valid = valid & ((tokens >= layout.sink_end) & (tokens < layout.tail_start)).unsqueeze(2)
        if layout.n_segments and k:  # outside the sinks and tail a token is in a segment
            chosen = torch.zeros(B, H, sets, layout.n_segments, dtype=torch.bool, device=tokens.device)
            chosen.scatter_(-1, self.segments, True if self.valid is None else self.valid)
            segment_of = ((tokens - layout.sink_end) // layout.segment_size).clamp(0, layout.n_segments - 1)
            valid = valid & ~chosen.gather(-1, segment_of.unsqueeze(2).expand(B, H, sets, n))
        if self.extra is not None:
            G = self.extra_valid.shape[2]
            dense = torch.zeros(B, H, G, layout.length, dtype=torch.bool, device=tokens.device)
            dense = dense.scatter(-1, self.extra.unsqueeze(2).expand(B, H, G, -1), self.extra_valid)
            valid = valid & ~dense.gather(-1, tokens.unsqueeze(2).expand(B, H, G, n))
        extra = tokens if self.extra is None else torch.cat([self.extra, tokens], dim=-1)
        extra_valid = valid if self.extra is None else _cat_flags(self.extra_valid, valid)
        listed, attended = self.listed, self.attended
        if listed is not None:
            listed = extra if listed is self.extra else torch.cat([listed, tokens], dim=-1)
            if attended is None:
                attended = torch.ones(B, H, 1, self.listed.shape[-1], dtype=torch.bool, device=tokens.device)
            attended = _cat_flags(attended, valid)
        return Selection(self.segments, self.valid, extra, extra_valid, listed, attended, self.runs)


def _cat_flags(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flags ``[B, H, G_a, n_a]`` and ``[B, H, G_b, n_b]`` side by side (``G_a, G_b`` in ``{1, G}``): ``[B, H, G, n_a + n_b]``."""
    if a.shape[2] != b.shape[2]:  # one of them shared by the group: both per selection
        both = max(a.shape[2], b.shape[2])
        a, b = a.expand(*a.shape[:2], both, -1), b.expand(*b.shape[:2], both, -1)
    return torch.cat([a, b], dim=-1)


@runtime_checkable
class SelectStage(Protocol):
    """A part that runs a decode step's select stage (``allocation``, or ``refine`` when a method has one).

    ``select_segments(step)`` returns the step's :class:`Selection`. ``step``
    (:class:`~sparseattn.allocations.step.SearchStep`) carries the layout, the ``k`` segments the
    budget buys (``k < S``: a step that can afford every segment never asks), the grouped query, and
    scores and picks on demand (``step.picks(n)``, ``step.scored_picks(n)``, ``step.scores(top_k)``, ...),
    so a stage that needs no scores never computes them.
    """

    def select_segments(self, step: SearchStep) -> Selection: ...


@runtime_checkable
class Allocation(SelectStage, Protocol):
    """Split one decode step's segments between the heads of a layer, the layer's total fixed.

    ``k`` is what the budget buys each head under a uniform split (see
    :meth:`~sparseattn.methods.segment_search.SegmentSearch.segments_for`); the layer attends
    ``k`` segments per selection on average, so the tokens attended per step still honour the budget.

    * ``uniform``: True when every head gets exactly ``k`` (token refinement then skips the plan);
    * ``width(k, n_segments)``: the most segments one head may get (``>= k``, ``<= n_segments``);
    * ``plan(estimates, log_total, k)``: ``estimates: [B, H_kv, G', w]`` the estimated log masses of
      the ``w = width(k, S)`` segments listed for each selection (its best ``w``, in any order);
      ``log_total: [B, H_kv, G']`` the log of each selection's whole estimated mass (every segment
      and the tokens every head attends anyway: sinks and tail). Returns a ``[B, H_kv, G', w]`` bool
      mask of the listed segments each selection attends, at most ``H_kv G' k`` per row (a row's
      budget is never exceeded). :func:`listed_estimates` builds the inputs from a step's scores.

    * ``select_segments(step)`` (:class:`SelectStage`): the step's split. :class:`~sparseattn.allocations.Uniform`
      runs the selector (each selection its ``k`` picks, whole segments: the fused kernels); a
      splitting allocation returns :func:`split_segments` (each selection lists its ``w`` picks and
      attends those ``plan`` flags).

    A ``plan`` that flags at most ``H_kv G' k`` per row by construction may say so with
    :func:`within_budget` (:class:`~sparseattn.allocations.PooledMass`'s, tested so): :func:`split_segments`
    then skips its check of that, which reads the mask's counts back to the host (on a GPU a sync per
    layer and step, and no CUDA graph). A subclass that overrides ``plan`` is checked again.

    The plan sees only each selection's listed segments and one total, unordered: what a pooled
    split needs, and what a decode state produces without sorting (a shortlisting summary lists its
    shortlist, ranked against nothing else).
    """

    uniform: bool

    def width(self, k: int, n_segments: int) -> int: ...

    def plan(self, estimates: torch.Tensor, log_total: torch.Tensor, k: int) -> torch.Tensor: ...


@runtime_checkable
class FixedShapePlan(Protocol):
    """An allocation whose ``plan`` also runs in fixed shapes (:mod:`sparseattn.methods.static_step`: a decode step
    a CUDA graph captures). ``plan_fixed(estimates, log_total, k, listed, k_bounds)`` is ``plan`` with ``k`` a 0-d
    long device tensor (the step's, read off a table, not a Python number) within ``k_bounds = (least, most)`` (the
    phase's, which size its work), and ``estimates: [B, H_kv, G', w]`` a phase's widest listing, of which the
    entries ``listed`` flags (bool, ``[w]`` or the estimates' shape) are the step's own; it flags only listed
    entries, what ``plan`` flags over them, and reads nothing back to the host."""

    def plan_fixed(
        self, estimates: torch.Tensor, log_total: torch.Tensor, k: torch.Tensor, listed: torch.Tensor, k_bounds: tuple[int, int]
    ) -> torch.Tensor: ...


def within_budget(plan):
    """Mark an allocation's ``plan`` as keeping the layer's budget by construction (see :class:`Allocation`)."""
    plan.within_budget = True
    return plan


def keeps_budget(allocation: Allocation) -> bool:
    """Whether ``allocation``'s own ``plan`` is marked :func:`within_budget` (an override of it is not)."""
    return bool(getattr(getattr(type(allocation), "plan", None), "within_budget", False))


def split_segments(allocation: Allocation, step: SearchStep) -> Selection:
    """The select stage of an allocation that splits segments between heads: each selection lists its
    ``w = allocation.width(k, S)`` picks (its best ``w`` under :class:`~sparseattn.selectors.TopK`), and
    ``allocation.plan`` flags which of them it attends (with ``TopK`` and
    :class:`~sparseattn.allocations.PooledMass`, a head given ``n`` attends its top ``n``).

    Raises ValueError when the plan is not a ``[B, H_kv, G', w]`` bool mask or flags more than the
    layer's ``H_kv G' k`` segments in a batch row (the latter not checked for an allocation that is
    ``within_budget``).
    """
    k = step.k
    w = allocation.width(k, step.layout.n_segments)
    scores, estimates, segments = step.scored_picks(w)
    valid = allocation.plan(estimates, log_total_mass(scores, step.always_log_mass()), k)
    B, H, shared = segments.shape[:3]
    if tuple(valid.shape) != (B, H, shared, w) or valid.dtype != torch.bool:
        raise ValueError(f"{allocation!r}.plan returned a {valid.dtype} mask of shape {tuple(valid.shape)}, expected bool {(B, H, shared, w)}")
    # The count is read back to the host: on a GPU a sync, and a step no CUDA graph can capture. A plan that keeps
    # the budget by construction (marked @within_budget, property-tested) is not checked.
    if not keeps_budget(allocation) and bool((valid.sum((1, 2, 3)) > H * shared * k).any()):
        raise ValueError(f"{allocation!r}.plan flagged more than the layer's {H * shared * k} segments: {valid.sum((1, 2, 3)).tolist()}")
    return Selection(segments, valid)


def log_total_mass(scores: torch.Tensor, always_mass: torch.Tensor) -> torch.Tensor:
    """``log(sum_s exp(scores[..., s]) + exp(always_mass))``, ``[B, H, G']``, in float32 or wider:
    a selection's whole estimated mass, an allocation's ``log_total``."""
    s = scores if scores.dtype == torch.float64 else scores.float()
    return torch.logaddexp(torch.logsumexp(s, dim=-1), always_mass.to(s.dtype))


def listed_estimates(scores: torch.Tensor, always_mass: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An allocation's inputs from a step's scores: ``(estimates, log_total, segments)``.

    ``scores: [B, H, G', S]`` segment log-mass estimates; ``always_mass: [B, H, G']`` the log mass of
    the always-attended tokens. ``segments`` are each selection's best ``width`` segments (in no
    particular order), ``estimates`` their scores, ``log_total`` as :func:`log_total_mass`.
    """
    top = scores.topk(width, dim=-1, sorted=False)
    return top.values, log_total_mass(scores, always_mass), top.indices


def pooled_counts_ref(scores: torch.Tensor, always_mass: torch.Tensor, k: int, width: int, floor: int) -> torch.Tensor:
    """Reference for :class:`~sparseattn.allocations.PooledMass`: a greedy loop in float64.

    Each head first takes its ``floor`` best segments; then, one at a time, the layer's remaining
    slots go to the (head, segment) with the highest share of its head's estimated mass
    ``exp(score - log Z_head)``, ``Z_head`` counting every segment and the always-attended tokens,
    until ``H G' k`` segments are taken (no head beyond ``width``).
    """
    B, H, G, S = scores.shape
    s = scores.double()
    log_z = torch.logaddexp(torch.logsumexp(s, dim=-1), always_mass.double())
    share = s - log_z[..., None]
    counts = torch.zeros(B, H, G, dtype=torch.long, device=scores.device)
    for b in range(B):
        ranked = [sorted(share[b, h, g].tolist(), reverse=True)[:width] for h in range(H) for g in range(G)]
        taken = [min(floor, len(r)) for r in ranked]
        for _ in range(H * G * k - sum(taken)):
            best = max((r[n], i) for i, (r, n) in enumerate(zip(ranked, taken)) if n < len(r))
            taken[best[1]] += 1
        counts[b] = torch.tensor(taken).view(H, G)
    return counts
