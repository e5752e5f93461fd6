"""The one place where command-line method names become method instances.

The library itself has no string registry: a method is an instance whose ``repr`` describes the run.
This table only serves the CLI (``--method NAME`` plus shared options).

One meaning of ``--budget`` for every method: the past KV tokens a decode step may attend (sinks and
recent window included). The Radar family turns it into top-k segments (``SegmentSearch.budget``);
the evicting methods keep that many tokens per KV head. Without ``--budget`` each method runs at its
paper's default (Radar family: ``--top-k`` segments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparseattn.methods import (
    H2O,
    Dense,
    PrefillEviction,
    Quest,
    Radar,
    RadarCentered,
    RadarExact,
    RadarLowest,
    RadarPlus,
    RadarRandom,
    RadarRecent,
    RadarRerank,
    SnapKV,
    SparseMethod,
    StreamingLLM,
    SubGen,
)


@dataclass(frozen=True)
class MethodOptions:
    """The CLI's shared method options; each method reads the ones it has (None: the method's default)."""

    top_k: int | None = None
    n_features: int = 2048
    sinks: int | None = None
    window: int | None = None
    seed: int = 0
    budget: int | None = None
    heavy_ratio: float | None = None
    observation_window: int | None = None
    page_size: int | None = None
    prefill_budget: int | None = None


@dataclass(frozen=True)
class MethodSpec:
    """A named method: a one-line description, the options it reads, and how to build it."""

    name: str
    description: str
    options: tuple[str, ...]
    build: Callable[[MethodOptions], SparseMethod]


def _given(**kwargs) -> dict:
    """The options the user gave (None means: keep the method's own default)."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _segments(o: MethodOptions, **extra) -> dict:
    """Options shared by the segment-search presets."""
    top_k = 64 if o.top_k is None else o.top_k
    return {"top_k": top_k, "sinks": o.sinks or 0, "window": o.window or 0, "budget": o.budget, **extra}


def _radar(o: MethodOptions) -> SparseMethod:
    return Radar(n_features=o.n_features, seed=o.seed, **_segments(o))


def _quest(o: MethodOptions) -> SparseMethod:
    return Quest(**_segments(o), **_given(page_size=o.page_size))


def _snapkv(o: MethodOptions, budget: int | None) -> SnapKV:
    return SnapKV(**_given(budget=budget, observation_window=o.observation_window))


def _snapkv_radar(o: MethodOptions) -> SparseMethod:
    prompt = o.prefill_budget if o.prefill_budget is not None else None if o.budget is None else 4 * o.budget
    return PrefillEviction(prefill=_snapkv(o, prompt), decode=_radar(o))


_SEGMENT_OPTIONS = ("budget", "top_k", "sinks", "window")

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("dense", "vanilla attention over every past token", (), lambda o: Dense()),
        MethodSpec(
            "radar",
            "Radar: random-feature segment search, top-k segments + buffer, sqrt(t) restructuring (Hao et al. 2025)",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            _radar,
        ),
        MethodSpec(
            "streamingllm",
            "StreamingLLM: attention sinks (default 4) + sliding window, budget = sinks + window (Xiao et al. 2023)",
            ("budget", "sinks"),
            lambda o: StreamingLLM(**_given(budget=o.budget, sinks=o.sinks)),
        ),
        MethodSpec(
            "h2o",
            "H2O: heavy hitters by accumulated attention + recent tokens, evicting per KV head (Zhang et al. 2023)",
            ("budget", "heavy_ratio"),
            lambda o: H2O(**_given(budget=o.budget, heavy_ratio=o.heavy_ratio)),
        ),
        MethodSpec(
            "snapkv",
            "SnapKV: prompt tokens voted by the observation window (max-pooled) + sliding window (Li et al. 2024)",
            ("budget", "observation_window"),
            lambda o: _snapkv(o, o.budget),
        ),
        MethodSpec(
            "subgen",
            "SubGen: recent window exact, older keys clustered online with samples, l2-sampled values (Zandieh et al. 2024)",
            ("budget", "window", "sinks", "seed"),
            lambda o: SubGen(**_given(budget=o.budget, window=o.window, sinks=o.sinks), seed=o.seed),
        ),
        MethodSpec(
            "quest",
            "Quest: pages of 16 tokens, top pages by the min/max key upper bound of q.k (Tang et al. 2024)",
            (*_SEGMENT_OPTIONS, "page_size"),
            _quest,
        ),
        MethodSpec(
            "radar-exact",
            "Radar ablation: segments ranked by their exact attention mass (the O(t) oracle)",
            _SEGMENT_OPTIONS,
            lambda o: RadarExact(**_segments(o)),
        ),
        MethodSpec(
            "radar-random",
            "Radar ablation: segments chosen uniformly at random",
            (*_SEGMENT_OPTIONS, "seed"),
            lambda o: RadarRandom(**_segments(o), seed=o.seed),
        ),
        MethodSpec(
            "radar-lowest",
            "Radar ablation: the segments with the lowest estimated scores",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            lambda o: RadarLowest(n_features=o.n_features, seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "radar-recent",
            "Radar ablation: the most recent segments (a longer sliding window)",
            _SEGMENT_OPTIONS,
            lambda o: RadarRecent(**_segments(o)),
        ),
        MethodSpec(
            "radar+",
            "Radar with segments of sqrt(t)/8 tokens, a centroid shortlist reranked by exact segment mass, 4 sinks (issue 7)",
            _SEGMENT_OPTIONS,
            lambda o: RadarPlus(**{**_segments(o), "top_k": o.top_k, "sinks": 4 if o.sinks is None else o.sinks}),
        ),
        MethodSpec(
            "radar-centered",
            "Radar with random features of segment-centred keys, the centroid scored exactly",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            lambda o: RadarCentered(n_features=o.n_features, seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "radar-rerank",
            "Radar's random features (n = 256 unless --n-features) shortlist, exact segment mass reranks",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            lambda o: RadarRerank(n_features=o.n_features if o.n_features != 2048 else 256, seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "snapkv+radar",
            "SnapKV compresses the prompt (to --prefill-budget, default 4 x budget), then Radar searches it + new tokens",
            (*_SEGMENT_OPTIONS, "prefill_budget", "observation_window", "n_features", "seed"),
            _snapkv_radar,
        ),
    )
}


def build_method(name: str, options: MethodOptions) -> SparseMethod:
    """The method called ``name`` with ``options``; a ValueError lists the known names otherwise."""
    try:
        spec = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}") from None
    return spec.build(options)
