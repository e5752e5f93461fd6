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
import inspect

import torch

from sparseattn.allocations.base import Allocation
from sparseattn.allocations.pooled import PooledMass
from sparseattn.allocations.uniform import Uniform
from sparseattn.methods.always import HeavyHitters
from sparseattn.methods.compose import PrefillEviction
from sparseattn.methods.layers import FirstLayers, SplitLayers, first_layers_options
from sparseattn.methods.rest import MergedRest
from sparseattn.methods.segment_search import Radar, SegmentSearch, feature_options, segment_options
from sparseattn.methods.snapkv import SnapKV
from sparseattn.refine.tokens import TopTokens
from sparseattn.registry import MethodEntry, Option, Range, register
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
    "RadarPlusTokens",
    "RadarRandom",
    "RadarRecent",
    "RadarRerank",
    "SnapKVRadar",
]


def RadarAlg1(
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
    budget: int | None = None,
) -> SegmentSearch:
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
    return SegmentSearch(
        summary=PerformerFeatures(n_features=n_features, orthogonal=orthogonal, antithetic=antithetic, seed=seed),
        selector=TopK(),
        schedule=SqrtSchedule(aspect=aspect),
        top_k=top_k,
        sinks=sinks,
        window=window,
        shared_kv_selection=shared_kv_selection,
        budget=budget,
    )


def Quest(
    top_k: int = 64,
    page_size: int = 16,
    *,
    sinks: int = 0,
    window: int = 0,
    shared_kv_selection: bool = False,
    budget: int | None = None,
) -> SegmentSearch:
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
    top_k: int = 64,
    *,
    sinks: int = 0,
    window: int = 0,
    aspect: float = 1.0,
    seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:
    """Radar's segments chosen uniformly at random (Figure 7, middle: the "uneducated guess").

    No scores are computed; the summary is :class:`ExactScore`, which stores nothing.
    """
    return _radar_with(ExactScore(), Random(seed=seed), top_k, sinks, window, aspect, budget)


def RadarLowest(
    top_k: int = 64,
    n_features: int = 2048,
    *,
    sinks: int = 0,
    window: int = 0,
    aspect: float = 1.0,
    seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:
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
    top_k: int | None = None,
    *,
    sinks: int = 4,
    window: int = 0,
    aspect: float = 8.0,
    shortlist: int = 16,
    factor: float = 2.0,
    per_group: bool = True,
    budget: int | None = None,
    allocation: Allocation | None = None,
    centroid_dtype: torch.dtype | None = None,
) -> SegmentSearch:
    """Radar's segment search with a better ranking (issue 7): centroid shortlist, exact rerank.

    ``SegmentSearch(Rerank(Centroid(), shortlist, factor, per_group=True), TopK(), SqrtSchedule(aspect=8), sinks=4)``:
    segments of ``sqrt(t) / 8`` tokens (8 sqrt(t) of them: finer selection, still O(sqrt t) scoring);
    every segment is scored by ``log c + q . mean k`` (d numbers per segment, cheaper than random
    features), the ``max(shortlist, factor * k)`` best of each KV group (by the group's summed mass)
    are rescored exactly from their keys, read once for the group's query heads, and each head
    attends the top ``k`` of those, plus 4 attention-sink tokens. On the default model it finds the
    segment exact search ranks first in 97-98% of layer-head-steps (raw Radar: 4-14%); see
    docs/methods.md for the measurements and docs/theory.md for what is guaranteed.

    ``per_group=False`` gives each query head its own shortlist (G times the key reads under
    grouped-query attention; on the default model ppl 8.070 vs 8.229 on code, 121.29 vs 121.22 on prose).

    ``top_k`` defaults to ``64 * aspect`` segments: the tokens of Radar's ``k = 64`` at a grid
    ``aspect`` times finer. ``budget`` (tokens) overrides it, as for every preset. ``allocation``
    splits the layer's segments between heads (:mod:`sparseattn.allocations`); ``centroid_dtype``
    stores the mean keys in another dtype (:class:`Centroid`).
    """
    if top_k is None:
        top_k = round(64 * aspect)
    summary = Rerank(Centroid(centroid_dtype), shortlist, factor, per_group)
    method = _radar_with(summary, TopK(), top_k, sinks, window, aspect, budget)
    return method if allocation is None else dataclasses.replace(method, allocation=allocation)


