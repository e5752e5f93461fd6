"""H2O, the heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models")."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from sparseattn.validation import check_int, check_number
from sparseattn.methods.always import RecentWindow
from sparseattn.methods.eviction import Candidates, Evicting, Observation
from sparseattn.registry import MethodEntry, Option, register


@dataclass(frozen=True)
class H2O(Evicting):
    """Keep, per KV head, the tokens with the largest accumulated attention plus the most recent ones.

    Each stored token accumulates the attention it receives: during prefill the column sums of the
    prompt's causal attention matrix, then the weights of every decode query. The prompt is evicted
    once it has been attended (densely) and, at every decode step, the new token overwrites the
    non-recent token with the lowest accumulated score (the paper's greedy eviction). Under
    grouped-query attention a KV head accumulates the attention of its whole group of query heads,
    since the storage, and so the eviction, is per KV head.

    Budget rule: ``budget = heavy + recent`` with ``heavy = floor(budget * heavy_ratio)``; a decode
    step attends ``min(t, budget)`` tokens. ``heavy_ratio = 0.5`` is the paper's even split.

    Args:
        budget: tokens kept and attended per step.
        heavy_ratio: the share of the budget given to heavy hitters, in ``[0, 1)``; the rest (at least
            one token, the newest) is the recent window.
    """

    budget: int = 1024
    heavy_ratio: float = 0.5
    observation = Observation(prompt_queries=None, decode=True)  # every query's attention, accumulated

    def __post_init__(self) -> None:
        check_int("H2O", "budget", self.budget, 1)
        check_number("H2O", "heavy_ratio", self.heavy_ratio, "a number in [0, 1)", lambda r: 0.0 <= r < 1.0)

    @property
    def heavy(self) -> int:
        """Heavy-hitter slots: ``floor(budget * heavy_ratio)``, leaving at least one recent slot."""
        return min(self.budget - 1, int(self.budget * self.heavy_ratio))

    #: Most recent tokens always kept: ``budget - heavy``.
    recent = property(lambda self: self.budget - self.heavy)

    def priority(self, tokens: Candidates) -> torch.Tensor:
        """Accumulated attention; the ``recent`` newest tokens (the newcomer included) never leave."""
        return tokens.attention.double().masked_fill(self.protected.mask(tokens), float("inf"))

    #: The always-kept part: the ``recent`` newest tokens (built once: priority runs every step).
    protected = cached_property(lambda self: RecentWindow(self.recent))


_OPTIONS = (Option("budget", int, help="past KV tokens kept per KV head"), Option("heavy_ratio", float, help="share of the budget for heavy hitters"))
_DESCRIPTION = "H2O: heavy hitters by accumulated attention + recent tokens, evicting per KV head (Zhang et al. 2023)"
register(MethodEntry("h2o", _DESCRIPTION, H2O, _OPTIONS, origin=__name__, category="baseline"))
