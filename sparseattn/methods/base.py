"""What every sparse decode method offers: a per-layer state that stores tokens and answers queries.

The protocols are the library API for new methods; :class:`KVState` is the base class that does the
shared work (validated, capacity-doubling key/value storage, dense causal prefill attention, batch
reindexing), so a method writes only how a decode query is answered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from sparseattn.ops.attention import causal_block_attention, compute_dtype
from sparseattn.ops.buffers import GrowableBuffer
from sparseattn.validation import check_int

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sum_nbytes(parts) -> dict[str, int]:
    """The ``nbytes()`` of several states (or layers), added kind by kind (``kv``, ``summaries`` ...)."""
    total: dict[str, int] = {}
    for part in parts:
        for kind, n in part.nbytes().items():
            total[kind] = total.get(kind, 0) + n
    return total


def observe_block(state, query: torch.Tensor) -> None:
    """Let ``state`` see a prefill block's queries ``[B, H_q, T, D]`` without its output being needed: the
    state's own ``observe_block`` (:meth:`KVState.observe_block`), or ``attend_block`` with the output dropped
    for a state that has none (the optional member of :class:`DecodeState`)."""
    observe = getattr(state, "observe_block", None)
    if observe is None:
        state.attend_block(query)
    else:
        observe(query)


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as an engine describes it to a method: shape, placement, dtype and logit rule.

    The cache of the layer is ``[batch, kv_heads, t, head_dim]`` keys and values of ``dtype`` on
    ``device``; ``scale`` is the logit scale (None: ``head_dim ** -0.5``), ``softcap`` Gemma-2's
    logit soft-capping (None: off), ``layer_idx`` seeds per-layer randomness and ``n_layers`` (None:
    unknown) is how many attention layers the model has, for methods that split a budget between
    layers. Validated on construction, so a state never sees a bad shape.

    Under tensor parallelism a process holds only some of the model's KV heads: the ``kv_heads``
    heads ``kv_head_offset, ..., kv_head_offset + kv_heads - 1`` of ``total_kv_heads`` (None: all of
    them, ``kv_heads``). Per-head randomness (random-feature projections) is drawn for all
    ``total_kv_heads`` and these rows kept, so a head decodes the same whatever the TP size.

    Example:
        >>> LayerSpec(batch=2, kv_heads=3, head_dim=64).scale
        0.125
        >>> LayerSpec(batch=1, kv_heads=2, head_dim=64, kv_head_offset=2, total_kv_heads=4).heads  # rank 1 of 2
        range(2, 4)
    """

    batch: int
    kv_heads: int
    head_dim: int
    layer_idx: int = 0
    device: torch.device | str | None = None
    dtype: torch.dtype = torch.float32
    scale: float | None = None
    softcap: float | None = None
    kv_head_offset: int = 0
    total_kv_heads: int | None = None
    n_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "kv_heads", "head_dim"):
            check_int("", name, getattr(self, name), 1)
        check_int("", "layer_idx", self.layer_idx, 0)
        if self.n_layers is not None:
            check_int("", "n_layers", self.n_layers, self.layer_idx + 1, f"or None; layer_idx is {self.layer_idx}")
        check_int("", "kv_head_offset", self.kv_head_offset, 0)
        total = self.kv_heads if self.total_kv_heads is None else self.total_kv_heads
        check_int("", "total_kv_heads", total, 1, "or None")
        if self.kv_head_offset + self.kv_heads > total:
            raise ValueError(
                f"LayerSpec holds KV heads {self.kv_head_offset}..{self.kv_head_offset + self.kv_heads - 1} "
                f"(kv_head_offset={self.kv_head_offset}, kv_heads={self.kv_heads}) but total_kv_heads={total}"
            )
        object.__setattr__(self, "total_kv_heads", total)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        scale = _positive_real("scale", self.head_dim**-0.5 if self.scale is None else self.scale, self.scale)
        softcap = None if self.softcap is None else _positive_real("softcap", self.softcap, self.softcap, "None or ")
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "softcap", softcap)

    @property
    def heads(self) -> range:
        """The model's KV heads this layer holds, in order (all of them unless tensor-parallel)."""
        return range(self.kv_head_offset, self.kv_head_offset + self.kv_heads)


def _positive_real(name: str, value, given, prefix: str = "") -> float:
    """``value`` as a float if it is a finite real number > 0 (a 0-d tensor too), else a ValueError naming ``name``."""
    try:
        number = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be {prefix}a finite number > 0, got {given!r}")
    return number