def RadarPlusPooled(
    top_k: int | None = None,
    *,
    sinks: int = 4,
    window: int = 0,
    aspect: float = 16.0,
    factor: float = 2.0,
    cap: float = 2.0,
    floor: float = 0.25,
    budget: int | None = None,
) -> SegmentSearch:
    """radar+ with the budget spent where attention is (issue 17): a finer grid, heads' budgets pooled.

    ``RadarPlus(aspect=16, allocation=PooledMass(cap=2, floor=0.25), centroid_dtype=torch.bfloat16)``.
    Three changes to radar+, each measured on text it was not tuned on (docs/methods.md):

    * segments of ``sqrt(t) / 16`` tokens instead of ``/ 8``: finer centroids shortlist better at the
      same shortlist size in tokens (twice the segments, each half as long);
    * the layer's segments split between its heads by :class:`PooledMass`: each head's exact shortlist
      masses become shares of its estimated total, the layer's ``H x k`` largest shares are taken, so
      a diffuse head attends up to ``cap x k`` segments and a peaked one down to ``floor x k``; the
      total per layer is radar+'s. ``cap = 2`` is the rerank's shortlist (``factor = 2``): a head can
      take its group's whole shortlist, and the split reads the exact masses only, never the coarse
      ranking of all segments (``cap = 4`` measured the same, 0.118 / 0.056 on the six texts);
    * centroids stored in bfloat16: the scoring of every segment reads half the bytes (it is a
      memory-bound matrix-vector product over the 2x larger grid); only the shortlist depends on it.

    ``budget`` is honoured on average over a layer's heads (one head may attend more). With
    ``cap > factor`` a head may take segments beyond its group's shortlist, ranked by their centroids
    below every shortlisted one: the split then ranks all segments (correct, slower).
    """
    return RadarPlus(
        top_k, sinks=sinks, window=window, aspect=aspect, factor=factor, budget=budget,
        allocation=PooledMass(cap=cap, floor=floor), centroid_dtype=torch.bfloat16,
    )  # fmt: skip


def OracleTokens(
    top_k: int = 1024,
    *,
    sinks: int = 0,
    window: int = 0,
    shared_kv_selection: bool = False,
    budget: int | None = None,
    allocation: Allocation | None = None,
) -> SegmentSearch:
    """The exact top-``budget`` tokens of each query head: the ceiling of any selector at this budget.

    ``SegmentSearch(ExactScore(), TopK(), FixedSchedule(1))``: every past token is a segment of one,
    scored by its exact logit, so a step attends the ``budget`` tokens with the most attention (the
    current token always among them). No summary can rank better at token granularity; what it
    loses against dense attention is the mass outside each head's top ``budget`` tokens, which only
    a different split of the budget (``allocation``, e.g. :class:`~sparseattn.allocations.PooledMass`)
    can recover. O(t) per step: a measuring stick, not a fast method.
    """
    return SegmentSearch(
        summary=ExactScore(), selector=TopK(), schedule=FixedSchedule(1), top_k=top_k, sinks=sinks, window=window,
        shared_kv_selection=shared_kv_selection, budget=budget, allocation=allocation or Uniform(),
    )  # fmt: skip


def OracleSegments(
    top_k: int = 64,
    segment_size: int = 16,
    *,
    sinks: int = 0,
    window: int = 0,
    budget: int | None = None,
    allocation: Allocation | None = None,
) -> SegmentSearch:
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
    top_k: int = 64,
    n_features: int = 2048,
    *,
    sinks: int = 0,
    window: int = 0,
    aspect: float = 1.0,
    seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:
    """Radar with centred random features (:class:`CenteredFeatures`): the centroid exact, the spread estimated."""
    summary = CenteredFeatures(PerformerFeatures(n_features=n_features, seed=seed))
    return _radar_with(summary, TopK(), top_k, sinks, window, aspect, budget)


def RadarRerank(
    top_k: int = 64,
    n_features: int = 256,
    *,
    sinks: int = 0,
    window: int = 0,
    aspect: float = 1.0,
    seed: int = 0,
    shortlist: int = 16,
    factor: float = 2.0,
    budget: int | None = None,
) -> SegmentSearch:
    """Radar's random features (n = 256) shortlist, the exact segment mass reranks (:class:`Rerank`)."""
    summary = Rerank(PerformerFeatures(n_features=n_features, seed=seed), shortlist, factor)
    return _radar_with(summary, TopK(), top_k, sinks, window, aspect, budget)


