"""Segment-search presets: Radar in both forms, Quest, and the selection ablations of the Radar paper (Figure 7).

Two Radars, named so a table says which one ran:

* :func:`Radar` (CLI ``radar``): the configuration the authors ran (aspect 4 and their rebuild rule,
  2048 antithetic draws, 1 sink, a 1024-token window);
* :func:`RadarAlg1` (CLI ``radar-alg1``): the paper's Algorithm 1 as written (c = sqrt(t), rebuilt at
  every perfect square, 2048 independent draws, no sink, no window). The ablations below swap one
  part of this one, as the paper's Figure 7 does.

Each is a :class:`~sparseattn.methods.segment_search.SegmentSearch` with one part swapped, so its
``repr`` is the full description of the run. Budget rule (as for every segment search): with
``budget`` set, a step attends ``max(1, (budget - sinks - tail) // c)`` segments of ``c`` tokens,
``tail`` being the unsegmented remainder plus the window (at least the current token); otherwise
``top_k`` segments. Segments never overlap the tail.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings

import torch

from sparseattn.allocations.base import Allocation
from sparseattn.allocations.pooled import PooledMass
from sparseattn.allocations.topp import TopP
from sparseattn.allocations.uniform import Uniform
from sparseattn.methods.always import HeavyHitters
from sparseattn.methods.compose import PrefillEviction
from sparseattn.methods.layers import FirstLayers, SplitLayers
from sparseattn.methods.rest import MergedRest, Rest
from sparseattn.methods.sampled_rest import SampledRest
from sparseattn.methods.segment_options import WINDOW_FROM_BUDGET, feature_options, segment_options
from sparseattn.methods.segment_search import Radar, SegmentSearch
from sparseattn.methods.snapkv import SnapKV
from sparseattn.refine.tokens import TopTokens
from sparseattn.registry import MethodEntry, Option, Range, alias, register
from sparseattn.schedules.fixed import FixedSchedule
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.base import Selector
from sparseattn.selectors.lowest import Lowest
from sparseattn.selectors.random import Random
from sparseattn.selectors.recent import Recent
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import Summary
from sparseattn.summaries.centered import CenteredFeatures
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.exact import ExactScore
from sparseattn.summaries.minmax import MinMaxBound
from sparseattn.summaries.performer import PerformerFeatures
from sparseattn.summaries.rerank import Rerank


__all__ = [
    "OracleSegments",
    "OracleTokens",
    "Quest",
    "Radar",
    "RadarAlg1",
    "RadarCentered",
    "RadarExact",
    "RadarLowest",
    "RadarPlus",
    "RadarPlusAdaptive",
    "RadarPlusMerged",
    "RadarPlusPooled",
    "RadarPlusTokens",
    "RadarRandom",
    "RadarRecent",
    "RadarRerank",
    "SnapKVRadar",
]


def RadarAlg1(
    top_k: int = 64, n_features: int = 2048, *, sinks: int = 0, window: int = 0, seed: int = 0,
    orthogonal: bool = False, antithetic: bool = False, aspect: float = 1.0, shared_kv_selection: bool = False,
    budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """The paper's Algorithm 1: ``SegmentSearch(PerformerFeatures(2048), TopK(), SqrtSchedule(), top_k=64)``.

    Segments of ``c = sqrt(t)`` tokens, all rebuilt whenever t is a perfect square; between squares
    new tokens wait in the buffer (up to ``2 sqrt(t)``), which is always attended; n = 2048
    independent Gaussian draws; no sinks, no extra window. One deviation, shared by every segment
    search: the current token is never sealed, so ``t`` here counts the past tokens (the square
    rebuild happens one step later than in the listing, and the current token is always attended).

    This is not what the authors ran (see :func:`Radar`); it is kept to compare with the paper's
    text and for the ablations, which swap one of its parts. ``budget`` replaces ``top_k`` by a
    token budget (see :class:`SegmentSearch`).
    """
    radar = Radar(
        top_k, n_features, sinks=sinks, window=window, seed=seed, orthogonal=orthogonal, antithetic=antithetic,
        shared_kv_selection=shared_kv_selection, budget=budget,
    )  # fmt: skip
    return dataclasses.replace(radar, schedule=SqrtSchedule(aspect=aspect))  # the as-run Radar on Algorithm 1's grid


def Quest(
    top_k: int = 64, page_size: int = 16, *, sinks: int = 0, window: int = 0, shared_kv_selection: bool = False,
    budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """Quest (Tang et al. 2024): ``SegmentSearch(MinMaxBound(), TopK(), FixedSchedule(page_size))``.

    Pages of ``page_size`` tokens keep per-channel minimum and maximum keys; a query scores a page by
    the upper bound ``sum_i max(q_i min_i, q_i max_i) >= q . k`` of every logit in it and attends the
    ``top_k`` best pages (``64 x 16 = 1024`` tokens by default) plus the unfilled last page (which
    holds at least the current token: a page is sealed once it is full and in the past).
    """
    return SegmentSearch(
        summary=MinMaxBound(),
        selector=TopK(),
        schedule=FixedSchedule(page_size),
        top_k=top_k,
        sinks=sinks,
        window=window,
        shared_kv_selection=shared_kv_selection,
        budget=budget,
    )


def _radar_with(
    summary: Summary, selector: Selector, top_k: int, sinks: int, window: int, aspect: float, budget: int | None
) -> SegmentSearch:
    return SegmentSearch(
        summary=summary,
        selector=selector,
        schedule=SqrtSchedule(aspect=aspect),
        top_k=top_k,
        sinks=sinks,
        window=window,
        budget=budget,
    )


def RadarExact(
    top_k: int = 64, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, budget: int | None = None
) -> SegmentSearch:
    """Exact segment search: Radar's segments ranked by their true attention mass (:class:`ExactScore`).

    The oracle Radar approximates (Figure 7, right): O(t) per step, not a fast method.
    """
    return _radar_with(ExactScore(), TopK(), top_k, sinks, window, aspect, budget)


def RadarRandom(
    top_k: int = 64, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """Radar's segments chosen uniformly at random (Figure 7, middle: the "uneducated guess").

    No scores are computed; the summary is :class:`ExactScore`, which stores nothing.
    """
    return _radar_with(ExactScore(), Random(seed=seed), top_k, sinks, window, aspect, budget)


def RadarLowest(
    top_k: int = 64, n_features: int = 2048, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """Radar's estimated scores, lowest segments first (Figure 7, left: a sanity check that should do poorly)."""
    return _radar_with(PerformerFeatures(n_features=n_features, seed=seed), Lowest(), top_k, sinks, window, aspect, budget)


