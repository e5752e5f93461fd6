"""A transformers ``Cache`` whose full-attention layers hold a sparse method's decode state.

transformers calls ``past_key_values.update(k, v, layer_idx)`` right before the attention function
(post-RoPE keys, not repeated for grouped-query attention). :class:`SparseLayer.update` hands the
tokens to the layer's decode state (the state *is* the storage: there is no second copy of the cache)
and leaves a hand-over record keyed by the key tensor it returns; the ``sparseattn`` attention
function (:mod:`sparseattn.hf.attention`) consumes that record and answers the query with the
state. Layers with a sliding window keep transformers' own class and attend densely within it.

Left padding: the first prefill call tells, from the attention mask, how many pad tokens lead each
row. Unpadded batches share one batched state. Padded batches get one state per row holding only
that row's real tokens, so every row decodes exactly as it would alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sparseattn.methods.base import DecodeState, SparseMethod

# key tensor id -> (key tensor, layer): what update() returned, waiting for the attention function.
_HANDOFF: dict[int, tuple[torch.Tensor, SparseLayer]] = {}


def take_handoff(key: torch.Tensor) -> SparseLayer | None:
    """The layer whose ``update`` returned ``key`` (consumed), or None if ``key`` did not come from one."""
    entry = _HANDOFF.pop(id(key), None)
    if entry is None or entry[0] is not key:
        return None
    return entry[1]


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


class RowwiseState:
    """One single-row decode state per batch row, each holding only that row's real (unpadded) tokens.

    Used for left-padded batches, so a row decodes exactly as it would alone: segment grids depend on
    each row's own length. Costs a Python loop over rows per layer and step.
    """

    def __init__(self, states: list[DecodeState]) -> None:
        self.states = states

    @property
    def length(self) -> int:
        return max(s.length for s in self.states)

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor, starts: list[int]) -> None:
        """Append ``keys[b, :, starts[b]:]`` to row b (``starts`` skips the row's padding)."""
        for b, state in enumerate(self.states):
            if starts[b] < keys.shape[2]:
                state.append(keys[b : b + 1, :, starts[b] :], values[b : b + 1, :, starts[b] :])

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``query: [B, H_q, D]`` -> output ``[B, H_q, D]`` and tokens attended ``[B, H_q]``."""
        outs, attended = [], []
        for b, state in enumerate(self.states):
            out, info = state.attend(query[b : b + 1])
            outs.append(out)
            attended.append(info.attended)
        return torch.cat(outs), torch.cat(attended)

    def attend_block(self, query: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """Causal prefill ``[B, H_q, T, D]``; queries of row b before ``starts[b]`` are padding (zeros)."""
        out = torch.zeros_like(query)
        for b, state in enumerate(self.states):
            if starts[b] < query.shape[2]:
                out[b : b + 1, :, starts[b] :] = state.attend_block(query[b : b + 1, :, starts[b] :]).to(query.dtype)
        return out

    def select(self, index: list[int]) -> None:
        seen: set[int] = set()
        states = []
        for i in index:
            states.append(self.states[i] if i not in seen else copy.deepcopy(self.states[i]))
            seen.add(i)
        self.states = states


class SparseLayer(DynamicLayer):
    """A full-attention cache layer backed by a :class:`~sparseattn.methods.base.DecodeState`.

    The state is created lazily by the attention function on this layer's first call, when the
    logit scale, soft-capping and padding are known; until then the first block waits here.
    """

    is_croppable = False
    supports_early_init = False

    def __init__(self, method: SparseMethod, layer_idx: int | None = None) -> None:
        self._keys_view: torch.Tensor | None = None
        super().__init__()
        self.method = method
        self.layer_idx = layer_idx
        self.state: DecodeState | RowwiseState | None = None
        self.seen = 0  #: tokens seen, padding included (what transformers counts positions and masks by)
        self.starts: list[int] | None = None  #: per-row padding, when rowwise
        self.stats = DecodeStats()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handoff_key: torch.Tensor | None = None

    # transformers' base classes assign ``keys``/``values`` (None on init and reset): accept only that.
    @property
    def keys(self) -> torch.Tensor | None:
        return self._stored(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise NotImplementedError("a SparseLayer's keys live in its decode state; offloading is not supported")

    @property
    def values(self) -> torch.Tensor | None:
        return self._stored(1)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise NotImplementedError("a SparseLayer's values live in its decode state; offloading is not supported")

    def _stored(self, which: int) -> torch.Tensor | None:
        state = getattr(self, "state", None)
        if state is None:
            pending = getattr(self, "_pending", None)
            return None if pending is None else pending[which]
        if isinstance(state, RowwiseState):
            # Re-pad each row on the left (O(t): for inspection only, never on the decode path).
            rows = [s.keys if which == 0 else s.values for s in state.states]
            longest = max(r.shape[2] for r in rows)
            return torch.cat([torch.nn.functional.pad(r, (0, 0, longest - r.shape[2], 0)) for r in rows])
        return state.keys if which == 0 else state.values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens ``[B, H_kv, T, D]``; return what the attention function will receive."""
        if self._handoff_key is not None:
            # The previous tokens were attended by another implementation: never silently dense (or wrong).
            _HANDOFF.pop(id(self._handoff_key), None)
            self._handoff_key = None
            raise RuntimeError(
                f"layer {self.layer_idx} of a SparseCache was updated twice without its attention running through "
                "sparseattn: the model's attention implementation is not 'sparseattn'. Use sparseattn.apply(model, "
                "method) (or model.set_attn_implementation('sparseattn')) before passing a SparseCache."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[2]
        if self.state is None:  # the first block waits for the attention function to make the state
            self._pending = (key_states, value_states)
            keys, values = key_states, value_states
        elif isinstance(self.state, RowwiseState):
            self.state.append_rows(key_states, value_states, [0] * key_states.shape[0])
            keys, values = key_states, value_states  # rows differ in length: only the new block is returned
        else:
            self.state.append(key_states, value_states)
            keys, values = self.state.keys, self.state.values
        self._handoff_key = keys
        _HANDOFF[id(keys)] = (keys, self)
        return keys, values

    def consume_handoff(self) -> None:
        self._handoff_key = None

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self._handoff_key is not None:
            _HANDOFF.pop(id(self._handoff_key), None)
        self.state, self._pending, self._handoff_key, self.starts = None, None, None, None
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
        if self.state is None:
            return
        if isinstance(self.state, RowwiseState):
            order = [int(i) for i in index.tolist()]
            self.state.select(order)
            self.starts = [self.starts[i] for i in order]
        else:
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
        return len(self.state.states) if isinstance(self.state, RowwiseState) else self.state.batch

    def nbytes(self) -> dict[str, int]:
        """Bytes held by this layer's state, by kind (``kv``, ``summaries`` ...)."""
        states = [] if self.state is None else self.state.states if isinstance(self.state, RowwiseState) else [self.state]
        total: dict[str, int] = {}
        for state in states:
            for kind, n in state.nbytes().items():
                total[kind] = total.get(kind, 0) + n
        return total


class SparseCache(DynamicCache):
    """``DynamicCache`` whose full-attention layers decode with ``method``; pass it as ``past_key_values``.

    Sliding-window (and chunked) layers keep transformers' own classes and stay dense: they already
    attend to a bounded window. The model must run with ``attn_implementation="sparseattn"``
    (see :func:`sparseattn.hf.apply`); hyperparameters live here, not in ``generate``'s kwargs.

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
        total: dict[str, int] = {}
        for layer in self.sparse_layers:
            for kind, n in layer.nbytes().items():
                total[kind] = total.get(kind, 0) + n
        return total
