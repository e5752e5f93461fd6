"""Diagnostics: how well a method's selection matches exact attention, per layer and head.

:class:`Probe` wraps a method so that every decode step computes, next to the method's own answer,
float64 dense attention over the same tokens and records:

* **hit@k** (segment methods): is the segment with the largest true attention mass among the k
  segments the method's selector picks from its scores? The Radar paper's appendix reports this
  with k = 1 and 3 on 10 segments (Radar 34.38% / 62.5%, recency 18.75% / 46.88%, random 10% / 30%).
* **mass recall**: the share of dense attention mass on the tokens the step attended.
* **relative error** of the step's attention output against dense attention.

By default the probe returns the dense output, so the model follows the dense trajectory and each
step measures the selection on exactly the queries and keys dense decoding would see (errors do not
compound); ``follow="method"`` returns the method's output instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseattn.methods.base import KVState, LayerSpec, SparseMethod, StatefulMethod, observe_block
from sparseattn.methods.segment_state import SegmentSearchState
from sparseattn.evaluation.selection_gap import CEILINGS, WHERE, selection_ceilings
from sparseattn.ops.attention import soft_cap

HIT_KS = (1, 3)


@dataclass
class ProbeRecords:
    """Per decode step: ``[B, H_q]`` tensors of each statistic (NaN where it does not apply)."""

    hits: dict[int, list[torch.Tensor]] = field(default_factory=lambda: {k: [] for k in HIT_KS})
    recall: list[torch.Tensor] = field(default_factory=list)
    rel_error: list[torch.Tensor] = field(default_factory=list)
    attended: list[torch.Tensor] = field(default_factory=list)
    n_segments: list[int] = field(default_factory=list)
    #: The mass each ceiling of :mod:`~sparseattn.evaluation.selection_gap` keeps, by name.
    ceilings: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {name: [] for name in CEILINGS})
    #: ``[B, H_q, len(WHERE)]``: mass the pooled oracle keeps and the method misses, by where it lies.
    missed: list[torch.Tensor] = field(default_factory=list)
    #: Relative error of the pooled oracle's output (its tokens only, renormalised) against dense attention.
    oracle_error: list[torch.Tensor] = field(default_factory=list)
    #: Optional per-step pictures: (token probs [H_q, t], exact segment mass [H_q, S], estimated [H_q, S]).
    pictures: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def mean_per_head(self, name: str, k: int | None = None) -> torch.Tensor:
        """Mean over steps and batch: ``[H_q]`` (NaN-aware)."""
        rows = self.hits[k] if name == "hit" else self.ceilings[name] if name in CEILINGS else getattr(self, name)
        if not rows:
            return torch.tensor([])
        stacked = torch.stack([r.double() for r in rows])  # [steps, B, H_q] (missed: [steps, B, H_q, where])
        return stacked.nanmean(dim=(0, 1))


@dataclass(frozen=True)
class Probe(StatefulMethod):
    """A method wrapped for diagnostics (see the module docstring).

    Args:
        method: the method under test.
        follow: ``"dense"`` (default) or ``"method"``: whose output the model continues with.
        pictures: keep per-step attention pictures (memory: O(t) per step and layer; for short runs).
    """

    method: SparseMethod
    follow: str = "dense"
    pictures: bool = False

    def __post_init__(self) -> None:
        if self.follow not in ("dense", "method"):
            raise ValueError(f"Probe.follow must be 'dense' or 'method', got {self.follow!r}")

    def state_type(self) -> type:
        return ProbeState


class ProbeState(KVState):
    """Keeps every token (for the dense reference) beside the wrapped method's own state."""

    def __init__(self, probe: Probe, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.probe = probe
        self.inner = probe.method.new_state(layer)
        self.records = ProbeRecords()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().append(keys, values)
        self.inner.append(keys, values)

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        observe_block(self.inner, query)  # let the method see its prefill (it may record or evict)
        return super().attend_block(query)

    def attend(self, query: torch.Tensor):
        group = self._check_query(query)
        B, H, D, t = self.batch, self.kv_heads, self.head_dim, self.length
        out, info = self.inner.attend(query)
        grouped = query.reshape(B, H, group, D).double()
        logits = torch.einsum("bhgd,bhtd->bhgt", grouped, self.keys.double()) * self.scale
        probs = torch.softmax(soft_cap(logits, self.softcap), dim=-1)  # [B, H, G, t]
        dense = torch.einsum("bhgt,bhtd->bhgd", probs, self.values.double()).reshape(B, H * group, D)
        flat_probs = probs.reshape(B, H * group, t)
        rec = self.records
        rec.attended.append(info.attended.cpu())
        rec.rel_error.append(((out.double() - dense).norm(dim=-1) / dense.norm(dim=-1)).cpu())
        mask = info.to_mask()
        nan = torch.full((B, H * group), float("nan"), dtype=torch.float64)
        rec.recall.append((flat_probs * mask).sum(-1).cpu() if mask.shape[-1] == t else nan)
        if mask.shape[-1] == t:
            self._ceilings(flat_probs, mask, info.attended, dense)
        self._segment_hits(grouped, probs, group)
        return (dense.to(query.dtype), info) if self.probe.follow == "dense" else (out, info)

    def _ceilings(self, probs: torch.Tensor, mask: torch.Tensor, spent: torch.Tensor, dense: torch.Tensor) -> None:
        """The step's selection ceilings and the pooled oracle's own output error (:mod:`.selection_gap`)."""
        layout = self.inner.layout if isinstance(self.inner, SegmentSearchState) else None
        ceilings, missed, oracle = selection_ceilings(probs, mask, spent, layout)
        rec = self.records
        for name, mass in ceilings.items():
            rec.ceilings[name].append(mass.cpu())
        rec.missed.append(missed.cpu())
        B, Hq, t = probs.shape
        H = self.kv_heads
        weights = (probs * oracle).reshape(B, H, Hq // H, t)
        out = torch.einsum("bhgt,bhtd->bhgd", weights, self.values.double()).reshape(B, Hq, -1)
        out = out / weights.reshape(B, Hq, t).sum(-1, keepdim=True).clamp_min(1e-300)
        rec.oracle_error.append(((out - dense).norm(dim=-1) / dense.norm(dim=-1)).cpu())

    def _segment_hits(self, grouped: torch.Tensor, probs: torch.Tensor, group: int) -> None:
        inner, rec = self.inner, self.records
        B, H = self.batch, self.kv_heads
        if not isinstance(inner, SegmentSearchState) or inner.layout.n_segments == 0:
            for k in HIT_KS:
                rec.hits[k].append(torch.full((B, H * group), float("nan"), dtype=torch.float64))
            rec.n_segments.append(0)
            return
        lay = inner.layout
        S, c = lay.n_segments, lay.segment_size
        mass = probs[..., lay.sink_end : lay.segment_end].reshape(B, H, group, S, c).sum(-1)  # [B, H, G, S]
        top = mass.argmax(-1, keepdim=True)  # the true top segment per query head
        selector = inner.method.selector
        k_step = inner.method.reach(inner.method.segments_for(lay), S)  # what a reranking summary shortlists for
        scores = inner.scores(grouped.to(inner.dtype), k_step) if selector.uses_scores else mass.new_zeros(B, H, group, S)
        generator = torch.Generator().manual_seed(len(rec.n_segments))
        for k in HIT_KS:
            picked = selector.select(scores, min(k, S), generator)  # [B, H, G, k]
            rec.hits[k].append((picked == top).any(-1).reshape(B, H * group).double().cpu())
        rec.n_segments.append(S)
        if self.probe.pictures:
            estimate = torch.softmax(scores.double(), dim=-1) if selector.uses_scores else torch.full_like(mass, 1.0 / S)
            exact = mass / mass.sum(-1, keepdim=True)
            rec.pictures.append(
                (probs[0].reshape(H * group, -1).cpu(), exact[0].reshape(H * group, S).cpu(), estimate[0].reshape(H * group, S).cpu())
            )


def summarize_probes(layers: list[ProbeState]) -> dict:
    """Per-layer, per-head and overall means of every statistic, as plain lists (JSON-ready)."""
    per_layer = []
    for idx, state in enumerate(layers):
        rec = state.records
        row = {"layer": idx}
        for k in HIT_KS:
            row[f"hit@{k}"] = rec.mean_per_head("hit", k).tolist()
        row["recall"] = rec.mean_per_head("recall").tolist()
        row["rel_error"] = rec.mean_per_head("rel_error").tolist()
        row["attended"] = rec.mean_per_head("attended").tolist()
        row["oracle_error"] = rec.mean_per_head("oracle_error").tolist()
        row["ceilings"] = {name: rec.mean_per_head(name).tolist() for name in CEILINGS}
        row["missed"] = dict(zip(WHERE, rec.mean_per_head("missed").T.tolist())) if rec.missed else {}
        row["mean_segments"] = sum(rec.n_segments) / len(rec.n_segments) if rec.n_segments else 0
        per_layer.append(row)

    def overall(key: str, name: str | None = None) -> float:
        values = torch.tensor([v for row in per_layer for v in (row[key] if name is None else row[key][name])],
                              dtype=torch.float64)
        return float(values.nanmean()) if values.numel() else float("nan")

    keys = [f"hit@{k}" for k in HIT_KS] + ["recall", "rel_error", "attended", "oracle_error"]
    return {
        "overall": {k: overall(k) for k in keys} | {f"kept:{name}": overall("ceilings", name) for name in CEILINGS},
        "per_layer": per_layer,
    }