def RadarRecent(
    top_k: int = 64, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, budget: int | None = None
) -> SegmentSearch:
    """Radar's most recent segments, whatever the query: a sliding window grown by ``top_k`` segments.

    No scores are computed; the summary is :class:`ExactScore`, which stores nothing.
    """
    return _radar_with(ExactScore(), Recent(), top_k, sinks, window, aspect, budget)


def RadarPlus(
    top_k: int | None = None, *, sinks: int = 4, window: int = 0, aspect: float = 8.0, shortlist: int = 16,
    factor: float = 2.0, per_group: bool = True, budget: int | None = None, split: str | Allocation = "uniform",
    cap: float | None = None, floor: float | None = None, bf16_centroids: bool = False, rest: str = "dropped",
    merge: int | None = None, allocation: Allocation | None = None, centroid_dtype: torch.dtype | None = None,
    p: float | None = None, samples: int | None = None, delta: float | None = None, prefilter: int = 0,
    prefilter_keep: float | None = None,
) -> SegmentSearch:  # fmt: skip
    """Radar's segment search with a sharper ranking: a centroid shortlist, reranked exactly.

    ``SegmentSearch(Rerank(Centroid(), shortlist, factor, per_group=True), TopK(), SqrtSchedule(aspect=8), sinks=4)``:
    segments of ``sqrt(t) / 8`` tokens (8 sqrt(t) of them: finer selection, still O(sqrt t) scoring);
    every segment is scored by ``log c + q . mean k`` (d numbers per segment, cheaper than random
    features), the ``max(shortlist, factor * k)`` best of each KV group (by the group's summed mass)
    are rescored exactly from their keys, read once for the group's query heads, and each head
    attends the top ``k`` of those, plus 4 attention-sink tokens. On the default model it finds the
    segment exact search ranks first in 97-98% of layer-head-steps (raw Radar: 4-14%); see
    docs/methods.md for the measurements and docs/theory.md for what is guaranteed.

    ``top_k`` defaults to ``64 * aspect`` segments: the tokens of Radar's ``k = 64`` at a grid
    ``aspect`` times finer. ``budget`` (tokens) overrides it, as for every preset.

    The variants, each an option (measured in docs/methods.md):

    * ``split``: how a layer's segments are shared between its heads: ``"uniform"`` (each head
      ``k``), ``"pooled"`` (:class:`PooledMass`: the layer's ``H x k`` largest estimated attention
      shares, a head between ``floor x k`` (default 0.25) and ``cap x k`` (default 2: the rerank's
      shortlist) segments, the total per layer fixed), ``"topp"`` (:class:`TopP`: each head the fewest
      of its ``k`` best segments whose estimated share of its attention mass, sinks and tail counted,
      reaches ``p``, default 0.95), or any :class:`Allocation` part;
    * ``bf16_centroids``: mean keys stored in bfloat16 (half the bytes of the scoring pass, which
      only shapes the shortlist); ``centroid_dtype`` names any dtype;
    * ``rest``: what a step does not attend is ``"dropped"``, or ``"merged"``: each block of
      ``merge`` segments (default 16; 0: one block) adds one token with the mean key and value of its
      unattended tokens (weight: their count), counted against the budget; or ``"sampled"``
      (experimental, transformers engine only; vAttention's idea, :class:`SampledRest`): ``samples``
      (default 32) of its tokens drawn uniformly per step and query head, each weighted by ``n /
      samples``, counted against the budget, and a bound on the error at confidence ``1 - delta``
      (default 0.05) in each step's report;
    * ``prefilter`` (experimental): groups of that many segments scored first by their mean key, only the
      best ``prefilter_keep`` (default 4) times the shortlist's segments scored one by one
      (:class:`Rerank`'s ``prefilter``: a page-level pass before the segments inside the pages).

    ``per_group=False`` gives each query head its own shortlist (G times the key reads under
    grouped-query attention). ``allocation`` is ``split`` given as a part.

    Choices per layer compose around it (the catalogue's ``radar+`` takes them as options:
    ``plain_layers``, ``first_layers``, ``layer_factor``): :func:`plain_first` (the first layers drop
    the rest: merging in layer 0 hurt texts that repeat themselves) and :class:`FirstLayers` (more
    budget in the first layers, the total over layers kept).
    """
    if top_k is None:
        top_k = round(64 * aspect)
    split = _split_part(split, allocation, cap, floor, default_cap=2.0, p=p)
    if bf16_centroids:
        if centroid_dtype not in (None, torch.bfloat16):
            raise ValueError(f"RadarPlus: bf16_centroids=True and centroid_dtype={centroid_dtype}: give one of them")
        centroid_dtype = torch.bfloat16
    if prefilter_keep is not None and not prefilter:
        raise ValueError(f"RadarPlus: prefilter_keep={prefilter_keep} changes nothing without prefilter (segments per group, >= 2)")
    extra = {"prefilter": prefilter, "prefilter_keep": 4.0 if prefilter_keep is None else prefilter_keep} if prefilter else {}
    summary = Rerank(Centroid(centroid_dtype), shortlist, factor, per_group, **extra)
    method = SegmentSearch(
        summary=summary, selector=TopK(), schedule=SqrtSchedule(aspect=aspect), top_k=top_k, sinks=sinks,
        window=window, budget=budget,
    )  # fmt: skip
    if not isinstance(split, Uniform):
        method = dataclasses.replace(method, allocation=split)
    part = _rest_part(rest, merge, samples, delta)
    return method if part is None else dataclasses.replace(method, rest=part)


