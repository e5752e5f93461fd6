"""The decode state of a segment search: its keys and values, segment grid and summaries, and one step's stages.

:class:`SegmentSearchState` is what :class:`~sparseattn.methods.segment_search.SegmentSearch` builds per
layer; a step runs as stages (plan, select, keep, attend), the select stage reading a
:class:`~sparseattn.methods.segment_step.SegmentStep`.
"""

from __future__ import annotations

import math

import torch

from sparseattn.allocations.base import Selection
from sparseattn.backends.base import EXTENSION_OPS
from sparseattn.backends.registry import select_backend
from sparseattn.methods.always import kept_tokens
from sparseattn.methods.base import KVState, LayerSpec, StatefulMethod
from sparseattn.methods.eviction import Candidates, finite_evidence, observe_prompt
from sparseattn.methods.rest import Rest, group_blocks, segment_sums
from sparseattn.methods.segment_step import SegmentSelection, SegmentStep
from sparseattn.ops.buffers import GrowableBuffer, Workspace
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.tokens import token_attention
from sparseattn.schedules.base import SegmentGrid
from sparseattn.seeding import layer_generator
from sparseattn.selectors.base import selector_seed
from sparseattn.summaries.base import GroupScoringSummary, SegmentKeys, ShortlistingSummary, Summary, TopKAwareSummary

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
    """The decode state of a :class:`~sparseattn.methods.segment_search.SegmentSearch` for one layer.

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

    def __init__(self, method: StatefulMethod, layer: LayerSpec) -> None:
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
        self._select_stage = method.select_stage
        self.generator = layer_generator(selector_seed(method.selector), layer.layer_idx)  #: the selector's draws
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

    def observe_block(self, query: torch.Tensor) -> None:
        """The ``always`` part's observation records the prefill's attention (nothing without one)."""
        super().observe_block(query)
        if self._record is not None:
            observe_prompt(self._observation, self._record.view(), query, self.keys, self.scale, self.softcap)

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

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the compute dtype times ``sqrt(scale)``: queries and keys so scaled give the logits."""
        return x.to(self.compute_dtype) * math.sqrt(self.scale)

    @property
    def workspace(self) -> Workspace:
        """The state's scratch buffers, reused step after step."""
        return self._workspace

    def block_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``rest`` with a ``per_block``: the key and value sums ``[B, H_kv, n_blocks, D]`` (float64) of each block."""
        return self._rest_sums[0].view(), self._rest_sums[1].view()

    def segment_sums(self) -> torch.Tensor:
        """A ``rest`` with a ``per_block``: each segment's key sum then value sum, ``[B, H_kv, S, 2 D]`` (float32)."""
        return self._segment_sums[0].view()

    def _summarize_into(self, first: int, last: int, rebuild: bool) -> None:
        if last <= first:
            return
        seg_keys = self._segment_keys()
        size = self._grid.segment_size
        per_chunk = max(1, _SUMMARY_CHUNK // (self.batch * self.kv_heads * size))
        parts: list[tuple[torch.Tensor, ...]] = []
        for a in range(first, last, per_chunk):
            chunk = self.scaled(seg_keys[:, :, a : min(last, a + per_chunk)])
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
        queries = self.scaled(grouped_query)
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

    def group_scores(self, grouped_query: torch.Tensor, top_k: int = 0, summaries: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Log of each KV group's summed estimated masses ``[B, H_kv, 1, S]`` (the shared selection's scores).

        A summary with a ``score_group`` method computes it directly (cheaper: PerformerFeatures adds
        the heads' features first); otherwise it is the logsumexp of :meth:`scores` over the group.
        ``summaries``: others than the state's own, of a summary that reads no keys (a fixed-shape step's wider
        grid, :mod:`sparseattn.methods.static_step`).
        """
        summary = self.method.summary
        if summaries is not None:
            queries, size = self.scaled(grouped_query), self.layout.segment_size
            if self._group_scoring:
                return summary.score_group(self._params, summaries, queries, None, size)
            return torch.logsumexp(summary.score(self._params, summaries, queries, None, size), dim=2, keepdim=True)
        if not self._group_scoring or self.layout.n_segments == 0:
            return torch.logsumexp(self.scores(grouped_query, top_k), dim=2, keepdim=True)
        summaries = tuple(buf.view() for buf in self._summaries)
        return summary.score_group(self._params, summaries, self.scaled(grouped_query), None, self.layout.segment_size)

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
        return SegmentStep(self, grouped, lay, k, 1 if self.method.shared_kv_selection else group)

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
        stored (as dense: see :class:`~sparseattn.methods.segment_search.SegmentSearch`), and the step's report."""
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

    def always_log_mass(self, grouped: torch.Tensor, lay: SegmentLayout) -> torch.Tensor:
        """Log attention mass ``[B, H_kv, G]`` of the sinks and the tail (attended by every head) for each query
        head of ``grouped``, on the scale of the segment scores (no soft-capping, as the summaries score).

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
        return mass

