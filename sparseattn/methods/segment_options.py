"""The registry options every segment-search preset shares (budget, top_k, sinks, window; a random-feature
summary's n_features and seed): declared once, so the presets' options read alike."""

from __future__ import annotations

from sparseattn.registry import Option, Range


def segment_options(top_k_none: str = "", window_none: str = "") -> tuple[Option, ...]:
    """The registry options every segment-search preset takes: ``budget``, ``top_k``, ``sinks``, ``window``
    (their defaults are the builder's; ``*_none`` says what a builder's None default stands for)."""
    return (
        Option("budget", int, help="past KV tokens a step may attend, sinks and window included (replaces top_k)"),
        Option("top_k", int, help="segments attended per step (not with budget)" + (f"; None: {top_k_none}" if top_k_none else "")),
        Option("sinks", int, help="first tokens always attended", minimum=0),
        Option("window", int, help="last tokens always attended" + (f"; None: {window_none}" if window_none else ""), minimum=0),
    )


#: What a None ``window`` stands for in the presets that derive it from the budget.
WINDOW_FROM_BUDGET = "min(1024, budget // 4), 1024 without a budget"


def feature_options() -> tuple[Option, ...]:
    """The registry options of a random-feature summary: ``n_features`` and ``seed``."""
    return (
        Option("n_features", int, help="random features per segment summary"),
        Option("seed", int, help="seed of the random draws", allowed=Range(0, 2**63 - 1)),
    )


def layer_options(what: str) -> tuple[Option, ...]:
    """The registry options of a per-layer budget (:class:`~sparseattn.methods.layers.FirstLayers`): ``first_layers``, ``layer_factor``."""
    return (
        Option("first_layers", int, help=f"first layers given more {what} (FirstLayers)", minimum=0),
        Option("layer_factor", float, help="their budget, x --budget (with first_layers; None: 4)", allowed=Range(1.0, 1024.0, integer=False, closed=True)),
    )
