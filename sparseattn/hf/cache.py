"""A transformers ``Cache`` whose full-attention layers hold a sparse method's decode state.

transformers calls ``past_key_values.update(k, v, layer_idx)`` right before the attention function
(post-RoPE keys, not repeated for grouped-query attention). :class:`SparseLayer.update` hands the
tokens to the layer's decode state (the state *is* the storage: there is no second copy of the cache)
and remembers the key tensor it returned. The ``sparseattn`` attention function
(:mod:`sparseattn.hf.attention`) is not given the cache, only the attention module: it reaches the
cache the module was called with (:func:`sparseattn.hf.apply` links the two for the duration of each
call), takes the layer ``module.layer_idx``, checks that the keys it received are the ones that layer
returned, and answers the query with the layer's state. No module-level state links the two calls.
Layers with a sliding window keep transformers' own class and attend densely within it.

Left padding: the first prefill call tells, from the attention mask, how many pad tokens lead each
row. Unpadded batches share one batched state. Padded batches get a :class:`RowwiseState`: one state
per row holding only that row's real tokens, so every row decodes exactly as it would alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sparseattn.methods.base import DecodeState, SparseMethod, StepInfo, check_batch_index, sum_nbytes


@dataclass
class DecodeStats:
    """Running totals of one layer's decode steps."""

    steps: int = 0
    attended: float = 0.0  #: sum over steps of the mean tokens attended per query head
    stored: float = 0.0  #: sum over steps of the mean tokens stored per row
    history: list[float] = field(default_factory=list, repr=False)

    def record(self, attended: torch.Tensor, stored: float) -> None:
        mean = float(attended.float().mean())
        self.steps += 1
        self.attended += mean
        self.stored += stored
        self.history.append(mean)


def _left_pad(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    """Concatenate ``[1, ..., t_b]`` rows along dim 0, each padded on the left of its last dim to the longest."""
    longest = max(r.shape[-1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (longest - r.shape[-1], 0), value=value) for r in rows])


