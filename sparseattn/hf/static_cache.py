"""A transformers ``Cache`` of fixed shapes: what a captured or compiled decode loop steps through.

:class:`StaticSparseCache` takes a prefilled :class:`~sparseattn.hf.cache.SparseCache` over: each layer's
decode state keeps its storage and structure, reserved for ``capacity`` tokens, and decodes through its
fixed-shape step (:mod:`sparseattn.methods.static_step`). The position of the next token is one device
tensor shared by every layer (the loop advances it; the model's ``position_ids`` are a view of it). Between
phases (a schedule's seal or rebuild) the host calls :meth:`StaticSparseCache.begin`, outside any graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from sparseattn.hf.cache import KeysHandOver, RowwiseState, SparseCache, SparseLayer
from sparseattn.methods.static_step import StaticDenseStep, StaticSegmentStep, static_step


class StaticSparseLayer(KeysHandOver, CacheLayerMixin):
    """One layer of a :class:`StaticSparseCache`: ``update`` hands the new token to the attention function,
    which stores and attends it in one fixed-shape step (:meth:`attend`)."""

    is_compileable = True
    is_sliding = False
    cache_name = "StaticSparseCache"

    def __init__(self, step: StaticSegmentStep | StaticDenseStep, position: torch.Tensor, layer_idx: int) -> None:
        super().__init__()
        self.step = step
        self.position = position
        self.layer_idx = layer_idx
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None
        self._returned = None  # on the instance from the start: a compiled step's guards see one dict shape
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # made from a prefilled state: nothing to allocate

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the new token ``[B, H_kv, 1, D]``; it is stored by the step that attends it."""
        if key_states.shape[2] != 1:
            raise ValueError(
                f"layer {self.layer_idx} of a StaticSparseCache decodes one token a step, got a block of {key_states.shape[2]}; "
                "prefill through a SparseCache and hand it to StaticSparseCache"
            )
        self._check_claimed()
        self._new = (key_states[:, :, 0], value_states[:, :, 0])
        self._returned = key_states
        return key_states, value_states

    def attend(self, query: torch.Tensor) -> torch.Tensor:
        """``query: [B, H_q, 1, D]`` -> ``[B, 1, H_q, D]`` (transformers' layout), the new token stored at the position."""
        key, value = self._new
        self._new = None
        return self.step.step(query[:, :, 0], key, value, self.position).unsqueeze(1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.capacity, 0

    def get_seq_length(self) -> int:
        return self.step.state.length  # the host's count, as of the latest phase (the loop passes positions itself)

    def get_max_length(self) -> int:
        return self.step.capacity


class StaticSparseCache(Cache):
    """A prefilled :class:`SparseCache` in fixed shapes, reserved for ``capacity`` tokens.

    Every layer must be a :class:`SparseLayer` whose state is unpadded (one state for the batch: rows of one
    length) and has a fixed-shape step (:func:`~sparseattn.methods.static_step.static_refusal`).
    """

    def __init__(self, cache: SparseCache, capacity: int) -> None:
        layers = []
        position = None
        for idx, layer in enumerate(cache.layers):
            if not isinstance(layer, SparseLayer) or layer.state is None:
                raise ValueError(f"StaticSparseCache: layer {idx} is {type(layer).__name__} without a prefilled sparse state")
            if isinstance(layer.state, RowwiseState):
                raise ValueError("StaticSparseCache: the batch was left-padded (rows of different lengths); the fixed-shape loop needs rows of one length")
            if position is None:
                position = torch.tensor([layer.state.length], dtype=torch.long, device=layer.state.device)
            layers.append(StaticSparseLayer(static_step(layer.state, capacity), position, idx))
        if position is None:
            raise ValueError("StaticSparseCache: the SparseCache holds no layer (run the prompt through it first)")
        super().__init__(layers=layers)
        self.position = position  #: int64 [1]: where the next token goes, on the device
        self.capacity = capacity
        self.attended_sum = 0.0  #: tokens attended per query head, summed over layers and steps begun
        self.steps_begun = 0

    @property
    def static_layers(self) -> list[StaticSparseLayer]:
        return list(self.layers)

    def begin(self, first: int, last: int) -> int:
        """Host side: the phase that starts at length ``first`` (the new token's own included), common to every
        layer (the shortest of theirs), at most up to length ``last``; returns its steps."""
        steps = [layer.step.plan(first, last) for layer in self.layers]
        n = min(p.steps for p in steps)
        for layer, phase in zip(self.layers, steps):
            if phase.steps > n:
                phase = layer.step.plan(first, first + n - 1)
            layer.step.begin(phase)
            self.attended_sum += sum(phase.attended(i) for i in range(n))
        self.steps_begun += n
        return n

    def finish(self, length: int) -> None:
        """After the loop: each state counts the ``length`` tokens stored (it can be read or stepped again)."""
        for layer in self.layers:
            layer.step.finish(length)

    def mean_attended(self) -> float:
        """Tokens attended per query head and step, averaged over layers and the steps begun."""
        return self.attended_sum / (self.steps_begun * len(self.layers)) if self.steps_begun else float("nan")


__all__ = ["StaticSparseCache", "StaticSparseLayer"]
