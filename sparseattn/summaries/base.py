"""The ``Summary`` protocol: how a segment of keys is summarised and scored against a query."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from sparseattn.backends.base import AttentionBackend
from sparseattn.backends.registry import select_backend
from sparseattn.ops.segments import SegmentKeys, check_segment_lists, scaled_keys, take_keys
from sparseattn.ops.segments import segment_log_mass as segment_log_mass_torch

__all__ = ["SegmentKeys", "Summary", "bound_scores", "scaled_keys", "segment_log_mass", "take_keys"]


def segment_log_mass(segment_keys: SegmentKeys | torch.Tensor, queries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Exact log attention masses ``logsumexp_{j in segment} q . k_j`` of listed segments: ``[B, H, R, m]``.

    ``queries: [B, H, R, D]`` (pre-scaled, compute dtype); ``index: [B, H, R', m]`` with ``R'`` in
    ``{1, R}``: one list shared by the R query rows (its keys read once for all of them) or one list
    per row. A :class:`SegmentKeys` runs on its ``backend`` (the one its decode state chose once:
    on the CPU the cpu backend's kernel, reading the keys in place), or, when it has none, on the one
    ``auto`` picks for this call; a plain tensor of scaled keys runs on the torch op
    (:func:`sparseattn.ops.segments.segment_log_mass`). Reference:
    :func:`sparseattn.ops.segments.segment_log_mass_ref`.
    """
    check_segment_lists(queries, index)
    if not isinstance(segment_keys, SegmentKeys):
        return segment_log_mass_torch(segment_keys, queries, index)
    backend = segment_keys.backend
    if backend is None:
        backend = select_backend("auto", "segment_log_mass", q=queries, keys=segment_keys.raw)
    return backend.segment_log_mass(segment_keys, queries, index, checked=False)


#: ``auto``'s backend for ``bound_scores`` by what its choice depends on (device, dtypes, head dim): a step
#: must not walk the backends' refusals again (Quest scores every layer at every step).
_BOUND_BACKENDS: dict[tuple, AttentionBackend] = {}