def SnapKVRadar(
    top_k: int = 64,
    n_features: int = 4096,
    *,
    sinks: int = 1,
    window: int | None = None,
    seed: int = 0,
    budget: int | None = None,
    prefill_budget: int | None = None,
    observation_window: int = 32,
) -> PrefillEviction:
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
    top_k: int = 64,
    n_features: int = 4096,
    *,
    sinks: int = 1,
    window: int | None = None,
    heavy: int | None = None,
    seed: int = 0,
    budget: int | None = None,
) -> SegmentSearch:
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
    top_k: int | None = None,
    *,
    sinks: int = 4,
    window: int = 0,
    aspect: float = 16.0,
    factor: float = 2.0,
    budget: int | None = None,
    allocation: Allocation | None = None,
) -> SegmentSearch:
    """radar+'s shortlist, then tokens instead of segments (issue 17): coarse to fine.

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


def _signed(wrapper, build, drop: tuple[str, ...], extra: dict[str, object]):
    """Give ``wrapper`` the signature of ``build`` without ``drop``, plus the keyword-only ``extra`` (the registry
    reads a builder's keywords and defaults from its signature)."""
    sig = inspect.signature(build)
    params = [p for p in sig.parameters.values() if p.name not in drop]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value) for name, value in extra.items()]
    wrapper.__signature__ = sig.replace(parameters=params)
    return wrapper


def _pooled(build):
    """``build`` with its budget split by :class:`~sparseattn.allocations.PooledMass` (``cap``, ``floor``)."""

    def pooled(*args, cap: float = 4.0, floor: float = 0.25, **options) -> SegmentSearch:
        return build(*args, allocation=PooledMass(cap=cap, floor=floor), **options)

    pooled.__name__ = pooled.__qualname__ = f"{build.__name__}Pooled"
    pooled.__doc__ = f"{build.__name__} with the layer's segments split by pooled attention mass (:class:`PooledMass`)."
    return _signed(pooled, build, ("allocation",), {"cap": 4.0, "floor": 0.25})


OracleTokensPooled = _pooled(OracleTokens)


def _first_layers(build):
    """``build`` wrapped in :class:`~sparseattn.methods.layers.FirstLayers` (``first_layers``, ``layer_factor``)."""

    def layered(*args, first_layers: int = 1, layer_factor: float = 4.0, **options) -> FirstLayers:
        return FirstLayers(build(*args, **options), layers=first_layers, factor=layer_factor)

    layered.__name__ = layered.__qualname__ = f"{build.__name__}FirstLayers"
    layered.__doc__ = f"{build.__name__} with more of the budget in the first layers (:class:`FirstLayers`)."
    return _signed(layered, build, (), {"first_layers": 1, "layer_factor": 4.0})


OracleTokensPooledFirstLayers = _first_layers(OracleTokensPooled)
RadarPlusPooledFirstLayers = _first_layers(RadarPlusPooled)


def _merged(build):
    """``build`` with what a step leaves out merged per block (:class:`~sparseattn.methods.rest.MergedRest`, ``merge``)."""

    def merged(*args, merge: int = 16, **options) -> SegmentSearch:
        return dataclasses.replace(build(*args, **options), rest=MergedRest(merge or None))  # 0: one block

    merged.__name__ = merged.__qualname__ = build.__name__.replace("Pooled", "Merged")
    merged.__doc__ = (
        f"{build.__name__} that keeps a coarse picture of what it does not attend (issue 17): every ``merge`` "
        "consecutive segments form a block, and each block's tokens a step leaves out enter its softmax as one "
        "merged token (mean key, mean value, log count; :class:`~sparseattn.methods.rest.MergedRest`) instead of "
        "being dropped; ``merge=0``: one block, the whole rest as one merged token. Each merged token counts "
        "against ``budget`` (``ceil(S / merge)``: ``sqrt(t)`` at the default grid), the selection shrinks to keep "
        "the total. On the CPU the C kernel attends the selection and returns its log-sum-exp; the merged tokens "
        "come from kept segment and block sums (no token is gathered)."
    )
    return _signed(merged, build, (), {"merge": 16})


