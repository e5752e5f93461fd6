"""The serving benchmark's runs: which engine and method each row of the comparison is, and what it measured.

Every comparison has stock vLLM first (the reference every ratio divides by), optionally stock in
float32, then the plugin's dense path and each sparse method, all four kinds on the distinct prompts
and, optionally, on the shared-prefix ones (:mod:`sparseattn.evaluation.serving_workload`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparseattn.evaluation.vllm_engine import Forced

#: Run labels every comparison has.
STOCK, STOCK_F32, DENSE = "stock", "stock float32", "dense"
#: Workloads: distinct prompts (the comparison), and one shared prompt (a labelled extra).
DISTINCT, SHARED = "distinct", "shared"


@dataclass(frozen=True)
class Run:
    """One row of the comparison: the engine it runs in and, for the plugin engine, the method it switches to."""

    label: str
    engine: str  #: ``stock``, ``stock float32`` or ``plugin``
    method: Mapping[str, Any] | None = None  #: ``additional_config["sparseattn"]`` (plugin runs)
    attended: int | None = None  #: past KV tokens a step attends (None: every token)


def plan_runs(methods: Mapping[str, Mapping[str, Any]], *, float32: bool = False) -> list[Run]:
    """Stock, optionally stock float32, the plugin's dense path, then each sparse method (label -> plugin config).

    >>> [r.label for r in plan_runs({"radar+ (1024)": {"method": "radar+", "budget": 1024}}, float32=True)]
    ['stock', 'stock float32', 'dense', 'radar+ (1024)']
    """
    runs = [Run(STOCK, STOCK)] + ([Run(STOCK_F32, STOCK_F32)] if float32 else [])
    runs.append(Run(DENSE, "plugin", {"method": "dense"}))
    for label, config in methods.items():
        budget = config.get("budget")
        runs.append(Run(label, "plugin", dict(config), int(budget) if budget is not None else None))
    return runs


@dataclass
class Measured:
    """What one run gave on one workload."""

    tok_s: list[float] = field(default_factory=list)
    ms_step: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None  #: greedy tokens of the first measurement
    forced: Forced | None = None
    answers: list[str] | None = None
    passkey: float | None = None
    fallback_steps: int = 0
    #: where a step's time went (plugin runs, with ``profile``): :func:`sparseattn.evaluation.serving_profile.step_profile`
    profile: dict[str, Any] | None = None
