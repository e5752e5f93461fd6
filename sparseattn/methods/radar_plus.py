"""radar+: Radar's segment search with a sharper ranking (a centroid shortlist reranked exactly), and its presets.

:func:`RadarPlus` (the catalogue's ``radar+``, the fast configuration), :func:`RadarPlusAdaptive` (``radar+adaptive``,
the recommended method in both engines), :func:`RadarPlusTokens` (``radar+tokens``: tokens instead of whole
segments), and the builders under former names. Each builder returns one type; choices per layer compose
around them (:func:`~sparseattn.methods.layers.plain_first`, :class:`~sparseattn.methods.layers.FirstLayers`),
and the catalogue's ``radar+`` takes them as options (:data:`RadarPlusByLayer`).
"""

from __future__ import annotations

import dataclasses

import torch

from sparseattn.allocations.base import Allocation
from sparseattn.allocations.named import named_allocation
from sparseattn.allocations.uniform import Uniform
from sparseattn.methods.layers import SplitLayers, plain_first, with_layer_options
from sparseattn.methods.rest import MergedRest, Rest
from sparseattn.methods.sampled_rest import SampledRest
from sparseattn.methods.segment_options import layer_options, segment_options
from sparseattn.methods.segment_search import SegmentSearch
from sparseattn.refine.tokens import TopTokens
from sparseattn.registry import ENGINES, MethodEntry, Option, Range, alias, register
from sparseattn.schedules.sqrt import SqrtSchedule
from sparseattn.selectors.topk import TopK
from sparseattn.summaries.centroid import Centroid
from sparseattn.summaries.rerank import Rerank
from sparseattn.summaries.spread import CentroidSpread

__all__ = ["RadarPlus", "RadarPlusAdaptive", "RadarPlusByLayer", "RadarPlusMerged", "RadarPlusPooled", "RadarPlusTokens"]


