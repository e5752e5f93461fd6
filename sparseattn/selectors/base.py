"""The ``Selector`` protocol: which segments a decode query attends to."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Selector(Protocol):
    """Pick ``k`` segments per query from their scores.

    ``scores: [B, H, G, S]`` (log-mass estimates from a :class:`~sparseattn.summaries.Summary`);
    returns distinct segment indices ``[B, H, G, min(k, S)]``. Selectors that ignore scores set
    ``uses_scores = False`` so the method skips scoring altogether. A selector whose indices are
    distinct by construction may declare ``distinct_indices = True`` in its class body to skip the
    per-step check (a device sync; not inherited by subclasses); otherwise every selection is checked.
    """

    uses_scores: bool

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor: ...
