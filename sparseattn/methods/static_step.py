"""Decode steps of fixed shapes: a layer's step as a CUDA graph captures it and a compiler specialises it.

A decode state's own step (:meth:`SegmentSearchState.attend`) reads its layout as Python numbers that change
with every token (the length, the tail, the segments the budget buys), and its storage grows. A captured
graph replays fixed kernels on fixed addresses with fixed arguments, so here the same policy runs in another
form:

* the storage is **reserved** up front (``capacity`` tokens: the prompt and every token to generate) and the
  step writes its token in place, at ``position``, a device tensor the loop advances (nothing is read back to
  the host, no Python number is written into a device tensor while decoding);
* the shapes are fixed while a segment size lasts: a :class:`Phase` is the run of steps over which the
  schedule seals at most one segment a step onto its grid and does not rebuild (a rebuild starts the next
  one). Its numbers per step (the grid, the segments the budget buys, the shortlist's size) are computed on
  the host by the method's own functions (:meth:`SegmentSearch.segments_for`, :meth:`Rerank.shortlist_size`),
  once per phase, and uploaded as small tables the step indexes with ``position``; the widest of them sets
  the shapes, narrower steps mask;
* the structure is the decode state's own: at a phase's start the host advances the state's length and
  calls its restructure, so the grid and the summaries are the ones the eager step builds (same code); a
  step that seals a segment summarises it on the device with the summary's own ``summarize`` (and a merged
  rest's sums), into storage reserved for the phase's widest grid.

A step attends two parts joined by their log-sum-exps: the **region** (the sinks and the selected segments,
fixed for the phase, so the state's own backend kernel reads it in place: the C kernel on the CPU, Triton on
a GPU; a torch gather for a backend without the log-sum-exp op) and the **tail** after the first step's grid
(``max(256, 2 sqrt(t))`` tokens at most, torch, masked past the length and before the step's own grid's end). The rerank's exact masses run on the state's own kernel too.

A split between heads (:class:`~sparseattn.allocations.PooledMass`) lists the phase's widest ``cap x k`` per
head and flags, by rank against the step's ``k`` read off the table, what its plan takes
(:class:`~sparseattn.allocations.base.FixedShapePlan`); its shares need the mass of the sinks and the tail, which
the step has anyway (the tail's logits are computed once for both). A merged rest
(:class:`~sparseattn.methods.rest.MergedRest`) joins the region and the tail by :func:`add_merged_rest`, from the
sums the state keeps (fixed while the grid is): so the preset ``radar+adaptive`` runs here.

What runs: :class:`~sparseattn.methods.dense.Dense` (every token before its :class:`DensePhase` is its region) and a :class:`SegmentSearch`
whose summary scores from its summaries alone, or a :class:`~sparseattn.summaries.Rerank` over such a summary;
the ``TopK`` selector; an even split or one with a fixed-shape plan; no ``always`` or ``refine`` part; no rest
or a merged one (:func:`static_refusal` says why otherwise). tests/test_static_loop.py checks every step
against the state's own (float64 and float32).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sparseattn.allocations.base import FixedShapePlan, log_total_mass
from sparseattn.allocations.uniform import Uniform
from sparseattn.backends.base import SegmentAttentionLSE
from sparseattn.backends.registry import select_backend
from sparseattn.methods.dense import Dense, DenseState
from sparseattn.methods.layers import layer_method
from sparseattn.methods.rest import MergedRest, add_merged_rest, segment_sums
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.methods.segment_state import SegmentSearchState
from sparseattn.ops.attention import soft_cap
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.ranking import top_within
from sparseattn.ops.segments import RestSums
from sparseattn.schedules.base import SegmentGrid
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import SegmentKeys, segment_log_mass
from sparseattn.summaries.rerank import Rerank


def _segment_refusal(method: SegmentSearch, capture: bool = False) -> str | None:
    summary = method.summary
    if isinstance(summary, Rerank):
        if summary.prefilter or summary.unit:
            return "Rerank's prefilter and unit options are not in the fixed-shape step"
        if method.shared_kv_selection:
            return "a shared KV-group selection over a Rerank is not in the fixed-shape step"
        summary = summary.coarse
    if summary.reads_keys:
        return f"{summary!r} reads the segments' keys to score them (O(t) a step, no fixed shape)"
    if capture and getattr(summary, "reads_back", False):
        return f"{summary!r} reads a value back to the host when it scores, which no CUDA graph captures"
    if type(method.selector) is not TopK:
        return f"the selector {method.selector!r}: the fixed-shape step keeps the top-k (TopK)"
    if not isinstance(method.allocation, (Uniform, FixedShapePlan)):
        return f"the split {method.allocation!r} has no plan in fixed shapes (Uniform and PooledMass have: plan_fixed)"
    if method.rest is not None and not isinstance(method.rest, MergedRest):
        return f"its rest part {method.rest!r}: the fixed-shape step merges the rest (MergedRest) or drops it"
    for name in ("always", "refine"):
        if getattr(method, name) is not None:
            return f"its {name} part {getattr(method, name)!r} is not in the fixed-shape step"
    return None


def static_refusal(method, n_layers: int | None = None, *, capture: bool = False) -> str | None:
    """Why ``method`` cannot decode through fixed-shape steps (in any of ``n_layers`` layers; with ``capture``, steps
    a CUDA graph captures), or None. Asked before any work: a loop that cannot run a method says so at its start.

    >>> from sparseattn import registry
    >>> static_refusal(registry.build("radar+", budget=512)) is None
    True
    >>> static_refusal(registry.build("radar+adaptive", budget=512), n_layers=30) is None
    True
    >>> static_refusal(registry.build("radar+", budget=512, rest="sampled"))
    'layer 0: its rest part SampledRest(samples=32, delta=0.05, seed=0): the fixed-shape step merges the rest (MergedRest) or drops it'
    """
    layers = range(n_layers) if n_layers else [0]
    for idx in layers:
        plain = layer_method(method, idx, n_layers)
        if isinstance(plain, Dense):
            continue
        if not isinstance(plain, SegmentSearch):
            return f"layer {idx}: {type(plain).__name__} has no fixed-shape step (Dense and SegmentSearch have)"
        reason = _segment_refusal(plain, capture)
        if reason is not None:
            return f"layer {idx}: {reason}"
    return None


#: The widest tail a phase may reach, at least (tokens; 2 sqrt(t) when larger): see :func:`tail_reach`.
SEALING_TAIL = 256


def tail_reach(length: int) -> int:
    """The widest tail a phase may still read at length ``length``: ``max(SEALING_TAIL, 2 sqrt t)`` tokens. The tail
    is copied whole every step (a few hundred tokens), so a phase whose tail keeps growing (one that seals segments,
    or dense's) ends there: a step's tail stays O(sqrt t) however long the generation, as ``SqrtSchedule``'s buffer
    between rebuilds does."""
    return max(SEALING_TAIL, 2 * math.isqrt(length))


@dataclass(frozen=True)
class Phase:
    """The steps over which a layer's shapes hold: its segment size and the region's start stay, and the grid grows
    by at most one segment a step (sealed by the step itself, on the device), until a rebuild.

    ``first`` is the length (tokens stored, the step's own included) at the phase's first step; step ``i``
    of the phase has length ``first + i``, a grid of ``segments[i]`` segments (``grid`` is the first step's) and
    a tail from ``tail_starts[i]``; its budget buys ``k[i]`` segments per head, of its ``width[i]`` best listed
    (``k[i]`` under an even split, up to ``cap x k[i]`` under a pooled one: :meth:`SegmentSearch.reach`) after
    reranking ``shortlist[i]`` (0 without a :class:`Rerank`); ``merged[i]``: the rest's merged tokens.
    """

    grid: SegmentGrid
    first: int
    sink_end: int
    k: tuple[int, ...]
    shortlist: tuple[int, ...]
    width: tuple[int, ...]
    merged: tuple[int, ...]
    segments: tuple[int, ...]
    tail_starts: tuple[int, ...]

    @property
    def steps(self) -> int:
        return len(self.k)

    @property
    def last(self) -> int:
        """The length at the phase's last step."""
        return self.first + self.steps - 1

    @property
    def tail_start(self) -> int:
        """Where the first step's tail starts: the widest tail's start."""
        return self.tail_starts[0]

    @property
    def tail(self) -> int:
        """The widest tail of the phase's steps: from the first step's start to the last step's length."""
        return self.last - self.tail_start

    @property
    def n_segments(self) -> int:
        """The most segments a step of the phase has (its last step's)."""
        return self.segments[-1]

    def grid_at(self, step: int) -> SegmentGrid:
        """The grid at step ``step`` of the phase."""
        return dataclasses.replace(self.grid, n_segments=self.segments[step])

    def attended(self, step: int) -> int:
        """Tokens a query head attends at step ``step`` of the phase (on average over a layer's heads under a split)."""
        merged = self.merged[step] if self.k[step] < self.segments[step] else 0
        return self.sink_end + self.k[step] * self.grid.segment_size + self.first + step - self.tail_starts[step] + merged


def _layout(method: SegmentSearch, grid: SegmentGrid, length: int) -> SegmentLayout:
    return SegmentLayout(length=length, sinks=method.sinks, segment_size=grid.segment_size, n_segments=grid.n_segments, window=method.window)


def _segmentable(method: SegmentSearch, length: int) -> int:
    """As :meth:`SegmentSearchState._segmentable`, for a length the state has not reached yet."""
    return max(0, length - min(method.sinks, length) - method.held_back)


def plan_phase(method: SegmentSearch, grid: SegmentGrid | None, first: int, last: int) -> Phase:
    """The phase that starts at length ``first`` (the grid ``grid`` before it), up to length ``last``: it runs while
    the schedule seals at most one segment a step onto the grid it plans at ``first`` (same size, no rebuild; a grid
    of none yet seals nothing within a phase) and the region's start stays (it moves only while the length is below
    the sinks). A phase that seals ends once its widest tail (from its first step's grid) would pass
    :func:`tail_reach`. The host's work, on numbers it knows: no device read."""
    if last < first:
        raise ValueError(f"plan_phase: last ({last}) must be >= first ({first})")
    start = method.schedule.plan(_segmentable(method, first), grid)
    ks, shortlists, widths, merged, segments, tails = [], [], [], [], [], []
    summary, rest = method.summary, method.rest
    opening = _layout(method, start, first)
    now = start
    for length in range(first, last + 1):
        if length > first:
            planned = method.schedule.plan(_segmentable(method, length), now)
            if planned != now and (planned.is_rebuild_of(now) or planned.n_segments != now.n_segments + 1 or not start.n_segments):
                break
            now = planned
            if now != start and length - opening.tail_start > tail_reach(length):
                break
        layout = _layout(method, now, length)
        if layout.sink_end != opening.sink_end or layout.tail_start != layout.segment_end:
            break  # the region moved (a prompt shorter than the sinks), or a window reaches into it: the next phase
        S = now.n_segments
        k = method.segments_for(layout)
        width = method.reach(k, S)
        m = summary.shortlist_size(width, S) if isinstance(summary, Rerank) else 0
        if isinstance(summary, Rerank) and summary.shortlist and m < width:
            raise ValueError(
                f"{summary!r} shortlists {m} segments at t={length}, fewer than the {width} a head may attend: the "
                "fixed-shape step reads the selection off the shortlist; use factor >= 1 or a larger shortlist"
            )
        ks.append(k)
        shortlists.append(m)
        widths.append(width)
        merged.append(rest.blocks(S) if rest is not None else 0)
        segments.append(S)
        tails.append(layout.tail_start)
    return Phase(start, first, opening.sink_end, *map(tuple, (ks, shortlists, widths, merged, segments, tails)))


@torch.compiler.disable
def _untraced(op, *args):
    """``op(*args)`` run as it is when a compiled step calls it: a backend's kernel (C through ctypes, or a Triton
    launch with its own workspace) is not for the compiler to trace; the graph breaks around it."""
    return op(*args)


def _softmax_parts(
    logits: torch.Tensor, valid: torch.Tensor, values: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(logits) @ values, logsumexp(logits))`` over the ``valid`` entries: logits ``[B, H, G, N]``, values
    ``[B, H, N, D]`` (one set for the group's query heads) or ``[B, H, G, N, D]``. A row with none valid gets output 0
    and log-sum-exp -inf: it weighs nothing when joined to another part."""
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse.clamp(min=torch.finfo(logits.dtype).min).unsqueeze(-1))
    if values.dim() == 4:
        return weights @ values, lse
    return (weights.unsqueeze(-2) @ values).squeeze(-2), lse


def _shortlisted(coarse: torch.Tensor, short: torch.Tensor, exact: torch.Tensor, listed: torch.Tensor) -> torch.Tensor:
    """A :class:`~sparseattn.summaries.base.Shortlist`'s ``scores`` when only the ``listed`` columns of a phase's
    widest shortlist ``short: [B, H, G, m]`` are this step's: the coarse scores ``[B, H, G, S]`` shifted below
    the least listed exact mass, the listed exact masses in place (what a split's total mass sums)."""
    least = exact.masked_fill(~listed, float("inf")).amin(-1, keepdim=True)
    shifted = coarse - ((coarse.amax(-1, keepdim=True) - least).clamp(min=0) + 1.0)
    return shifted.scatter(-1, short, torch.where(listed, exact, shifted.gather(-1, short)))


class _Reserved:
    """A prefilled state's storage reserved for ``capacity`` tokens (``[B, H_kv, capacity, D]`` views at fixed
    addresses), and what a fixed-shape step does with it: store the token at a device position, attend."""

    def __init__(self, state: SegmentSearchState | DenseState, capacity: int) -> None:
        if capacity <= state.length:
            raise ValueError(f"{type(self).__name__}: capacity must exceed the {state.length} tokens stored, got {capacity}")
        self.state = state
        self.capacity = capacity
        state._keys.reserve(capacity)
        state._values.reserve(capacity)

    def finish(self, length: int) -> None:
        """After the loop: the state counts the ``length`` tokens the steps stored (it can be read or stepped again)."""
        self.state._keys.fill_to(length)
        self.state._values.fill_to(length)

    def _check_fits(self, phase: Phase | DensePhase) -> None:
        """Refuse a phase whose steps would store past the reserved capacity (before any work)."""
        if phase.last > self.capacity:
            raise ValueError(f"the phase reaches length {phase.last}, past the reserved capacity {self.capacity}")

    def _reserved(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state._keys.storage.narrow(2, 0, self.capacity), self.state._values.storage.narrow(2, 0, self.capacity)

    def _store(self, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> None:
        keys, values = self._reserved()
        keys.index_copy_(2, position, key.unsqueeze(2))
        values.index_copy_(2, position, value.unsqueeze(2))

    def _attend(
        self, grouped: torch.Tensor, region: SegmentLayout, segments: torch.Tensor | None, kept: torch.Tensor | None,
        tail: tuple[torch.Tensor, torch.Tensor] | None, rest: RestSums | None = None,
        listing: tuple[torch.Tensor, torch.Tensor] | None = None, counts: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Attention ``[B, H_kv, G, D]`` (compute dtype) of ``grouped`` over two parts joined by their log-sum-exps:
        the ``region`` (its sinks and the listed ``segments`` whose ``kept`` is set; fixed for the phase, so the
        backend's kernel reads it in place), and the ``tail`` (its logits and which are reached,
        :meth:`_tail_logits`); with ``rest``, the merged tokens of the region's segments left out join the same
        softmax (:func:`add_merged_rest`: the tail lies after every block), reading the selection as ``listing``
        (segments and flags) when given, each block holding ``counts`` tokens."""
        parts = []
        if region.sink_end or segments is not None:
            parts += self._region(grouped, region, segments, kept)
        if tail is not None:
            parts.append(self._tail(tail))
        if len(parts) == 1 and rest is None:
            return parts[0][0]
        lse = torch.stack([part[1] for part in parts])  # [parts, B, H_kv, G]
        top = lse.amax(dim=0)
        weights = torch.exp(lse - top.clamp(min=torch.finfo(lse.dtype).min)).unsqueeze(-1)
        total = weights.sum(dim=0)
        out = sum(w * out for w, (out, _) in zip(weights, parts)) / total
        if rest is None:
            return out
        state = self.state
        keys, values = self._reserved()
        lse = top + total.squeeze(-1).log()
        listed, flags = listing if listing is not None else (segments, kept)
        return add_merged_rest(
            out, lse, grouped, keys, values, region, listed, flags, rest, state.scale, state.softcap, state._workspace, counts
        ).to(out.dtype)  # fmt: skip

    def _region(
        self, grouped: torch.Tensor, region: SegmentLayout, segments: torch.Tensor | None, kept: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(out, lse)`` parts over the region: one, by the state's backend kernel when it returns log-sum-exps
        (:class:`~sparseattn.backends.base.SegmentAttentionLSE`: the C kernel, Triton), else two in torch: the
        sinks (read in place for the group's query heads) and the listed segments' tokens (gathered per head)."""
        state = self.state
        B, H, G, D = grouped.shape
        keys, values = self._reserved()
        if segments is None:
            segments = torch.zeros(B, H, 1, 0, dtype=torch.long, device=grouped.device)
        backend = self._lse_backend(grouped)
        if backend is not None:
            out, lse = _untraced(backend.segment_attention_lse, grouped, keys, values, region, segments, kept, state.scale, state.softcap)
            return [(out.to(state.compute_dtype), lse.to(state.compute_dtype))]
        cd = state.compute_dtype
        q = grouped.to(cd)
        parts = []
        n, k = region.sink_end, segments.shape[-1]
        if n:
            sinks = torch.ones(n, dtype=torch.bool, device=grouped.device)
            logits = q @ keys.narrow(2, 0, n).to(cd).transpose(-1, -2) * state.scale
            parts.append(_softmax_parts(logits, sinks, values.narrow(2, 0, n).to(cd), state.softcap))
        if k:
            c = region.segment_size
            index = (n + segments.expand(B, H, G, k).unsqueeze(-1) * c + torch.arange(c, device=grouped.device)).flatten(-2)
            gather = index.unsqueeze(-1).expand(*index.shape, D)
            k_sel = keys.unsqueeze(2).expand(B, H, G, self.capacity, D).gather(3, gather).to(cd)
            v_sel = values.unsqueeze(2).expand(B, H, G, self.capacity, D).gather(3, gather).to(cd)
            logits = (q.unsqueeze(-2) @ k_sel.transpose(-1, -2)).squeeze(-2) * state.scale
            valid = kept.expand(B, H, G, k).unsqueeze(-1).expand(B, H, G, k, c).flatten(-2)
            parts.append(_softmax_parts(logits, valid, v_sel, state.softcap))
        return parts

    def _tail_logits(
        self, grouped: torch.Tensor, length: torch.Tensor, start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tail's logits ``[B, H_kv, G, width]`` (``scale q . k``, not soft-capped) over the phase's widest tail
        (positions ``tail_start .. tail_start + width - 1``) and which of them are this step's (``< length``, and from
        ``start`` on: the step's own tail, after what its grid has sealed); None without a tail. Computed once a
        step: the attention over the tail and a split's always-attended mass read them."""
        if not self._tail_width:
            return None
        state = self.state
        keys = self._reserved()[0]
        # Copied whole (a few hundred tokens: SEALING_TAIL): a batched product over strided slices of the storage runs ~10x slower.
        k_tail = keys.narrow(2, self._tail_start, self._tail_width).to(state.compute_dtype).contiguous()
        logits = grouped.to(state.compute_dtype) @ k_tail.transpose(-1, -2) * state.scale  # the group's heads as rows
        reached = self._tail_positions < length  # positions: made once per phase
        return logits, reached if start is None else reached & (self._tail_positions >= start)

    def _tail(self, tail: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` over the tail, from its logits (:meth:`_tail_logits`)."""
        state = self.state
        logits, reached = tail
        v_tail = self._reserved()[1].narrow(2, self._tail_start, self._tail_width).to(state.compute_dtype).contiguous()
        return _softmax_parts(logits, reached, v_tail, state.softcap)

    def _lse_backend(self, grouped: torch.Tensor):
        """The backend with the log-sum-exp op this step reads its region with, or None (a torch gather)."""
        raise NotImplementedError


class StaticSegmentStep(_Reserved):
    """A :class:`SegmentSearchState`'s decode step in fixed shapes (see the module's description).

    Args:
        state: a prefilled state (its prompt stored, its structure built).
        capacity: tokens the storage is reserved for: the prompt and every token to be generated.
    """

    def __init__(self, state: SegmentSearchState, capacity: int) -> None:
        reason = _segment_refusal(state.method)
        if reason is not None:
            raise ValueError(f"StaticSegmentStep: {reason}")
        super().__init__(state, capacity)
        self.phase: Phase | None = None

    def plan(self, first: int, last: int) -> Phase:
        """The phase that starts at length ``first`` (from the state's grid, as the steps before left it)."""
        self._commit(first - 1)
        return plan_phase(self.state.method, self.state.grid, first, last)

    def begin(self, phase: Phase) -> None:
        """Host side, outside any graph: the state's structure at ``phase.first`` (as its own append would build
        it: the step's token is not written yet, and never segmented at its own step), its buffers reserved for the
        segments the phase seals, and the phase's tables."""
        state = self.state
        self._check_fits(phase)
        self._commit(phase.first - 1)
        state._keys.fill_to(phase.first)
        state._values.fill_to(phase.first)
        state._restructure()
        if state.grid != phase.grid:
            raise RuntimeError(f"the state restructured to {state.grid}, its plan said {phase.grid}")
        self.phase = phase
        device = state.device
        S, c = phase.n_segments, phase.grid.segment_size
        rest = state.method.rest
        if phase.grid.n_segments:
            # The segments the phase seals are summarised by its steps, into storage reserved now (it must not move
            # under a graph): each summary's, and a merged rest's segment sums and block sums (new blocks from zero).
            for buf in [*state._summaries, *state._segment_sums]:
                buf.reserve(S)
            if state._rest_sums:
                blocks, grown = rest.blocks(phase.grid.n_segments), rest.blocks(S)
                for buf in state._rest_sums:
                    buf.reserve(grown)
                    buf.storage.narrow(2, blocks, grown - blocks).zero_()
        self._summaries = tuple(buf.storage.narrow(2, 0, S) for buf in state._summaries) if S else ()
        table = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self._k, self._m, self._w = table(phase.k), table(phase.shortlist), table(phase.width)
        self._segments, self._tail_starts = table(phase.segments), table(phase.tail_starts)
        self._seals = S > phase.grid.n_segments  # the steps seal segments themselves
        self._sealed = torch.tensor([False] + [b > a for a, b in zip(phase.segments, phase.segments[1:])], device=device)
        self._segment_ids = torch.arange(S, device=device)
        self._k_max, self._m_max, self._w_max = max(phase.k), max(phase.shortlist), max(phase.width)
        # A merged rest reads the sums the state keeps of its segments (the whole storage: rows at a fixed stride)
        # and blocks, and counts each block's tokens at the step's grid.
        self._rest = None
        if rest is not None and self._k_max:
            self._rest = RestSums(state._segment_sums[0].storage, *(b.storage.narrow(2, 0, rest.blocks(S)) for b in state._rest_sums), rest.per_block)
        # The region the backend's kernel reads in place (sinks and the phase's widest grid); the tail after the
        # first step's grid, each step masking what its own grid has sealed since.
        self._region_layout = SegmentLayout(length=phase.sink_end + S * c, sinks=phase.sink_end, segment_size=c, n_segments=S)
        self._tail_start, self._tail_width = phase.tail_start, phase.tail
        # Made once per phase, not per step: the tail's positions.
        self._tail_positions = phase.tail_start + torch.arange(phase.tail, device=device)
        # The narrowest sizes too: a step's top-n is the phase's widest top-n, of which the least are ranked.
        split = not isinstance(state.method.allocation, Uniform)
        self._m_min, self._best_min = min(phase.shortlist), min(phase.width if split else phase.k)

    def finish(self, length: int) -> None:
        """After the loop: the state counts the ``length`` tokens the steps stored and the segments they sealed."""
        self._commit(length)
        super().finish(length)

    def _commit(self, length: int) -> None:
        """The host's count of what the phase's steps up to ``length`` sealed on the device: the state's grid and
        its buffers' lengths (nothing to do before a phase or when its steps sealed nothing)."""
        phase, state = self.phase, self.state
        if phase is None or not self._seals or length < phase.first:
            return
        S = phase.segments[min(length, phase.last) - phase.first]
        state._grid = phase.grid_at(min(length, phase.last) - phase.first)
        for buf in [*state._summaries, *state._segment_sums]:
            buf.fill_to(S)
        for buf in state._rest_sums:
            buf.fill_to(state.method.rest.blocks(S))

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Store ``key, value: [B, H_kv, D]`` at ``position`` (int64 ``[1]``, on the state's device) and attend with
        ``query: [B, H_q, D]``: ``[B, H_q, D]`` in the query's dtype. Fixed shapes within the phase, no host read."""
        state, phase = self.state, self.phase
        B, H, D = state.batch, state.kv_heads, state.head_dim
        self._store(key, value, position)
        state._nonfinite |= ~(torch.isfinite(key).all(-1) & torch.isfinite(value).all(-1))
        length = position + 1
        row = length - phase.first
        if self._seals:
            self._seal(row)
        grouped = query.reshape(B, H, -1, D)
        tail = self._tail_logits(grouped, length, self._tail_starts[row])
        segments, kept, listing = self._select(grouped, row, tail) if self._k_max else (None, None, None)
        out = self._attend(grouped, self._region_layout, segments, kept, tail, self._rest, listing, self._block_counts(row))
        out = out.masked_fill(state._nonfinite[:, :, None, None], float("nan"))
        return out.reshape(B, -1, D).to(query.dtype)

    def _seal(self, row: torch.Tensor) -> None:
        """The grid's newest segment summarised as the state's own append summarises a sealed one (its keys scaled,
        the summary's ``summarize``; a merged rest's segment and block sums), written in place: at a step that seals
        it, or again, unchanged, at a step that does not (the block sums then add zeros). One shape every step."""
        state, phase = self.state, self.phase
        c = phase.grid.segment_size
        newest = (self._segments[row] - 1).view(1)  # the phase starts with a segment: never below 0
        positions = phase.sink_end + newest * c + torch.arange(c, device=newest.device)
        keys, values = self._reserved()
        seg_keys = keys.index_select(2, positions).unsqueeze(2)  # [B, H, 1, c, D]
        for buf, summary in zip(self._summaries, state.method.summary.summarize(state._params, state.scaled(seg_keys))):
            buf.index_copy_(2, newest, summary.to(buf.dtype))
        rest = state.method.rest
        if state._rest_sums:
            seg_values = values.index_select(2, positions).unsqueeze(2)
            k_sum, v_sum = segment_sums(seg_keys, seg_values, torch.float64)  # [B, H, 1, D], as the state sums them
            state._segment_sums[0].storage.index_copy_(2, newest, torch.cat([k_sum, v_sum], dim=-1).to(torch.float32))
            sealed = self._sealed[row]
            block = newest.div(rest.per_block, rounding_mode="floor")
            for buf, add in zip(state._rest_sums, (k_sum, v_sum)):
                buf.storage.index_add_(2, block, add.masked_fill(~sealed, 0.0))

    def _block_counts(self, row: torch.Tensor) -> torch.Tensor | None:
        """Tokens in each of a merged rest's blocks at the step's grid (a block not begun: 0), or None without a rest."""
        if self._rest is None:
            return None
        per = self._rest.per_block
        left = self._segments[row] - torch.arange(self._rest.block_k.shape[2], device=self._segments.device) * per
        return (left.clamp(0, per) * self.phase.grid.segment_size).to(torch.float64)

    def _select(
        self, grouped: torch.Tensor, row: torch.Tensor, tail: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The phase's widest listing ``[B, H, G, n]`` (in no order) and which entries this step attends: its best
        ``k[row]`` under an even split; under a split with a fixed-shape plan, what the plan flags among its best
        ``width[row]`` (ranked by the summary's scores, or a :class:`Rerank`'s exact masses over its shortlist).
        Third, for a merged rest, the same selection as a KV group's shortlist ``[B, H, 1, m]`` and each head's flags
        ``[B, H, G, m]`` (the rest then reads each shortlisted segment's sums once for the group), or None."""
        state, phase = self.state, self.phase
        method, summary = state.method, state.method.summary
        B, H, G, D = grouped.shape
        c = phase.grid.segment_size
        split = not isinstance(method.allocation, Uniform)
        widest, n = (self._w_max, self._w[row]) if split else (self._k_max, self._k[row])
        queries = state.scaled(grouped)
        if isinstance(summary, Rerank) and summary.shortlist:
            coarse = self._sealed_only(summary.coarse.score(state._params, self._summaries, queries, None, c), row)  # [B, H, G, S]
            ranked = torch.logsumexp(coarse, dim=2, keepdim=True) if summary.per_group else coarse
            _, short, listed = top_within(ranked, self._m_max, self._m_min, self._m[row])  # [B, H, G', m_max]
            short, listed = short.expand(B, H, G, self._m_max), listed.expand(B, H, G, self._m_max)
            exact = self._log_mass(queries, short[:, :, : ranked.shape[2]]).masked_fill(~listed, float("-inf"))
            values, best, attends = top_within(exact, widest, self._best_min, n)
            segments = short.gather(-1, best)
            scores = _shortlisted(coarse, short, exact, listed) if split else None  # what a split's total mass sums
        else:
            if method.shared_kv_selection:  # the group's summed masses, as the state's own step sums them
                scores = state.group_scores(grouped, summaries=self._summaries)  # [B, H, 1, S]
            else:
                scores = summary.score(state._params, self._summaries, queries, None, c)  # [B, H, G, S]
            scores = self._sealed_only(scores, row)
            values, segments, attends = top_within(scores, widest, self._best_min, n)
        if self._seals:  # a segment not sealed yet is never attended, even on a tie of -inf scores
            attends = attends & (segments < self._segments[row])
        if split:
            always = self._always_log_mass(grouped, tail)  # [B, H, G]
            if scores.shape[2] == 1:  # a shared selection: its group's summed mass
                always = torch.logsumexp(always, dim=2, keepdim=True)
            bounds = (min(phase.k), self._k_max)
            attends = method.allocation.plan_fixed(values, log_total_mass(scores, always), self._k[row], attends, bounds)
        listing = None
        if self._rest is not None and isinstance(summary, Rerank) and summary.shortlist and summary.per_group:
            flags = torch.zeros(B, H, G, self._m_max, dtype=torch.bool, device=grouped.device).scatter_(-1, best, attends)
            listing = (short[:, :, :1], flags)
        return segments.expand(B, H, G, widest), attends.expand(B, H, G, widest), listing

    def _sealed_only(self, scores: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """``scores [..., S]`` over the phase's widest grid, the segments the step's grid has not sealed at -inf."""
        if not self._seals:
            return scores
        return scores.masked_fill(self._segment_ids >= self._segments[row], float("-inf"))

    def _always_log_mass(self, grouped: torch.Tensor, tail: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``[B, H_kv, G]`` the log mass of the sinks and the tail reached, on the scale of the segment scores (not
        soft-capped): as :meth:`SegmentSearchState.always_log_mass`, from the tail's logits the step has anyway."""
        state = self.state
        cd = state.compute_dtype
        mass = torch.full(grouped.shape[:3], float("-inf"), dtype=cd, device=grouped.device)
        if self.phase.sink_end:
            sinks = self._reserved()[0].narrow(2, 0, self.phase.sink_end).to(cd)
            mass = torch.logsumexp(grouped.to(cd) @ sinks.transpose(-1, -2) * state.scale, dim=-1)
        if tail is not None:
            logits, reached = tail
            mass = torch.logaddexp(mass, torch.logsumexp(logits.masked_fill(~reached, float("-inf")), dim=-1))
        return mass

    def _log_mass(self, queries: torch.Tensor, short: torch.Tensor) -> torch.Tensor:
        """Exact log masses ``[B, H, G, m]`` of the shortlisted segments ``short: [B, H, G', m]``, by the kernel the
        state's own step runs (:func:`~sparseattn.summaries.base.segment_log_mass`: keys read in place, once per list)."""
        state, phase = self.state, self.phase
        B, H, D = state.batch, state.kv_heads, state.head_dim
        c, S = phase.grid.segment_size, phase.n_segments
        raw = self._reserved()[0].narrow(2, phase.sink_end, S * c).view(B, H, S, c, D)
        if state._mass_backend is None:  # as the state's step chooses it, once
            state._mass_backend = select_backend("auto", "segment_log_mass", q=queries, keys=raw)
        keys = SegmentKeys(raw, math.sqrt(state.scale), state.compute_dtype, state._workspace, state._mass_backend)
        return _untraced(segment_log_mass, keys, queries, short)

    def _lse_backend(self, grouped: torch.Tensor):
        state = self.state
        state._select_backend(grouped)  # as the state's own step chooses it, once
        return state._backend if "lse" in state._kernels else None


@dataclass(frozen=True)
class DensePhase:
    """The steps over which a dense layer's shapes hold: every token stored before the phase is its region (read in
    place, as sinks), the tokens its steps store are the tail, up to :func:`tail_reach` of them. Step ``i`` has
    length ``first + i`` and attends all of it."""

    first: int
    steps: int

    @property
    def last(self) -> int:
        """The length at the phase's last step."""
        return self.first + self.steps - 1

    @property
    def tail_start(self) -> int:
        return self.first - 1

    def attended(self, step: int) -> int:
        return self.first + step


def plan_dense_phase(first: int, last: int) -> DensePhase:
    """The dense phase from length ``first`` up to length ``last``, ended where its tail would pass :func:`tail_reach`."""
    if last < first:
        raise ValueError(f"plan_dense_phase: last ({last}) must be >= first ({first})")
    length = first
    while length < last and length + 1 - (first - 1) <= tail_reach(length + 1):
        length += 1
    return DensePhase(first, length - first + 1)


class StaticDenseStep(_Reserved):
    """A :class:`DenseState`'s decode step in fixed shapes: the tokens stored before the phase as one fixed region (the
    backend's kernel, every token a sink, when it returns log-sum-exps), the phase's own tokens as the tail, joined by
    log-sum-exp. Phases (:class:`DensePhase`) keep the tail, copied whole every step, O(sqrt t) wide: one phase for the
    whole generation would read every generated token as tail, O(N^2) over N tokens."""

    def __init__(self, state: DenseState, capacity: int) -> None:
        super().__init__(state, capacity)
        self.phase: DensePhase | None = None

    def plan(self, first: int, last: int) -> DensePhase:
        return plan_dense_phase(first, last)

    def begin(self, phase: DensePhase) -> None:
        """Host side, outside any graph: the region and the tail of ``phase``."""
        self._check_fits(phase)
        self.phase = phase
        n = phase.tail_start
        self._region_layout = SegmentLayout(length=n, sinks=n, segment_size=1, n_segments=0)
        self._tail_start, self._tail_width = n, phase.steps
        self._tail_positions = n + torch.arange(phase.steps, device=self.state.device)

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        state = self.state
        B, H, D = state.batch, state.kv_heads, state.head_dim
        self._store(key, value, position)
        grouped = query.reshape(B, H, -1, D)
        out = self._attend(grouped, self._region_layout, None, None, self._tail_logits(grouped, position + 1))
        return out.reshape(B, -1, D).to(query.dtype)

    def _lse_backend(self, grouped: torch.Tensor):
        backend = self.state._backend
        return backend if isinstance(backend, SegmentAttentionLSE) else None


def static_step(state, capacity: int) -> StaticSegmentStep | StaticDenseStep:
    """The fixed-shape step of a prefilled decode state, its storage reserved for ``capacity`` tokens."""
    if isinstance(state, SegmentSearchState):
        return StaticSegmentStep(state, capacity)
    if isinstance(state, DenseState):
        return StaticDenseStep(state, capacity)
    raise ValueError(f"{type(state).__name__} has no fixed-shape step (DenseState and SegmentSearchState have)")


__all__ = [
    "DensePhase", "Phase", "StaticDenseStep", "StaticSegmentStep", "plan_dense_phase", "plan_phase", "static_refusal",
    "static_step", "tail_reach",
]
