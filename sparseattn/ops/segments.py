"""Sealed segments' keys read on demand, the exact log mass of listed segments (torch op and reference), and
the sums a merged rest keeps of them (:class:`RestSums`).

The exact log mass of a segment for a query is ``logsumexp_{j in segment} q . k_j`` (keys and
query pre-scaled so that logits are plain dot products): what every segment summary estimates, and
what :class:`~sparseattn.summaries.Rerank` computes for its shortlist. :func:`segment_log_mass` is
the torch implementation (the ``torch`` backend's), :func:`segment_log_mass_ref` its float64
reference; the ``cpu`` backend's C kernel reads the keys in place instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sparseattn.ops.attention import gather_tokens
from sparseattn.ops.buffers import Workspace


class MassBackend(Protocol):
    """What :class:`SegmentKeys` needs of its backend: exact segment log masses (every
    :class:`~sparseattn.backends.base.AttentionBackend` has it; ops sit below backends, so named here)."""

    def segment_log_mass(self, segment_keys: SegmentKeys, queries: torch.Tensor, index: torch.Tensor, *, checked: bool = True) -> torch.Tensor: ...


class SegmentKeys:
    """The sealed segments' keys as a summary that ``reads_keys`` receives them: read on demand.

    ``raw: [B, H, S, c, D]`` is a view of the cache (storage dtype, unscaled: no copy is made);
    :meth:`take` scales and converts only the segments asked for, :meth:`all` every one (O(t)).
    A summary may also be handed a plain, already scaled ``[B, H, S, c, D]`` tensor (tests do);
    :func:`scaled_keys` accepts both.

    ``backend`` computes exact log masses of these segments
    (:func:`sparseattn.summaries.base.segment_log_mass`): the decode state chooses it once, on its
    first step; ``None`` lets ``auto`` choose on each call.
    """

    def __init__(
        self,
        raw: torch.Tensor,
        factor: float,
        dtype: torch.dtype,
        workspace: Workspace | None = None,
        backend: MassBackend | None = None,
    ) -> None:
        self.raw, self.factor, self.dtype = raw, factor, dtype
        self.workspace = workspace  # the decode state's scratch: taken keys reuse one buffer across steps
        self.backend = backend

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


@dataclass(frozen=True)
class RestSums:
    """The sums a merged rest (:class:`~sparseattn.methods.rest.MergedRest`) keeps of the sealed segments, as
    one value: what the merged-rest ops read instead of the segments' tokens.

    ``seg_kv: [B, H_kv, S, 2 D]`` float32, each segment's key sum then value sum side by side (one row
    read per segment); ``block_k, block_v: [B, H_kv, n, D]`` float64, each block's key and value sums, a
    block being ``per_block`` consecutive segments (the last one what is left). The decode state makes one
    per step from views of its buffers; nothing is checked here (the step is the hot path): the C kernel
    refuses ``per_block < 1``.
    """

    seg_kv: torch.Tensor
    block_k: torch.Tensor
    block_v: torch.Tensor
    per_block: int


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


def check_segment_lists(queries: torch.Tensor, index: torch.Tensor) -> None:
    """``index`` must be ``[B, H, 1 or R, m]`` for ``queries: [B, H, R, D]``."""
    if index.dim() != 4 or index.shape[:2] != queries.shape[:2] or index.shape[2] not in (1, queries.shape[2]):
        raise ValueError(f"segment lists must be [B, H, 1 or {queries.shape[2]}, m], got {tuple(index.shape)}")


def segment_log_mass(segment_keys: SegmentKeys | torch.Tensor, queries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Exact log attention masses of listed segments, by torch ops: ``[B, H, R, m]`` in the queries' dtype.

    ``queries: [B, H, R, D]`` (pre-scaled, compute dtype); ``index: [B, H, R', m]`` with ``R'`` in
    ``{1, R}``: one list shared by the R query rows (its keys copied once for all of them) or one
    list per row. The listed segments' keys are copied out (:func:`take_keys`) and multiplied.
    Reference: :func:`segment_log_mass_ref`.

    Example:
        >>> keys, q = torch.randn(1, 1, 4, 3, 8), torch.randn(1, 1, 2, 8)
        >>> index = torch.tensor([[[[3, 1]]]])
        >>> got = segment_log_mass(keys, q, index)
        >>> torch.allclose(got.double(), segment_log_mass_ref(keys, q, index), atol=1e-5)
        True
    """
    B, H, R, D = queries.shape
    sets, m = index.shape[2], index.shape[3]
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


def segment_log_mass_ref(segment_keys: SegmentKeys | torch.Tensor, queries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Reference for :func:`segment_log_mass`: every segment's log mass in float64, then the listed ones.

    A :class:`SegmentKeys` is read as its raw keys times its factor, in float64 (no rounding to the
    compute dtype first). Returns ``[B, H, R, m]`` float64.
    """
    if isinstance(segment_keys, SegmentKeys):
        keys = segment_keys.raw.double() * segment_keys.factor
    else:
        keys = segment_keys.double()
    B, H, R, _ = queries.shape
    logits = torch.einsum("bhrd,bhscd->bhrsc", queries.double(), keys)  # [B, H, R, S, c]
    return torch.logsumexp(logits, dim=-1).gather(-1, index.expand(B, H, R, index.shape[-1]))
