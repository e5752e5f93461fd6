"""The ``Summary`` protocol: how a segment of keys is summarised and scored against a query."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from sparseattn.backends.cpu_kernels import MAX_GROUP, kernel_reads, segment_log_mass_cpu
from sparseattn.ops.attention import gather_tokens
from sparseattn.ops.buffers import Workspace


class SegmentKeys:
    """The sealed segments' keys as a summary that ``reads_keys`` receives them: read on demand.

    ``raw: [B, H, S, c, D]`` is a view of the cache (storage dtype, unscaled: no copy is made);
    :meth:`take` scales and converts only the segments asked for, :meth:`all` every one (O(t)).
    A summary may also be handed a plain, already scaled ``[B, H, S, c, D]`` tensor (tests do);
    :func:`scaled_keys` accepts both.
    """

    def __init__(self, raw: torch.Tensor, factor: float, dtype: torch.dtype, workspace: Workspace | None = None) -> None:
        self.raw, self.factor, self.dtype = raw, factor, dtype
        self.workspace = workspace  # the decode state's scratch: taken keys reuse one buffer across steps

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def all(self) -> torch.Tensor:
        return self.raw.to(self.dtype) * self.factor

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Segments ``index: [B, H, m]`` -> scaled keys ``[B, H, m, c, D]`` (a copy of those only)."""
        B, H, S, c, D = self.raw.shape
        m = index.shape[-1]
        try:  # the segments as one token axis: a view of the cache (reshape could copy all t keys)
            token_rows = self.raw.view(B, H, S * c, D)
        except RuntimeError:  # segments not evenly strided: index the selected ones directly
            b = torch.arange(B, device=index.device).view(B, 1, 1)
            h = torch.arange(H, device=index.device).view(1, H, 1)
            return self.raw[b, h, index].to(self.dtype) * self.factor
        tokens = (index.unsqueeze(-1) * c + torch.arange(c, device=index.device)).view(B, H, m * c)
        # Row gathers (index_select) of the cache's token rows: advanced indexing is ~10x slower on CPU.
        taken = gather_tokens(token_rows, tokens, self.workspace, "segment_keys").view(B, H, m, c, D)
        taken = taken.to(self.dtype) if taken.dtype != self.dtype else taken
        return taken.mul_(self.factor)  # our own copy: scaled in place


def segment_log_mass(segment_keys: SegmentKeys | torch.Tensor, queries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Exact log attention masses ``logsumexp_{j in segment} q . k_j`` of listed segments: ``[B, H, R, m]``.

    ``queries: [B, H, R, D]`` (pre-scaled, compute dtype); ``index: [B, H, R', m]`` with ``R'`` in
    ``{1, R}``: one list shared by the R query rows (its keys read once for all of them) or one list
    per row. A :class:`SegmentKeys` view of a CPU cache is read in place by the cpu backend's kernel
    (float32 queries); otherwise the listed segments' keys are copied out and multiplied (the reference).
    """
    B, H, R, D = queries.shape
    sets, m = index.shape[2], index.shape[3]
    if sets not in (1, R):
        raise ValueError(f"segment lists must be [B, H, 1 or {R}, m], got {tuple(index.shape)}")
    fast = isinstance(segment_keys, SegmentKeys) and queries.dtype == torch.float32 and R <= MAX_GROUP
    if fast and kernel_reads(segment_keys.raw):
        return segment_log_mass_cpu(queries, segment_keys.raw, segment_keys.factor, index)
    if sets == 1:
        keys = take_keys(segment_keys, index[:, :, 0]).to(queries.dtype)  # [B, H, m, c, D]: read once for the rows
        c = keys.shape[-2]
        logits = torch.matmul(keys.reshape(B, H, m * c, D), queries.transpose(-1, -2))  # [B, H, m c, R]
        return torch.logsumexp(logits.view(B, H, m, c, R), dim=3).transpose(-1, -2)
    keys = take_keys(segment_keys, index.reshape(B, H, R * m))  # [B, H, R m, c, D]: m segments per row
    keys = keys.view(B, H, R, m, *keys.shape[-2:]).to(queries.dtype)
    c = keys.shape[-2]
    # A matmul per row ([m c, D] @ [D]); einsum would broadcast-multiply then sum on CPU.
    logits = torch.matmul(keys.reshape(B, H, R, m * c, D), queries.unsqueeze(-1)).view(B, H, R, m, c)
    return torch.logsumexp(logits, dim=-1)


def scaled_keys(segment_keys: SegmentKeys | torch.Tensor) -> torch.Tensor:
    """Every segment's scaled keys ``[B, H, S, c, D]``, from a :class:`SegmentKeys` or a tensor."""
    return segment_keys.all() if isinstance(segment_keys, SegmentKeys) else segment_keys


def take_keys(segment_keys: SegmentKeys | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Scaled keys ``[B, H, m, c, D]`` of segments ``index: [B, H, m]``."""
    if isinstance(segment_keys, SegmentKeys):
        return segment_keys.take(index)
    B, H = index.shape[:2]
    b = torch.arange(B, device=index.device).view(B, 1, 1)
    h = torch.arange(H, device=index.device).view(1, H, 1)
    return segment_keys[b, h, index]


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

        ``segment_keys`` (:class:`SegmentKeys`, ``[B, H, S, c, D]`` read on demand) is passed only
        when ``reads_keys`` is True; read it with :func:`scaled_keys` or :func:`take_keys`. A summary
        that declares ``uses_top_k = True`` also receives ``top_k=`` (the segments the step attends).

        A summary may also define ``score_group`` with the same arguments, returning ``[B, H, 1, S]``:
        the log of the group's summed masses, ``logsumexp_g score[..., g, :]``, computed more cheaply
        (selections shared by a KV group use it; without it the state takes that logsumexp itself).
        """
        ...