@dataclass(frozen=True)
class RowwiseSelection:
    """What one decode step of a :class:`RowwiseState` attended: each row's own :class:`StepInfo`."""

    rows: tuple[StepInfo, ...]

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]``."""
        return torch.cat([row.attended for row in self.rows])

    @property
    def merged(self) -> torch.Tensor:
        """Stand-in tokens attended per query head beyond the stored ones, ``[B, H_q]``."""
        return torch.cat([row.merged for row in self.rows])

    def to_mask(self) -> torch.Tensor:
        """``[B, H_q, t]`` over the stored tokens, each row padded on the left (``False``) like :attr:`RowwiseState.keys`."""
        return _left_pad([row.to_mask() for row in self.rows], value=False)


class RowwiseState:
    """One single-row decode state per batch row, each holding only that row's real (unpadded) tokens.

    Used for left-padded batches, so a row decodes exactly as it would alone: segment grids depend on
    each row's own length. Costs a Python loop over rows per layer and step. A :class:`DecodeState`
    over the padded batch: blocks ``[B, H_kv, T, D]`` cover every row's positions, padding included,
    and each row keeps the part after its ``pads[b]`` leading pad tokens.

    Args:
        states: one state of batch 1 per row.
        pads: leading pad tokens of each row (in the whole sequence).
        seen: positions already appended, padding included (non-zero when the states hold tokens).
    """

    def __init__(self, states: list[DecodeState], pads: list[int], seen: int = 0) -> None:
        if len(states) != len(pads) or not states:
            raise ValueError(f"RowwiseState needs one pad count per state, got {len(states)} states and {len(pads)} pads")
        self.states = list(states)
        self.pads = list(pads)
        self.seen = seen

    @property
    def batch(self) -> int:
        return len(self.states)

    @property
    def length(self) -> int:
        """The longest row's stored tokens (the width of :attr:`keys`)."""
        return max(s.length for s in self.states)

    @property
    def row_lengths(self) -> list[int]:
        """Tokens stored by each row."""
        return [s.length for s in self.states]

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, t, D]``, each row re-padded with zeros on the left (a copy, O(t): for inspection only)."""
        return _left_pad([s.keys.transpose(-1, -2) for s in self.states]).transpose(-1, -2)

    @property
    def values(self) -> torch.Tensor:
        """``[B, H_kv, t, D]``, aligned with :attr:`keys`."""
        return _left_pad([s.values.transpose(-1, -2) for s in self.states]).transpose(-1, -2)

    def _starts(self, block: int, first: int) -> list[int]:
        """Per row, the first real position of a ``block``-token slice starting at sequence position ``first``."""
        return [min(block, max(0, pad - first)) for pad in self.pads]

    def _check_rows(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[0] != self.batch:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have {self.batch} batch rows, got {shape}")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``[B, H_kv, T, D]`` (the next ``T`` positions); row b skips what is still its padding."""
        self._check_rows("keys", keys)
        self._check_rows("values", values)
        T = keys.shape[2]
        for b, (state, start) in enumerate(zip(self.states, self._starts(T, self.seen))):
            if start < T:
                state.append(keys[b : b + 1, :, start:], values[b : b + 1, :, start:])
        self.seen += T

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, RowwiseSelection]:
        """``query: [B, H_q, D]`` -> output ``[B, H_q, D]`` and each row's selection."""
        self._check_rows("query", query)
        outs, infos = [], []
        for b, state in enumerate(self.states):
            out, info = state.attend(query[b : b + 1])
            outs.append(out)
            infos.append(info)
        return torch.cat(outs), RowwiseSelection(tuple(infos))

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Causal prefill ``[B, H_q, T, D]`` of the last ``T`` appended positions; queries at padding get zeros."""
        self._check_rows("query", query)
        T = query.shape[2]
        out = torch.zeros_like(query)
        for b, (state, start) in enumerate(zip(self.states, self._starts(T, self.seen - T))):
            if start < T:
                out[b : b + 1, :, start:] = state.attend_block(query[b : b + 1, :, start:]).to(query.dtype)
        return out

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, RowwiseSelection]:
        """Append one position (``key, value: [B, H_kv, D]``, past every row's padding) and attend with ``query``."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            self._check_rows(name, x)
        if any(pad > self.seen for pad in self.pads):
            raise ValueError("RowwiseState.step: a row is still in its padding; append the prompt first")
        outs, infos = [], []
        for b, state in enumerate(self.states):
            out, info = state.step(query[b : b + 1], key[b : b + 1], value[b : b + 1])
            outs.append(out)
            infos.append(info)
        self.seen += 1
        return torch.cat(outs), RowwiseSelection(tuple(infos))

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep, repeat or reorder rows (a repeated row is deep-copied: rows never share a state)."""
        order = check_batch_index(index, self.batch).tolist()
        seen: set[int] = set()
        states = []
        for i in order:
            states.append(self.states[i] if i not in seen else copy.deepcopy(self.states[i]))
            seen.add(i)
        self.states = states
        self.pads = [self.pads[i] for i in order]

    def nbytes(self) -> dict[str, int]:
        return sum_nbytes(self.states)


class KeysHandOver:
    """The hand-over between a cache layer's ``update`` and the sparseattn attention function.

    ``update`` returns keys (remembered in ``_returned``); the attention function :meth:`claim` s them. A layer
    updated again before its keys were claimed was attended by another implementation, and keys that reach the
    attention function changed on the way: both raise, so a step never runs silently dense or on other tokens.
    """

    layer_idx: int | None
    cache_name: str = "cache"  #: the cache class, as messages name it
    _returned: torch.Tensor | None = None

    def _check_claimed(self) -> None:
        if self._returned is not None:
            # The previous tokens were attended by another implementation: never silently dense (or wrong).
            self._returned = None
            raise RuntimeError(
                f"layer {self.layer_idx} of a {self.cache_name} was updated twice without its attention running through "
                "sparseattn: the model's attention implementation is not 'sparseattn', or it was set without "
                "sparseattn.apply (which links each attention module to the cache it is called with). Use "
                f"sparseattn.apply(model, method) before passing a {self.cache_name}."
            )

    def claim(self, key: torch.Tensor) -> None:
        """Called by the attention function with the ``key`` it received: the one :meth:`update` just returned.

        Raises a RuntimeError when it is not (the model changed the keys between the cache and the
        attention function, or called the attention without updating this layer): the state would
        answer a query about tokens it never stored.
        """
        returned, self._returned = self._returned, None
        if returned is None or returned is not key:
            raise RuntimeError(
                f"layer {self.layer_idx} of a {self.cache_name}: the keys reaching the sparseattn attention function are "
                f"not the ones this layer's update() returned ({'no update' if returned is None else 'another tensor'}); "
                "the model transforms or shares keys between the cache and the attention, which sparseattn does not support"
            )


def _state_tensor(which: int, name: str) -> property:
    """A :class:`SparseLayer` attribute ``name`` (``keys``: ``which=0``, ``values``: 1) read from the decode
    state, or from the first block while it waits for the state; setting it to anything but None is refused."""

    def get(layer: SparseLayer) -> torch.Tensor | None:
        state = getattr(layer, "state", None)
        if state is None:
            pending = getattr(layer, "_pending", None)
            return None if pending is None else pending[which]
        return state.keys if which == 0 else state.values

    def accept_none(layer: SparseLayer, value: torch.Tensor | None) -> None:
        if value is not None:
            raise NotImplementedError(f"a SparseLayer's {name} live in its decode state; offloading is not supported")

    return property(get, accept_none)


class SparseLayer(KeysHandOver, DynamicLayer):
    """A full-attention cache layer backed by a :class:`~sparseattn.methods.base.DecodeState`.

    The state is created lazily by the attention function on this layer's first call, when the
    logit scale, soft-capping and padding are known; until then the first block waits here.
    """

    is_croppable = False
    supports_early_init = False
    cache_name = "SparseCache"

    def __init__(self, method: SparseMethod, layer_idx: int | None = None) -> None:
        self._keys_view: torch.Tensor | None = None
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.state: DecodeState | None = None  #: a method's state, or a RowwiseState of them for a padded batch
        self.seen = 0  #: tokens seen, padding included (what transformers counts positions and masks by)
        self.stats = DecodeStats()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._returned: torch.Tensor | None = None  #: the keys update() returned, until the attention function takes them

    # transformers' base classes assign ``keys``/``values`` (None on init and reset): accept only that.
    keys = _state_tensor(0, "keys")
    values = _state_tensor(1, "values")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens ``[B, H_kv, T, D]``; return what the attention function will receive."""
        self._check_claimed()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.state is None:  # the first block waits for the attention function to make the state
            self._pending = (key_states, value_states)
            keys, values = key_states, value_states
        else:
            self.state.append(key_states, value_states)
            if isinstance(self.state, RowwiseState):
                keys, values = key_states, value_states  # rows differ in length: only the new block is returned
            else:
                keys, values = self.state.keys, self.state.values
        self.seen += key_states.shape[2]  # counted once stored: a block the state refused is not seen
        self._returned = keys
        return keys, values

    def record_step(self, info: StepInfo) -> None:
        """Count one decode step: ``info.attended`` and the tokens stored per row."""
        state = self.state
        stored = sum(state.row_lengths) / state.batch if isinstance(state, RowwiseState) else state.length
        self.stats.record(info.attended, stored)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self._pending, self._returned = None, None, None
        self.seen = 0
        self.stats = DecodeStats()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(
                "a SparseCache cannot be cropped (assisted or speculative decoding): its segment summaries and "
                "evictions cannot be rolled back"
            )

    def _select(self, index: torch.Tensor) -> None:
        if self._pending is not None:
            k, v = self._pending
            self._pending = (k.index_select(0, index.to(k.device)), v.index_select(0, index.to(v.device)))
        if self.state is not None:
            self.state.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self._batch_size()
        if batch:
            self._select(torch.arange(batch).repeat_interleave(repeats))

    def _batch_size(self) -> int:
        if self.state is None:
            return 0 if self._pending is None else self._pending[0].shape[0]
        return self.state.batch

    def nbytes(self) -> dict[str, int]:
        """Bytes held by this layer's state, by kind (``kv``, ``summaries`` ...)."""
        return {} if self.state is None else dict(self.state.nbytes())


class SparseCache(DynamicCache):
    """``DynamicCache`` whose full-attention layers decode with ``method``; pass it as ``past_key_values``.

    Sliding-window (and chunked) layers keep transformers' own classes and stay dense: they already
    attend to a bounded window. The model must be prepared with :func:`sparseattn.hf.apply` (the
    ``"sparseattn"`` attention implementation plus the hooks that let it reach this cache); used
    otherwise, the cache raises rather than decode densely. Hyperparameters live here, not in
    ``generate``'s kwargs; any number of caches may be used with one applied model.

    Args:
        method: the sparse method, e.g. ``Radar(top_k=8)``.
        config: the model config (recommended: it decides which layers are sliding); without it every
            layer is a full-attention :class:`SparseLayer`.
    """

    def __init__(self, method: SparseMethod, config=None) -> None:
        if not hasattr(method, "new_state"):
            raise ValueError(f"SparseCache needs a sparse method with new_state(), got {method!r}")
        self.method = method
        if config is None:
            super().__init__()
            self.layers = []
            self.layer_class_to_replicate = None
        else:
            super().__init__(config=config)
            self.layers = [
                SparseLayer(method, idx) if type(layer) is DynamicLayer else layer for idx, layer in enumerate(self.layers)
            ]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(SparseLayer(self.method, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    @property
    def sparse_layers(self) -> list[SparseLayer]:
        return [layer for layer in self.layers if isinstance(layer, SparseLayer)]

    def mean_attended(self) -> float:
        """Tokens attended per decode step and query head, averaged over sparse layers and steps (nan if none)."""
        steps = sum(layer.stats.steps for layer in self.sparse_layers)
        return sum(layer.stats.attended for layer in self.sparse_layers) / steps if steps else float("nan")

    def mean_stored(self) -> float:
        """Tokens stored per row at decode steps, averaged like :meth:`mean_attended` (the dense count)."""
        steps = sum(layer.stats.steps for layer in self.sparse_layers)
        return sum(layer.stats.stored for layer in self.sparse_layers) / steps if steps else float("nan")

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the sparse layers' states, by kind, summed over layers."""
        return sum_nbytes(self.sparse_layers)