RadarPlusMerged = _merged(RadarPlusPooled)


def _merged_after_layers(merged_build, plain_build):
    """``plain_build`` in the first ``plain_layers`` layers, the merged rest in every later one (:class:`SplitLayers`)."""

    def split(*args, merge: int = 128, plain_layers: int = 1, **options) -> SplitLayers:
        return SplitLayers(plain_build(*args, **options), merged_build(*args, merge=merge, **options), layers=plain_layers)

    split.__name__ = split.__qualname__ = f"{merged_build.__name__}AfterFirstLayers"
    split.__doc__ = (
        f"{plain_build.__name__} in the first ``plain_layers`` layers (default 1), {merged_build.__name__} with "
        "blocks of ``merge`` segments (default 128) in every later layer (:class:`~sparseattn.methods.layers.SplitLayers`). "
        "Measured (docs/methods.md): merging in layer 0 hurt the texts that repeat themselves (the KJV), merging in "
        "the later layers helped most texts."
    )
    return _signed(split, merged_build, ("merge",), {"merge": 128, "plain_layers": 1})


RadarPlusMergedAfterFirstLayers = _merged_after_layers(RadarPlusMerged, RadarPlusPooled)


def _factor_option(default: float) -> Option:
    return Option("factor", float, default, "segments shortlisted, x what the budget buys", allowed=Range(1.0, 1024.0, integer=False))


def _aspect_option(default: float) -> Option:
    return Option("aspect", float, default, "segments of sqrt(t) / aspect tokens", allowed=Range(0.0, 1024.0, integer=False))


def _pool_options(cap: float = 4.0) -> tuple[Option, ...]:
    return (
        Option("cap", float, cap, "most segments one head may get, as a multiple of the uniform share", allowed=Range(1.0, 1024.0, integer=False)),
        Option("floor", float, 0.25, "fewest segments a head keeps, as a fraction of the uniform share"),
    )  # fmt: skip