def RadarPlusAdaptive(
    top_k: int | None = None, *, sinks: int = 4, window: int = 0, aspect: float = 16.0, factor: float = 2.0,
    cap: float = 2.0, floor: float = 0.25, merge: int = 128, plain_layers: int = 1, budget: int | None = None,
    bf16_centroids: bool = False, prefilter: int = 0, prefilter_keep: float | None = None,
) -> SplitLayers:  # fmt: skip
    """radar+ with the budget spent where attention is: the recommended method, in both engines.

    ``plain_first(RadarPlus(aspect=16, split="pooled", rest="merged", merge=128), layers=1)``:

    * segments of ``sqrt(t) / 16`` tokens: finer centroids shortlist better at the same shortlist
      size in tokens;
    * each layer's segments split between its heads by their estimated attention shares
      (:class:`PooledMass`, a head between ``floor`` and ``cap`` times the uniform share; the total
      per layer is radar+'s): diffuse heads get more, peaked heads fewer;
    * centroids in float32 (``bf16_centroids=True``: stored in bfloat16, half their memory, scored in float32;
      the same quality on six unseen texts in both engines, no measurable speed difference in vLLM's fused
      step, docs/serving.md);
    * from layer ``plain_layers`` on, what a step leaves out enters its softmax as one merged token
      per block of ``merge`` segments (:class:`MergedRest`) instead of being dropped.

    ``budget`` is honoured on average over a layer's heads (one head may attend more). Measured on
    texts it was not tuned on, in both engines, in docs/methods.md; vLLM's paged engine runs it on
    its pages or, with the engine's ``segment`` (4: this grid at 4-8k tokens), on segments inside them,
    where it selects what this engine selects (docs/serving.md).
    """
    merged = RadarPlus(
        top_k, sinks=sinks, window=window, aspect=aspect, factor=factor, budget=budget, split="pooled", cap=cap,
        floor=floor, bf16_centroids=bf16_centroids, rest="merged", merge=merge, prefilter=prefilter,
        prefilter_keep=prefilter_keep,
    )  # fmt: skip
    return plain_first(merged, plain_layers)


