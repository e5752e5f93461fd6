"""SnapKV: the prompt's end votes for the prompt tokens to keep (Li et al. 2024, "SnapKV: LLM Knows What
You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F

from sparseattn.validation import check_int
from sparseattn.methods.eviction import Candidates, Evicting, Observation
from sparseattn.registry import MethodEntry, Option, register


@dataclass(frozen=True)
class SnapKV(Evicting):
    """Compress the prompt to the tokens its last queries attend to most, then decode in a sliding window.

    After the prompt has been attended (densely), the queries of its last ``observation_window``
    tokens vote: each earlier token's votes are the attention it receives from them, summed over those
    queries (and over the query heads of a KV group: selection is per KV head, as the storage is),
    then smoothed by 1-D pooling with ``kernel_size`` so neighbours of a hit are kept too. The top
    ``budget - observation_window`` are kept (pinned) with the window itself. Decoding appends new
    tokens to the window; the oldest unpinned token leaves it (the sliding window of the Radar paper's
    LongBench protocol, "32 + n_c" tokens).

    Budget rule: ``budget = n_c + observation_window``: pinned prompt tokens plus the sliding window;
    a decode step attends ``min(t, budget)`` tokens. A prompt of at most ``budget`` tokens is kept whole.
    Without :meth:`attend_block` (a prompt appended with ``prefill`` and no queries) there are no votes
    and the most recent ``budget`` tokens are kept.

    Args:
        budget: tokens kept and attended per step (the paper's ``max_capacity_prompt``).
        observation_window: the prompt's last queries that vote; also the sliding window's minimum length.
        kernel_size: odd width of the pooling that smooths the votes (1: no smoothing).
        pooling: ``"max"`` (the paper's listing) or ``"avg"`` (the reference code's default).
    """

    budget: int = 2048
    observation_window: int = 32
    kernel_size: int = 5
    pooling: str = "max"

    def __post_init__(self) -> None:
        check_int("SnapKV", "observation_window", self.observation_window, 1)
        floor = self.observation_window + 1
        why = f"the minimum is observation_window + 1 = {floor}: the window plus one pinned prompt token"
        check_int("SnapKV", "budget", self.budget, floor, why)
        check_int("SnapKV", "kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKV.kernel_size must be odd (the pooling keeps the length), got {self.kernel_size}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"SnapKV.pooling must be 'max' or 'avg', got {self.pooling!r}")

    @property
    def observation(self) -> Observation:
        """The votes: attention from the last ``observation_window`` queries of the latest prompt block only."""
        return Observation(prompt_queries=self.observation_window, decode=False, per_prompt=True)

    def priority(self, tokens: Candidates) -> torch.Tensor:
        """After a prompt: the pooled votes of the tokens before the window (the window stays). At a decode
        step: the newer the better, the prompt's survivors (before its window) pinned."""
        if tokens.decode:
            pinned = tokens.positions < tokens.prompt_length - self.observation_window
            return tokens.positions.double().masked_fill(pinned, float("inf"))
        before_window = tokens.positions < tokens.seen - self.observation_window
        order = tokens.positions.argsort(dim=-1)  # pool neighbours in the sequence, not in the slots
        pooled = pool_votes(
            tokens.attention.gather(-1, order), before_window.gather(-1, order), self.kernel_size, self.pooling
        )
        votes = torch.empty_like(pooled).scatter_(-1, order, pooled).double()
        return votes.masked_fill(~before_window, float("inf"))


def pool_votes(votes: torch.Tensor, candidate: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Smooth ``votes: [B, H, L]`` (in position order) over the ``candidate`` tokens only.

    Non-candidates count as padding: ``-inf`` for max pooling, 0 for average pooling (like the zero
    padding of ``avg_pool1d``), so the observation window never lends its votes to its neighbours.
    """
    B, H, L = votes.shape
    pad = kernel_size // 2
    if pooling == "max":
        x = votes.masked_fill(~candidate, float("-inf")).reshape(B * H, 1, L)
        return F.max_pool1d(x, kernel_size, stride=1, padding=pad).reshape(B, H, L)
    x = votes.masked_fill(~candidate, 0.0).reshape(B * H, 1, L)
    return F.avg_pool1d(x, kernel_size, stride=1, padding=pad).reshape(B, H, L)


_OPTIONS = (Option("budget", int, help="past KV tokens kept per KV head"), Option("observation_window", int, help="last prompt queries that vote"))
_DESCRIPTION = "SnapKV: prompt tokens voted by the observation window (max-pooled) + sliding window (Li et al. 2024)"
register(MethodEntry("snapkv", _DESCRIPTION, SnapKV, _OPTIONS, origin=__name__, category="baseline"))