@runtime_checkable
class StepInfo(Protocol):
    """What one decode step attended to: the second item :meth:`DecodeState.attend` returns.

    Every state returns one (the transformers integration's row-wise padded-batch state too), so a
    caller reads ``attended`` without asking which kind of state answered.
    """

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]`` (an integer tensor): the stored tokens of ``to_mask()``,
        plus any stand-in tokens a state attends instead of stored ones (a merged rest,
        :class:`~sparseattn.methods.rest.MergedRest`, counts each merged token against the budget;
        the toolkit's infos report them as ``merged``, ``[B, H_q]``, zeros for most methods)."""
        ...

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, t]`` over the ``t`` stored tokens (``keys``' dim 2)."""
        ...


@runtime_checkable
class DecodeState(Protocol):
    """The per-layer state of a method: the KV tokens plus whatever structure the method keeps.

    This is everything an engine calls on a state (:mod:`sparseattn.hf.cache` and
    :mod:`sparseattn.hf.attention` call nothing else), so a class with these members decodes through
    ``model.generate``, beam search included.

    Shapes: ``keys, values: [B, H_kv, T, D]`` blocks; ``query: [B, H_q, D]`` for one decode step,
    with ``H_q`` a multiple of ``H_kv`` (grouped-query attention, query head h uses KV head h // G).
    ``B`` is :attr:`batch`; ``t`` is :attr:`length`.

    ``keys`` and ``values`` are read only once the state holds tokens (a state may raise before its
    first :meth:`append`); on Python < 3.12, ``isinstance(state, DecodeState)`` reads them, so check
    a state that holds tokens.
    """

    @property
    def batch(self) -> int:
        """Batch rows ``B`` (changes with :meth:`select_batch`)."""
        ...

    @property
    def length(self) -> int:
        """Tokens stored, ``t`` (a method that evicts stores fewer than it has seen)."""
        ...

    @property
    def keys(self) -> torch.Tensor:
        """The stored keys ``[B, H_kv, t, D]``, in the order :meth:`StepInfo.to_mask` indexes (a view: no copy)."""
        ...

    @property
    def values(self) -> torch.Tensor:
        """The stored values ``[B, H_kv, t, D]``, aligned with :attr:`keys`."""
        ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens ``[B, H_kv, T, D]`` (a prefill block or one decode token) without querying."""
        ...

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Output ``[B, H_q, D]`` of the newest token's query ``[B, H_q, D]`` over the stored tokens, and what it attended."""
        ...

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of the last ``T`` appended tokens' queries ``[B, H_q, T, D]`` (prefill).

        Optional beside it: ``observe_block(query) -> None``, what this does to the state without computing
        the output (a shared prefill calls it where the output would be dropped; :func:`observe_block`).
        """
        ...

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Append one token (``key, value: [B, H_kv, D]``) and attend with its ``query: [B, H_q, D]``."""
        ...

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep, repeat or reorder batch rows: ``index: [B']`` integer rows in ``[0, B)`` (beam search,
        ``generate``'s expansion); afterwards :attr:`batch` is ``B'``."""
        ...

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: ``kv`` (the stored tokens) plus whatever structure the method adds."""
        ...


@runtime_checkable
class SparseMethod(Protocol):
    """A decode-time attention method: an immutable policy that makes one state per layer."""

    def new_state(self, layer: LayerSpec) -> DecodeState:
        """An empty state for the layer ``layer`` describes (its cache: ``[batch, kv_heads, t, head_dim]``)."""
        ...


def layer_spec(*args, **kwargs) -> LayerSpec:
    """A :class:`LayerSpec` passed alone, or the one built from :class:`LayerSpec`'s arguments.

    Lets ``method.new_state(batch=1, kv_heads=2, head_dim=8)`` stand for
    ``method.new_state(LayerSpec(1, 2, 8))`` in examples and tests; engines pass a ``LayerSpec``.
    """
    if len(args) == 1 and not kwargs and isinstance(args[0], LayerSpec):
        return args[0]
    if any(isinstance(x, LayerSpec) for x in (*args, *kwargs.values())):
        raise ValueError("new_state takes a LayerSpec alone, or LayerSpec's arguments (batch, kv_heads, head_dim, ...); not both")
    try:
        return LayerSpec(*args, **kwargs)
    except TypeError as error:
        raise ValueError(f"new_state needs a LayerSpec or its arguments (batch, kv_heads, head_dim, ...): {error}") from None


class StatefulMethod:
    """Base of the method dataclasses: :meth:`new_state` builds the class :meth:`state_type` names.

    The state class is called as ``state_type()(method, layer)`` with ``layer`` a :class:`LayerSpec`.
    """

    def state_type(self) -> type:
        raise NotImplementedError

    def new_state(self, *args, **kwargs) -> DecodeState:
        """A decode state for one layer: ``new_state(LayerSpec(...))``, or ``new_state(batch, kv_heads, head_dim, **options)``."""
        return self.state_type()(self, layer_spec(*args, **kwargs))


def check_batch_index(index: torch.Tensor, batch: int) -> torch.Tensor:
    """``index`` if it is a non-empty 1-D integer tensor of rows in ``[0, batch)``; a ValueError otherwise.

    Checked before any buffer is reindexed, so a bad index leaves a state as it was.
    """
    integer = isinstance(index, torch.Tensor) and not index.is_floating_point() and index.dtype != torch.bool
    if not integer or index.dim() != 1 or index.numel() == 0:
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"select_batch needs a non-empty 1-D integer tensor of batch rows, got {shape}")
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= batch:
        raise ValueError(f"select_batch: row indices must be in [0, {batch}), got values in [{low}, {high}]")
    return index.long()


def resolve_device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class KVState:
    """Base of the decode states: validated key/value storage that grows by capacity doubling.

    Subclasses implement :meth:`attend` and may hook :meth:`_after_append` (build structure) and
    :meth:`observe_block` (record prefill statistics, evict). Scores are computed in float32 (float64
    for float64 inputs) whatever the storage dtype, so fp16/bf16 caches never overflow.

    Args:
        layer: the layer's cache shape ``[batch, kv_heads, t, head_dim]``, device, dtype, logit
            scale and soft-cap, and index (which seeds per-layer randomness).
    """

    #: True when the state never rewrites a stored token in place (only appends, or swaps its buffers
    #: whole through ``GrowableBuffer.replace``/``apply_``): the keys and values of a prompt it shares
    #: with other such states may then be stored once for all of them
    #: (:func:`sparseattn.evaluation.shared_prefill.prefill_together`). Off unless a subclass opts in.
    appends_only: ClassVar[bool] = False

    def __init__(self, layer: LayerSpec) -> None:
        if not isinstance(layer, LayerSpec):
            raise ValueError(f"a state is made for a LayerSpec, got {layer!r}")
        self.layer = layer
        self.batch, self.kv_heads, self.head_dim = layer.batch, layer.kv_heads, layer.head_dim
        self.layer_idx = layer.layer_idx
        self.device = layer.device
        self.dtype = layer.dtype
        self.compute_dtype = compute_dtype(layer.dtype)
        self.scale = layer.scale
        self.softcap = layer.softcap
        self._keys = GrowableBuffer(dim=2)
        self._values = GrowableBuffer(dim=2)

    # -- storage -------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored keys (no copy); ``t = 0`` before anything is stored."""
        return self._keys.view() if self.length else self._empty()

    @property
    def values(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored values (no copy); ``t = 0`` before anything is stored."""
        return self._values.view() if self.length else self._empty()

    def _empty(self) -> torch.Tensor:
        # An empty state still has a shape (protocol checks such as isinstance read these properties).
        return torch.empty(self.batch, self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: ``kv`` (the stored tokens) and whatever structure the method adds."""
        return {"kv": 2 * self.length * self.batch * self.kv_heads * self.head_dim * self.dtype.itemsize}

    def _check_block(self, name: str, x: torch.Tensor, tokens_dim: bool) -> None:
        expected = (self.batch, self.kv_heads, "T", self.head_dim) if tokens_dim else (self.batch, self.kv_heads, self.head_dim)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of shape {expected}, got {type(x).__name__}")
        shape_ok = x.dim() == len(expected) and all(e == "T" or e == s for e, s in zip(expected, x.shape))
        if not shape_ok:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but this state was made for {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but this state lives on {self.device}")

    def _check_query_tensor(self, query: torch.Tensor, block: bool = False) -> int:
        """Validate the shape, dtype and device of ``query: [B, H_q, D]`` (``[B, H_q, T, D]`` for a block);
        return the group size. Touches no state, so :meth:`step` runs it before appending."""
        B, D = self.batch, self.head_dim
        want = f"({B}, H_q, T, {D})" if block else f"({B}, H_q, {D})"
        if (
            not isinstance(query, torch.Tensor)
            or query.dim() != (4 if block else 3)
            or query.shape[0] != B
            or query.shape[-1] != D
            or query.shape[1] == 0
            or query.shape[1] % self.kv_heads
        ):
            got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise ValueError(f"query must have shape {want} with H_q a multiple of kv_heads={self.kv_heads}, got {got}")
        if query.dtype != self.dtype:
            raise ValueError(f"query has dtype {query.dtype} but this state was made for {self.dtype}")
        if query.device != self.device:
            raise ValueError(f"query is on {query.device} but this state lives on {self.device}")
        return query.shape[1] // self.kv_heads

    def _check_query(self, query: torch.Tensor, block: bool = False) -> int:
        """Validate ``query: [B, H_q, D]`` (or ``[B, H_q, T, D]`` for a block) against a non-empty state;
        return the group size."""
        group = self._check_query_tensor(query, block)
        if self.length == 0:
            raise ValueError("attend() called on an empty state: append keys and values first")
        return group

    def _check_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Validate a decode step's ``query: [B, H_q, D]``, ``key, value: [B, H_kv, D]`` before anything is stored.

        A step that fails validation must leave the state as it was (no token appended, no statistic
        recorded), so every check of :meth:`append` and :meth:`attend` that depends only on the inputs
        runs here first.
        """
        self._check_block("key", key, False)
        self._check_block("value", value, False)
        self._check_query_tensor(query)

    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Validate a block of keys and values ``[B, H_kv, T, D]`` (same shape, this state's dtype and device)."""
        self._check_block("keys", keys, True)
        self._check_block("values", values, True)
        if keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add a block of tokens ``[B, H_kv, T, D]`` (prefill, chunked prefill or one decode token)."""
        self._check_kv(keys, values)
        self._keys.append(keys)
        self._values.append(values)
        self._after_append(keys.shape[2])

    def prefill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Alias of :meth:`append` (a prompt block), resolved on the subclass."""
        self.append(keys, values)

    def _after_append(self, n_new: int) -> None:
        """Hook: bring the method's structure up to date with ``n_new`` new tokens."""

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Append one token (``key, value: [B, H_kv, D]``) and attend with its ``query: [B, H_q, D]``.

        Raises ValueError, with the state unchanged, when any of the three is malformed.
        """
        self._check_step(query, key, value)
        self.append(key.unsqueeze(2), value.unsqueeze(2))
        return self.attend(query)

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        raise NotImplementedError

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Dense causal attention of the last ``T`` stored tokens' queries ``[B, H_q, T, D]`` (prefill),
        then :meth:`observe_block`.

        Every method prefills densely (the paper's setting); methods that learn from the prompt's
        attention override :meth:`observe_block`, not this, to record what they need.
        """
        group = self._check_prefill_query(query)
        B, H, D, T = self.batch, self.kv_heads, self.head_dim, query.shape[2]
        out = causal_block_attention(query.reshape(B, H, group, T, D), self.keys, self.values, self.scale, self.softcap)
        self.observe_block(query)
        return out.reshape(B, H * group, T, D)

    def observe_block(self, query: torch.Tensor) -> None:
        """What :meth:`attend_block` does to the state, without computing its output: record the prompt's
        attention statistics, evict. Nothing here; a state that learns from the prefill overrides it.

        A shared prefill (:class:`~sparseattn.evaluation.shared_prefill.FanoutState`) answers with one
        state's output and only lets the others observe: each ends as its own prefill leaves it, and the
        ``T x t`` attention is computed once, not once per method.
        """
        self._check_prefill_query(query)

    def _check_prefill_query(self, query: torch.Tensor) -> int:
        """The query group of a well-formed prefill block ``[B, H_q, T, D]`` with ``T <= length``; ValueError otherwise."""
        group = self._check_query(query, block=True)
        if query.shape[2] > self.length:
            raise ValueError(f"attend_block: {query.shape[2]} queries but only {self.length} stored tokens")
        return group

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) batch rows: ``index: [B']`` long (beam search, ``generate``'s expansion)."""
        index = check_batch_index(index, self.batch).to(self.device)
        for buf in self._buffers():
            buf.apply_(lambda t: t.index_select(0, index))
        self.batch = int(index.numel())

    def _buffers(self) -> list[GrowableBuffer]:
        """Every buffer whose dim 0 is the batch (subclasses add their structure's)."""
        return [self._keys, self._values]