def RadarPlus(
    top_k: int | None = None, *, sinks: int = 4, window: int = 0, aspect: float = 8.0, shortlist: int = 16,
    factor: float = 2.0, per_group: bool = True, budget: int | None = None, split: str | Allocation = "uniform",
    cap: float | None = None, floor: float | None = None, bf16_centroids: bool = False, rest: str = "dropped",
    merge: int | None = None, allocation: Allocation | None = None, centroid_dtype: torch.dtype | None = None,
    p: float | None = None, samples: int | None = None, delta: float | None = None, prefilter: int = 0,
    prefilter_keep: float | None = None, coarse: str = "centroid", unit: int = 0,
) -> SegmentSearch:  # fmt: skip
    """Radar's segment search with a sharper ranking: a centroid shortlist, reranked exactly.

    ``SegmentSearch(Rerank(Centroid(), shortlist, factor, per_group=True), TopK(), SqrtSchedule(aspect=8), sinks=4)``:
    segments of ``sqrt(t) / 8`` tokens (8 sqrt(t) of them: finer selection, still O(sqrt t) scoring);
    every segment is scored by ``log c + q . mean k`` (d numbers per segment, cheaper than random
    features), the ``max(shortlist, factor * k)`` best of each KV group (by the group's summed mass; ``k`` being
    the most segments one head may attend, :meth:`SegmentSearch.reach`)
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
    * ``coarse`` (experimental): the shortlist's score, ``"centroid"`` (the mean key) or ``"spread"``
      (:class:`CentroidSpread`: the mean key plus half the query-weighted per-channel variance of the keys, twice
      the summary's memory; transformers and vLLM's generic path);
    * ``prefilter`` (experimental): groups of that many segments scored first by their mean key, only the
      best ``prefilter_keep`` (default 4) times the shortlist's segments scored one by one
      (:class:`Rerank`'s ``prefilter``: a page-level pass before the segments inside the pages);
    * ``unit`` (experimental): the shortlist made of whole units of about that many tokens (whole segments), ranked
      by their segments' coarse mass (:class:`Rerank`'s ``unit``: 32, a paged cache's line of bf16 keys, read whole).

    ``per_group=False`` gives each query head its own shortlist (G times the key reads under
    grouped-query attention). ``allocation`` is ``split`` given as a part.

    Choices per layer compose around it (the catalogue's ``radar+`` takes them as options:
    ``plain_layers``, ``first_layers``, ``layer_factor``): :func:`plain_first` (the first layers drop
    the rest: merging in layer 0 hurt texts that repeat themselves) and :class:`FirstLayers` (more
    budget in the first layers, the total over layers kept).
    """
    if top_k is None:
        top_k = round(64 * aspect)
    split = named_allocation(split, allocation, cap, floor, default_cap=2.0, p=p)
    if bf16_centroids:
        if centroid_dtype not in (None, torch.bfloat16):
            raise ValueError(f"RadarPlus: bf16_centroids=True and centroid_dtype={centroid_dtype}: give one of them")
        centroid_dtype = torch.bfloat16
    if prefilter_keep is not None and not prefilter:
        raise ValueError(f"RadarPlus: prefilter_keep={prefilter_keep} changes nothing without prefilter (segments per group, >= 2)")
    extra = {"prefilter": prefilter, "prefilter_keep": 4.0 if prefilter_keep is None else prefilter_keep} if prefilter else {}
    extra.update({"unit": unit} if unit else {})
    if coarse not in COARSE:
        raise ValueError(f"RadarPlus: coarse must be one of {tuple(COARSE)}, got {coarse!r}")
    summary = Rerank(COARSE[coarse](centroid_dtype), shortlist, factor, per_group, **extra)
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
    bf16_centroids: bool = False, prefilter: int = 0, prefilter_keep: float | None = None, coarse: str = "centroid",
    unit: int = 0,
) -> SplitLayers:  # fmt: skip
    """radar+ with the budget spent where attention is: the recommended method, in both engines.

    ``plain_first(RadarPlus(aspect=16, split="pooled", rest="merged", merge=128), layers=1)``:

    * segments of ``sqrt(t) / 16`` tokens: finer centroids shortlist better at the same shortlist
      size in tokens;
    * each layer's segments split between its heads by their estimated attention shares
      (:class:`PooledMass`, a head between ``floor`` and ``cap`` times the uniform share; the total
      per layer is radar+'s): diffuse heads get more, peaked heads fewer; the KV group's shortlist is
      ``factor`` times what its widest head may take (``cap x k``: :meth:`SegmentSearch.reach`), so the
      exact rerank still corrects the ranking for a head at its cap;
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
        prefilter_keep=prefilter_keep, coarse=coarse, unit=unit,
    )  # fmt: skip
    return plain_first(merged, plain_layers)


#: The shortlist's scores ``RadarPlus(coarse=...)`` names, each built from the centroid storage dtype.
COARSE = {"centroid": Centroid, "spread": CentroidSpread}

#: ``RadarPlus`` options of the former ``radar+pooled`` (and of ``radar+merged`` before its rest).
POOLED_OPTIONS = {"aspect": 16.0, "split": "pooled", "bf16_centroids": True}


def RadarPlusPooled(top_k: int | None = None, **options) -> SegmentSearch:
    """``RadarPlus(aspect=16, split="pooled", bf16_centroids=True)`` under its former name (the registry's
    ``radar+pooled``, now an alias of those options of ``radar+``); ``options`` are RadarPlus's."""
    return RadarPlus(top_k, **{**POOLED_OPTIONS, **options})


def RadarPlusMerged(top_k: int | None = None, *, merge: int = 16, **options) -> SegmentSearch:
    """``RadarPlus(aspect=16, split="pooled", bf16_centroids=True, rest="merged", merge=16)`` under its former
    name (the registry's ``radar+merged``, now an alias of those options of ``radar+``)."""
    return RadarPlus(top_k, **{**POOLED_OPTIONS, "rest": "merged", "merge": merge, **options})


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


