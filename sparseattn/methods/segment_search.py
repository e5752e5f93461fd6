"""Segment search: summary x selector x schedule, and Radar as its preset (Algorithm 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sparseattn.methods.base import SUPPORTED_DTYPES
from sparseattn.ops.attention import compute_dtype, segment_attention, segment_mask
from sparseattn.ops.buffers import GrowableBuffer
from sparseattn.ops.layout import SegmentLayout
from sparseattn.schedules.base import Schedule, SegmentGrid
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.base import Selector
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import Summary
from sparseattn.summaries.performer import PerformerFeatures

# Tokens x heads summarised at once during a rebuild: bounds the [.., c, n_features] temporary.
_SUMMARY_CHUNK = 8192


@dataclass(frozen=True)
class SegmentSearch:
    """Attend to the top segments of the past, found through per-segment summaries.

    Per decode step: score the sealed segments with ``summary``, pick ``top_k`` of them with
    ``selector``, and attend to their tokens plus the ``sinks`` first tokens, the unsealed buffer and
    the last ``window`` tokens. ``schedule`` decides when segments are sealed or rebuilt. Any
    summary x selector x schedule combination runs; with ``top_k`` >= the number of segments the
    output is exactly dense attention.

    Args:
        summary: how segments are summarised and scored (e.g. :class:`PerformerFeatures`).
        selector: which scored segments are attended (e.g. :class:`TopK`).
        schedule: when segments are sealed and rebuilt (e.g. :class:`SqrtSchedule`).
        top_k: segments attended per step (at most all of them).
        sinks: first tokens, outside the segments, always attended.
        window: last tokens always attended (on top of the schedule's buffer).
        shared_kv_selection: one selection per KV head, from the group's summed estimated masses,
            instead of one per query head (cheaper gathers under grouped-query attention).
    """

    summary: Summary = field(default_factory=PerformerFeatures)
    selector: Selector = field(default_factory=TopK)
    schedule: Schedule = field(default_factory=SqrtSchedule)
    top_k: int = 64
    sinks: int = 0
    window: int = 0
    shared_kv_selection: bool = False

    def __post_init__(self) -> None:
        for name, proto in (("summary", Summary), ("selector", Selector), ("schedule", Schedule)):
            part = getattr(self, name)
            if isinstance(part, type):
                raise ValueError(f"SegmentSearch.{name} must be an instance of a {proto.__name__} part, got the class {part.__name__}; use {part.__name__}()")
            if not isinstance(part, proto):
                raise ValueError(
                    f"SegmentSearch.{name} must implement the {proto.__name__} protocol, got {getattr(self, name)!r}"
                )
        for name in ("top_k", "sinks", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SegmentSearch.{name} must be an int >= 0, got {value!r}")

    def new_state(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> SegmentSearchState:
        """A decode state for one layer: ``[batch, kv_heads, t, head_dim]`` keys and values."""
        return SegmentSearchState(
            self, batch, kv_heads, head_dim, layer_idx=layer_idx, device=device, dtype=dtype, scale=scale
        )


def Radar(
    top_k: int = 64,
    n_features: int = 2048,
    *,
    sinks: int = 0,
    window: int = 0,
    seed: int = 0,
    orthogonal: bool = False,
    antithetic: bool = False,
    aspect: float = 1.0,
    shared_kv_selection: bool = False,
) -> SegmentSearch:
    """The paper's method: ``SegmentSearch(PerformerFeatures(n), TopK(), SqrtSchedule())``.

    Defaults are Algorithm 1 exactly (n = 2048, k = 64, no sinks, no extra window); the paper's
    experiments add a 1024-token window.
    """
    return SegmentSearch(
        summary=PerformerFeatures(n_features=n_features, orthogonal=orthogonal, antithetic=antithetic, seed=seed),
        selector=TopK(),
        schedule=SqrtSchedule(aspect=aspect),
        top_k=top_k,
        sinks=sinks,
        window=window,
        shared_kv_selection=shared_kv_selection,
    )


@dataclass(frozen=True)
class SegmentSelection:
    """What one decode step of a :class:`SegmentSearch` attended to.

    ``segments: [B, H_kv, G', k]`` with ``G' = group`` (per query head) or 1 (shared per KV head).
    """

    layout: SegmentLayout
    segments: torch.Tensor
    group: int
    rebuilt: bool  #: the latest append rebuilt every summary
    sealed: int  #: segments the latest append sealed onto the grid

    @property
    def per_query_head(self) -> torch.Tensor:
        """Selected segment indices ``[B, H_q, k]``."""
        B, H, _, k = self.segments.shape
        return self.segments.expand(B, H, self.group, k).reshape(B, H * self.group, k)

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]``."""
        lay = self.layout
        starts = lay.sink_end + self.per_query_head * lay.segment_size
        in_segments = (lay.tail_start - starts).clamp(0, lay.segment_size).sum(-1)
        return in_segments + lay.sink_end + lay.tail_size

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, t]``."""
        mask = segment_mask(self.layout, self.segments, self.group)
        B, H, G, t = mask.shape
        return mask.reshape(B, H * G, t)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_selection(selector: Selector, segments: torch.Tensor, shape: tuple[int, ...], n_segments: int) -> None:
    """A selector must return distinct in-range indices: a repeat would count tokens twice in the softmax."""
    if tuple(segments.shape) != shape or segments.dtype != torch.long:
        raise ValueError(f"{selector!r} returned {segments.dtype} indices of shape {tuple(segments.shape)}, expected long {shape}")
    ordered = segments.sort(dim=-1).values
    bad = (ordered[..., 0] < 0) | (ordered[..., -1] >= n_segments) | (ordered.diff(dim=-1) == 0).any(-1)
    if bool(bad.any()):
        raise ValueError(
            f"{selector!r} returned segment indices that are repeated or outside [0, {n_segments}): "
            f"{segments[bad][0].tolist()}"
        )


class SegmentSearchState:
    """The decode state of a :class:`SegmentSearch` for one layer.

    Holds the keys and values (capacity-doubling storage, no per-token copy of the cache), the
    segment grid and the summaries of sealed segments. Work per token: the schedule's amortised
    summary work, scoring the S segments, and attention over the attended tokens; nothing is O(t)
    per step unless the summary reads keys (:class:`ExactScore`, the oracle).
    """

    def __init__(
        self,
        method: SegmentSearch,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> None:
        for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.method = method
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.layer_idx = layer_idx
        self.device = _resolve_device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self._keys = GrowableBuffer(dim=2)
        self._values = GrowableBuffer(dim=2)
        self._summaries: list[GrowableBuffer] = []
        self._grid: SegmentGrid | None = None
        self._params = method.summary.prepare(
            kv_heads, head_dim, layer_idx=layer_idx, device=self.device, dtype=self.compute_dtype
        )
        seed = getattr(method.selector, "seed", 0)
        self._generator = torch.Generator().manual_seed((seed * 0x9E3779B1 + layer_idx) % (2**63))
        self._rebuilt_since_attend = False
        self._sealed_since_attend = 0
        self.n_rebuilds = 0

    # -- storage -------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored keys."""
        return self._keys.view()

    @property
    def values(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored values."""
        return self._values.view()

    @property
    def grid(self) -> SegmentGrid | None:
        return self._grid

    @property
    def layout(self) -> SegmentLayout:
        grid = self._grid or SegmentGrid(1, 0, 0)
        m = self.method
        return SegmentLayout(
            length=self.length, sinks=m.sinks, segment_size=grid.segment_size, n_segments=grid.n_segments, window=m.window
        )

    def _check_block(self, name: str, x: torch.Tensor, tokens_dim: bool) -> None:
        expected = (self.batch, self.kv_heads, "T", self.head_dim) if tokens_dim else (self.batch, self.kv_heads, self.head_dim)
        shape_ok = x.dim() == len(expected) and all(e == "T" or e == s for e, s in zip(expected, x.shape))
        if not shape_ok:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but this state was made for {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but this state lives on {self.device}")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add a block of tokens ``[B, H_kv, T, D]`` (prefill, chunked prefill or one decode token).

        Builds or extends the segment structure as the schedule says; a prefill of t tokens costs
        one O(t) pass of summary work.
        """
        self._check_block("keys", keys, True)
        self._check_block("values", values, True)
        if keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
        self._keys.append(keys)
        self._values.append(values)
        self._rebuilt_since_attend, self._sealed_since_attend = False, 0
        self._restructure()

    prefill = append

    def _segmentable(self) -> int:
        return max(0, self.length - self.method.sinks)

    def _restructure(self) -> None:
        n = self._segmentable()
        old = self._grid
        new = self.method.schedule.plan(n, old)
        if new.covered > n:
            raise ValueError(f"{self.method.schedule!r} planned {new} covering more than the {n} segmentable tokens")
        if new.is_rebuild_of(old):
            self._summaries = []
            self._grid = new
            self._summarize_into(0, new.n_segments, rebuild=True)
            self._rebuilt_since_attend = True
            self.n_rebuilds += 1
        else:
            assert old is not None
            if new.n_segments < old.n_segments:
                raise ValueError(f"{self.method.schedule!r} shrank the grid from {old} to {new} without a rebuild")
            self._grid = new
            self._summarize_into(old.n_segments, new.n_segments, rebuild=False)
            self._sealed_since_attend += new.n_segments - old.n_segments

    def _segment_keys(self) -> torch.Tensor:
        lay = self.layout
        seg = self.keys[:, :, lay.sink_end : lay.segment_end]
        return seg.view(self.batch, self.kv_heads, lay.n_segments, lay.segment_size, self.head_dim)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.compute_dtype) * math.sqrt(self.scale)

    def _summarize_into(self, first: int, last: int, rebuild: bool) -> None:
        if last <= first:
            return
        seg_keys = self._segment_keys()
        size = self._grid.segment_size
        per_chunk = max(1, _SUMMARY_CHUNK // (self.batch * self.kv_heads * size))
        parts: list[tuple[torch.Tensor, ...]] = []
        for a in range(first, last, per_chunk):
            chunk = self._scaled(seg_keys[:, :, a : min(last, a + per_chunk)])
            parts.append(self.method.summary.summarize(self._params, chunk))
        merged = [torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0] for pieces in zip(*parts)]
        if rebuild or not self._summaries:
            self._summaries = [GrowableBuffer(dim=2) for _ in merged]
        for buf, tensor in zip(self._summaries, merged):
            buf.append(tensor)

    # -- decoding ------------------------------------------------------------------------------

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, SegmentSelection]:
        """Append one token (``key, value: [B, H_kv, D]``) and attend with its ``query: [B, H_q, D]``."""
        self._check_block("key", key, False)
        self._check_block("value", value, False)
        self.append(key.unsqueeze(2), value.unsqueeze(2))
        return self.attend(query)

    def scores(self, grouped_query: torch.Tensor) -> torch.Tensor:
        """Segment log-mass estimates ``[B, H_kv, G, S]`` for ``grouped_query: [B, H_kv, G, D]``."""
        summary = self.method.summary
        if self.layout.n_segments == 0:
            return grouped_query.new_zeros(*grouped_query.shape[:3], 0, dtype=self.compute_dtype)
        summaries = tuple(buf.view() for buf in self._summaries)
        seg_keys = self._scaled(self._segment_keys()) if summary.reads_keys else None
        return summary.score(
            self._params, summaries, self._scaled(grouped_query), seg_keys, self.layout.segment_size
        )

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, SegmentSelection]:
        """Sparse attention of ``query: [B, H_q, D]`` over the stored tokens: ``([B, H_q, D], selection)``."""
        B, D = self.batch, self.head_dim
        if query.dim() != 3 or query.shape[0] != B or query.shape[2] != D or query.shape[1] % self.kv_heads:
            raise ValueError(
                f"query must have shape ({B}, H_q, {D}) with H_q a multiple of kv_heads={self.kv_heads}, "
                f"got {tuple(query.shape)}"
            )
        if query.dtype != self.dtype:
            raise ValueError(f"query has dtype {query.dtype} but this state was made for {self.dtype}")
        if query.device != self.device:
            raise ValueError(f"query is on {query.device} but this state lives on {self.device}")
        if self.length == 0:
            raise ValueError("attend() called on an empty state: append keys and values first")
        group = query.shape[1] // self.kv_heads
        grouped = query.view(B, self.kv_heads, group, D)
        lay = self.layout
        shared = 1 if self.method.shared_kv_selection else group
        k = min(self.method.top_k, lay.n_segments)
        if k == lay.n_segments:
            segments = torch.arange(k, device=query.device).expand(B, self.kv_heads, shared, k)
        else:
            selector = self.method.selector
            if selector.uses_scores:
                scores = self.scores(grouped)
                if shared == 1:
                    scores = torch.logsumexp(scores, dim=2, keepdim=True)
            else:
                scores = torch.zeros(B, self.kv_heads, shared, lay.n_segments, device=query.device)
            segments = selector.select(scores, k, self._generator)
            _check_selection(selector, segments, (B, self.kv_heads, shared, k), lay.n_segments)
        out = segment_attention(grouped, self.keys, self.values, lay, segments, self.scale)
        info = SegmentSelection(
            layout=lay, segments=segments, group=group, rebuilt=self._rebuilt_since_attend, sealed=self._sealed_since_attend
        )
        return out.reshape(B, self.kv_heads * group, D).to(query.dtype), info
