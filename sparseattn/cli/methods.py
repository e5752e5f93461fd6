"""The one place where command-line method names become method instances.

The library itself has no string registry: a method is an instance whose ``repr`` describes the run.
This table only serves the CLI (``--method NAME`` plus shared options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sparseattn.methods import Dense, Radar, SparseMethod


@dataclass(frozen=True)
class MethodOptions:
    """The CLI's shared method options; each method reads the ones it has."""

    top_k: int | None = None
    n_features: int = 2048
    sinks: int = 0
    window: int = 0
    seed: int = 0


@dataclass(frozen=True)
class MethodSpec:
    """A named method: a one-line description, the options it reads, and how to build it."""

    name: str
    description: str
    options: tuple[str, ...]
    build: Callable[[MethodOptions], SparseMethod]


def _radar(o: MethodOptions) -> SparseMethod:
    return Radar(top_k=64 if o.top_k is None else o.top_k, n_features=o.n_features, sinks=o.sinks, window=o.window, seed=o.seed)


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("dense", "vanilla attention over every past token", (), lambda o: Dense()),
        MethodSpec(
            "radar",
            "Radar: random-feature segment search, top-k segments + buffer, sqrt(t) restructuring (Hao et al. 2025)",
            ("top_k", "n_features", "sinks", "window", "seed"),
            _radar,
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