#: The catalogue's builder of ``radar+``: :func:`RadarPlus` with the per-layer options ``plain_layers``,
#: ``first_layers`` and ``layer_factor``.
RadarPlusByLayer = with_layer_options(RadarPlus, rest_layers=True)


def _radar_plus_options(*, variants: bool) -> tuple[Option, ...]:
    """The options of radar+ and its presets (``variants``: also the choices that make the variants)."""
    shared = (*segment_options(top_k_none="64 x aspect"), *_grid_options())
    pool = (
        Option("cap", float, help="most segments one head may get, x the uniform share (split=pooled; None: 2)",
               allowed=Range(1.0, 1024.0, integer=False, closed=True)),
        Option("floor", float, help="fewest segments a head keeps, x the uniform share (split=pooled; None: 0.25)"),
    )  # fmt: skip
    bf16 = Option("bf16_centroids", bool, help="mean keys stored in bfloat16 (half their memory), scored in float32")
    coarse = Option("coarse", str, help="experimental: the shortlist's score, the mean key (centroid) or the mean key plus "
                    "the keys' query-weighted spread (spread: twice the memory; not in vLLM's fused step)",
                    allowed=tuple(COARSE))  # fmt: skip
    prefilter = (
        Option("prefilter", int, help="experimental: groups of this many segments (a page's) scored first by their mean key; "
               "0: none", minimum=0),
        Option("prefilter_keep", float, help="groups whose segments are scored, x the shortlist in segments (with prefilter; "
               "None: 4)", allowed=Range(1.0, 1024.0, integer=False, closed=True)),
        Option("unit", int, help="experimental: the shortlist made of whole units of about this many tokens (whole "
               "segments; 32: a paged cache's line of bf16 keys), ranked by their segments' coarse mass; 0: single "
               "segments", minimum=0),
    )  # fmt: skip
    if not variants:
        return (*shared, *pool, Option("merge", int, help="segments per merged token of the rest (0: one block)", minimum=0),
                Option("plain_layers", int, help="first layers that drop the rest (the others merge it)", minimum=0), bf16,
                coarse, *prefilter)  # fmt: skip
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
        *layer_options("segments"),
        coarse,
        *prefilter,
    )  # fmt: skip


def _grid_options() -> tuple[Option, ...]:
    return (
        Option("aspect", float, help="segments of sqrt(t) / aspect tokens", allowed=Range(0.0, 1024.0, integer=False)),
        Option("factor", float, help="segments shortlisted, x the most one head may attend (its split's width)",
               allowed=Range(0.0, 1024.0, integer=False)),
    )


for _entry in (
    MethodEntry(
        "radar+",
        "Radar with a sharper ranking: segments of sqrt(t)/8 tokens scored by their mean key, the best rescored "
        "exactly from their keys, plus 4 attention sinks (radar+adaptive without its split and rest); split, "
        "bf16_centroids, rest and first_layers make its variants",
        RadarPlusByLayer, _radar_plus_options(variants=True), category="fast", engines=ENGINES,
    ),
    MethodEntry(
        "radar+adaptive",
        "radar+ with the budget spent where attention is: heads' shares pooled by estimated mass on a 2x finer grid, "
        "the rest merged per 128 segments after layer 0; the recommended method in both engines",
        RadarPlusAdaptive, _radar_plus_options(variants=False), category="recommended", engines=ENGINES,
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
_POOLED = "radar+:split=pooled,aspect=16.0,bf16_centroids=true"  # POOLED_OPTIONS as a spec
for _old, _now in (
    ("radar+pooled", _POOLED),
    ("radar+merged", _POOLED + ",rest=merged,merge=16"),
    ("radar+pooled-layers", _POOLED + ",first_layers=1"),
    ("radar+merged-after", "radar+adaptive:bf16_centroids=true"),
):
    alias(_old, _now)
