"""Vanilla attention over every stored token: the reference every budget is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.backends.cpu_backend import CpuBackend
from sparseattn.backends.cpu_kernels import segment_attention_cpu
from sparseattn.methods.base import LayerSpec, KVState, StatefulMethod
from sparseattn.ops.attention import dense_decode_attention
from sparseattn.ops.layout import SegmentLayout
from sparseattn.registry import MethodEntry, register

DENSE_BACKENDS = ("torch", "cpu")


@dataclass(frozen=True)
class AllTokens:
    """A step that attended every one of ``length`` stored tokens with each of ``heads`` query heads."""

    length: int
    batch: int
    heads: int
    device: torch.device

    @property
    def attended(self) -> torch.Tensor:
        return torch.full((self.batch, self.heads), self.length, dtype=torch.long, device=self.device)

    def to_mask(self) -> torch.Tensor:
        return torch.ones(self.batch, self.heads, self.length, dtype=torch.bool, device=self.device)


@dataclass(frozen=True)
class Dense(StatefulMethod):
    """Dense (vanilla) attention, decoding from capacity-doubling storage (no per-token copy of the cache).

    Args:
        backend: ``"torch"`` (default: torch's SDPA, the baseline every speed is measured against) or
            ``"cpu"`` (the cpu backend's C kernel over all tokens, for comparing like with like: the
            same kernel that runs the sparse methods on the CPU; float32/bfloat16/float16 on CPU).

    Example:
        >>> state = Dense().new_state(batch=1, kv_heads=2, head_dim=8)
        >>> out, info = state.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
        >>> info.attended.tolist()
        [[1, 1, 1, 1]]
    """

    backend: str = "torch"

    def __post_init__(self) -> None:
        if self.backend not in DENSE_BACKENDS:
            raise ValueError(f"Dense.backend must be one of {DENSE_BACKENDS}, got {self.backend!r}")

    def state_type(self) -> type:
        return DenseState


class DenseState(KVState):
    """Every stored token, every step: one SDPA call per KV head with its query heads as rows."""

    def __init__(self, method: Dense, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.method = method

    def _cpu_refusal(self, grouped: torch.Tensor, keys: torch.Tensor) -> None:
        """Raise ValueError when the C kernel cannot answer ``grouped: [B, H_kv, G, D]`` over ``keys``."""
        every = SegmentLayout(length=keys.shape[2], sinks=keys.shape[2], segment_size=1, n_segments=0)
        none = torch.zeros(*grouped.shape[:2], 1, 0, dtype=torch.long)
        reason = CpuBackend().refusal(grouped, keys, every, none, self.softcap)
        if reason is not None:
            raise ValueError(f"Dense(backend='cpu') cannot run: {reason}")

    def _check_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Also ask the C kernel before the token is stored: a step it refuses must leave the state unchanged."""
        super()._check_step(query, key, value)
        if self.method.backend == "cpu":
            B, H, D = self.batch, self.kv_heads, self.head_dim
            self._cpu_refusal(query.reshape(B, H, query.shape[1] // H, D), key.unsqueeze(2))

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, AllTokens]:
        group = self._check_query(query)
        B, H, D = self.batch, self.kv_heads, self.head_dim
        grouped = query.reshape(B, H, group, D)
        if self.method.backend == "cpu":
            self._cpu_refusal(grouped, self.keys)
            every = SegmentLayout(length=self.length, sinks=self.length, segment_size=1, n_segments=0)  # all tokens: sinks
            none = torch.zeros(B, H, 1, 0, dtype=torch.long)
            out = segment_attention_cpu(grouped, self.keys, self.values, every, none, self.scale, self.softcap)
        else:
            out = dense_decode_attention(grouped, self.keys, self.values, self.scale, self.softcap)
        info = AllTokens(self.length, B, H * group, self.device)
        return out.reshape(B, H * group, D), info


register(MethodEntry("dense", "vanilla attention over every past token", Dense, origin=__name__))
