"""The ``Summary`` protocol: how a segment of keys is summarised and scored against a query."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


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
        self,
        params: Any,
        summaries: tuple[torch.Tensor, ...],
        queries: torch.Tensor,
        segment_keys: torch.Tensor | None,
        segment_size: int,
    ) -> torch.Tensor:
        """Log-mass estimates ``[B, H, G, S]`` for ``queries: [B, H, G, D]``.

        ``segment_keys`` (``[B, H, S, c, D]``) is passed only when ``reads_keys`` is True.
        """
        ...
