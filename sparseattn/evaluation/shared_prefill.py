"""One prefill for several methods: the model's forward pass runs once, every method keeps its own state.

Every method in the toolkit prefills densely (a prompt's tokens attend causally to all earlier
ones); they differ only in what their decode state keeps and builds from the prompt's keys, values
and queries. Prefilling each method separately repeats the whole forward pass, projections and MLPs
included, once per method: on a 2-core CPU a batch of eight 4k-token prompts takes minutes each
time. :class:`Fanout` is a method whose state forwards every call to the states of several methods
(each sees exactly the keys, values and queries it would see alone, so each builds exactly its own
structure: SnapKV its votes, Radar its segments) and answers the prefill with the first method's
dense output; :func:`prefill_together` runs the forward once under it and splits the cache into one
:class:`~sparseattn.hf.cache.SparseCache` per method, ready to decode (:func:`prefill_shared` also returns
the prompt's next-token logits, the same for every method, for generation: ``sparseattn ruler``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from sparseattn.hf import apply, cache_kwargs
from sparseattn.hf.cache import RowwiseState, SparseCache, SparseLayer
from sparseattn.methods.base import LayerSpec, SparseMethod, sum_nbytes
from sparseattn.progress import forward_progress


class FanoutState:
    """The decode states of several methods fed the same calls; answers with the first one's output."""

    def __init__(self, states: list) -> None:
        self.states = states

    @property
    def length(self) -> int:
        return self.states[0].length

    @property
    def batch(self) -> int:
        return self.states[0].batch

    @property
    def keys(self) -> torch.Tensor:
        return self.states[0].keys

    @property
    def values(self) -> torch.Tensor:
        return self.states[0].values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for state in self.states:
            state.append(keys, values)

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        outputs = [state.attend_block(query) for state in self.states]
        return outputs[0]

    def attend(self, query: torch.Tensor):
        results = [state.attend(query) for state in self.states]
        return results[0]

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        results = [state.step(query, key, value) for state in self.states]
        return results[0]

    def select_batch(self, index: torch.Tensor) -> None:
        for state in self.states:
            state.select_batch(index)

    def nbytes(self) -> dict[str, int]:
        return sum_nbytes(self.states)


@dataclass(frozen=True)
class Fanout:
    """A method whose states feed every call to one state of each of ``methods`` (prefill sharing only).

    Its outputs are the first method's, so it is exact for prefill, where every method attends densely;
    decode with the per-method caches :func:`prefill_together` returns, not with this.
    """

    methods: tuple[SparseMethod, ...]

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("Fanout needs at least one method, got none")

    def new_state(self, layer: LayerSpec) -> FanoutState:
        return FanoutState([method.new_state(layer) for method in self.methods])


def _split_layer(layer: SparseLayer, method: SparseMethod, index: int) -> SparseLayer:
    """The cache layer of ``method`` (the ``index``-th of the fan-out) after a shared prefill."""
    single = SparseLayer(method, layer.layer_idx)
    single.is_initialized, single.seen = layer.is_initialized, layer.seen
    if layer.is_initialized:
        single.dtype, single.device = layer.dtype, layer.device
    if isinstance(layer.state, RowwiseState):
        rows = layer.state
        single.state = RowwiseState([row.states[index] for row in rows.states], rows.pads, rows.seen)
    elif layer.state is not None:
        single.state = layer.state.states[index]
    return single


@dataclass(frozen=True)
class Prefilled:
    """What one shared prefill gives: a ready-to-decode cache per method and the prompt's next-token logits.

    Attributes:
        caches: one :class:`~sparseattn.hf.cache.SparseCache` per method, keyed as the methods were.
        logits: ``[B, vocab]`` float logits of the last prompt position. Every method prefills densely,
            so these are every method's: the first generated token does not depend on the method.
    """

    caches: dict[str, SparseCache]
    logits: torch.Tensor


def prefill_shared(model, methods: dict[str, SparseMethod], ids: torch.Tensor, *, progress: bool = True) -> Prefilled:
    """Prefill ``ids: [B, T]`` once: one ready-to-decode cache per method (same keys as ``methods``) and the logits.

    Each returned cache is what prefilling that method alone would give: its state received the same
    ``append``/``attend_block`` calls with the same tensors (tested against separate prefills).
    """
    if not methods:
        raise ValueError("a shared prefill needs at least one method, got none")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be [batch, tokens] with tokens >= 1, got shape {tuple(ids.shape)}")
    labels = list(methods)
    fanout = Fanout(tuple(methods[label] for label in labels))
    shared = SparseCache(fanout, config=model.config)
    # Only the last position's logits are needed: ask for them alone (a [B, T, vocab] tensor otherwise).
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    description = f"prefill {ids.shape[0]} x {ids.shape[1]} tokens for {len(labels)} methods"
    with apply(model, fanout), torch.no_grad(), forward_progress(model, description, enabled=progress):
        logits = model(ids.to(model.device), **cache_kwargs(model, shared), use_cache=True, **keep_last).logits[:, -1].float()
    caches = {}
    for index, label in enumerate(labels):
        cache = SparseCache(methods[label], config=model.config)
        cache.layers = [
            _split_layer(layer, methods[label], index) if isinstance(layer, SparseLayer) else _copy_dense_layer(layer)
            for layer in shared.layers
        ]
        caches[label] = cache
    return Prefilled(caches, logits)


def prefill_together(
    model, methods: dict[str, SparseMethod], ids: torch.Tensor, *, progress: bool = True
) -> dict[str, SparseCache]:
    """Prefill ``ids: [B, T]`` once and return one ready-to-decode cache per method (same keys as ``methods``).

    :func:`prefill_shared` without the logits.
    """
    return prefill_shared(model, methods, ids, progress=progress).caches


def _copy_dense_layer(layer):
    """A sliding-window layer (transformers' own class) for one method: every method needs its own copy."""
    import copy

    return copy.deepcopy(layer)
