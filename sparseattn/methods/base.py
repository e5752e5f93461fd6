"""What every sparse decode method offers: a per-layer state that stores tokens and answers queries.

The protocols are the library API for new methods; :class:`KVState` is the base class that does the
shared work (validated, capacity-doubling key/value storage, dense causal prefill attention, batch
reindexing), so a method writes only how a decode query is answered.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from sparseattn.ops.attention import causal_block_attention, compute_dtype
from sparseattn.ops.buffers import GrowableBuffer

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@runtime_checkable
class StepInfo(Protocol):
    """What one decode step attended to."""

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]``."""
        ...

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, t]`` over the stored tokens."""
        ...


@runtime_checkable
class DecodeState(Protocol):
    """The per-layer state of a method: the KV tokens plus whatever structure the method keeps.

    Shapes: ``keys, values: [B, H_kv, T, D]`` blocks; ``query: [B, H_q, D]`` for one decode step,
    with ``H_q`` a multiple of ``H_kv`` (grouped-query attention, query head h uses KV head h // G).
    """

    @property
    def length(self) -> int:
        """Tokens stored (a method that evicts stores fewer than it has seen)."""
        ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens (a prefill block or one decode token) without querying."""
        ...

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Attention output ``[B, H_q, D]`` of the newest token's query over the stored tokens."""
        ...

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Causal attention ``[B, H_q, T, D]`` of the last ``T`` appended tokens' queries (prefill)."""
        ...

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Append one token (``key, value: [B, H_kv, D]``) and attend with its query."""
        ...


@runtime_checkable
class SparseMethod(Protocol):
    """A decode-time attention method: a small dataclass of hyperparameters that makes states."""

    def new_state(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> DecodeState: ...


class StatefulMethod:
    """Base of the method dataclasses: :meth:`new_state` builds the class :meth:`state_type` names.

    The state class is called as ``state_type()(method, batch, kv_heads, head_dim, **options)``.
    """

    def state_type(self) -> type:
        raise NotImplementedError

    def new_state(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> DecodeState:
        """A decode state for one layer: ``[batch, kv_heads, t, head_dim]`` keys and values."""
        return self.state_type()(
            self, batch, kv_heads, head_dim, layer_idx=layer_idx, device=device, dtype=dtype, scale=scale, softcap=softcap
        )


def resolve_device(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class KVState:
    """Base of the decode states: validated key/value storage that grows by capacity doubling.

    Subclasses implement :meth:`attend` and may hook :meth:`_after_append` (build structure) and
    :meth:`attend_block` (record prefill statistics, evict). Scores are computed in float32 (float64
    for float64 inputs) whatever the storage dtype, so fp16/bf16 caches never overflow.

    Args:
        batch, kv_heads, head_dim: the layer's cache shape ``[batch, kv_heads, t, head_dim]``.
        layer_idx: seeds per-layer randomness.
        device, dtype: where and how the keys and values are stored.
        scale: logit scale (default ``head_dim ** -0.5``).
        softcap: Gemma-2 logit soft-capping, or None.
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.layer_idx = layer_idx
        self.device = resolve_device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype(dtype)
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
        self.softcap = None if softcap is None else float(softcap)
        self._keys = GrowableBuffer(dim=2)
        self._values = GrowableBuffer(dim=2)

    # -- storage -------------------------------------------------------------------------------

    @property
    def length(self) -> int:
        return len(self._keys)

    @property
    def keys(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored keys (no copy)."""
        return self._keys.view()

    @property
    def values(self) -> torch.Tensor:
        """``[B, H_kv, t, D]`` view of the stored values (no copy)."""
        return self._values.view()

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: ``kv`` (the stored tokens) and whatever structure the method adds."""
        return {"kv": 2 * self.length * self.batch * self.kv_heads * self.head_dim * self.dtype.itemsize}

    def _check_block(self, name: str, x: torch.Tensor, tokens_dim: bool) -> None:
        expected = (self.batch, self.kv_heads, "T", self.head_dim) if tokens_dim else (self.batch, self.kv_heads, self.head_dim)
        shape_ok = x.dim() == len(expected) and all(e == "T" or e == s for e, s in zip(expected, x.shape))
        if not shape_ok:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but this state was made for {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but this state lives on {self.device}")

    def _check_query(self, query: torch.Tensor, block: bool = False) -> int:
        """Validate ``query: [B, H_q, D]`` (or ``[B, H_q, T, D]`` for a block); return the group size."""
        B, D = self.batch, self.head_dim
        want = f"({B}, H_q, T, {D})" if block else f"({B}, H_q, {D})"
        if query.dim() != (4 if block else 3) or query.shape[0] != B or query.shape[-1] != D or query.shape[1] % self.kv_heads:
            raise ValueError(
                f"query must have shape {want} with H_q a multiple of kv_heads={self.kv_heads}, got {tuple(query.shape)}"
            )
        if query.dtype != self.dtype:
            raise ValueError(f"query has dtype {query.dtype} but this state was made for {self.dtype}")
        if query.device != self.device:
            raise ValueError(f"query is on {query.device} but this state lives on {self.device}")
        if self.length == 0:
            raise ValueError("attend() called on an empty state: append keys and values first")
        return query.shape[1] // self.kv_heads

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add a block of tokens ``[B, H_kv, T, D]`` (prefill, chunked prefill or one decode token)."""
        self._check_block("keys", keys, True)
        self._check_block("values", values, True)
        if keys.shape != values.shape:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
        self._keys.append(keys)
        self._values.append(values)
        self._after_append(keys.shape[2])

    def prefill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Alias of :meth:`append` (a prompt block), resolved on the subclass."""
        self.append(keys, values)

    def _after_append(self, n_new: int) -> None:
        """Hook: bring the method's structure up to date with ``n_new`` new tokens."""

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Append one token (``key, value: [B, H_kv, D]``) and attend with its ``query: [B, H_q, D]``."""
        self._check_block("key", key, False)
        self._check_block("value", value, False)
        self.append(key.unsqueeze(2), value.unsqueeze(2))
        return self.attend(query)

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        raise NotImplementedError

    def attend_block(self, query: torch.Tensor) -> torch.Tensor:
        """Dense causal attention of the last ``T`` stored tokens' queries ``[B, H_q, T, D]`` (prefill).

        Every method prefills densely (the paper's setting); methods that learn from the prompt's
        attention override this to record what they need.
        """
        group = self._check_query(query, block=True)
        T = query.shape[2]
        if T > self.length:
            raise ValueError(f"attend_block: {T} queries but only {self.length} stored tokens")
        B, H, D = self.batch, self.kv_heads, self.head_dim
        out = causal_block_attention(query.reshape(B, H, group, T, D), self.keys, self.values, self.scale, self.softcap)
        return out.reshape(B, H * group, T, D)

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep (or repeat, or reorder) batch rows: ``index: [B']`` long (beam search, ``generate``'s expansion)."""
        index = index.to(self.device)
        for buf in self._buffers():
            buf.apply_(lambda t: t.index_select(0, index))
        self.batch = int(index.numel())

    def _buffers(self) -> list[GrowableBuffer]:
        """Every buffer whose dim 0 is the batch (subclasses add their structure's)."""
        return [self._keys, self._values]
