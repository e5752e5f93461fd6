"""Float64 references for the backends' ops: slow, obvious, and independent of the kernels.

:data:`REFERENCES` names the reference of each op of :data:`~sparseattn.backends.base.OPS`; each
lives beside its torch implementation in :mod:`sparseattn.ops` and takes that op's arguments:

* ``segment_attention``: :func:`sparseattn.ops.attention.segment_attention_ref` (a dense mask, soft-capping included);
* ``segment_log_mass``: :func:`sparseattn.ops.segments.segment_log_mass_ref`;
* ``slot_attention``: :func:`sparseattn.ops.slots.slot_attention_ref` (returns ``out`` only);
* ``dense``: :func:`sparseattn.ops.attention.dense_decode_attention_ref`;
* ``bound_scores``: :func:`sparseattn.ops.bounds.bound_scores_ref` (the definition, elementwise).

Here, for the Triton kernel's split merge: :func:`merge_partials_ref`, combining attention states over
disjoint key sets by log-sum-exp (FlashInfer's ``merge_state``), written as one softmax over the states' LSEs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sparseattn.ops.attention import dense_decode_attention_ref, segment_attention_ref
from sparseattn.ops.bounds import bound_scores_ref
from sparseattn.ops.segments import segment_log_mass_ref
from sparseattn.ops.slots import slot_attention_ref

REFERENCES: Mapping[str, Callable[..., torch.Tensor]] = {
    "segment_attention": segment_attention_ref,
    "segment_log_mass": segment_log_mass_ref,
    "slot_attention": slot_attention_ref,
    "dense": dense_decode_attention_ref,
    "bound_scores": bound_scores_ref,
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
