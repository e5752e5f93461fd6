"""Mean-key summary: a Jensen lower bound of the segment's log attention mass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


_CENTROID_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True, repr=False)
class Centroid:
    """Score = ``log c + q . mean_j k_j``.

    By Jensen's inequality ``log sum_j exp(q.k_j) >= log c + q . mean_j k_j``: a lower bound,
    tight when the segment's logits are equal. O(d) per segment.

    Args:
        dtype: storage of the mean keys; None keeps the compute dtype (float32, or float64 for
            float64 inputs). ``torch.bfloat16`` (or ``torch.float16``) halves the bytes a step reads
            to score every segment (the scoring is a memory-bound pass over all S centroids): each
            mean is taken in float64 and rounded to the storage dtype once (through float32, as torch
            converts), and scored in the query's dtype from the stored values. The stored mean is off
            by up to 0.4% of each coordinate (8 bits of mantissa), enough to shortlist
            (:class:`~sparseattn.summaries.Rerank` rescores the shortlist exactly), not to bound: the
            Jensen bound holds up to that rounding. vLLM's fused step stores and scores bfloat16
            centroids the same way (``paged_kernels.c``, ``summarise``), so both engines rank alike.
    """

    dtype: torch.dtype | None = None

    reads_keys = False
    #: vLLM's fused step stores and scores centroids so (:data:`sparseattn.vllm.route.KERNELS`; this class's own).
    paged_kernel = "centroid"

    def __post_init__(self) -> None:
        if self.dtype not in _CENTROID_DTYPES:
            raise ValueError(f"Centroid.dtype must be one of {_CENTROID_DTYPES}, got {self.dtype!r}")

    def __repr__(self) -> str:  # the default storage is left out: ``Centroid()`` as before the option existed
        return "Centroid()" if self.dtype is None else f"Centroid(dtype={self.dtype})"

    def prepare(self, kv_heads: int, head_dim: int, *, layer_idx: int, device: torch.device, dtype: torch.dtype) -> None:
        return None

    def summarize(self, params: None, keys: torch.Tensor) -> tuple[torch.Tensor]:
        if self.dtype in (torch.bfloat16, torch.float16):  # one rounding of a float64 mean: reproducible in C
            return (keys.to(torch.float64).mean(dim=-2).to(self.dtype),)
        means = keys.mean(dim=-2)
        return (means if self.dtype is None else means.to(self.dtype),)

    def score(
        self,
        params: None,
        summaries: tuple[torch.Tensor],
        queries: torch.Tensor,
        segment_keys: torch.Tensor | None,
        segment_size: int,
    ) -> torch.Tensor:
        (centroids,) = summaries
        # Scored in the query's dtype: a bf16 product would round every score to 8 bits and tie many.
        products = queries @ centroids.to(queries.dtype).transpose(-1, -2)
        return products + math.log(segment_size)
