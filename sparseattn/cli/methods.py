"""The one place where command-line method names become method instances.

The library itself has no string registry: a method is an instance whose ``repr`` describes the run.
This table only serves the CLI (``--method NAME`` plus shared options).

One meaning of ``--budget`` for every method: the past KV tokens a decode step may attend (sinks and
recent window included). The Radar family turns it into top-k segments (``SegmentSearch.budget``);
the evicting methods keep that many tokens per KV head. Without ``--budget`` each method runs at its
paper's default (Radar family: ``--top-k`` segments).

The CLI refuses what a method would silently ignore: an option the method does not take, a value
out of its range, and ``--top-k`` together with ``--budget`` (the budget decides the segments
attended, so the ``--top-k`` would be dropped); see :func:`check_method_options`.
:func:`build_method` itself stays lenient, as library code may pass one set of options to every method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from sparseattn.methods.presets import RadarAlg1


@dataclass(frozen=True)
class MethodOptions:
    """The CLI's shared method options; each method reads the ones it has (None: the method's default)."""

    top_k: int | None = None
    n_features: int | None = None
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
    # Only what was given: Radar's own defaults are the authors' (1 sink, a window tied to the budget).
    given = _given(top_k=o.top_k, n_features=o.n_features, sinks=o.sinks, window=o.window, budget=o.budget)
    return Radar(**given, seed=o.seed)


def _radar_alg1(o: MethodOptions) -> SparseMethod:
    given = _given(top_k=o.top_k, n_features=o.n_features, sinks=o.sinks, window=o.window, budget=o.budget)
    return RadarAlg1(**given, seed=o.seed)


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
            "Radar as its authors ran it: random-feature segment search over segments of sqrt(t)/4 tokens, top-k "
            "segments + 1 sink + a recent window (Hao et al. 2025)",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            _radar,
        ),
        MethodSpec(
            "radar-alg1",
            "Radar as the paper's Algorithm 1 writes it: segments of sqrt(t) tokens rebuilt at every perfect square, "
            "top-k segments + the buffer",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            _radar_alg1,
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
            "subgen-guarded",
            "SubGen with its normaliser floored by the value samples' own estimate: outputs stay within the values' range",
            ("budget", "window", "sinks", "seed"),
            lambda o: SubGen(**_given(budget=o.budget, window=o.window, sinks=o.sinks), seed=o.seed, guard=True),
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
            lambda o: RadarLowest(**_given(n_features=o.n_features), seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "radar-recent",
            "Radar ablation: the most recent segments (a longer sliding window)",
            _SEGMENT_OPTIONS,
            lambda o: RadarRecent(**_segments(o)),
        ),
        MethodSpec(
            "radar+",
            "Radar with a sharper ranking: segments of sqrt(t)/8 tokens scored by their mean key, the best rescored "
            "exactly from their keys, plus 4 attention sinks",
            _SEGMENT_OPTIONS,
            lambda o: RadarPlus(**{**_segments(o), "top_k": o.top_k, "sinks": 4 if o.sinks is None else o.sinks}),
        ),
        MethodSpec(
            "radar-centered",
            "Radar with random features of segment-centred keys, the centroid scored exactly",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            lambda o: RadarCentered(**_given(n_features=o.n_features), seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "radar-rerank",
            "Radar's random features (n = 256 unless --n-features) shortlist, exact segment mass reranks",
            (*_SEGMENT_OPTIONS, "n_features", "seed"),
            lambda o: RadarRerank(**_given(n_features=o.n_features), seed=o.seed, **_segments(o)),
        ),
        MethodSpec(
            "snapkv+radar",
            "SnapKV compresses the prompt (to --prefill-budget, default 4 x budget), then Radar searches it + new tokens",
            (*_SEGMENT_OPTIONS, "prefill_budget", "observation_window", "n_features", "seed"),
            _snapkv_radar,
        ),
    )
}


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: integers in ``[low, high]``, or floats in ``(low, high)``."""

    low: float
    high: float
    integer: bool = True

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer:
            return isinstance(value, int) and self.low <= value <= self.high
        return self.low < value < self.high  # False for NaN

    def __str__(self) -> str:
        return f"an integer in [{self.low}, {self.high}]" if self.integer else f"a number in ({self.low:g}, {self.high:g})"


#: Counts larger than this are no real run's and overflow torch's 64-bit sizes on the way (a budget
#: of 1e23 died with "Overflow when unpacking long long"); 2**31 - 1 leaves that far behind.
MAX_COUNT = 2**31 - 1

#: The range of every numeric option of :class:`MethodOptions`.
OPTION_RANGES: dict[str, Range] = {
    "top_k": Range(1, MAX_COUNT),
    "n_features": Range(1, MAX_COUNT),
    "sinks": Range(0, MAX_COUNT),
    "window": Range(0, MAX_COUNT),
    "seed": Range(0, 2**63 - 1),
    "budget": Range(1, MAX_COUNT),
    "heavy_ratio": Range(0.0, 1.0, integer=False),
    "observation_window": Range(1, MAX_COUNT),
    "page_size": Range(1, MAX_COUNT),
    "prefill_budget": Range(1, MAX_COUNT),
}


def flag(key: str) -> str:
    """How a :class:`MethodOptions` field is spelled as a command-line flag: ``top_k`` -> ``--top-k``."""
    return "--" + key.replace("_", "-")


def range_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` for the option ``key`` (its value and allowed range), None if nothing."""
    allowed = OPTION_RANGES[key]
    return None if value in allowed else f"{value!r} is out of range; allowed: {allowed}"


class OptionError(ValueError):
    """Method options the CLI refuses; ``options`` names the fields at fault."""

    def __init__(self, message: str, options: tuple[str, ...]) -> None:
        super().__init__(message)
        self.options = options


def check_method_options(name: str, given: Mapping[str, object], spell: Callable[[str], str] = flag) -> None:
    """Refuse what ``name`` would silently ignore or misread in the options the user gave.

    ``given`` holds only the options the user set; ``spell`` names an option as the user wrote it
    (``--top-k`` on the command line, ``top_k`` inside ``-m radar:top_k=8``). Raises a ValueError
    for an unknown method, an :class:`OptionError` for an option the method does not take, a value
    out of range, or ``top_k`` together with ``budget``.
    """
    try:
        spec = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}") from None
    unused = tuple(key for key in given if key not in spec.options)
    if unused:
        takes = ", ".join(spell(o) for o in spec.options) if spec.options else "no options"
        raise OptionError(f"{name} does not take {', '.join(spell(k) for k in unused)}; it takes {takes}", unused)
    for key, value in given.items():
        problem = range_problem(key, value)
        if problem:
            raise OptionError(f"{spell(key)} {problem}", (key,))
    if "budget" in given and "top_k" in given:
        raise OptionError(
            f"give {spell('budget')} or {spell('top_k')}, not both: {name} turns the budget into the segments it "
            f"attends, so {spell('top_k')} would be ignored",
            ("budget", "top_k"),
        )


def build_method(name: str, options: MethodOptions) -> SparseMethod:
    """The method called ``name`` with ``options``; a ValueError lists the known names otherwise."""
    try:
        spec = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}") from None
    return spec.build(options)
