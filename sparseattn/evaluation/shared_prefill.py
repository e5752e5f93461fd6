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

The prompt's keys and values are stored once, not once per method: every method that keeps them all
as they are (dense attention, the segment searches: states marked
:attr:`~sparseattn.methods.base.KVState.appends_only`) would otherwise hold its own identical copy,
47 KB per token of SmolLM2-135M in float32, 1.5 GB per method for a batch of eight 4k-token prompts.
After each prompt block those states' buffers are checked equal and handed one storage
(:class:`PromptSharingBuffer`); the tokens each decodes afterwards are its own, written after the
prompt in the shared storage while it is in use and kept aside in between, so each state still sees
exactly the keys and values it would see alone. An evicting method's compaction gives it its own
storage (:meth:`GrowableBuffer.replace`), as does outgrowing the shared capacity or reindexing rows.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from sparseattn.hf import apply, cache_kwargs
from sparseattn.hf.cache import RowwiseState, SparseCache, SparseLayer
from sparseattn.methods.base import KVState, LayerSpec, SparseMethod, observe_block, sum_nbytes
from sparseattn.ops.buffers import GrowableBuffer
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
        if keys.shape[2] > 1:  # a prompt block: store what the states hold alike once
            share_prompt(self.states)

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """The first state's prefill output; the others only observe the block (their outputs would be dropped)."""
        out = self.states[0].attend_block(query)
        for state in self.states[1:]:
            observe_block(state, query)
        return out

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


class _SharedPrompt:
    """One storage of a prompt's keys (or values) for several :class:`PromptSharingBuffer`s.

    ``data`` holds the ``prompt`` shared entries along the buffer's dim, then the decode tokens of
    ``owner``, the buffer that wrote there last.
    """

    def __init__(self, data: torch.Tensor, prompt: int) -> None:
        self.data, self.prompt, self.owner = data, prompt, None


class PromptSharingBuffer(GrowableBuffer):
    """A :class:`GrowableBuffer` whose first ``prompt`` entries are stored once for several buffers.

    Its own entries after the prompt (decode tokens) are kept in a private ``tail`` too and written
    back after the prompt whenever the buffer is read or appended to after another one was
    (:meth:`_claim`: a copy of the tail only, no allocation), so :meth:`view` is always this buffer's
    own contents, in the contiguous layout of a plain buffer. A view is valid until another buffer
    sharing the prompt is read or appended to (a plain buffer's view is valid until it grows).
    Outgrowing the shared capacity, :meth:`replace`, :meth:`apply_` and truncating into the prompt
    give the buffer storage of its own first, so the prompt is never written through a shared one.
    """

    def __init__(self, shared: _SharedPrompt, dim: int) -> None:
        super().__init__(dim)
        self._shared: _SharedPrompt | None = shared
        self._data, self._length = shared.data, shared.prompt
        self._tail = GrowableBuffer(dim)

    @property
    def shared(self) -> bool:
        """Whether the prompt's storage is still shared (False once this buffer has its own)."""
        return self._shared is not None

    def _claim(self) -> None:
        shared = self._shared
        if shared is not None and shared.owner is not self:
            if len(self._tail):
                shared.data.narrow(self.dim, shared.prompt, len(self._tail)).copy_(self._tail.view())
            shared.owner = self

    def _own(self) -> None:
        """Leave the shared storage: a copy of this buffer's contents, the capacity kept."""
        if self._shared is not None:
            self._claim()
            own = self._data.clone()
            self._shared, self._tail = None, GrowableBuffer(self.dim)
            self._data = own

    def append(self, block: torch.Tensor) -> None:
        if self._shared is None:
            return super().append(block)
        if self._length + block.shape[self.dim] > self.capacity:
            self._claim()
            self._shared, self._tail = None, GrowableBuffer(self.dim)  # growing copies into a buffer of its own
            return super().append(block)
        self._claim()
        super().append(block)
        self._tail.append(block)

    def view(self) -> torch.Tensor:
        self._claim()
        return super().view()

    def replace(self, block: torch.Tensor) -> None:
        self._shared, self._tail = None, GrowableBuffer(self.dim)
        super().replace(block)

    def truncate(self, length: int) -> None:
        prompt = self._shared.prompt if self._shared is not None else 0
        if self._shared is not None and length < prompt:
            self._own()
        super().truncate(length)
        if self._shared is not None:
            self._tail.truncate(length - prompt)

    def apply_(self, fn) -> None:
        self._own()
        super().apply_(fn)


def _sharable_buffers(state) -> tuple[GrowableBuffer, GrowableBuffer] | None:
    """A state's key and value buffers when it keeps every token as appended (plain storage only)."""
    if not (isinstance(state, KVState) and type(state).appends_only):
        return None
    buffers = state._keys, state._values
    if not all(type(buf) in (GrowableBuffer, PromptSharingBuffer) and len(buf) for buf in buffers):
        return None
    return buffers


def share_prompt(states: list) -> int:
    """Store once the keys and values that several states hold alike; returns how many states share them.

    Among ``states``, those that keep their tokens as appended (:attr:`KVState.appends_only`) and hold
    exactly the keys and values of the first of them (checked element by element) get one storage
    for them: the first one's. Call right after the same prompt block was appended to all of them.
    """
    candidates = [(state, buffers) for state in states if (buffers := _sharable_buffers(state)) is not None]
    if len(candidates) < 2:
        return 0
    first = candidates[0][1]

    def same(buf: GrowableBuffer, ref: GrowableBuffer) -> bool:
        if isinstance(buf, PromptSharingBuffer) and isinstance(ref, PromptSharingBuffer) and buf._shared is not None \
                and buf._shared is ref._shared:  # one prompt: compare what each holds after it (views would overlap)
            tails = len(buf._tail), len(ref._tail)
            return tails[0] == tails[1] and (not tails[0] or torch.equal(buf._tail.view(), ref._tail.view()))
        a, b = buf.view(), ref.view()
        return buf.dim == ref.dim and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)

    alike = [state for state, buffers in candidates if all(same(buf, ref) for buf, ref in zip(buffers, first))]
    if len(alike) < 2:
        return 0
    for state, buffers in candidates:  # one that differs must not keep writing into the storage shared anew
        if not any(state is other for other in alike):
            for buf in buffers:
                if isinstance(buf, PromptSharingBuffer):
                    buf._own()
    for name, ref in (("_keys", first[0]), ("_values", first[1])):
        ref.view()  # a sharing buffer writes its own decode tokens back first: its storage holds its contents
        shared = _SharedPrompt(ref._data, len(ref))
        for state in alike:
            setattr(state, name, PromptSharingBuffer(shared, ref.dim))
    return len(alike)


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
