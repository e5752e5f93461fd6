"""What every sparse decode method offers: a per-layer state that appends tokens and answers queries."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@runtime_checkable
class StepInfo(Protocol):
    """What one decode step attended to."""

    @property
    def attended(self) -> torch.Tensor:
        """Tokens attended per query head, ``[B, H_q]``."""
        ...

    def to_mask(self) -> torch.Tensor:
        """The attended set as a boolean mask ``[B, H_q, t]``."""
        ...


@runtime_checkable
class DecodeState(Protocol):
    """The per-layer state of a method: the KV tokens plus whatever structure the method keeps.

    Shapes: ``keys, values: [B, H_kv, T, D]`` blocks; ``query: [B, H_q, D]`` for one decode step,
    with ``H_q`` a multiple of ``H_kv`` (grouped-query attention, query head h uses KV head h // G).
    """

    @property
    def length(self) -> int: ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add tokens (a prefill block or one decode token) without querying."""
        ...

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, StepInfo]:
        """Attention output ``[B, H_q, D]`` of the newest token's query over the stored tokens."""
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
    ) -> DecodeState: ...