#: ``RadarPlus`` options of the former ``radar+pooled`` (and of ``radar+merged`` before its rest).
_POOLED_OPTIONS = {"aspect": 16.0, "split": "pooled", "bf16_centroids": True}


def RadarPlusPooled(top_k: int | None = None, **options) -> SegmentSearch:
    """``RadarPlus(aspect=16, split="pooled", bf16_centroids=True)`` under its former name (the registry's
    ``radar+pooled``, now an alias of those options of ``radar+``); ``options`` are RadarPlus's."""
    return RadarPlus(top_k, **{**_POOLED_OPTIONS, **options})


def RadarPlusMerged(top_k: int | None = None, *, merge: int = 16, **options) -> SegmentSearch:
    """``RadarPlus(aspect=16, split="pooled", bf16_centroids=True, rest="merged", merge=16)`` under its former
    name (the registry's ``radar+merged``, now an alias of those options of ``radar+``)."""
    return RadarPlus(top_k, **{**_POOLED_OPTIONS, "rest": "merged", "merge": merge, **options})


def _split_part(
    split: str | Allocation, allocation: Allocation | None, cap: float | None, floor: float | None, default_cap: float,
    p: float | None = None,
) -> Allocation:  # fmt: skip
    """The :class:`Allocation` part ``split`` names (``cap``/``floor`` only with ``"pooled"``, ``p`` only with ``"topp"``)."""
    if allocation is not None:
        if split != "uniform":
            raise ValueError(f"give split or allocation, not both (split={split!r}, allocation={allocation!r})")
        split = allocation
    if isinstance(split, Allocation):
        part = split
    elif split == "uniform":
        part = Uniform()
    elif split == "pooled":
        if p is not None:
            raise ValueError(f"p shapes the 'topp' split; split is {split!r}")
        return PooledMass(cap=default_cap if cap is None else cap, floor=0.25 if floor is None else floor)
    elif split == "topp":
        if cap is not None or floor is not None:
            raise ValueError(f"cap and floor shape the 'pooled' split; split is {split!r}")
        return TopP(0.95 if p is None else p)
    else:
        raise ValueError(f"split must be 'uniform', 'pooled', 'topp' or an Allocation part, got {split!r}")
    if p is not None:
        raise ValueError(f"p shapes the 'topp' split; split is {split!r}")
    if cap is not None or floor is not None:
        raise ValueError(f"cap and floor shape the 'pooled' split; split is {split!r}")
    return part


def _rest_part(rest: str, merge: int | None, samples: int | None = None, delta: float | None = None) -> Rest | None:
    """What a step leaves out: ``"dropped"`` (None), ``"merged"`` (a :class:`MergedRest` of blocks of ``merge``
    segments) or ``"sampled"`` (a :class:`SampledRest`: ``samples`` per step and query head, a bound at
    confidence ``1 - delta``). An option that shapes another choice than ``rest``'s is refused."""
    if rest not in ("dropped", "merged", "sampled"):
        raise ValueError(f"rest must be 'dropped', 'merged' or 'sampled', got {rest!r}")
    if rest != "merged" and merge is not None:
        raise ValueError(f"merge={merge!r} shapes the merged rest; rest is {rest!r} (give rest='merged')")
    for name, value in (("samples", samples), ("delta", delta)):
        if rest != "sampled" and value is not None:
            raise ValueError(f"{name}={value!r} shapes the sampled rest; rest is {rest!r} (give rest='sampled')")
    if rest == "dropped":
        return None
    if rest == "merged":
        return MergedRest((16 if merge is None else merge) or None)  # 0: one block
    return SampledRest(32 if samples is None else samples, 0.05 if delta is None else delta)


def plain_first(method: SegmentSearch, layers: int) -> SplitLayers:
    """``method`` in every layer but its first ``layers``, which run it without its ``rest`` (:class:`SplitLayers`;
    ``layers=0``: every layer runs ``method``)."""
    if method.rest is None and layers:
        raise ValueError(f"plain_layers={layers!r} shapes the merged or sampled rest; rest is 'dropped' (give rest='merged' or 'sampled')")
    return SplitLayers(dataclasses.replace(method, rest=None), method, layers=layers)


def _per_layer(method, first_layers: int, layer_factor: float | None):
    """``method`` with ``layer_factor`` times the budget in its first ``first_layers`` layers (:class:`FirstLayers`)."""
    if not first_layers:
        if layer_factor is not None:
            raise ValueError("layer_factor shapes the first layers' budget; give first_layers too")
        return method
    return FirstLayers(method, layers=first_layers, factor=4.0 if layer_factor is None else layer_factor)