for _entry in (
    MethodEntry(
        "radar-alg1",
        "Radar as the paper's Algorithm 1 writes it: segments of sqrt(t) tokens rebuilt at every perfect square, "
        "top-k segments + the buffer",
        RadarAlg1,
        (*segment_options(), *feature_options(2048)),
    ),
    MethodEntry(
        "quest",
        "Quest: pages of 16 tokens, top pages by the min/max key upper bound of q.k (Tang et al. 2024)",
        Quest,
        (*segment_options(), Option("page_size", int, 16, "tokens per page")),
    ),
    MethodEntry(
        "radar-exact",
        "Radar ablation: segments ranked by their exact attention mass (the O(t) oracle)",
        RadarExact,
        segment_options(),
    ),
    MethodEntry(
        "radar-random",
        "Radar ablation: segments chosen uniformly at random",
        RadarRandom,
        (*segment_options(), feature_options(0)[1]),
    ),
    MethodEntry(
        "radar-lowest",
        "Radar ablation: the segments with the lowest estimated scores",
        RadarLowest,
        (*segment_options(), *feature_options(2048)),
    ),
    MethodEntry(
        "radar-recent",
        "Radar ablation: the most recent segments (a longer sliding window)",
        RadarRecent,
        segment_options(),
    ),
    MethodEntry(
        "radar+",
        "Radar with a sharper ranking: segments of sqrt(t)/8 tokens scored by their mean key, the best rescored "
        "exactly from their keys, plus 4 attention sinks",
        RadarPlus,
        (*segment_options(top_k=None, sinks=4), _aspect_option(8.0)),
    ),
    MethodEntry(
        "radar-centered",
        "Radar with random features of segment-centred keys, the centroid scored exactly",
        RadarCentered,
        (*segment_options(), *feature_options(2048)),
    ),
    MethodEntry(
        "radar-rerank",
        "Radar's random features (n = 256 unless --n-features) shortlist, exact segment mass reranks",
        RadarRerank,
        (*segment_options(), *feature_options(256)),
    ),
    MethodEntry(
        "snapkv+radar",
        "SnapKV compresses the prompt (to --prefill-budget, default 4 x budget), then Radar searches it + new tokens",
        SnapKVRadar,
        (
            *segment_options(sinks=1, window=None),
            Option("prefill_budget", int, None, "prompt tokens SnapKV keeps per KV head; None: 4 x budget, 2048 without"),
            Option("observation_window", int, 32, "last prompt queries that vote"),
            *feature_options(4096),
        ),
    ),
    MethodEntry(
        "radar+h2o",
        "Radar plus H2O's heavy hitters: the --heavy tokens with the most attention so far (default budget / 8) "
        "are attended on top of the segments",
        RadarH2O,
        (
            *segment_options(sinks=1, window=None),
            Option("heavy", int, None, "heavy-hitter tokens attended per step; None: budget // 8, 128 without a budget"),
            *feature_options(4096),
        ),
    ),
    MethodEntry(
        "oracle-tokens",
        "Ceiling: the exact top-budget tokens of each query head (exact logits, O(t) per step)",
        OracleTokens,
        segment_options(top_k=1024),
    ),
    MethodEntry(
        "oracle-tokens-pooled",
        "Ceiling with a non-uniform split: the layer's tokens go to the heads' largest exact attention shares "
        "(PooledMass), the total per layer fixed",
        OracleTokensPooled,
        (*segment_options(top_k=1024), *_pool_options()),
    ),
    MethodEntry(
        "oracle-segments",
        "Ceiling on a fixed grid: the exact top segments of --segment-size tokens (O(t) per step)",
        OracleSegments,
        (*segment_options(), Option("segment_size", int, 16, "tokens per segment")),
    ),
    MethodEntry(
        "radar+pooled",
        "radar+ on a 2x finer grid (bf16 centroids) with the layer's segments split by the heads' estimated "
        "attention shares (PooledMass): diffuse heads get more, peaked heads fewer, the total per layer fixed",
        RadarPlusPooled,
        (*segment_options(top_k=None, sinks=4), _aspect_option(16.0), _factor_option(2.0), *_pool_options(cap=2.0)),
    ),
    MethodEntry(
        "radar+merged",
        "radar+pooled plus what a step leaves out, merged: each block of `merge` segments adds one token with the "
        "mean key and value of its unattended tokens (weight: their count), counted against the budget",
        RadarPlusMerged,
        (*segment_options(top_k=None, sinks=4), _aspect_option(16.0), _factor_option(2.0), *_pool_options(cap=2.0),
         Option("merge", int, 16, "segments per merged token of the rest (one merged token per block; 0: one block)", minimum=0)),
    ),
    MethodEntry(
        "radar+merged-after",
        "radar+pooled in the first `plain_layers` layers (default 1), radar+merged with blocks of `merge` segments "
        "(default 128) in every later layer: the rest merged where it helped, dropped in layer 0 where it hurt",
        RadarPlusMergedAfterFirstLayers,
        (*segment_options(top_k=None, sinks=4), _aspect_option(16.0), _factor_option(2.0), *_pool_options(cap=2.0),
         Option("merge", int, 128, "segments per merged token of the rest (0: one block, the whole rest)", minimum=0),
         Option("plain_layers", int, 1, "first layers that drop the rest (the others merge it)", minimum=0)),
    ),
    MethodEntry(
        "oracle-tokens-pooled-layers",
        "Ceiling with both splits: per-layer budgets (FirstLayers) and pooled head budgets (PooledMass)",
        OracleTokensPooledFirstLayers,
        (*segment_options(top_k=1024), *_pool_options(), *first_layers_options()),
    ),
    MethodEntry(
        "radar+pooled-layers",
        "radar+pooled with more of the budget in the first layers (FirstLayers; diffuse attention there): "
        "the tokens over all layers still honour --budget per layer on average",
        RadarPlusPooledFirstLayers,
        (*segment_options(top_k=None, sinks=4), _aspect_option(16.0), _factor_option(2.0), *_pool_options(cap=2.0), *first_layers_options()),
    ),
    MethodEntry(
        "radar+tokens",
        "radar+'s shortlist of segments (mean keys, per KV group), then each head's best tokens in them by exact "
        "logits instead of whole segments, plus 4 sinks",
        RadarPlusTokens,
        (*segment_options(top_k=None, sinks=4), _aspect_option(16.0), _factor_option(2.0)),
    ),
):
    register(_entry)
