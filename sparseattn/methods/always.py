"""Tokens that are always kept (and so always attended): sinks, a recent window, heavy hitters.

One reusable part for every method that protects tokens. An :class:`AlwaysKept` marks, among the
:class:`~sparseattn.methods.eviction.Candidates` a policy ranks, the tokens that must stay; parts
combine with ``|`` (the union), and :class:`Protected` puts any of them in front of any eviction
policy, so "the largest keys, plus 4 sinks" or "H2O's heavy hitters plus sinks" are one line::

    Protected(H2O(budget=512), Sinks(4))

The presets use them too: StreamingLLM protects :class:`Sinks`, H2O a :class:`RecentWindow` window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from sparseattn.methods.eviction import Candidates, Evicting, EvictionPolicy, Observation
from sparseattn.validation import check_int


@runtime_checkable
class AlwaysKept(Protocol):
    """A set of tokens that must stay: a boolean mask over the candidates a policy ranks."""

    observation: Observation | None  #: the attention record the part reads (None: it reads none)

    @property
    def size(self) -> int:
        """The most tokens it marks (what it costs of a budget)."""
        ...

    def mask(self, tokens: Candidates) -> torch.Tensor:
        """``[B, H_kv, n]`` bool: True for the candidates that must stay."""
        ...


class _Union:
    """``a | b``: parts combine into their union."""

    def __or__(self, other: AlwaysKept) -> AnyOf:
        if not isinstance(other, AlwaysKept) or isinstance(other, type):
            raise ValueError(f"an always-kept part combines with another part (Sinks, RecentWindow, HeavyHitters), got {other!r}")
        left = self.parts if isinstance(self, AnyOf) else (self,)
        right = other.parts if isinstance(other, AnyOf) else (other,)
        return AnyOf(left + right)


@dataclass(frozen=True)
class _Counted(_Union):
    """A part that keeps ``n`` tokens (its ``size``); ``n`` is checked once, named after the part."""

    n: int

    def __post_init__(self) -> None:
        check_int(type(self).__name__, "n", self.n, 0)

    @property
    def size(self) -> int:
        return self.n


@dataclass(frozen=True)
class Sinks(_Counted):
    """The first ``n`` tokens of the sequence (StreamingLLM's attention sinks)."""

    n: int = 4
    observation = None

    def mask(self, tokens: Candidates) -> torch.Tensor:
        return tokens.positions < self.n


@dataclass(frozen=True)
class RecentWindow(_Counted):
    """The ``n`` newest tokens seen, the newcomer included (a sliding window)."""

    n: int = 64
    observation = None

    def mask(self, tokens: Candidates) -> torch.Tensor:
        return tokens.positions > tokens.newest - self.n


@dataclass(frozen=True)
class HeavyHitters(_Counted):
    """The ``n`` candidates that received the most attention (H2O's heavy hitters), per KV head.

    Reads the engine's record of the prompt's and every decode step's attention; ties go to the newer token.
    """

    n: int = 64
    observation = Observation()

    def mask(self, tokens: Candidates) -> torch.Tensor:
        score = tokens.attention.double().nan_to_num(nan=float("-inf"))
        n = min(self.n, score.shape[-1])
        # Newest first, then a stable sort: equal scores keep the newer token, as the engines do.
        newest_first = tokens.positions.argsort(dim=-1, descending=True)
        ranked = score.gather(-1, newest_first).argsort(dim=-1, descending=True, stable=True)[..., :n]
        keep = torch.zeros_like(score, dtype=torch.bool)
        return keep.scatter_(-1, newest_first.gather(-1, ranked), True)


@dataclass(frozen=True)
class AnyOf(_Union):
    """The union of several parts (what ``a | b`` builds)."""

    parts: tuple[AlwaysKept, ...]

    def __post_init__(self) -> None:
        for part in self.parts:
            if not isinstance(part, AlwaysKept) or isinstance(part, type):
                raise ValueError(f"AnyOf.parts must be always-kept part instances, got {part!r}")

    @property
    def observation(self) -> Observation | None:
        return merge_observations(self, *(part.observation for part in self.parts))

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)

    def mask(self, tokens: Candidates) -> torch.Tensor:
        masks = [part.mask(tokens) for part in self.parts]
        return torch.stack(masks).any(dim=0) if masks else torch.zeros_like(tokens.positions, dtype=torch.bool)


def kept_tokens(part: AlwaysKept, tokens: Candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``part`` adds to a step that attends a selection: the at most ``part.size`` candidates it marks,
    as indices ``[B, H_kv, n]`` into ``tokens`` (``n = min(size, candidates)``, marked ones first) and
    ``[B, H_kv, 1, n]`` flags of those it marks (a row may mark fewer)."""
    marked = part.mask(tokens)  # [B, H, t]
    n = min(part.size, marked.shape[-1])
    index = marked.to(torch.int8).topk(n, dim=-1, sorted=False).indices
    return index, marked.gather(-1, index).unsqueeze(2)


def merge_observations(owner, *observations: Observation | None) -> Observation | None:
    """The one observation several parts share (None when none reads a record); differing ones are refused."""
    wanted = {obs for obs in observations if obs is not None}
    if len(wanted) > 1:
        raise ValueError(f"{owner!r}: its parts read different attention records {sorted(map(repr, wanted))}; one engine keeps one")
    return next(iter(wanted), None)


@dataclass(frozen=True)
class Protected(Evicting):
    """``policy``, with the tokens ``always`` marks never evicted: any eviction policy plus sinks, a window, heavy hitters.

    The protected tokens count against the policy's budget (the store still holds ``budget`` slots);
    a protected set as large as the budget leaves nothing to evict and is refused at the step that
    finds it.

    Example:
        >>> from sparseattn import StreamingLLM
        >>> method = Protected(StreamingLLM(budget=6, sinks=0), Sinks(1) | HeavyHitters(1))
        >>> state = method.new_state(batch=1, kv_heads=1, head_dim=4)
        >>> state.append(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
        >>> _ = state.attend_block(torch.randn(1, 1, 20, 4))
        >>> state.length, int((state.positions == 0).sum())
        (6, 1)
    """

    policy: EvictionPolicy
    always: AlwaysKept

    def __post_init__(self) -> None:
        if not isinstance(self.policy, EvictionPolicy) or isinstance(self.policy, type):
            raise ValueError(f"Protected.policy must be an eviction policy instance (e.g. H2O(), StreamingLLM()), got {self.policy!r}")
        if not isinstance(self.always, AlwaysKept) or isinstance(self.always, type):
            raise ValueError(f"Protected.always must be an always-kept part (Sinks, RecentWindow, HeavyHitters, a | b), got {self.always!r}")
        merge_observations(self, self.policy.observation, self.always.observation)

    @property
    def budget(self) -> int:
        return self.policy.budget

    @property
    def observation(self) -> Observation | None:
        return merge_observations(self, self.policy.observation, self.always.observation)

    def priority(self, tokens: Candidates) -> torch.Tensor:
        return self.policy.priority(tokens).double().masked_fill(self.always.mask(tokens), float("inf"))