def OracleTokens(
    top_k: int = 1024, *, sinks: int = 0, window: int = 0, shared_kv_selection: bool = False,
    budget: int | None = None, split: str | Allocation = "uniform", cap: float | None = None,
    floor: float | None = None, allocation: Allocation | None = None, p: float | None = None,
) -> SegmentSearch:  # fmt: skip
    """The exact top-``budget`` tokens of each query head: the ceiling of any selector at this budget.

    ``SegmentSearch(ExactScore(), TopK(), FixedSchedule(1))``: every past token is a segment of one,
    scored by its exact logit, so a step attends the ``budget`` tokens with the most attention (the
    current token always among them). No summary can rank better at token granularity; what it
    loses against dense attention is the mass outside each head's top ``budget`` tokens, which only
    a different split of the budget can recover: ``split="pooled"`` (:class:`PooledMass`, the
    layer's tokens to the heads' largest exact attention shares, ``cap`` default 4, ``floor`` 0.25)
    and more in the first layers (:class:`FirstLayers`; the catalogue's ``first_layers`` option), as
    for :func:`RadarPlus`. O(t) per step: a measuring stick, not a fast method.
    """
    return SegmentSearch(
        summary=ExactScore(), selector=TopK(), schedule=FixedSchedule(1), top_k=top_k, sinks=sinks, window=window,
        shared_kv_selection=shared_kv_selection, budget=budget,
        allocation=_split_part(split, allocation, cap, floor, default_cap=4.0, p=p),
    )  # fmt: skip


def OracleSegments(
    top_k: int = 64, segment_size: int = 16, *, sinks: int = 0, window: int = 0, budget: int | None = None,
    allocation: Allocation | None = None,
) -> SegmentSearch:  # fmt: skip
    """The exact top segments of ``segment_size`` tokens (fixed grid): the ceiling of any summary on that grid.

    ``SegmentSearch(ExactScore(), TopK(), FixedSchedule(segment_size))``; compare with
    :func:`OracleTokens` at the same budget to see what segment granularity costs, and with a
    method on the same grid to see what its ranking costs. O(t) per step.
    """
    return SegmentSearch(
        summary=ExactScore(), selector=TopK(), schedule=FixedSchedule(segment_size), top_k=top_k, sinks=sinks,
        window=window, budget=budget, allocation=allocation or Uniform(),
    )  # fmt: skip