def bound_scores(low: torch.Tensor, high: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Quest's bounds ``sum_i max(q_i low_i, q_i high_i)`` ``[B, H, G, S]`` of every segment, on the backend
    ``auto`` picks (the Triton kernel on CUDA, the torch op elsewhere). Reference:
    :func:`sparseattn.ops.bounds.bound_scores_ref`."""
    key = (queries.device, queries.dtype, low.dtype, queries.shape[-1], torch.is_grad_enabled() and queries.requires_grad)
    backend = _BOUND_BACKENDS.get(key)
    if backend is None:
        backend = _BOUND_BACKENDS[key] = select_backend("auto", "bound_scores", q=queries, keys=low)
    return backend.bound_scores(low, high, queries, checked=False)


@runtime_checkable
class Summary(Protocol):
    """Summarise sealed segments of keys and score them for a decode query.

    Every score is an estimate of the segment's **log attention mass**
    ``log sum_{j in segment} exp(q . k_j)`` (q, k pre-scaled so that logits are plain dot products).
    A common scale lets selections be compared and shared across the query heads of a KV group
    (masses add: logsumexp of log-masses).

    Keys and queries arrive pre-scaled by ``sqrt(scale)`` (the paper's k' = k / d^(1/4)) in the
    compute dtype (float32, or float64 for float64 inputs).
    """

    #: True when ``score`` needs the segments' keys themselves (O(t) per step, an oracle).
    reads_keys: bool

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> Any:
        """Per-layer parameters (e.g. the random projection), or None."""
        ...

    def summarize(self, params: Any, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Summaries of sealed segments. ``keys: [B, H, S, c, D]`` -> tensors shaped ``[B, H, S, ...]``."""
        ...

    def score(
        self, params: Any, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: SegmentKeys | torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        """Log-mass estimates ``[B, H, G, S]`` for ``queries: [B, H, G, D]``.

        ``segment_keys`` (:class:`SegmentKeys`, ``[B, H, S, c, D]`` read on demand) is passed only
        when ``reads_keys`` is True; read it with :func:`scaled_keys` or :func:`take_keys`.
        Optional capabilities are the protocols below (:class:`TopKAwareSummary`,
        :class:`GroupScoringSummary`); the decode state asks for them with ``isinstance`` only, once per state.
        """
        ...


@runtime_checkable
class TopKAwareSummary(Summary, Protocol):
    """A summary whose ``score`` also takes ``top_k=`` (the segments the step attends), e.g. a rerank
    that rescores a shortlist sized by it. Declares ``uses_top_k = True``."""

    uses_top_k: bool


@runtime_checkable
class GroupScoringSummary(Summary, Protocol):
    """A summary that scores a KV group at once, more cheaply than per query head (PerformerFeatures
    adds the heads' features first); selections shared by a group use it, others take the
    logsumexp of :meth:`Summary.score` over the group."""

    def score_group(
        self, params: Any, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: SegmentKeys | torch.Tensor | None, segment_size: int,
    ) -> torch.Tensor:  # fmt: skip
        """``[B, H, 1, S]``: ``logsumexp_g score[..., g, :]`` for ``queries: [B, H, G, D]``."""
        ...


@dataclass(frozen=True)
class Shortlist:
    """A two-stage summary's step: every segment's coarse scores and the shortlist it rescored.

    ``coarse: [B, H, G, S]`` the first stage's scores; ``index: [B, H, G', m]`` the shortlisted
    segments (``G'`` = 1 when a KV group shares one list); ``exact: [B, H, G, m]`` their exact scores.
    :attr:`scores` is what :meth:`Summary.score` returns: the coarse scores shifted below the smallest
    exact one, with the exact ones in place, so every shortlisted segment of a row scores above every
    other segment of it and the top ``n <= m`` of ``scores`` are the top ``n`` of ``exact``. It is
    computed on first use: a step that only needs the best segments (:meth:`top`) never pays for it.
    """

    coarse: torch.Tensor
    index: torch.Tensor
    exact: torch.Tensor

    @functools.cached_property
    def scores(self) -> torch.Tensor:
        """``[B, H, G, S]``: the coarse order kept below the shortlist (shifted by a margin, not a huge constant that would round it away)."""
        if self.exact.shape[-1] == 0:
            return self.coarse
        shift = (self.coarse.amax(-1, keepdim=True) - self.exact.amin(-1, keepdim=True)).clamp(min=0) + 1.0
        # In place on the fresh difference: one pass over the [B, H, G, S] grid fewer than .scatter's copy.
        return (self.coarse - shift).scatter_(-1, self.index.expand_as(self.exact), self.exact)

    def top(self, n: int, *, sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, segment indices)`` of each row's ``n <= m`` best segments, read off the shortlist."""
        index = self.index.expand_as(self.exact)
        if n == self.exact.shape[-1] and not sorted:  # the whole shortlist
            return self.exact, index
        best = self.exact.topk(n, dim=-1, sorted=sorted)
        return best.values, index.gather(-1, best.indices)


@runtime_checkable
class ShortlistingSummary(TopKAwareSummary, Protocol):
    """A summary that ranks a shortlist above the rest (:class:`~sparseattn.summaries.Rerank`): a
    decode state that needs only the top ``n <= m`` segments reads them off the shortlist instead of
    sorting all ``S`` scores (exactly the same segments, up to ties)."""

    def score_shortlist(
        self, params: Any, summaries: tuple[torch.Tensor, ...], queries: torch.Tensor,
        segment_keys: SegmentKeys | torch.Tensor | None, segment_size: int, top_k: int = 0,
    ) -> Shortlist | None:  # fmt: skip
        """The step's :class:`Shortlist`, or None, before any work, when the summary shortlists nothing (then use :meth:`Summary.score`)."""
        ...
