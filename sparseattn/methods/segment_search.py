"""Segment search: summary x selector x schedule, and Radar as its authors ran it as its preset.

The method (:class:`SegmentSearch`, a frozen policy) lives here; its per-layer decode state in
:mod:`sparseattn.methods.segment_state`, one step as its parts see it in :mod:`sparseattn.methods.segment_step`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from sparseattn.allocations.base import Allocation, SelectStage
from sparseattn.allocations.uniform import Uniform
from sparseattn.backends.registry import check_backend_name
from sparseattn.methods.always import AlwaysKept
from sparseattn.methods.base import StatefulMethod
from sparseattn.methods.rest import Rest
from sparseattn.methods.segment_options import WINDOW_FROM_BUDGET, feature_options, segment_options
from sparseattn.methods.segment_state import SegmentSearchState
from sparseattn.ops.layout import SegmentLayout
from sparseattn.registry import MethodEntry, register
from sparseattn.schedules.aspect import AspectSchedule
from sparseattn.schedules.base import Schedule
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.base import Selector
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import Summary
from sparseattn.summaries.performer import PerformerFeatures
from sparseattn.validation import check_int


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

    def reach(self, k: int, n_segments: int) -> int:
        """The most segments one selection may attend in a step whose budget buys ``k`` each: the select stage's
        ``width`` (``k`` under a uniform split, up to ``cap x k`` under :class:`~sparseattn.allocations.PooledMass`).

        It is the ``top_k`` a summary that sizes its work by the step is told (:class:`~sparseattn.summaries.Rerank`'s
        shortlist: ``factor x`` it), in both engines: a head the allocation gives more than ``k`` keeps a shortlist
        larger than what it takes. Sized by ``k`` instead, a pooled head at its cap attended the whole shortlist,
        and most of what the preset lost against the exact pooled oracle was lost there
        (``benchmarks/selection_gap.py``, docs/methods.md).
        """
        width = getattr(self.select_stage, "width", None)
        return k if width is None else max(k, min(n_segments, width(k, n_segments)))

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