def RadarCentered(
    top_k: int = 64, n_features: int = 2048, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """Radar with centred random features (:class:`CenteredFeatures`): the centroid exact, the spread estimated."""
    summary = CenteredFeatures(PerformerFeatures(n_features=n_features, seed=seed))
    return _radar_with(summary, TopK(), top_k, sinks, window, aspect, budget)


def RadarRerank(
    top_k: int = 64, n_features: int = 256, *, sinks: int = 0, window: int = 0, aspect: float = 1.0, seed: int = 0,
    shortlist: int = 16, factor: float = 2.0, budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """Radar's random features (n = 256) shortlist, the exact segment mass reranks (:class:`Rerank`)."""
    summary = Rerank(PerformerFeatures(n_features=n_features, seed=seed), shortlist, factor)
    return _radar_with(summary, TopK(), top_k, sinks, window, aspect, budget)


def SnapKVRadar(
    top_k: int = 64, n_features: int = 4096, *, sinks: int = 1, window: int | None = None, seed: int = 0,
    budget: int | None = None, prefill_budget: int | None = None, observation_window: int = 32,
) -> PrefillEviction:  # fmt: skip
    """SnapKV compresses the prompt, then :func:`Radar` searches what it kept plus the new tokens.

    The prompt keeps ``prefill_budget`` tokens per KV head (default ``4 * budget``, SnapKV's own 2048
    without a budget); the other options are Radar's.
    """
    if prefill_budget is None and budget is not None:
        prefill_budget = 4 * budget
    prompt = SnapKV(observation_window=observation_window, **({} if prefill_budget is None else {"budget": prefill_budget}))
    decode = Radar(top_k, n_features, sinks=sinks, window=window, seed=seed, budget=budget)
    return PrefillEviction(prefill=prompt, decode=decode)


def RadarH2O(
    top_k: int = 64, n_features: int = 4096, *, sinks: int = 1, window: int | None = None, heavy: int | None = None,
    seed: int = 0, budget: int | None = None,
) -> SegmentSearch:  # fmt: skip
    """:func:`Radar` plus H2O's heavy hitters: every step also attends the ``heavy`` tokens that received the
    most attention so far (prompt and decode steps), wherever they lie.

    ``heavy`` defaults to ``budget // 8`` (128 without a budget) and counts against the budget; the
    rest is Radar's (1 sink, a window of ``min(1024, budget // 4)``, segments). The one-line composition::

        dataclasses.replace(Radar(budget=1024), always=HeavyHitters(128))
    """
    if heavy is None:
        heavy = 128 if budget is None else max(1, budget // 8)
    radar = Radar(top_k, n_features, sinks=sinks, window=window, seed=seed, budget=budget)
    return dataclasses.replace(radar, always=HeavyHitters(heavy))


def RadarPlusTokens(
    top_k: int | None = None, *, sinks: int = 4, window: int = 0, aspect: float = 16.0, factor: float = 2.0,
    budget: int | None = None, allocation: Allocation | None = None,
) -> SegmentSearch:  # fmt: skip
    """radar+'s shortlist, then tokens instead of segments: coarse to fine.

    ``SegmentSearch(Centroid(), TopK(), SqrtSchedule(aspect=16), sinks=4, shared_kv_selection=True,
    refine=TopTokens(factor=2))``: each KV group shortlists the ``2k`` segments with the highest
    group mass by their mean keys (radar+'s shortlist), the exact logit of every token in them is
    computed (the keys radar+'s rerank reads), and each query head attends its ``budget - 4 - tail``
    best tokens plus the 4 sinks and the tail, instead of its best whole segments: a segment's
    neighbours of the tokens that matter no longer take the budget.
    """
    if top_k is None:
        top_k = round(64 * aspect)
    return SegmentSearch(
        summary=Centroid(), selector=TopK(), schedule=SqrtSchedule(aspect=aspect), top_k=top_k, sinks=sinks,
        window=window, shared_kv_selection=True, budget=budget, allocation=allocation or Uniform(),
        refine=TopTokens(factor=factor),
    )  # fmt: skip


def with_layer_options(preset, *, rest_layers: bool = False):
    """The catalogue's builder of ``preset`` (a builder of one :class:`SegmentSearch`): the preset, then the
    per-layer choices the options name: ``plain_layers`` (with ``rest_layers``: :func:`plain_first`) and
    ``first_layers`` / ``layer_factor`` (:class:`FirstLayers`). Its signature is the preset's with those
    keywords added, so the registry reads every default from the preset itself."""

    def build(*args, plain_layers: int = 0, first_layers: int = 0, layer_factor: float | None = None, **options):
        method = preset(*args, **options)
        if plain_layers:  # (an option of the catalogue's entry only with rest_layers)
            method = plain_first(method, plain_layers)
        return _per_layer(method, first_layers, layer_factor)

    keyword = inspect.Parameter.KEYWORD_ONLY
    extra = [inspect.Parameter("first_layers", keyword, default=0), inspect.Parameter("layer_factor", keyword, default=None)]
    if rest_layers:
        extra.insert(0, inspect.Parameter("plain_layers", keyword, default=0))
    build.__signature__ = inspect.signature(preset).replace(
        parameters=[*inspect.signature(preset).parameters.values(), *extra], return_annotation=inspect.Signature.empty
    )
    build.__name__ = build.__qualname__ = f"{preset.__name__}ByLayer"
    build.__doc__ = f"{preset.__name__} with the catalogue's per-layer options (see :func:`with_layer_options`)."
    return build


#: The catalogue's builders of the presets whose options include per-layer choices.
RadarPlusByLayer = with_layer_options(RadarPlus, rest_layers=True)
OracleTokensByLayer = with_layer_options(OracleTokens)


def _radar_plus_options(*, variants: bool) -> tuple[Option, ...]:
    """The options of radar+ and its presets (``variants``: also the choices that make the variants)."""
    shared = (*segment_options(top_k_none="64 x aspect"), *_grid_options())
    pool = (
        Option("cap", float, help="most segments one head may get, x the uniform share (split=pooled; None: 2)",
               allowed=Range(1.0, 1024.0, integer=False)),
        Option("floor", float, help="fewest segments a head keeps, x the uniform share (split=pooled; None: 0.25)"),
    )  # fmt: skip
    bf16 = Option("bf16_centroids", bool, help="mean keys stored in bfloat16 (half their memory), scored in float32")
    prefilter = (
        Option("prefilter", int, help="experimental: groups of this many segments (a page's) scored first by their mean key; "
               "0: none", minimum=0),
        Option("prefilter_keep", float, help="groups whose segments are scored, x the shortlist in segments (with prefilter; "
               "None: 4)", allowed=Range(1.0, 1024.0, integer=False)),
    )  # fmt: skip
    if not variants:
        return (*shared, *pool, Option("merge", int, help="segments per merged token of the rest (0: one block)", minimum=0),
                Option("plain_layers", int, help="first layers that drop the rest (the others merge it)", minimum=0), bf16,
                *prefilter)  # fmt: skip
    return (
        *shared,
        Option("split", str, help="a layer's segments between its heads: uniform, pooled by estimated attention share, "
               "or topp (each head the fewest reaching share p)", allowed=("uniform", "pooled", "topp")),
        Option("p", float, help="share of attention mass each head reaches (split=topp; None: 0.95)"),
        *pool,
        bf16,
        Option("rest", str, help="what a step does not attend: dropped, merged into one token per block, or sampled "
               "(experimental, transformers only: a uniform sample, scaled up, with an error bound)",
               allowed=("dropped", "merged", "sampled")),
        Option("merge", int, help="segments per merged token of the rest (rest=merged; 0: one block; None: 16)", minimum=0),
        Option("samples", int, help="tokens of the rest drawn per step and query head, each counted against the "
               "budget (rest=sampled; None: 32)"),
        Option("delta", float, help="the sampled rest's error bound holds with probability 1 - delta (rest=sampled; None: 0.05)"),
        Option("plain_layers", int, help="first layers that drop the rest even with rest=merged or sampled", minimum=0),
        *_layer_options("segments"),
        *prefilter,
    )  # fmt: skip


def _grid_options() -> tuple[Option, ...]:
    return (
        Option("aspect", float, help="segments of sqrt(t) / aspect tokens", allowed=Range(0.0, 1024.0, integer=False)),
        Option("factor", float, help="segments shortlisted, x what the budget buys", allowed=Range(1.0, 1024.0, integer=False)),
    )


def _layer_options(what: str) -> tuple[Option, ...]:
    return (
        Option("first_layers", int, help=f"first layers given more {what} (FirstLayers)", minimum=0),
        Option("layer_factor", float, help="their budget, x --budget (with first_layers; None: 4)", allowed=Range(1.0, 1024.0, integer=False)),
    )


BOTH = ("transformers", "vllm")

for _entry in (
    MethodEntry(
        "radar+",
        "Radar with a sharper ranking: segments of sqrt(t)/8 tokens scored by their mean key, the best rescored "
        "exactly from their keys, plus 4 attention sinks (radar+adaptive without its split and rest); split, "
        "bf16_centroids, rest and first_layers make its variants",
        RadarPlusByLayer, _radar_plus_options(variants=True), category="fast", engines=BOTH,
    ),
    MethodEntry(
        "radar+adaptive",
        "radar+ with the budget spent where attention is: heads' shares pooled by estimated mass on a 2x finer grid, "
        "the rest merged per 128 segments after layer 0; the recommended method in both engines",
        RadarPlusAdaptive, _radar_plus_options(variants=False), category="recommended", engines=BOTH,
    ),
    MethodEntry(
        "radar-alg1",
        "Radar as the paper's Algorithm 1 writes it: segments of sqrt(t) tokens rebuilt at every perfect square, "
        "top-k segments + the buffer",
        RadarAlg1, (*segment_options(), *feature_options()), category="paper", engines=BOTH,
    ),
    MethodEntry(
        "quest",
        "Quest: pages of 16 tokens, top pages by the min/max key upper bound of q.k (Tang et al. 2024)",
        Quest, (*segment_options(), Option("page_size", int, help="tokens per page")), category="baseline", engines=BOTH,
    ),
    MethodEntry(
        "radar-exact",
        "Radar ablation: segments ranked by their exact attention mass (the O(t) oracle)",
        RadarExact, segment_options(), category="ablation", engines=BOTH,
    ),
    MethodEntry(
        "radar-random",
        "Radar ablation: segments chosen uniformly at random",
        RadarRandom, (*segment_options(), feature_options()[1]), category="ablation", engines=BOTH,
    ),
    MethodEntry(
        "radar-lowest",
        "Radar ablation: the segments with the lowest estimated scores",
        RadarLowest, (*segment_options(), *feature_options()), category="ablation", engines=BOTH,
    ),
    MethodEntry(
        "radar-recent",
        "Radar ablation: the most recent segments (a longer sliding window)",
        RadarRecent, segment_options(), category="ablation", engines=BOTH,
    ),
    MethodEntry(
        "radar-centered",
        "Radar with random features of segment-centred keys, the centroid scored exactly",
        RadarCentered, (*segment_options(), *feature_options()), engines=BOTH,
    ),
    MethodEntry(
        "radar-rerank",
        "Radar's random features (n_features = 256) shortlist, exact segment mass reranks",
        RadarRerank, (*segment_options(), *feature_options()), engines=BOTH,
    ),
    MethodEntry(
        "snapkv-then-radar",
        "SnapKV compresses the prompt (to prefill_budget, default 4 x budget), then Radar searches it + new tokens",
        SnapKVRadar,
        (
            *segment_options(window_none=WINDOW_FROM_BUDGET),
            Option("prefill_budget", int, help="prompt tokens SnapKV keeps per KV head; None: 4 x budget, 2048 without"),
            Option("observation_window", int, help="last prompt queries that vote"),
            *feature_options(),
        ),
    ),
    MethodEntry(
        "radar-with-h2o",
        "Radar with H2O's heavy hitters: the `heavy` tokens with the most attention so far (default budget / 8) "
        "are attended on top of the segments",
        RadarH2O,
        (
            *segment_options(window_none=WINDOW_FROM_BUDGET),
            Option("heavy", int, help="heavy-hitter tokens attended per step; None: budget // 8, 128 without a budget"),
            *feature_options(),
        ),
    ),
    MethodEntry(
        "oracle-tokens",
        "Ceiling: the exact top-budget tokens of each query head (exact logits, O(t) per step); split=pooled "
        "shares the layer's tokens by the heads' exact attention mass",
        OracleTokensByLayer,
        (
            *segment_options(),
            Option("split", str, help="a layer's tokens between its heads: uniform, pooled by exact attention share, "
                   "or topp (each head the fewest reaching share p)", allowed=("uniform", "pooled", "topp")),
            Option("p", float, help="share of attention mass each head reaches (split=topp; None: 0.95)"),
            Option("cap", float, help="most tokens one head may get, x the uniform share (split=pooled; None: 4)",
                   allowed=Range(1.0, 1024.0, integer=False)),
            Option("floor", float, help="fewest tokens a head keeps, x the uniform share (split=pooled; None: 0.25)"),
            *_layer_options("tokens"),
        ),
        category="ceiling", engines=BOTH,
    ),
    MethodEntry(
        "oracle-segments",
        "Ceiling on a fixed grid: the exact top segments of `segment_size` tokens (O(t) per step)",
        OracleSegments, (*segment_options(), Option("segment_size", int, help="tokens per segment")), category="ceiling", engines=BOTH,
    ),
    MethodEntry(
        "radar+tokens",
        "radar+'s shortlist of segments (mean keys, per KV group), then each head's best tokens in them by exact "
        "logits instead of whole segments, plus 4 sinks",
        RadarPlusTokens,
        (*segment_options(top_k_none="64 x aspect"), *_grid_options()),
    ),
):
    register(_entry)

#: The names that were variants, as the options of the methods they are now.
_POOLED = "radar+:split=pooled,aspect=16.0,bf16_centroids=true"  # _POOLED_OPTIONS as a spec
for _old, _now in (
    ("radar+pooled", _POOLED),
    ("radar+merged", _POOLED + ",rest=merged,merge=16"),
    ("radar+pooled-layers", _POOLED + ",first_layers=1"),
    ("radar+merged-after", "radar+adaptive:bf16_centroids=true"),
    ("oracle-tokens-pooled", "oracle-tokens:split=pooled"),
    ("oracle-tokens-pooled-layers", "oracle-tokens:split=pooled,first_layers=1"),
    # "+" means radar+'s sharper ranking; a composition names its parts in words.
    ("radar+h2o", "radar-with-h2o"),
    ("snapkv+radar", "snapkv-then-radar"),
):
    alias(_old, _now)

#: Former builders that were variants, by name: what each is now (built on first use, with a warning).
_FORMER_BUILDERS = {
    "OracleTokensPooled": ("OracleTokens(split='pooled')", lambda: functools.partial(OracleTokens, split="pooled")),
    "OracleTokensPooledFirstLayers": (
        "OracleTokensByLayer(split='pooled', first_layers=1)", lambda: functools.partial(OracleTokensByLayer, split="pooled", first_layers=1)
    ),
    "RadarPlusPooledFirstLayers": (
        "RadarPlusByLayer(first_layers=1, **POOLED)", lambda: functools.partial(RadarPlusByLayer, first_layers=1, **_POOLED_OPTIONS)
    ),
    "RadarPlusMergedAfterFirstLayers": (
        "RadarPlusAdaptive(bf16_centroids=True)", lambda: functools.partial(RadarPlusAdaptive, bf16_centroids=True)
    ),
}


def __getattr__(name: str):
    if name in _FORMER_BUILDERS:
        now, made = _FORMER_BUILDERS[name]
        warnings.warn(f"{name} is now {now}; the old name will be removed in the next release", FutureWarning, stacklevel=2)
        return made()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
