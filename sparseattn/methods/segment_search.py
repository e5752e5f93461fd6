"""Segment search: summary x selector x schedule, and Radar as its authors ran it as its preset."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from sparseattn.allocations.base import Allocation, Selection, SelectStage
from sparseattn.allocations.uniform import Uniform
from sparseattn.backends.base import EXTENSION_OPS
from sparseattn.backends.registry import check_backend_name, select_backend
from sparseattn.methods.always import AlwaysKept, kept_tokens
from sparseattn.methods.base import KVState, LayerSpec, StatefulMethod
from sparseattn.methods.eviction import Candidates, finite_evidence, observe_prompt
from sparseattn.methods.rest import Rest, group_blocks, segment_sums
from sparseattn.ops.attention import segment_mask
from sparseattn.ops.buffers import GrowableBuffer, Workspace
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.attention import gather_tokens
from sparseattn.ops.tokens import token_attention
from sparseattn.registry import MethodEntry, Option, Range, register
from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.schedules.base import Schedule, SegmentGrid
from sparseattn.validation import check_int
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.base import Selector, has_distinct_indices, selector_seed
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import GroupScoringSummary, SegmentKeys, ShortlistingSummary, Summary, TopKAwareSummary
from sparseattn.summaries.performer import PerformerFeatures

# Tokens x heads summarised at once during a rebuild: bounds the [.., c, n_features] temporary.
_SUMMARY_CHUNK = 8192

#: The attend stage's capability table: what a step needs (a :attr:`Selection.need`, or ``"lse"`` when a
#: ``rest`` joins a selection of whole segments, ``"merged"`` when it can do so inside the kernel) -> the
#: backend op that runs it in one call (the optional ops' capabilities are the backends' one table,
#: :data:`~sparseattn.backends.base.EXTENSION_OPS`; ``segment_attention`` every backend of the state runs).
#: A decode state resolves it once for the backend it chose; a need its backend lacks runs the torch gather path.
KERNEL_CAPABILITIES: dict[str, str] = {
    "segments": "segment_attention",
    "masked": "segment_attention_masked",
    "lse": "segment_attention_lse",
    "merged": "segment_attention_merged",
}


@dataclass(frozen=True)
class SegmentSearch(StatefulMethod):
    """Attend to the top segments of the past, found through per-segment summaries.

    The ``t`` stored tokens are split as ``[sinks | segments | tail]``:

    * the first ``sinks`` tokens, always attended;
    * the segmentable tokens: those after the sinks that have left the recent window, i.e. all but
      the last ``max(window, 1)`` tokens. ``schedule`` cuts them into equal segments (sealing new ones
      and rebuilding as it says); what does not fill a segment is the unsegmented remainder;
    * the tail: the remainder plus the last ``max(window, 1)`` tokens, always attended and never
      offered to the selector, so ``top_k`` segments are ``top_k`` segments *outside* the tail.

    The newest token (the one whose query is asked) is never sealed, even with ``window = 0``: it is
    always attended. (The paper's Algorithm 1 seals it into a segment at every perfect square, where
    it can then go unattended; no implementation should want that.)

    Per decode step: score the sealed segments with ``summary``, pick ``top_k`` of them with
    ``selector``, and attend to their tokens plus the sinks and the tail. Any summary x selector x
    schedule combination runs; with ``top_k`` >= the number of segments the output is exactly dense
    attention.

    A non-finite (NaN or infinite) key or value makes every later output of its batch row and KV
    head NaN, as dense attention's outputs are NaN there (an infinite key whose logits are all -inf
    is the one case where dense stays finite), whichever segments are selected; other rows and heads
    are untouched. A NaN query gives NaN for its own query head, as in dense attention.

    Args:
        summary: how segments are summarised and scored (e.g. :class:`PerformerFeatures`).
        selector: which scored segments are attended (e.g. :class:`TopK`).
        schedule: when segments are sealed and rebuilt (e.g. :class:`SqrtSchedule`).
        top_k: segments attended per step (at most all of them); ignored when ``budget`` is set.
        budget: if set, the number of past tokens a step may attend (sinks and tail included):
            each step attends ``max(1, (budget - sinks - tail) // c)`` segments, where ``tail`` is
            the remainder plus window it must keep and ``c`` the segment size. Below
            ``sinks + tail + c`` the floor of one segment exceeds the budget: ``attended`` reports
            it and the first such step warns (once per method instance) with the numbers.
        backend: which implementation attends over the selection: ``"auto"`` (the fastest that
            accepts the inputs: the Triton kernel on CUDA, the C kernel on the CPU, else torch), ``"torch"``,
            ``"cpu"``, ``"triton"`` or ``"xformers"`` (see :mod:`sparseattn.backends`); a named backend
            that refuses raises.
        sinks: first tokens, outside the segments, always attended.
        window: last tokens always attended and never segmented (the newest token never is, even
            with ``window = 0``); the schedule's remainder is attended on top of them.
        shared_kv_selection: one selection per KV head, from the group's summed estimated masses,
            instead of one per query head (cheaper gathers under grouped-query attention).
        always: an always-kept part (:mod:`sparseattn.methods.always`) whose tokens every step
            attends on top of the selection, e.g. ``HeavyHitters(64)``: H2O's heavy hitters plus
            segment search. Its ``size`` counts against ``budget``. It ranks every stored token (an
            O(t) pass over positions and, for heavy hitters, a 4-byte-per-token attention record,
            not over the keys), and the step runs the torch gather path (the fused kernels take
            contiguous ranges only).
        allocation: how the layer's segments are split between its heads (:mod:`sparseattn.allocations`),
            the step's select stage unless ``refine`` is set:
            :class:`~sparseattn.allocations.Uniform` (default) gives every selection ``k``;
            :class:`~sparseattn.allocations.PooledMass` gives more to heads whose attention is diffuse
            and fewer to peaked ones, ``k`` per selection on average, so a step's tokens over the
            layer's heads still honour ``budget`` (one head may attend more than ``budget``). A
            non-uniform split runs a backend's masked kernel where it has one
            (:class:`~sparseattn.backends.base.MaskedSegmentAttention`: the C kernel), else the
            torch gather path.
        refine: None, or a select stage run instead of the allocation's
            (:class:`~sparseattn.allocations.SelectStage`): :class:`~sparseattn.refine.TopTokens`
            shortlists more segments than the budget buys and attends the best tokens inside them
            (exact logits) instead of whole segments, the allocation then splitting tokens between
            heads (the torch gather path); any part with ``select_segments`` plugs in here.
        rest: None, or a part that joins what a step does not attend to its softmax
            (:class:`~sparseattn.methods.rest.Rest`), e.g. :class:`~sparseattn.methods.rest.MergedRest`;
            what it adds counts against ``budget``.
    """

    summary: Summary = field(default_factory=PerformerFeatures)
    selector: Selector = field(default_factory=TopK)
    schedule: Schedule = field(default_factory=SqrtSchedule)
    top_k: int = 64
    sinks: int = 0
    window: int = 0
    shared_kv_selection: bool = False
    budget: int | None = None
    backend: str = "auto"
    always: AlwaysKept | None = None
    allocation: Allocation = field(default_factory=Uniform)
    refine: SelectStage | None = None
    rest: Rest | None = None

    def __post_init__(self) -> None:
        if self.always is not None and (isinstance(self.always, type) or not isinstance(self.always, AlwaysKept)):
            raise ValueError(
                f"SegmentSearch.always must be None or an always-kept part instance (HeavyHitters(n), Sinks(n), a | b), got {self.always!r}"
            )
        for name, proto in (("summary", Summary), ("selector", Selector), ("schedule", Schedule), ("allocation", Allocation)):
            part = getattr(self, name)
            if isinstance(part, type):
                raise ValueError(f"SegmentSearch.{name} must be an instance of a {proto.__name__} part, got the class {part.__name__}; use {part.__name__}()")
            if not isinstance(part, proto):
                raise ValueError(
                    f"SegmentSearch.{name} must implement the {proto.__name__} protocol, got {getattr(self, name)!r}"
                )
        for name in ("top_k", "sinks", "window"):
            check_int("SegmentSearch", name, getattr(self, name), 0)
        if self.budget is not None:
            check_int("SegmentSearch", "budget", self.budget, 1, "or None: top_k segments")
        # The slots with a stage hook take any part that implements it (a protocol check, once, here).
        if self.refine is not None and (isinstance(self.refine, type) or not isinstance(self.refine, SelectStage)):
            raise ValueError(
                f"SegmentSearch.refine must be None or a TopTokens instance (or any part implementing the SelectStage "
                f"protocol: select_segments(step) -> Selection), got {self.refine!r}"
            )
        if self.rest is not None and (isinstance(self.rest, type) or not isinstance(self.rest, Rest)):
            raise ValueError(
                f"SegmentSearch.rest must be None or a MergedRest or SampledRest instance (or any part implementing the Rest "
                f"protocol: per_block, blocks, attend_segments, attend_tokens), got {self.rest!r}"
            )
        check_backend_name("SegmentSearch.backend", self.backend, "segment_attention", "auto", auto=True)

    @property
    def select_stage(self) -> SelectStage:
        """The part whose ``select_segments`` runs a step's select stage: ``refine`` if set, else ``allocation``."""
        return self.allocation if self.refine is None else self.refine

    def segments_for(self, layout: SegmentLayout) -> int:
        """Segments one step attends under this layout: ``top_k``, or what the ``budget`` leaves room for."""
        if self.budget is None:
            return min(self.top_k, layout.n_segments)
        if self.budget >= layout.length:  # everything fits: dense attention, whatever the always part adds
            return layout.n_segments
        room = self.budget - layout.sink_end - layout.tail_size - self.extra_tokens - self.merged_tokens(layout)
        return min(layout.n_segments, max(1, room // layout.segment_size))

    def tokens_for(self, layout: SegmentLayout, k: int) -> int:
        """Tokens a refined step (``refine``) picks per head outside the sinks and tail: what the ``budget``
        leaves (at least 1), or the tokens of ``k`` segments without a budget."""
        if self.budget is None:
            return k * layout.segment_size
        return max(1, self.budget - layout.sink_end - layout.tail_size - self.extra_tokens - self.merged_tokens(layout))

    @property
    def extra_tokens(self) -> int:
        """Tokens the ``always`` part may add to a step (0 without one)."""
        return 0 if self.always is None else self.always.size

    def merged_tokens(self, layout: SegmentLayout) -> int:
        """Merged tokens the ``rest`` part adds to a step that does not attend every segment (0 without one)."""
        return 0 if self.rest is None else self.rest.blocks(layout.n_segments)

    @property
    def held_back(self) -> int:
        """The newest tokens that are never segmented: the window, and at least the current token."""
        return max(self.window, 1)

    def _warn_over_budget(self, layout: SegmentLayout, k: int) -> None:
        """Warn, once per method instance, when a step attends more than ``budget`` tokens."""
        merged = self.merged_tokens(layout) if k < layout.n_segments else 0
        attended = min(layout.length, layout.max_attended(k) + self.extra_tokens + merged)
        if self.budget is None or attended <= self.budget or self.__dict__.get("_warned_over_budget"):
            return
        object.__setattr__(self, "_warned_over_budget", True)  # not a field: equality and repr unchanged
        remainder = layout.tail_size - min(self.held_back, layout.length - layout.sink_end)
        warnings.warn(
            f"SegmentSearch budget={self.budget} is below what it can honour: a step at t={layout.length} "
            f"attends {attended} of {layout.length} tokens = {layout.sink_end} sink(s) + a {layout.tail_size}-token "
            f"tail (window {self.window}, at least the current token, plus {remainder} not yet segmented) + "
            f"{k} segment(s) of {layout.segment_size} (at least one segment is attended)"
            + (f" + {merged} merged token(s) of the rest" if merged else "")
            + f". Raise the budget to >= {layout.sink_end + layout.tail_size + layout.segment_size + merged} or lower sinks/window.",
            stacklevel=4,
        )

    def state_type(self) -> type:
        return SegmentSearchState


#: The recent window of the authors' perplexity runs (their LongBench runs use 32).
RADAR_WINDOW = 1024


def Radar(
    top_k: int = 64,
    n_features: int = 4096,
    *,
    sinks: int = 1,
    window: int | None = None,
    seed: int = 0,
    orthogonal: bool = False,
    antithetic: bool = True,
    aspect: float = 4.0,
    shared_kv_selection: bool = False,
    budget: int | None = None,
) -> SegmentSearch:
    """Radar as its authors ran it (Hao et al. 2025, their public code and experiment scripts).

    ``SegmentSearch(PerformerFeatures(4096, antithetic=True), TopK(), AspectSchedule(4), top_k=64,
    sinks=1, window=1024)``. What differs from the paper's Algorithm 1 (:func:`RadarAlg1`):

    ==================  ===============================================  ==============================
    part                as run (this preset)                             Algorithm 1
    ==================  ===============================================  ==============================
    segment size        ``c = floor(sqrt(t) / 4)``                       ``c = sqrt(t)``
    rebuild             when ``t // c >= 2 * 4^2 * c`` (t ~doubled),     at every perfect square
                        full segments sealed in between                  (buffer up to ``2 sqrt(t)``)
    features            2048 Gaussian draws as +-omega: 4096 features    2048 independent draws
    always attended     1 sink + the last 1024 tokens + remainder < c    the buffer
    ==================  ===============================================  ==============================

    ``t`` counts the segmentable tokens (after the sink, outside the window). At the paper's
    perplexity point (16k prefill, k = 64) that is c = 30: 1 + 64 x 30 + 1024 + 29 = 2,974 tokens
    attended per step.

    Token budget (the toolkit's one meaning: past tokens a step may attend, sinks and window
    included): with ``budget`` set and ``window`` not given, the window is ``min(1024, budget // 4)``,
    one sink is kept, and the rest goes to segments: ``(budget - 1 - tail) // c`` of them, the tail
    being the window plus the remainder (see :class:`SegmentSearch`). The authors count only the
    middle tokens (``k = n_c // c``, window and remainder extra); here the total is honoured, and a
    budget too small for ``1 + window + remainder + c`` tokens warns.

    Args:
        top_k: segments per step when no ``budget`` is given (the authors' 64).
        n_features: features per key; with ``antithetic`` (default) the draws are ``n_features / 2``.
        sinks, window: always-attended first and last tokens; ``window=None`` means 1024, or
            ``min(1024, budget // 4)`` under a budget.
        seed, orthogonal, antithetic: the random features (:class:`PerformerFeatures`).
        aspect: ``a`` of :class:`AspectSchedule` (segments ``a`` times shorter than ``sqrt(t)``).
        shared_kv_selection, budget: as for :class:`SegmentSearch`.
    """
    if budget is not None:
        check_int("Radar", "budget", budget, 1)  # before budget // 4 can raise a TypeError
    if window is None:
        window = RADAR_WINDOW if budget is None else min(RADAR_WINDOW, budget // 4)
    return SegmentSearch(
        summary=PerformerFeatures(n_features=n_features, orthogonal=orthogonal, antithetic=antithetic, seed=seed),
        selector=TopK(),
        schedule=AspectSchedule(aspect=aspect),
        top_k=top_k,
        sinks=sinks,
        window=window,
        shared_kv_selection=shared_kv_selection,
        budget=budget,
    )


@dataclass(frozen=True)
class SegmentSelection:
    """What one decode step of a :class:`SegmentSearch` attended to.

    ``segments: [B, H_kv, G', k]`` with ``G' = group`` (per query head) or 1 (shared per KV head).
    """

    layout: SegmentLayout
    segments: torch.Tensor
    group: int
    rebuilt: bool  #: the latest append rebuilt every summary
    sealed: int  #: segments the latest append sealed onto the grid
    extra: torch.Tensor | None = None  #: ``[B, H_kv, n]`` positions the ``always`` part added
    extra_valid: torch.Tensor | None = None  #: ``[B, H_kv, G', n]``: which of them each selection attends
    valid: torch.Tensor | None = None  #: ``[B, H_kv, G', k]``: which listed segments are attended (None: all)
    n_merged: int = 0  #: merged tokens of the rest every query head attends (``rest``); counted in ``attended``
    #: ``[B, H_kv, G]`` the bound the ``rest`` reported on the error its estimate adds to each query head's
    #: output (``step.rest_bound``, e.g. :class:`~sparseattn.methods.sampled_rest.SampledRest`'s), NaN where
    #: the output is; None when the step had no rest or its rest reports none.
    rest_bound: torch.Tensor | None = None

    @property
    def per_query_head(self) -> torch.Tensor:
        """Selected segment indices ``[B, H_q, k]``."""
        B, H, _, k = self.segments.shape
        return self.segments.expand(B, H, self.group, k).reshape(B, H * self.group, k)

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]``."""
        lay = self.layout
        starts = lay.sink_end + self.per_query_head * lay.segment_size
        in_segments = (lay.tail_start - starts).clamp(0, lay.segment_size)
        if self.valid is not None:
            B, H, _, k = self.segments.shape
            in_segments = in_segments * self.valid.expand(B, H, self.group, k).reshape(B, H * self.group, k)
        in_segments = in_segments.sum(-1)
        attended = in_segments + lay.sink_end + lay.tail_size
        if self.extra_valid is not None:
            B, H, sets, n = self.extra_valid.shape
            attended = attended + self.extra_valid.sum(-1).expand(B, H, self.group).reshape(B, H * self.group)
        return attended + self.n_merged

    @property
    def merged(self) -> torch.Tensor:
        """Merged tokens of the rest attended per query head, ``[B, H_q]`` (``n_merged`` each)."""
        B, H = self.segments.shape[:2]
        return torch.full((B, H * self.group), self.n_merged, dtype=torch.long, device=self.segments.device)

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, t]`` (stored tokens: the ``merged`` ones are not among them)."""
        mask = segment_mask(self.layout, self.segments, self.group, self.valid)
        B, H, G, t = mask.shape
        if self.extra_valid is not None:
            sets, n = self.extra_valid.shape[2:]
            extra = torch.zeros(B, H, sets, t, dtype=torch.long, device=mask.device)
            extra.scatter_add_(-1, self.extra.unsqueeze(2).expand(B, H, sets, n), self.extra_valid.long())
            mask = mask | (extra > 0)
        return mask.reshape(B, H * G, t)


def _check_selection(selector: Selector, segments: torch.Tensor, shape: tuple[int, ...], n_segments: int) -> None:
    """A selector must return distinct in-range indices: a repeat would count tokens twice in the softmax."""
    if tuple(segments.shape) != shape or segments.dtype != torch.long:
        raise ValueError(f"{selector!r} returned {segments.dtype} indices of shape {tuple(segments.shape)}, expected long {shape}")
    if has_distinct_indices(selector):  # guaranteed by construction (e.g. topk): skip the sync
        return
    ordered = segments.sort(dim=-1).values
    bad = (ordered[..., 0] < 0) | (ordered[..., -1] >= n_segments) | (ordered.diff(dim=-1) == 0).any(-1)
    if bool(bad.any()):
        raise ValueError(
            f"{selector!r} returned segment indices that are repeated or outside [0, {n_segments}): "
            f"{segments[bad][0].tolist()}"
        )


def _prepare_heads(summary: Summary, layer: LayerSpec, dtype: torch.dtype):
    """The summary's parameters for the KV heads ``layer`` holds: drawn for all ``layer.total_kv_heads``
    heads and these rows kept, so a head's parameters do not depend on how the heads are sharded."""
    params = summary.prepare(layer.total_kv_heads, layer.head_dim, layer_idx=layer.layer_idx, device=layer.device, dtype=dtype)
    if params is None or layer.kv_heads == layer.total_kv_heads:
        return params
    if not (isinstance(params, torch.Tensor) and params.dim() >= 1 and params.shape[0] == layer.total_kv_heads):
        shape = tuple(params.shape) if isinstance(params, torch.Tensor) else type(params).__name__
        raise ValueError(
            f"{summary!r}: its parameters ({shape}) are not one row per KV head ({layer.total_kv_heads}), so they "
            f"cannot be split to the heads {layer.heads.start}..{layer.heads.stop - 1} this layer holds"
        )
    return params[layer.heads.start : layer.heads.stop].clone()  # a copy: the other heads' rows are freed


class SegmentSearchState(KVState):
    """The decode state of a :class:`SegmentSearch` for one layer.

    Holds the keys and values (capacity-doubling storage, no per-token copy of the cache), the
    segment grid, the summaries of sealed segments, and ``[B, H_kv]`` flags of the (row, KV head)
    pairs that stored a non-finite key or value (their outputs are NaN, as in dense attention). Work per token: the schedule's amortised
    summary work, scoring the S segments, and attention over the attended tokens; nothing is O(t)
    per step unless the summary reads keys (:class:`ExactScore`, the oracle).

    A step runs as stages, each part behind one declared hook, so a new part type plugs in without
    a change here: *plan* (the layout and the ``k`` segments the budget buys), *select*
    (``method.select_stage.select_segments(step)``, a :class:`~sparseattn.allocations.SelectStage`
    returning a :class:`~sparseattn.allocations.Selection`; it asks the :class:`SegmentStep` for
    scores, which the summary computes on demand), *keep* (the ``always`` part's ``mask``, its tokens
    added each once) and *attend* (the backend op :data:`KERNEL_CAPABILITIES` gives for the selection's
    ``need``, a ``rest``'s :class:`~sparseattn.methods.rest.Rest` hooks, or the torch gather path).
    """

    appends_only = True  # keys and values are only read (summaries live in their own buffers)

    def __init__(self, method: SegmentSearch, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.method = method
        self._summaries: list[GrowableBuffer] = []
        # ``rest`` that reads sums (``per_block`` not None): each block's key and value sums (float64), blocks
        # of rest.per_block segments of the grid ...
        sums = method.rest is not None and method.rest.per_block is not None
        self._rest_sums: list[GrowableBuffer] = [GrowableBuffer(dim=2), GrowableBuffer(dim=2)] if sums else []
        # ... and each segment's key and value sums side by side (float32, [B, H, S, 2 D]): a kernel step
        # subtracts the attended segments' sums from them, one row read per segment.
        self._segment_sums: list[GrowableBuffer] = [GrowableBuffer(dim=2)] if sums else []
        self._grid: SegmentGrid | None = None
        self._params = _prepare_heads(method.summary, layer, self.compute_dtype)
        # The parts' capabilities and stage hooks, asked once: a protocol check is slow, and a step asks none.
        self._shortlisting = isinstance(method.summary, ShortlistingSummary)
        self._top_k_aware = isinstance(method.summary, TopKAwareSummary) and bool(method.summary.uses_top_k)
        self._group_scoring = isinstance(method.summary, GroupScoringSummary)
        self._top_k_selector = type(method.selector) is TopK  # its picks are the best: read off a shortlist
        self._select_stage = method.select_stage
        seed = selector_seed(method.selector)
        self._generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + layer.layer_idx) % (2**63))
        self._rebuilt_since_attend = False
        self._sealed_since_attend = 0
        self.n_rebuilds = 0
        self._nonfinite = torch.zeros(layer.batch, layer.kv_heads, dtype=torch.bool, device=self.device)
        self._backend = None  # chosen on the first step, when the inputs are known
        self._kernels: frozenset[str] = frozenset()  # the needs of KERNEL_CAPABILITIES that backend runs in one call
        self._mass_backend = None  # likewise, for the exact segment masses of summaries that read keys
        self._workspace = Workspace()
        # The attention each stored token received, when the always-kept part reads it (heavy hitters).
        observation = None if method.always is None else method.always.observation
        self._observation = observation
        self._record = GrowableBuffer(dim=2) if observation is not None else None
        self.prompt_length = 0  #: ``length`` after the latest prompt block (a block of more than one token)

    # -- structure -----------------------------------------------------------------------------

    @property
    def grid(self) -> SegmentGrid | None:
        return self._grid

    @property
    def layout(self) -> SegmentLayout:
        grid = self._grid or SegmentGrid(1, 0, 0)
        m = self.method
        return SegmentLayout(
            length=self.length, sinks=m.sinks, segment_size=grid.segment_size, n_segments=grid.n_segments, window=m.window
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``kv`` (the cache itself) and ``summaries`` (the O(sqrt t) per-segment structure)."""
        summaries = sum(buf.view().numel() * buf.view().element_size() for buf in self._summaries if len(buf))
        params = self._params.numel() * self._params.element_size() if isinstance(self._params, torch.Tensor) else 0
        record = {"attention_record": self._record.view().numel() * self._record.view().element_size()} if self._record is not None and len(self._record) else {}
        rest = {"rest_sums": sum(buf.view().numel() * buf.view().element_size() for buf in [*self._rest_sums, *self._segment_sums] if len(buf))} if self._rest_sums else {}
        return {**super().nbytes(), "summaries": summaries, "projection": params, **record, **rest}

    def _buffers(self) -> list[GrowableBuffer]:
        return [*super()._buffers(), *self._summaries, *self._rest_sums, *self._segment_sums, *([self._record] if self._record is not None else [])]

    @property
    def attention_record(self) -> torch.Tensor | None:
        """``[B, H_kv, t]`` the attention each stored token received (what the ``always`` part observes), or None."""
        return self._record.view() if self._record is not None and len(self._record) else None

    def _after_append(self, n_new: int) -> None:
        """Build or extend the segment structure as the schedule says (a prefill of t tokens: one O(t) pass)."""
        self._rebuilt_since_attend, self._sealed_since_attend = False, 0
        # A NaN/inf token in an unselected segment would vanish from the output; dense attention shows
        # it. One O(new tokens) check here, a flag per (row, KV head), no device sync.
        new_k, new_v = self.keys[:, :, -n_new:], self.values[:, :, -n_new:]
        self._nonfinite |= ~(torch.isfinite(new_k).all(dim=(2, 3)) & torch.isfinite(new_v).all(dim=(2, 3)))
        if n_new > 1:
            self.prompt_length = self.length
        if self._record is not None:
            if n_new > 1 and self._observation.per_prompt and len(self._record):
                self._record.view().zero_()  # a new prompt's observation replaces the last one's
            self._record.append(torch.zeros(self.batch, self.kv_heads, n_new, dtype=self.compute_dtype, device=self.device))
        self._restructure()

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Dense causal prefill attention ``[B, H_q, T, D]``; the ``always`` part's observation records it."""
        out = super().attend_block(query)
        if self._record is not None:
            observe_prompt(self._observation, self._record.view(), query, self.keys, self.scale, self.softcap)
        return out

    def _segmentable(self) -> int:
        """Tokens the schedule may cut into segments: after the sinks, before the held-back newest ones."""
        return max(0, self.length - min(self.method.sinks, self.length) - self.method.held_back)

    def select_batch(self, index: torch.Tensor) -> None:
        super().select_batch(index)
        self._nonfinite = self._nonfinite.index_select(0, index.to(self.device))

    def _restructure(self) -> None:
        n = self._segmentable()
        old = self._grid
        new = self.method.schedule.plan(n, old)
        if new.covered > n:
            raise ValueError(f"{self.method.schedule!r} planned {new} covering more than the {n} segmentable tokens")
        if new.is_rebuild_of(old):
            self._summaries = []
            self._grid = new
            self._summarize_into(0, new.n_segments, rebuild=True)
            self._sum_rest(0, new.n_segments)
            self._rebuilt_since_attend = True
            self.n_rebuilds += 1
        else:
            assert old is not None
            if new.n_segments < old.n_segments:
                raise ValueError(f"{self.method.schedule!r} shrank the grid from {old} to {new} without a rebuild")
            self._grid = new
            self._summarize_into(old.n_segments, new.n_segments, rebuild=False)
            self._sum_rest(old.n_segments, new.n_segments)
            self._sealed_since_attend += new.n_segments - old.n_segments

    def _segment_keys(self) -> torch.Tensor:
        lay = self.layout
        seg = self.keys[:, :, lay.sink_end : lay.segment_end]
        return seg.view(self.batch, self.kv_heads, lay.n_segments, lay.segment_size, self.head_dim)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.compute_dtype) * math.sqrt(self.scale)

    def _summarize_into(self, first: int, last: int, rebuild: bool) -> None:
        if last <= first:
            return
        seg_keys = self._segment_keys()
        size = self._grid.segment_size
        per_chunk = max(1, _SUMMARY_CHUNK // (self.batch * self.kv_heads * size))
        parts: list[tuple[torch.Tensor, ...]] = []
        for a in range(first, last, per_chunk):
            chunk = self._scaled(seg_keys[:, :, a : min(last, a + per_chunk)])
            parts.append(self.method.summary.summarize(self._params, chunk))
        merged = [torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0] for pieces in zip(*parts)]
        if rebuild or not self._summaries:
            self._summaries = [GrowableBuffer(dim=2) for _ in merged]
        for buf, tensor in zip(self._summaries, merged):
            buf.append(tensor)

    def _sum_rest(self, first: int, last: int) -> None:
        """``rest``: the key and value sums of segments ``first..last-1`` (float32, kept per segment) added
        to their blocks' (float64): the block ``first`` falls in gets the new segments' sums added, whole
        new blocks are appended. O(new tokens): a block of any size is never summed again."""
        rest = self.method.rest
        if not self._rest_sums or last <= first:  # no rest, or one that reads no sums
            return
        per = rest.per_block
        lay = self.layout
        lo, hi = lay.sink_end + first * lay.segment_size, lay.segment_end
        shape = (self.batch, self.kv_heads, -1, lay.segment_size, self.head_dim)
        new = segment_sums(self.keys[:, :, lo:hi].reshape(shape), self.values[:, :, lo:hi].reshape(shape), torch.float64)
        b0 = first // per
        split = min(last, (b0 + 1) * per) - first  # new segments in the block of `first`
        for block_buf, sums in zip(self._rest_sums, new):
            head = sums[:, :, :split].sum(2, keepdim=True)  # [B, H, 1, D]
            if first % per:  # the block already holds earlier segments
                head = head + block_buf.view()[:, :, b0 : b0 + 1]
            blocks = torch.cat([head, group_blocks(sums[:, :, split:], per)], dim=2)
            if first == 0:
                block_buf.replace(blocks)
            else:
                block_buf.truncate(b0)
                block_buf.append(blocks)
        seg = torch.cat(new, dim=-1).to(torch.float32)  # [B, H, new segments, 2 D]
        if first == 0:
            self._segment_sums[0].replace(seg)
        else:
            self._segment_sums[0].truncate(first)
            self._segment_sums[0].append(seg)

    # -- decoding ------------------------------------------------------------------------------

    def _score_inputs(self, grouped_query: torch.Tensor) -> tuple:
        """What a summary's ``score`` takes after ``params``: summaries, scaled queries, segment keys, segment size."""
        summary = self.method.summary
        summaries = tuple(buf.view() for buf in self._summaries)
        queries = self._scaled(grouped_query)
        seg_keys = None
        if summary.reads_keys:
            raw = self._segment_keys()
            if self._mass_backend is None:  # exact segment masses: auto's choice, once per state
                self._mass_backend = select_backend("auto", "segment_log_mass", q=queries, keys=raw)
            seg_keys = SegmentKeys(raw, math.sqrt(self.scale), self.compute_dtype, self._workspace, self._mass_backend)
        return summaries, queries, seg_keys, self.layout.segment_size

    def scores(self, grouped_query: torch.Tensor, top_k: int = 0) -> torch.Tensor:
        """Segment log-mass estimates ``[B, H_kv, G, S]`` for ``grouped_query: [B, H_kv, G, D]``.

        ``top_k`` (the segments this step attends) is passed to summaries that declare ``uses_top_k``.
        """
        summary = self.method.summary
        if self.layout.n_segments == 0:
            return grouped_query.new_zeros(*grouped_query.shape[:3], 0, dtype=self.compute_dtype)
        extra = {"top_k": top_k} if self._top_k_aware else {}
        return summary.score(self._params, *self._score_inputs(grouped_query), **extra)

    def best_segments(
        self, grouped_query: torch.Tensor, top_k: int, n: int, *, sorted: bool, with_scores: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``(scores, values, segments)``: the step's scores (``[B, H_kv, G', S]``, G' = 1 for a shared
        selection) and each selection's ``n`` best (``[B, H_kv, G', n]``, best first if ``sorted``).

        A shortlisting summary (:class:`~sparseattn.summaries.base.ShortlistingSummary`) hands its
        shortlist over: when it holds ``n`` segments, the best are read off it instead of a top-n over
        all S scores (the same segments: the shortlist ranks above the rest); then, with
        ``with_scores=False``, ``scores`` is None and never computed (a pass over the grid saved).
        """
        summary = self.method.summary
        if not self.method.shared_kv_selection and self._shortlisting and self.layout.n_segments:
            step = summary.score_shortlist(self._params, *self._score_inputs(grouped_query), top_k=top_k)
            if step is not None and n <= step.exact.shape[-1]:
                return (step.scores if with_scores else None, *step.top(n, sorted=sorted))
            scores = self.scores(grouped_query, top_k) if step is None else step.scores
        elif self.method.shared_kv_selection:
            scores = self.group_scores(grouped_query, top_k)
        else:
            scores = self.scores(grouped_query, top_k)
        top = scores.topk(n, dim=-1, sorted=sorted)
        return scores, top.values, top.indices

    def group_scores(self, grouped_query: torch.Tensor, top_k: int = 0) -> torch.Tensor:
        """Log of each KV group's summed estimated masses ``[B, H_kv, 1, S]`` (the shared selection's scores).

        A summary with a ``score_group`` method computes it directly (cheaper: PerformerFeatures adds
        the heads' features first); otherwise it is the logsumexp of :meth:`scores` over the group.
        """
        summary = self.method.summary
        if not self._group_scoring or self.layout.n_segments == 0:
            return torch.logsumexp(self.scores(grouped_query, top_k), dim=2, keepdim=True)
        summaries = tuple(buf.view() for buf in self._summaries)
        return summary.score_group(self._params, summaries, self._scaled(grouped_query), None, self.layout.segment_size)

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, SegmentSelection]:
        """Sparse attention of ``query: [B, H_q, D]`` over the stored tokens: ``([B, H_q, D], selection)``.

        The stages: plan (:meth:`_plan`), select (every segment when the budget buys them all, else the
        method's select stage, which scores on demand through the :class:`SegmentStep`), keep (the
        ``always`` part's tokens) and attend (:meth:`_attend_selection`).
        """
        step = self._plan(query)
        lay, k = step.layout, step.k
        if k == lay.n_segments:  # every segment: nothing to score or select
            selection = Selection(torch.arange(k, device=query.device).expand(self.batch, self.kv_heads, step.shared, k))
        else:
            selection = self._select_stage.select_segments(step)
        if self.method.always is not None:
            selection = self._keep(lay, selection)
        return self._attend_selection(query, step, selection)

    def _plan(self, query: torch.Tensor) -> SegmentStep:
        """The plan stage: the step's layout and the ``k`` segments its budget buys (warning once if the
        budget is below what it can honour)."""
        group = self._check_query(query)
        lay = self.layout
        k = self.method.segments_for(lay)
        self.method._warn_over_budget(lay, k)
        grouped = query.reshape(self.batch, self.kv_heads, group, self.head_dim)
        return SegmentStep(self, grouped, lay, k, 1 if self.method.shared_kv_selection else group, group)

    def _keep(self, lay: SegmentLayout, selection: Selection) -> Selection:
        """The keep stage: the ``always`` part's tokens on top of the selection, each token once."""
        B, H, t = self.batch, self.kv_heads, lay.length
        positions = torch.arange(t, device=self.device).expand(B, H, t)
        record = self.attention_record
        tokens = Candidates(
            positions, seen=t, prompt_length=self.prompt_length, keys=lambda: self.keys,
            attention=None if record is None else (lambda: record), owner=self.method,
        )  # fmt: skip
        extra, marked = kept_tokens(self.method.always, tokens)  # indices of positions 0..t-1: positions
        return selection.with_tokens(extra, marked, lay)

    def _attend_selection(self, query: torch.Tensor, step: SegmentStep, selection: Selection) -> tuple[torch.Tensor, SegmentSelection]:
        """The attend stage: the backend op :data:`KERNEL_CAPABILITIES` gives for what the selection needs
        (with a ``rest``, the rest's own attend step), or the torch gather path."""
        lay = step.layout
        rest = self.method.rest if step.k < lay.n_segments else None  # a step that attends everything leaves no rest
        need = selection.need
        if need != "tokens":
            if rest is not None:
                need = "lse"  # the rest joins the kernel's softmax by its log-sum-exp
            self._select_backend(step.query)
            if need not in self._kernels:
                need = "tokens"
        if need == "tokens":
            return self._attend_gathered(query, step, selection, rest)
        backend = self._backend
        if need == "lse":
            out = rest.attend_segments(step, selection, backend, "merged" in self._kernels)
        elif need == "masked":  # an allocation's split: heads attend different numbers of the listed segments
            out = backend.segment_attention_masked(
                step.query, self.keys, self.values, lay, selection.segments, selection.valid, self.scale, self.softcap
            )
        else:
            # Unchecked: the backend accepted this state's inputs once, and the state guarantees the shapes it checks.
            out = backend.segment_attention(
                step.query, self.keys, self.values, lay, selection.segments, self.scale, self.softcap, workspace=self._workspace, checked=False
            )
        return self._finish(query, out, step, selection, rest)

    def _attend_gathered(
        self, query: torch.Tensor, step: SegmentStep, selection: Selection, rest: Rest | None
    ) -> tuple[torch.Tensor, SegmentSelection]:
        """One softmax over the selection's listed tokens (torch; the ``rest``'s own form when merging), and
        the ``always`` part's record of the weights they received."""
        listed, attended, runs = selection.listing(step.layout)
        if rest is not None:
            out, probs = rest.attend_tokens(step, listed, attended, runs)
        else:
            out, probs = token_attention(step.query, self.keys, self.values, listed, attended, self.scale, self.softcap, self._workspace)
        if self._observation is not None and self._observation.decode:
            # Invalid entries (padding, or a token listed twice) have weight 0: adding them changes nothing.
            self._record.view().scatter_add_(-1, listed, finite_evidence(probs).sum(dim=2))
        return self._finish(query, out, step, selection, rest)

    def _finish(
        self, query: torch.Tensor, out: torch.Tensor, step: SegmentStep, selection: Selection, rest: Rest | None
    ) -> tuple[torch.Tensor, SegmentSelection]:
        """``out [B, H_kv, G, D]`` as ``[B, H_q, D]`` in the query's dtype, NaN where a non-finite token was
        stored (as dense: see :class:`SegmentSearch`), and the step's report."""
        lay = step.layout
        out = out.masked_fill(self._nonfinite[:, :, None, None], float("nan"))
        bound = step.rest_bound
        if bound is not None:
            bound = bound.masked_fill(self._nonfinite[:, :, None], float("nan"))
        info = SegmentSelection(
            layout=lay, segments=selection.segments, group=step.group, rebuilt=self._rebuilt_since_attend,
            sealed=self._sealed_since_attend, extra=selection.extra, extra_valid=selection.extra_valid,
            valid=selection.valid, n_merged=0 if rest is None else rest.blocks(lay.n_segments), rest_bound=bound,
        )  # fmt: skip
        return out.reshape(self.batch, self.kv_heads * step.group, self.head_dim).to(query.dtype), info

    def _select_backend(self, grouped: torch.Tensor) -> None:
        """The attention backend, chosen once, on the first step's inputs, and the needs of
        :data:`KERNEL_CAPABILITIES` it runs in one call."""
        if self._backend is None:
            self._backend = select_backend(
                self.method.backend, "segment_attention", q=grouped, keys=self.keys, softcap=self.softcap
            )
            self._kernels = frozenset(
                need for need, op in KERNEL_CAPABILITIES.items() if op not in EXTENSION_OPS or isinstance(self._backend, EXTENSION_OPS[op])
            )

    def _always_log_mass(self, grouped: torch.Tensor, lay: SegmentLayout, shared: int) -> torch.Tensor:
        """Log attention mass ``[B, H_kv, G']`` of the sinks and the tail (attended by every head), on the
        scale of the segment scores (no soft-capping, as the summaries score).

        A backend with :class:`SegmentAttentionLSE` gives it in one call (the normaliser of attention over
        an empty selection); otherwise a few dozen keys are gathered and scored in torch. One call, not
        five small tensor operations: each costs ~0.1 ms at a cold step (measured at 128k)."""
        self._select_backend(grouped)
        fast = "lse" in self._kernels and self.compute_dtype != torch.float64
        if fast and (lay.sink_end > 0 or lay.tail_start < lay.length):  # (the kernel refuses a head with no token)
            nothing = torch.zeros(self.batch, self.kv_heads, 1, 0, dtype=torch.long, device=grouped.device)
            mass = self._backend.segment_attention_lse(grouped, self.keys, self.values, lay, nothing, None, self.scale, None)[1]
            mass = mass.to(self.compute_dtype)
        else:
            keys = torch.cat([self.keys[:, :, : lay.sink_end], self.keys[:, :, lay.tail_start : lay.length]], dim=2)
            logits = grouped.to(self.compute_dtype) @ keys.to(self.compute_dtype).transpose(-1, -2)  # a few dozen tokens
            mass = torch.logsumexp(logits * self.scale, dim=-1)
        return torch.logsumexp(mass, dim=2, keepdim=True) if shared == 1 else mass


class SegmentStep:
    """One decode step of a :class:`SegmentSearchState`, as its parts see it: what a select stage
    (:class:`~sparseattn.allocations.SelectStage`) and a rest (:class:`~sparseattn.methods.rest.Rest`)
    read, and the scores and picks they ask for (computed on demand: a stage that needs no scores never
    pays for them).

    Attributes:
        query: ``[B, H_kv, G, D]`` the step's queries grouped by KV head.
        layout: the step's :class:`SegmentLayout` (``S = layout.n_segments``).
        k: segments the budget buys per selection (``< S`` when a select stage is asked).
        shared: ``G'``, selections per KV head: 1 under ``shared_kv_selection``, else ``G``.
        group: ``G``, query heads per KV head.
        rest_bound: None, or ``[B, H_kv, G]``: what the ``rest``'s attend hook reports as the bound on the
            error its estimate adds to each query head's output (see :class:`~sparseattn.methods.rest.Rest`).
    """

    __slots__ = ("_state", "query", "layout", "k", "shared", "group", "rest_bound")

    def __init__(self, state: SegmentSearchState, query: torch.Tensor, layout: SegmentLayout, k: int, shared: int, group: int) -> None:
        self._state = state
        self.query, self.layout, self.k, self.shared, self.group = query, layout, k, shared, group
        self.rest_bound: torch.Tensor | None = None

    # The state's fields a stage reads: its method, the stored keys and values ([B, H_kv, t, D] views),
    # the attention scale and soft-cap, its scratch buffers (Workspace), device and layer index.
    method = property(lambda self: self._state.method)
    keys = property(lambda self: self._state.keys)
    values = property(lambda self: self._state.values)
    scale = property(lambda self: self._state.scale)
    softcap = property(lambda self: self._state.softcap)
    workspace = property(lambda self: self._state._workspace)
    device = property(lambda self: self._state.device)
    layer_idx = property(lambda self: self._state.layer_idx)

    def scores(self, top_k: int | None = None) -> torch.Tensor:
        """Each selection's segment log-mass estimates ``[B, H_kv, G', S]`` (a shared selection ranks its
        group's summed masses); ``top_k`` (default ``k``) goes to summaries that take it."""
        state, top_k = self._state, self.k if top_k is None else top_k
        return state.group_scores(self.query, top_k) if self.shared == 1 else state.scores(self.query, top_k)

    def selector_scores(self, top_k: int | None = None) -> torch.Tensor:
        """What the selector ranks: :meth:`scores`, or zeros ``[B, H_kv, G', S]`` (nothing scored) for a
        selector that declares ``uses_scores = False``."""
        if self._state.method.selector.uses_scores:
            return self.scores(top_k)
        state = self._state
        return torch.zeros(state.batch, state.kv_heads, self.shared, self.layout.n_segments, device=self.query.device)

    def choose(self, n: int, scores: torch.Tensor) -> torch.Tensor:
        """The selector's ``n`` picks ``[B, H_kv, G', n]`` among ``scores``, from the state's seeded
        generator; ValueError when they are not distinct in-range indices."""
        state = self._state
        selector = state.method.selector
        segments = selector.select(scores, n, state._generator)
        _check_selection(selector, segments, (state.batch, state.kv_heads, self.shared, n), self.layout.n_segments)
        return segments

    def picks(self, n: int) -> torch.Tensor:
        """The selector's ``n`` picks ``[B, H_kv, G', n]``. Under :class:`TopK` they are each selection's
        ``n`` best, read off a shortlisting summary's shortlist when it holds them (see
        :meth:`SegmentSearchState.best_segments`); then the scores of every segment are never computed."""
        if self._state._top_k_selector:
            return self._state.best_segments(self.query, self.k, n, sorted=False, with_scores=False)[2]
        return self.choose(n, self.selector_scores(self.k))

    def scored_picks(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [B, H_kv, G', S], estimates [B, H_kv, G', n], segments [B, H_kv, G', n])``: the step's
        scores, and the selector's ``n`` picks (as :meth:`picks`) with their scores."""
        if self._state._top_k_selector:  # its n picks are the n best
            return self._state.best_segments(self.query, self.k, n, sorted=False)
        scores = self.scores(self.k)
        segments = self.choose(n, scores)
        return scores, scores.gather(-1, segments), segments

    def always_log_mass(self) -> torch.Tensor:
        """``[B, H_kv, G']`` the log attention mass of the sinks and the tail, which every head attends
        (on the scale of :meth:`scores`)."""
        return self._state._always_log_mass(self.query, self.layout, self.shared)

    def token_logits(self, index: torch.Tensor) -> torch.Tensor:
        """Exact logits ``[B, H_kv, G, L]`` (``scale q . k``, not soft-capped, in the compute dtype) of the
        tokens ``index: [B, H_kv, L]`` lists: their keys are gathered once for the group's query heads."""
        state = self._state
        keys = gather_tokens(state.keys, index, state._workspace, "refine_keys")
        return torch.einsum("bhgd,bhld->bhgl", state._scaled(self.query), state._scaled(keys))

    def block_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``rest`` with a ``per_block``: the key and value sums ``[B, H_kv, n_blocks, D]`` (float64) of each block of ``rest.per_block`` segments."""
        sums = self._state._rest_sums
        return sums[0].view(), sums[1].view()

    def segment_sums(self) -> torch.Tensor:
        """A ``rest`` with a ``per_block``: each segment's key sum then value sum, ``[B, H_kv, S, 2 D]`` (float32)."""
        return self._state._segment_sums[0].view()


def segment_options(top_k_none: str = "", window_none: str = "") -> tuple[Option, ...]:
    """The registry options every segment-search preset takes: ``budget``, ``top_k``, ``sinks``, ``window``
    (their defaults are the builder's; ``*_none`` says what a builder's None default stands for)."""
    return (
        Option("budget", int, help="past KV tokens a step may attend, sinks and window included (replaces top_k)"),
        Option("top_k", int, help="segments attended per step (not with budget)" + (f"; None: {top_k_none}" if top_k_none else "")),
        Option("sinks", int, help="first tokens always attended", minimum=0),
        Option("window", int, help="last tokens always attended" + (f"; None: {window_none}" if window_none else ""), minimum=0),
    )


#: What a None ``window`` stands for in the presets that derive it from the budget.
WINDOW_FROM_BUDGET = "min(1024, budget // 4), 1024 without a budget"


def feature_options() -> tuple[Option, ...]:
    """The registry options of a random-feature summary: ``n_features`` and ``seed``."""
    return (
        Option("n_features", int, help="random features per segment summary"),
        Option("seed", int, help="seed of the random draws", allowed=Range(0, 2**63 - 1)),
    )


register(
    MethodEntry(
        "radar",
        "Radar as its authors ran it: random-feature segment search over segments of sqrt(t)/4 tokens, top-k "
        "segments + 1 sink + a recent window (Hao et al. 2025)",
        Radar,
        (*segment_options(window_none=WINDOW_FROM_BUDGET), *feature_options()),
        origin=__name__,
        category="paper",
        engines=("transformers", "vllm"),
    )
)
