"""Float64 references for the backends' ops: slow, obvious, and independent of the kernels.

:data:`REFERENCES` is the one table of them: the reference of every op of
:data:`~sparseattn.backends.base.OPS` and of every optional op of
:data:`~sparseattn.backends.base.EXTENSION_OPS`, each taking that op's arguments (``tests/test_backends.py``
fails for an op without one, and compares every backend's op with it on fresh random inputs). Each lives
beside the idea it computes:

* ``segment_attention``: :func:`sparseattn.ops.attention.segment_attention_ref` (a dense mask, soft-capping included);
* ``segment_log_mass``: :func:`sparseattn.ops.segments.segment_log_mass_ref`;
* ``slot_attention``: :func:`sparseattn.ops.slots.slot_attention_ref` (returns ``out`` only);
* ``dense``: :func:`sparseattn.ops.attention.dense_decode_attention_ref`;
* ``bound_scores``: :func:`sparseattn.ops.bounds.bound_scores_ref` (the definition, elementwise);
* ``segment_attention_masked``: :func:`sparseattn.ops.attention.segment_attention_masked_ref`;
* ``segment_attention_lse``: :func:`sparseattn.ops.attention.segment_attention_lse_ref` (``(out, lse)``);
* ``segment_attention_merged``: :func:`segment_attention_merged_ref` here, the op's arguments handed to
  :func:`sparseattn.ops.merged.merged_attention_ref` (which reads the tokens, not the op's sums).

Here, for the Triton kernel's split merge: :func:`merge_partials_ref`, combining attention states over
disjoint key sets by log-sum-exp (FlashInfer's ``merge_state``), written as one softmax over the states' LSEs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sparseattn.ops.attention import (
    dense_decode_attention_ref,
    segment_attention_lse_ref,
    segment_attention_masked_ref,
    segment_attention_ref,
    segment_mask,
)
from sparseattn.ops.bounds import bound_scores_ref
from sparseattn.ops.layout import SegmentLayout
from sparseattn.ops.merged import merged_attention_ref
from sparseattn.ops.segments import RestSums, segment_log_mass_ref
from sparseattn.ops.slots import slot_attention_ref


def segment_attention_merged_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor,
    valid: torch.Tensor | None, sums: RestSums, scale: float, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference for a backend's ``segment_attention_merged``: ``[B, H_kv, G, D]`` float64.

    :func:`~sparseattn.ops.merged.merged_attention_ref` over the attended mask, its blocks of
    ``sums.per_block`` segments in ``[sink_end, segment_end)``. The tensors of ``sums`` are not read: they
    are sums of the keys and values, which the reference takes from the tokens themselves.
    """
    mask = segment_mask(layout, segments, q.shape[2], valid)
    L = layout.length
    return merged_attention_ref(
        q, keys[:, :, :L], values[:, :, :L], mask, layout.sink_end, layout.segment_end,
        sums.per_block * layout.segment_size, scale, softcap,
    )  # fmt: skip


REFERENCES: Mapping[str, Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = {
    "segment_attention": segment_attention_ref,
    "segment_log_mass": segment_log_mass_ref,
    "slot_attention": slot_attention_ref,
    "dense": dense_decode_attention_ref,
    "bound_scores": bound_scores_ref,
    "segment_attention_masked": segment_attention_masked_ref,
    "segment_attention_lse": segment_attention_lse_ref,
    "segment_attention_merged": segment_attention_merged_ref,
}


def merge_partials_ref(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states computed over disjoint key sets, in float64.

    State ``s`` is a normalised output ``o_s`` and the log-sum-exp ``lse_s`` of its logits; the
    merged state is ``o = sum_s softmax(lse)_s * o_s`` and ``lse = logsumexp_s lse_s``. A state with
    ``lse = -inf`` saw no key and contributes nothing (its output is ignored, even if NaN); a row
    whose states all saw nothing merges to ``o = 0``, ``lse = -inf``.

    Args:
        outs: ``[..., S, D]``; lses: ``[..., S]``.
    Returns:
        ``(out [..., D], lse [...])`` in float64.

    Example (two halves of one softmax merge to the whole):
        >>> logits, v = torch.randn(6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
        >>> halves = [(torch.softmax(l, 0) @ vv, torch.logsumexp(l, 0)) for l, vv in zip(logits.split(3), v.split(3))]
        >>> out, lse = merge_partials_ref(torch.stack([o for o, _ in halves]), torch.stack([s for _, s in halves]))
        >>> torch.allclose(out, torch.softmax(logits, 0) @ v), torch.allclose(lse, torch.logsumexp(logits, 0))
        (True, True)
    """
    outs, lses = outs.double(), lses.double()
    seen = lses > float("-inf")
    any_seen = seen.any(dim=-1, keepdim=True)
    weights = torch.softmax(torch.where(any_seen, lses, 0.0), dim=-1) * seen  # [..., S]
    out = (weights.unsqueeze(-1) * torch.where(seen.unsqueeze(-1), outs, 0.0)).sum(dim=-2)
    return out, torch.logsumexp(lses, dim=-1)
