"""Composition beyond the paper: evict the prompt with one method, then decode with another."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sparseattn.methods.base import DecodeState, KVState, LayerSpec, SparseMethod, StatefulMethod, StepInfo, observe_block
from sparseattn.methods.eviction import EvictionPolicy


@dataclass(frozen=True)
class PrefillEviction(StatefulMethod):
    """Compress the prompt with ``prefill`` (an evicting method), then decode with ``decode``.

    The prompt is attended densely and evicted by ``prefill`` (e.g. :class:`SnapKV` keeps the prompt
    tokens its end attends to most); at the first decode step the tokens it kept, the same number per
    KV head and in their original order, become the prompt of a fresh ``decode`` state (e.g. Radar's
    segment search), which then appends the new tokens. The two budgets are separate:
    ``prefill.budget`` bounds the compressed prompt, ``decode``'s budget bounds every decode step.

    Args:
        prefill: an :class:`~sparseattn.methods.eviction.EvictionPolicy` that evicts the prompt
            (:class:`StreamingLLM`, :class:`H2O`, :class:`SnapKV`, or one of your own).
        decode: any sparse method.

    Example:
        >>> from sparseattn import Radar, SnapKV
        >>> method = PrefillEviction(prefill=SnapKV(budget=40, observation_window=8), decode=Radar(top_k=2, n_features=16))
        >>> state = method.new_state(batch=1, kv_heads=2, head_dim=8)
        >>> state.append(torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8))
        >>> _ = state.attend_block(torch.randn(1, 4, 100, 8))
        >>> _, info = state.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
        >>> state.length, state.seen
        (41, 101)
    """

    prefill: SparseMethod
    decode: SparseMethod

    def __post_init__(self) -> None:
        if isinstance(self.prefill, type) or not isinstance(self.prefill, EvictionPolicy):
            raise ValueError(
                "PrefillEviction.prefill must be an eviction policy instance, whose engine hands over the tokens it "
                f"keeps (StreamingLLM, H2O, SnapKV or your own EvictionPolicy), got {self.prefill!r}"
            )
        if isinstance(self.decode, type) or not hasattr(self.decode, "new_state"):
            raise ValueError(f"PrefillEviction.decode must be a sparse method instance, got {self.decode!r}")

    def state_type(self) -> type:
        return PrefillEvictionState


class PrefillEvictionState:
    """The ``prefill`` method's state until the first decode token, then the ``decode`` method's.

    ``seen`` counts every token; ``length`` the tokens the active state stores.
    """

    def __init__(self, method: PrefillEviction, layer: LayerSpec) -> None:
        self.method = method
        self.layer = layer
        self.prefill_state = method.prefill.new_state(layer)
        self.decode_state: DecodeState | None = None
        self.seen = 0
        # Inputs are checked against the layer before the hand-over (which mutates), by a storage-less
        # KVState of the same layer: the inner states are reached only through DecodeState.
        self._inputs = KVState(layer)

    @property
    def active(self):
        return self.prefill_state if self.decode_state is None else self.decode_state

    # What every decode state reports, read from the active one.
    batch = property(lambda self: self.active.batch)
    length = property(lambda self: self.active.length)
    keys = property(lambda self: self.active.keys)
    values = property(lambda self: self.active.values)

    def nbytes(self) -> dict[str, int]:
        return self.active.nbytes()

    def select_batch(self, index: torch.Tensor) -> None:
        self.active.select_batch(index)

    def _hand_over(self) -> None:
        """The prefill method's kept tokens become the decode method's prompt."""
        state = self.method.decode.new_state(replace(self.layer, batch=self.prefill_state.batch))
        if self.prefill_state.length:
            keys, values, _ = self.prefill_state.kept_tokens()
            state.append(keys, values)
        self.decode_state = state
        self.prefill_state = None

    def _checker(self) -> KVState:
        self._inputs.batch = self.active.batch  # beam search may have changed it
        return self._inputs

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A block goes to the prefill method; the first single token hands over to the decode method."""
        self._checker()._check_kv(keys, values)
        if self.decode_state is None and keys.shape[2] == 1:
            self._hand_over()
        self.active.append(keys, values)
        self.seen += keys.shape[2]

    prefill = append

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        return self.active.attend_block(query)

    def observe_block(self, query: torch.Tensor) -> None:
        observe_block(self.active, query)

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        if self.decode_state is None:
            self._checker()._check_query_tensor(query)  # a refused query must not trigger the hand-over
            if self.prefill_state.length == 0:
                raise ValueError("attend() called on an empty state: append keys and values first")
            self._hand_over()
        return self.decode_state.attend(query)

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Append one token and attend; a malformed input raises ValueError before the hand-over or any append."""
        self._checker()._check_step(query, key, value)
        self.append(key.unsqueeze(2), value.unsqueeze(2))
        return self.attend(query)
