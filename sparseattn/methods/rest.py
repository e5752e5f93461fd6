"""What a step leaves out: merged into one token per block of segments instead of dropped.

A segment search attends its selection and drops every other token's share of the softmax. In a
diffuse head (layer 0 of small models is the common case) the dropped share is large and spread
thin, and no top-k at this budget holds it. :class:`MergedRest` keeps a coarse picture of it: the
grid's segments are grouped into blocks of ``segments`` consecutive segments, and each block's tokens
that the step does *not* attend enter the softmax as one merged token with their mean key, their
mean value, and the weight of their count:

    logit_b = log n_b + scale * q . mean_k_b,    value_b = mean_v_b.

That is exactly those tokens' share when their keys are equal, and never more than it otherwise
(Jensen: ``n exp(q . mean k) <= sum exp(q . k)``), so a block whose keys disagree (where the mean
value would misrepresent what attention picks in it) is down-weighted by construction. The
measured alternative with the blocks' exact masses and the same mean values is worse
(docs/methods.md): the under-estimate is a feature, not an approximation to remove.

Each merged token counts as one attended token against ``budget`` (it is one key and one value in
the softmax), so a step attends ``ceil(S / segments)`` merged tokens plus its selection, the
selection shrunk to keep the total. With ``segments = 16`` on radar+pooled's grid (``16 sqrt(t)``
segments) that is ``sqrt(t)`` merged tokens: the step stays O(sqrt t).

The state keeps each block's key and value sums (float64: the step subtracts what it attends, and
the difference of two large sums must not lose the rest); the step subtracts, per query head, the
keys and values it attends inside the block (read anyway by the attention), so the rest is exact
per head whatever the selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from sparseattn.ops.attention import gather_tokens, soft_cap
from sparseattn.ops.buffers import Workspace
from sparseattn.ops.segments import RestSums
from sparseattn.validation import check_int

if TYPE_CHECKING:
    from sparseattn.allocations.base import Selection
    from sparseattn.backends.base import SegmentAttentionLSE
    from sparseattn.methods.segment_step import SegmentStep


@runtime_checkable
class Rest(Protocol):
    """A segment search's ``rest`` part: what a step does not attend, joined to its softmax.

    The decode state keeps each block of ``per_block`` consecutive segments' key and value sums
    (float64) and each segment's (float32, key sum then value sum), read through ``step.block_sums()``
    and ``step.segment_sums()``; a rest whose ``per_block`` is None reads no sums, and none are kept
    (e.g. :class:`~sparseattn.methods.sampled_rest.SampledRest`, which reads the cache). At a step that
    attends fewer than every segment it calls one of the rest's two attend hooks, as the attend stage's
    capability table says:

    * ``attend_segments(step, selection, backend, fused)``: a selection of whole segments, on a backend
      with :class:`~sparseattn.backends.base.SegmentAttentionLSE` (``fused``: it also has
      :class:`~sparseattn.backends.base.MergedRestAttention`); returns ``out [B, H_kv, G, D]``;
    * ``attend_tokens(step, listed, attended, runs)``: the torch gather path over the listed tokens
      (:meth:`~sparseattn.allocations.Selection.listing`); returns ``(out, probs [B, H_kv, G, L])``.

    A hook may report a per-query-head bound on the error its estimate of the rest adds to the output,
    ``[B, H_kv, G]``, by setting ``step.rest_bound`` (the step starts with None); the state reports it as
    :attr:`~sparseattn.methods.segment_step.SegmentSelection.rest_bound` (``SampledRest`` does;
    :class:`MergedRest` reports none).

    ``blocks(n_segments)`` is what it adds to a step: tokens counted against the budget.
    """

    per_block: int | None

    def blocks(self, n_segments: int) -> int: ...

    def attend_segments(self, step: SegmentStep, selection: Selection, backend: SegmentAttentionLSE, fused: bool) -> torch.Tensor: ...

    def attend_tokens(
        self, step: SegmentStep, listed: torch.Tensor, attended: torch.Tensor | None, runs: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class MergedRest:
    """Attend the unattended tokens of every block of ``segments`` consecutive segments as one merged token.

    Its attend step (the :class:`Rest` hooks): over whole segments, the backend's kernel with each head's
    log-sum-exp plus the merged tokens from the segments' and blocks' sums (:func:`add_merged_rest`, or
    the backend's fused kernel), no token gathered; over listed tokens, :func:`merged_attention`.

    Args:
        segments: segments per block (>= 1), or None: one block, the whole rest as one merged token per
            step and query head. One merged token per block counts against the budget.
    """

    segments: int | None = 16
    #: vLLM's fused step merges the rest so (:data:`sparseattn.vllm.route.KERNELS`).
    paged_kernel = "merged"

    def __post_init__(self) -> None:
        if self.segments is not None:
            check_int("MergedRest", "segments", self.segments, 1, "or None for one block")

    @property
    def per_block(self) -> int:
        """Segments per block (one block holds any grid when ``segments`` is None)."""
        return _ONE_BLOCK if self.segments is None else self.segments

    def blocks(self, n_segments: int) -> int:
        """Merged tokens a step adds over a grid of ``n_segments`` segments."""
        return -(-n_segments // self.per_block)

    def attend_segments(self, step: SegmentStep, selection: Selection, backend: SegmentAttentionLSE, fused: bool) -> torch.Tensor:
        """``[B, H_kv, G, D]``: the selection's whole segments by ``backend`` plus the merged rest, in one call
        when ``fused`` and the window reaches into no segment (the fused kernel's one condition, which a
        segment search's state always meets), else the kernel's log-sum-exp and :func:`add_merged_rest`."""
        lay, q, segments, valid = step.layout, step.query, selection.segments, selection.valid
        sums = RestSums(step.segment_sums(), *step.block_sums(), self.per_block)
        if fused and lay.tail_start >= lay.segment_end:
            return backend.segment_attention_merged(q, step.keys, step.values, lay, segments, valid, sums, step.scale, step.softcap)
        out, lse = backend.segment_attention_lse(q, step.keys, step.values, lay, segments, valid, step.scale, step.softcap)
        return add_merged_rest(
            out, lse, q, step.keys, step.values, lay, segments, valid, sums, step.scale, step.softcap, step.workspace
        ).to(out.dtype)

    def attend_tokens(
        self, step: SegmentStep, listed: torch.Tensor, attended: torch.Tensor | None, runs: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, probs)``: :func:`merged_attention` over the listed tokens, with this part's blocks."""
        lay = step.layout
        block_k, block_v = step.block_sums()
        return merged_attention(
            step.query, step.keys, step.values, listed, attended, block_k, block_v,
            block_counts(lay.n_segments, lay.segment_size, self.per_block, step.device), lay.sink_end, lay.segment_end,
            min(self.per_block, lay.n_segments) * lay.segment_size, step.scale, step.softcap, step.workspace, runs,
        )  # fmt: skip


#: Segments per block of ``MergedRest(None)``: more than any grid has.
_ONE_BLOCK = 2**62


def group_blocks(sums: torch.Tensor, per_block: int) -> torch.Tensor:
    """``[B, H, S, D]`` per-segment sums added ``per_block`` at a time: ``[B, H, ceil(S / per_block), D]``.

    The last block holds what is left (``S mod per_block`` segments, if any).
    """
    B, H, S, D = sums.shape
    per_block = min(per_block, max(S, 1))  # one block of every segment (MergedRest(None)): no padding to it
    pad = -S % per_block
    if pad:
        sums = torch.cat([sums, sums.new_zeros(B, H, pad, D)], dim=2)
    return sums.view(B, H, -1, per_block, D).sum(3)


def block_sums(seg_keys: torch.Tensor, seg_values: torch.Tensor, per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value sums ``[B, H, n_blocks, D]`` (float64) of segments ``[B, H, S, c, D]`` grouped ``per_block`` at a time."""
    keys, values = segment_sums(seg_keys, seg_values, torch.float64)
    return group_blocks(keys, per_block), group_blocks(values, per_block)


def block_counts(n_segments: int, segment_size: int, per_block: int, device=None) -> torch.Tensor:
    """Tokens in each block ``[n_blocks]`` (float64): ``per_block x segment_size``, the last block what is left."""
    n = -(-n_segments // per_block)
    # Block j holds min(per_block, what is left from j per_block on): computed on the device (writing the last
    # entry from a Python number is a copy from the host: on a GPU a sync, and no CUDA graph).
    left = n_segments - torch.arange(n, dtype=torch.float64, device=device) * per_block
    return left.clamp(max=per_block) * segment_size


def attended_block_sums(
    x: torch.Tensor, weight: torch.Tensor, block: torch.Tensor, n: int, runs: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """``out[b, h, g, j] = sum_l weight[b, h, g, l] x[b, h, l]`` over the listed tokens ``l`` of block ``j``: ``[B, H, G, n, D]``, float64.

    ``x: [B, H, L, D]``, ``weight: [B, H, G, L]`` (0 for tokens outside every block), ``block: [B, H, L]``
    each token's block (any valid one where the weight is 0). ``runs = (first, count, length)``: the
    entries ``[first, first + count x length)`` come in runs of ``length`` tokens of one block (a
    segment search's listing: whole segments), summed per run first, so the work is ``G`` sums over
    ``L / length`` runs instead of over ``L`` tokens; the other entries are summed one by one.
    """
    B, H, G, L = weight.shape
    D = x.shape[-1]
    out = torch.zeros(B, H, G, n, D, dtype=torch.float64, device=x.device)
    first, count, length = runs if runs is not None else (0, 0, 1)
    for lo, hi in ((0, first), (first + count * length, L)):  # single tokens: sinks, tail, extra tokens
        if hi > lo:
            contrib = (weight[..., lo:hi].unsqueeze(-1) * x[:, :, None, lo:hi].to(weight.dtype)).to(torch.float64)
            out.scatter_add_(3, block[:, :, None, lo:hi, None].expand(B, H, G, hi - lo, D), contrib)
    if count:
        w = weight[..., first : first + count * length].reshape(B, H, G, count, length)
        xs = x[:, :, first : first + count * length].reshape(B, H, count, length, D).to(weight.dtype)
        if bool((w.amax(-1) == w.amin(-1)).all()):  # each head takes a run whole or not at all: sum it once
            per_run = w[..., 0].unsqueeze(-1) * xs.sum(3).unsqueeze(2)  # [B, H, G, count, D]
        else:  # a run cut by the window: token by token within the runs
            per_run = torch.einsum("bhgrc,bhrcd->bhgrd", w, xs)
        run_block = block[:, :, first : first + count * length : length]  # [B, H, count]
        summed = torch.zeros(B, H, G, n, D, dtype=per_run.dtype, device=x.device)
        summed.scatter_add_(3, run_block[:, :, None, :, None].expand(B, H, G, count, D), per_run)
        out += summed.to(torch.float64)  # at most a block's tokens per sum: the working dtype holds it
    return out


def merged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    attended: torch.Tensor | None,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    counts: torch.Tensor,
    start: int,
    end: int,
    block_tokens: int,
    scale: float,
    softcap: float | None = None,
    workspace: Workspace | None = None,
    runs: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the listed tokens plus one merged token per block of what they leave out.

    ``q: [B, H_kv, G, D]``; ``index: [B, H_kv, L]`` the listed token positions, ``attended: [B, H_kv,
    1 or G, L]`` which of them each query head attends (None: all); ``block_k, block_v: [B, H_kv, n,
    D]`` the blocks' key and value sums, ``counts: [n]`` their tokens; block ``b`` holds the positions
    of ``[start + b x block_tokens, start + (b + 1) x block_tokens)`` before ``end``. Per query head, the attended
    tokens inside a block are subtracted from its sums; what is left, ``m`` tokens, is one token of
    logit ``log m + scale q . (sum k / m)`` (soft-capped as the others) and value ``sum v / m``; an
    emptied block has weight 0. ``runs``: see :func:`attended_block_sums` (a segment search's listing
    passes its segments' runs). Returns ``out: [B, H_kv, G, D]`` and the listed tokens' ``probs: [B, H_kv,
    G, L]`` (0 where not attended), in float32 (float64 for float64 inputs).
    """
    B, H, G, D = q.shape
    n = block_k.shape[2]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = gather_tokens(keys, index, workspace, "token_keys").to(cd)  # [B, H, L, D]
    v = gather_tokens(values, index, workspace, "token_values").to(cd)
    qc = q.to(cd)
    logits = soft_cap(torch.matmul(qc, k.transpose(-1, -2)) * scale, softcap)  # [B, H, G, L]
    took = torch.ones_like(logits, dtype=torch.bool) if attended is None else attended.expand(B, H, G, -1)
    logits = logits.masked_fill(~took, float("-inf"))
    # What each head attends inside the blocks leaves the rest: subtract it from the sums (in float64).
    inside = (index >= start) & (index < end)  # [B, H, L]: the tail after the last segment is no block's
    block = (index - start).div(block_tokens, rounding_mode="floor").clamp(0, max(n - 1, 0))
    weight = (took & inside.unsqueeze(2)).to(cd)  # [B, H, G, L]
    taken = torch.zeros(B, H, G, n, dtype=torch.float64, device=q.device)
    taken.scatter_add_(3, block.unsqueeze(2).expand(B, H, G, -1), weight.to(torch.float64))
    rest_n = counts.to(torch.float64) - taken  # [B, H, G, n]
    rest_k = block_k.unsqueeze(2) - attended_block_sums(k, weight, block, n, runs)
    rest_v = block_v.unsqueeze(2) - attended_block_sums(v, weight, block, n, runs)
    left = rest_n > 0.5  # counts are whole numbers: a float64 difference of them is exact
    m = rest_n.clamp_min(1.0).unsqueeze(-1)
    mean_k, mean_v = (rest_k / m).to(cd), (rest_v / m).to(cd)
    merged = soft_cap((qc.unsqueeze(3) * mean_k).sum(-1) * scale, softcap) + rest_n.clamp_min(1.0).log().to(cd)
    merged = merged.masked_fill(~left, float("-inf"))  # [B, H, G, n]
    probs = torch.softmax(torch.cat([logits, merged], dim=-1), dim=-1)
    L = logits.shape[-1]
    listed = probs[..., :L]
    return torch.matmul(listed, v) + torch.einsum("bhgn,bhgnd->bhgd", probs[..., L:], mean_v), listed


def segment_sums(
    seg_keys: torch.Tensor, seg_values: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value sums ``[B, H, S, D]`` of segments ``[B, H, S, c, D]``, in ``dtype``: what a step subtracts
    from its blocks' sums for every segment it attends, without reading the segment's tokens again."""
    return seg_keys.to(dtype).sum(3), seg_values.to(dtype).sum(3)


def add_merged_rest(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout,
    segments: torch.Tensor,
    valid: torch.Tensor | None,
    sums: RestSums,
    scale: float,
    softcap: float | None = None,
    workspace: Workspace | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a segment selection, ``out [B, H_kv, G, D]`` with log-sum-exp ``lse [B, H_kv, G]`` (the
    kernel's), with the merged tokens of what it leaves out added to its softmax: no token is gathered.

    ``segments: [B, H_kv, G', w]`` each selection's listed segments, ``valid`` (same shape, None: all)
    which it attends (``G'`` in ``{1, G}``); ``sums``: each segment's key sum then value sum side by side
    (``seg_kv``, :func:`segment_sums` concatenated: one row read per segment) and each block's (``block_k,
    block_v``, :func:`block_sums`, ``per_block`` segments each). The attended set is the layout's: sinks, the
    attended segments below ``tail_start``, and the tail; a segment the window reaches into is
    attended whole if selected, else only its tokens in the tail (summed here from the cache: at most
    ``window`` tokens). The merged token of block ``b``, as :func:`merged_attention` defines it, has
    ``logit = log m + scale q . (K_b - A_b) / m`` and value ``(V_b - W_b) / m`` (``A_b, W_b``: what
    the head attends in the block). Neither ``A_b`` nor ``W_b`` is formed per block: the step needs only
    ``q . A_b`` (each attended segment's ``q . sum k``, added per block) and ``sum_b p_b W_b / m_b`` (the
    attended segments' value sums weighted by their block's ``p_b / m_b``), so the work is two
    ``D``-vectors per attended segment and per block: O(budget / c + n) per query head.

    When every KV head lists the same segments for all its query heads (a shared selection, or a listing
    expanded from one row per KV head) the rows are read once per KV head; otherwise once per (query head,
    listed segment), an unattended one weighted 0. Neither path reads anything back to the host (on a GPU:
    no sync, and a step a CUDA graph captures); the choice is made from the listing's shape and strides,
    never its values. The two paths agree to float32 rounding.

    ``seg_kv`` may hold more rows than the layout's segments (a fixed-shape step passes its reserved storage:
    rows at a fixed stride, no copy); ``counts: [n]`` (float64), each block's tokens, when they are not the
    layout's (:func:`block_counts`: a fixed-shape step's grid grows within its widest layout).

    Returns ``[B, H_kv, G, D]`` float32 (float64 for float64 ``q``). ``workspace``: where the segment rows
    are copied (a fresh multi-megabyte tensor per step costs page faults, see
    :class:`~sparseattn.ops.buffers.Workspace`). Reference: :func:`~sparseattn.ops.merged.merged_attention_ref`.
    """
    seg_kv, block_k, block_v, per_block = sums.seg_kv, sums.block_k, sums.block_v, sums.per_block
    B, H, G, D = q.shape
    S, c = layout.n_segments, layout.segment_size
    ws = workspace or Workspace()
    n, w = block_k.shape[2], segments.shape[3]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    sd = seg_kv.dtype
    attended = torch.ones(B, H, G, w, dtype=torch.bool, device=q.device) if valid is None else valid.expand(B, H, G, w)
    flat_kv = seg_kv.reshape(-1, 2 * D)
    base = (torch.arange(B * H, device=q.device) * seg_kv.shape[2]).view(B, H, 1)  # each (b, h)'s first row of the sums
    # A listing expanded from one row per KV head (a pooled split read off the group's shortlist: Shortlist.top)
    # says so by its stride, with no comparison read back to the host (on a GPU: no sync, and a capturable step).
    shared = segments.shape[2] == 1 or segments.stride(2) == 0
    weight = attended.to(sd)
    if shared:
        # One listing per KV head (a shared selection, or a pooled split read off the group's shortlist):
        # each listed segment's row is read once for the group's heads, and the sums are small products.
        listed = torch.index_select(flat_kv, 0, (base + segments[:, :, 0]).view(-1),
                                    out=ws.get("rest_rows", (B * H * w, 2 * D), sd, q.device)).view(B, H, w, 2 * D)  # fmt: skip
        block = segments[:, :, :1].div(per_block, rounding_mode="floor").expand(B, H, G, w)
        q_listed = torch.matmul(q.to(sd), listed[..., :D].transpose(-1, -2)) * weight  # [B, H, G, w]
    else:
        # One row per (query head, listed segment), weighted by whether that head attends it: G times the rows of
        # a shared listing, the same shapes every step.
        listed_segments = segments.expand(B, H, G, w)
        rows = (base.unsqueeze(-1) + listed_segments).reshape(-1)
        listed = torch.index_select(flat_kv, 0, rows, out=ws.get("rest_rows", (B * H * G * w, 2 * D), sd, q.device))
        listed = listed.view(B, H, G, w, 2 * D)
        block = listed_segments.div(per_block, rounding_mode="floor")
        q_listed = (q.to(sd).unsqueeze(3) * listed[..., :D]).sum(-1) * weight  # [B, H, G, w]
    q_taken = torch.zeros(B, H, G, n, dtype=torch.float64, device=q.device).scatter_add_(3, block, q_listed.double())
    taken = torch.zeros(B, H, G, n, dtype=torch.float64, device=q.device).scatter_add_(3, block, weight.double() * c)
    extra = None
    tail_start, seg_end = layout.tail_start, layout.segment_end
    if tail_start < seg_end and S:  # the window reaches into segments: their tail tokens are attended anyway
        first = (tail_start - layout.sink_end) // c
        reach = torch.arange(first, S, device=q.device)  # [O]
        chosen = ((segments.unsqueeze(-1) == reach) & attended.narrow(2, 0, segments.shape[2]).unsqueeze(-1)).any(-2)
        unchosen = (~chosen).expand(B, H, G, -1).to(torch.float64)  # [B, H, G, O]: these attend only the tail part
        owner = (torch.arange(tail_start, seg_end, device=q.device) - layout.sink_end).div(c, rounding_mode="floor") - first
        tail_n = torch.zeros(len(reach), dtype=torch.float64, device=q.device).index_add_(
            0, owner, torch.ones(len(owner), dtype=torch.float64, device=q.device))  # fmt: skip
        part_k, part_v = (torch.zeros(B, H, len(reach), D, dtype=torch.float64, device=q.device).index_add_(
            2, owner, x[:, :, tail_start:seg_end].to(torch.float64)) for x in (keys, values))  # fmt: skip
        reach_block = reach.div(per_block, rounding_mode="floor").expand(B, H, G, -1)
        q_taken.scatter_add_(3, reach_block, unchosen * torch.einsum("bhgd,bhod->bhgo", q.double(), part_k))
        taken.scatter_add_(3, reach_block, unchosen * tail_n)
        extra = (reach_block, unchosen, part_v)
    rest_n = (block_counts(S, c, per_block, q.device) if counts is None else counts) - taken  # [B, H, G, n]
    left = rest_n > 0.5  # whole numbers: the float64 difference is exact
    m = rest_n.clamp_min(1.0)
    q_rest = torch.einsum("bhgd,bhnd->bhgn", q.double(), block_k) - q_taken  # q . (K_b - A_b), float64
    logits = (soft_cap((q_rest / m).to(cd) * scale, softcap) + m.log().to(cd)).masked_fill(~left, float("-inf"))
    top = torch.maximum(lse.to(cd), logits.amax(-1))  # [B, H, G]
    first_w = torch.exp(lse.to(cd) - top)
    more = torch.exp(logits - top.unsqueeze(-1))  # [B, H, G, n]
    per_token = (more / m.to(cd)).double()  # p_b / m_b, up to the common normaliser
    rest_v = torch.einsum("bhgn,bhnd->bhgd", per_token, block_v)
    coef = (per_token.gather(3, block) * weight.double()).to(sd)  # [B, H, G, w]
    if shared:
        attended_v = torch.matmul(coef, listed[..., D:])  # [B, H, G, D]
    else:
        attended_v = (coef.unsqueeze(-1) * listed[..., D:]).sum(3)
    rest_v = rest_v - attended_v.double()
    if extra is not None:
        reach_block, unchosen, part_v = extra
        rest_v = rest_v - torch.einsum("bhgo,bhod->bhgd", per_token.gather(3, reach_block) * unchosen, part_v)
    num = first_w.unsqueeze(-1) * out.to(cd) + rest_v.to(cd)
    return num / (first_w + more.sum(-1)).unsqueeze(-1)
