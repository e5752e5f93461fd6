"""StreamingLLM: attention sinks plus a sliding window (Xiao et al. 2023, "Efficient Streaming Language
Models with Attention Sinks")."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
import torch

from sparseattn.validation import check_int
from sparseattn.methods.always import Sinks
from sparseattn.methods.eviction import Candidates, Evicting
from sparseattn.registry import MethodEntry, Option, register


@dataclass(frozen=True)
class StreamingLLM(Evicting):
    """Keep the first ``sinks`` tokens and the last ``budget - sinks``; evict everything in between.

    Budget rule: a decode step attends ``min(t, budget)`` tokens, ``sinks`` of them the attention
    sinks and the rest the most recent tokens (the new one included). Evicts physically: the cache
    holds ``budget`` slots per KV head. Positions are those of the original sequence (keys are stored
    after RoPE), which the paper's "positions within the cache" variant would re-encode instead.

    Args:
        budget: tokens kept and attended per step (sinks + window).
        sinks: first tokens always kept (the paper uses 4).

    Example:
        >>> state = StreamingLLM(budget=6, sinks=2).new_state(batch=1, kv_heads=1, head_dim=4)
        >>> state.prefill(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
        >>> _, info = state.step(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))
        >>> info.position_mask(21)[0, 0].nonzero().flatten().tolist()
        [0, 1, 17, 18, 19, 20]
    """

    budget: int = 1024
    sinks: int = 4

    def __post_init__(self) -> None:
        check_int("StreamingLLM", "sinks", self.sinks, 0)
        why = f"the minimum is sinks + 1 = {self.sinks + 1}: the sinks plus the newest token"
        check_int("StreamingLLM", "budget", self.budget, self.sinks + 1, why)

    #: Recent tokens kept: ``budget - sinks``.
    window = property(lambda self: self.budget - self.sinks)

    def priority(self, tokens: Candidates) -> torch.Tensor:
        """The newer the better; the sinks never leave."""
        return tokens.positions.double().masked_fill(self.protected.mask(tokens), float("inf"))

    #: The always-kept part: the first ``sinks`` tokens (built once: priority runs every step).
    protected = cached_property(lambda self: Sinks(self.sinks))


_OPTIONS = (Option("budget", int, help="past KV tokens kept per KV head, sinks included"), Option("sinks", int, help="first tokens always kept", minimum=0))
_DESCRIPTION = "StreamingLLM: attention sinks (default 4) + sliding window, budget = sinks + window (Xiao et al. 2023)"
register(MethodEntry("streamingllm", _DESCRIPTION, StreamingLLM, _OPTIONS, origin=__name__, category="baseline", engines=("transformers", "vllm")))
