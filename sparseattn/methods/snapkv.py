"""SnapKV: the prompt's end votes for the prompt tokens to keep (Li et al. 2024, "SnapKV: LLM Knows What
You are Looking for Before Generation")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparseattn.methods.base import LayerSpec, StatefulMethod
from sparseattn.validation import check_int
from sparseattn.methods.eviction import EvictingState, finite_evidence
from sparseattn.ops.slots import causal_probability_sums
from sparseattn.registry import MethodEntry, Option, register


@dataclass(frozen=True)
class SnapKV(StatefulMethod):
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
    hands_over_tokens: ClassVar[bool] = True

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

    def state_type(self) -> type:
        return SnapKVState


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


class SnapKVState(EvictingState):
    """Pinned slots (``field("pinned")``) hold the selected prompt tokens; the rest is the sliding window."""

    def __init__(self, method: SnapKV, layer: LayerSpec) -> None:
        super().__init__(method.budget, layer)
        self.method = method
        self._add_slot_field("pinned", torch.bool, False)
        self._votes: torch.Tensor | None = None
        self._prompt_open = False

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        block = isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[2] > 1
        super().append(keys, values)  # validates first: a refused block must not open a prompt
        if block:
            self._prompt_open = True

    def _record_block(self, grouped_query: torch.Tensor) -> None:
        w = min(self.method.observation_window, grouped_query.shape[3])
        votes = causal_probability_sums(grouped_query[:, :, :, -w:], self.keys, self.scale, self.softcap)
        self._votes = finite_evidence(votes)

    def _candidates(self) -> torch.Tensor:
        """Tokens before the observation window, which compete for the pinned slots."""
        return self.positions < self.seen - self.method.observation_window

    def _prefill_priority(self) -> torch.Tensor:
        candidate = self._candidates()
        if self._votes is None or self._votes.shape != candidate.shape:
            votes = torch.zeros(candidate.shape, dtype=torch.float64, device=self.device)
        else:
            order = self.positions.argsort(dim=-1)  # pool neighbours in the sequence, not in the slots
            pooled = pool_votes(
                self._votes.gather(-1, order), candidate.gather(-1, order), self.method.kernel_size, self.method.pooling
            )
            votes = torch.empty_like(pooled).scatter_(-1, order, pooled).double()
        return votes.masked_fill(~candidate, float("inf"))

    def _settle(self) -> None:
        super()._settle()
        self._votes = None
        if self._prompt_open:
            self.field("pinned").logical_or_(self._candidates())
            self._prompt_open = False

    def _eviction_priority(self, position: int) -> torch.Tensor:
        return self.positions.double().masked_fill(self.field("pinned"), float("inf"))


register(
    MethodEntry(
        "snapkv",
        "SnapKV: prompt tokens voted by the observation window (max-pooled) + sliding window (Li et al. 2024)",
        SnapKV,
        (
            Option("budget", int, 2048, "past KV tokens kept per KV head"),
            Option("observation_window", int, 32, "last prompt queries that vote"),
        ),
        origin=__name__,
    )
)
