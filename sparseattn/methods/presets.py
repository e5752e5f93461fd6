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
import warnings

from sparseattn.allocations.base import Allocation
from sparseattn.allocations.named import named_allocation
from sparseattn.allocations.uniform import Uniform
from sparseattn.methods.always import HeavyHitters
from sparseattn.methods.compose import PrefillEviction
from sparseattn.methods.layers import with_layer_options
from sparseattn.methods.segment_options import WINDOW_FROM_BUDGET, feature_options, layer_options, segment_options
from sparseattn.methods.segment_search import Radar, SegmentSearch
from sparseattn.methods.snapkv import SnapKV
from sparseattn.registry import ENGINES, MethodEntry, Option, Range, alias, register
from sparseattn.schedules.fixed import FixedSchedule
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.base import Selector
from sparseattn.selectors.lowest import Lowest
from sparseattn.selectors.random import Random
from sparseattn.selectors.recent import Recent
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.base import Summary
from sparseattn.summaries.centered import CenteredFeatures
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
    for :func:`~sparseattn.methods.radar_plus.RadarPlus`. O(t) per step: a measuring stick, not a fast method.
    """
    return SegmentSearch(
        summary=ExactScore(), selector=TopK(), schedule=FixedSchedule(1), top_k=top_k, sinks=sinks, window=window,
        shared_kv_selection=shared_kv_selection, budget=budget,
        allocation=named_allocation(split, allocation, cap, floor, default_cap=4.0, p=p),
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






#: The catalogue's builder of ``oracle-tokens``: :func:`OracleTokens` with ``first_layers`` and ``layer_factor``.
OracleTokensByLayer = with_layer_options(OracleTokens)








for _entry in (
    MethodEntry(
        "radar-alg1",
        "Radar as the paper's Algorithm 1 writes it: segments of sqrt(t) tokens rebuilt at every perfect square, "
        "top-k segments + the buffer",
        RadarAlg1, (*segment_options(), *feature_options()), category="paper", engines=ENGINES,
    ),
    MethodEntry(
        "quest",
        "Quest: pages of 16 tokens, top pages by the min/max key upper bound of q.k (Tang et al. 2024)",
        Quest, (*segment_options(), Option("page_size", int, help="tokens per page")), category="baseline", engines=ENGINES,
    ),
    MethodEntry(
        "radar-exact",
        "Radar ablation: segments ranked by their exact attention mass (the O(t) oracle)",
        RadarExact, segment_options(), category="ablation", engines=ENGINES,
    ),
    MethodEntry(
        "radar-random",
        "Radar ablation: segments chosen uniformly at random",
        RadarRandom, (*segment_options(), feature_options()[1]), category="ablation", engines=ENGINES,
    ),
    MethodEntry(
        "radar-lowest",
        "Radar ablation: the segments with the lowest estimated scores",
        RadarLowest, (*segment_options(), *feature_options()), category="ablation", engines=ENGINES,
    ),
    MethodEntry(
        "radar-recent",
        "Radar ablation: the most recent segments (a longer sliding window)",
        RadarRecent, segment_options(), category="ablation", engines=ENGINES,
    ),
    MethodEntry(
        "radar-centered",
        "Radar with random features of segment-centred keys, the centroid scored exactly",
        RadarCentered, (*segment_options(), *feature_options()), engines=ENGINES,
    ),
    MethodEntry(
        "radar-rerank",
        "Radar's random features (n_features = 256) shortlist, exact segment mass reranks",
        RadarRerank, (*segment_options(), *feature_options()), engines=ENGINES,
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
                   allowed=Range(1.0, 1024.0, integer=False, closed=True)),
            Option("floor", float, help="fewest tokens a head keeps, x the uniform share (split=pooled; None: 0.25)"),
            *layer_options("tokens"),
        ),
        category="ceiling", engines=ENGINES,
    ),
    MethodEntry(
        "oracle-segments",
        "Ceiling on a fixed grid: the exact top segments of `segment_size` tokens (O(t) per step)",
        OracleSegments, (*segment_options(), Option("segment_size", int, help="tokens per segment")), category="ceiling", engines=ENGINES,
    ),):
    register(_entry)

#: The names that were variants, as the options of the methods they are now.
for _old, _now in (
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
    "RadarPlusPooledFirstLayers": ("RadarPlusByLayer(first_layers=1, **POOLED)", lambda: _radar_plus("pooled_first_layers")),
    "RadarPlusMergedAfterFirstLayers": ("RadarPlusAdaptive(bf16_centroids=True)", lambda: _radar_plus("merged_after")),
}


def _radar_plus(which: str):
    from sparseattn.methods import radar_plus  # (the radar+ family's former names: built on first use)

    if which == "pooled_first_layers":
        return functools.partial(radar_plus.RadarPlusByLayer, first_layers=1, **radar_plus.POOLED_OPTIONS)
    return functools.partial(radar_plus.RadarPlusAdaptive, bf16_centroids=True)


def __getattr__(name: str):
    if name in _FORMER_BUILDERS:
        now, made = _FORMER_BUILDERS[name]
        warnings.warn(f"{name} is now {now}; the old name will be removed in the next release", FutureWarning, stacklevel=2)
        return made()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
