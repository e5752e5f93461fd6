"""The ``Selector`` protocol: which segments a decode query attends to, and its optional capabilities."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Selector(Protocol):
    """Pick ``k`` segments per query from their scores.

    ``scores: [B, H, G, S]`` (log-mass estimates from a :class:`~sparseattn.summaries.Summary`);
    returns distinct segment indices ``[B, H, G, min(k, S)]``. Selectors that ignore scores set
    ``uses_scores = False`` so the method skips scoring altogether. Optional capabilities are the
    protocols below; the decode state asks for them with ``isinstance`` and nothing else.
    """

    uses_scores: bool

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor: ...


@runtime_checkable
class SeededSelector(Selector, Protocol):
    """A selector that draws at random: the decode state seeds its generator from ``seed`` and the layer index."""

    seed: int


@runtime_checkable
class DistinctSelector(Selector, Protocol):
    """A selector whose indices are distinct and in range by construction (e.g. ``topk``).

    ``distinct_indices = True`` skips the per-step check of the selection (a device sync). Only the
    class's own declaration counts: a subclass that overrides ``select`` is checked again.
    """

    distinct_indices: bool


def has_distinct_indices(selector: Selector) -> bool:
    """Whether ``selector``'s own class declares ``distinct_indices = True`` (see :class:`DistinctSelector`)."""
    return isinstance(selector, DistinctSelector) and bool(type(selector).__dict__.get("distinct_indices", False))


@runtime_checkable
class BestSelector(Selector, Protocol):
    """A selector whose ``n`` picks are each selection's ``n`` highest scores (e.g. ``topk``), in any order.

    ``picks_best = True`` lets a decode step read its picks off a shortlist that holds them (a
    shortlisting summary ranks its shortlist above every other segment), never scoring the rest of
    the grid. Only the class's own declaration counts: a subclass that overrides ``select`` is run.
    """

    picks_best: bool


def keeps_best(selector: Selector) -> bool:
    """Whether ``selector``'s own class declares ``picks_best = True`` (see :class:`BestSelector`)."""
    return isinstance(selector, BestSelector) and bool(type(selector).__dict__.get("picks_best", False))


def selector_seed(selector: Selector) -> int:
    """The seed of a :class:`SeededSelector`; 0 for a selector that draws nothing."""
    return int(selector.seed) if isinstance(selector, SeededSelector) else 0
