"""The transformers engine's decode step: what a select stage and a rest read in a decode state, and its report.

:class:`SegmentStep` is the :class:`~sparseattn.allocations.step.SearchStep` of a
:class:`~sparseattn.methods.segment_state.SegmentSearchState` (its scores, picks and always-attended
mass, written once there), plus what a ``rest``'s hooks and a token refinement read: the stored keys
and values, the attention scale, scratch buffers, and the rest's running sums.
:class:`SegmentSelection` is what the step attended, as the state reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparseattn.allocations.step import SearchStep
from sparseattn.ops.attention import gather_tokens, segment_mask
from sparseattn.ops.layout import SegmentLayout


class SegmentStep(SearchStep):
    """One decode step of a segment search's decode state, as its parts see it (see :class:`SearchStep`).

    ``state`` is the :class:`~sparseattn.methods.segment_state.SegmentSearchState`; the step reads only
    its public interface. Beyond :class:`SearchStep`'s attributes:

    Attributes:
        rest_bound: None, or ``[B, H_kv, G]``: what the ``rest``'s attend hook reports as the bound on the
            error its estimate adds to each query head's output (see :class:`~sparseattn.methods.rest.Rest`).
    """

    __slots__ = ("state", "rest_bound")

    def __init__(self, state: Any, query: torch.Tensor, layout: SegmentLayout, k: int, shared: int) -> None:
        super().__init__(state.method, query, layout, k, shared, state.generator)
        self.state = state
        self.rest_bound: torch.Tensor | None = None

    # What a rest or a refinement reads of the state: the stored keys and values ([B, H_kv, t, D] views),
    # the attention scale and soft-cap, its scratch buffers (Workspace), device and layer index.
    keys = property(lambda self: self.state.keys)
    values = property(lambda self: self.state.values)
    scale = property(lambda self: self.state.scale)
    softcap = property(lambda self: self.state.softcap)
    workspace = property(lambda self: self.state.workspace)
    device = property(lambda self: self.state.device)
    layer_idx = property(lambda self: self.state.layer_idx)

    def head_scores(self, top_k: int) -> torch.Tensor:
        return self.state.scores(self.query, top_k)

    def group_scores(self, top_k: int) -> torch.Tensor:
        return self.state.group_scores(self.query, top_k)

    def best(self, n: int, with_scores: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Each selection's ``n`` best: off a shortlisting summary's shortlist when it holds them, else a
        top-n over the scores (see :meth:`~sparseattn.methods.segment_state.SegmentSearchState.best_segments`)."""
        return self.state.best_segments(self.query, self.reach, n, sorted=False, with_scores=with_scores)

    def head_always_log_mass(self) -> torch.Tensor:
        return self.state.always_log_mass(self.query, self.layout)

    def token_logits(self, index: torch.Tensor) -> torch.Tensor:
        """Exact logits ``[B, H_kv, G, L]`` (``scale q . k``, not soft-capped, in the compute dtype) of the
        tokens ``index: [B, H_kv, L]`` lists: their keys are gathered once for the group's query heads."""
        state = self.state
        keys = gather_tokens(state.keys, index, state.workspace, "refine_keys")
        return torch.einsum("bhgd,bhld->bhgl", state.scaled(self.query), state.scaled(keys))

    def block_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``rest`` with a ``per_block``: the key and value sums ``[B, H_kv, n_blocks, D]`` (float64) of each block of ``rest.per_block`` segments."""
        return self.state.block_sums()

    def segment_sums(self) -> torch.Tensor:
        """A ``rest`` with a ``per_block``: each segment's key sum then value sum, ``[B, H_kv, S, 2 D]`` (float32)."""
        return self.state.segment_sums()


@dataclass(frozen=True)
class SegmentSelection:
    """What one decode step of a :class:`~sparseattn.methods.segment_search.SegmentSearch` attended to.

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

