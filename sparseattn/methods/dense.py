"""Vanilla attention over every stored token: the reference every budget is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseattn.backends.registry import check_backend_name, get_backend
from sparseattn.methods.base import LayerSpec, KVState, StatefulMethod
from sparseattn.registry import MethodEntry, register


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

    @property
    def merged(self) -> torch.Tensor:
        return torch.zeros(self.batch, self.heads, dtype=torch.long, device=self.device)

    def to_mask(self) -> torch.Tensor:
        return torch.ones(self.batch, self.heads, self.length, dtype=torch.bool, device=self.device)


@dataclass(frozen=True)
class Dense(StatefulMethod):
    """Dense (vanilla) attention, decoding from capacity-doubling storage (no per-token copy of the cache).

    Args:
        backend: a backend that implements the ``dense`` op (:mod:`sparseattn.backends`): ``"torch"``
            (default: torch's SDPA, the baseline every speed is measured against) or ``"cpu"`` (the
            cpu backend's C kernel over all tokens, for comparing like with like: the same kernel that
            runs the sparse methods on the CPU; float32/bfloat16/float16 on CPU).

    Example:
        >>> state = Dense().new_state(batch=1, kv_heads=2, head_dim=8)
        >>> out, info = state.step(torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
        >>> info.attended.tolist()
        [[1, 1, 1, 1]]
    """

    backend: str = "torch"

    def __post_init__(self) -> None:
        check_backend_name("Dense.backend", self.backend, "dense", "torch", auto=False)

    def state_type(self) -> type:
        return DenseState


class DenseState(KVState):
    """Every stored token, every step: one call of the backend's ``dense`` op per step (a KV group's query heads as rows)."""

    appends_only = True  # stored tokens are read, never rewritten: a shared prefill may store the prompt once

    def __init__(self, method: Dense, layer: LayerSpec) -> None:
        super().__init__(layer)
        self.method = method
        self._backend = get_backend(method.backend)
        self._accepted = False  # the backend accepted this state's inputs once: later steps skip its checks

    def _accept(self, grouped: torch.Tensor, keys: torch.Tensor) -> None:
        """Raise ValueError when the backend refuses ``grouped: [B, H_kv, G, D]`` over ``keys``; else remember it accepted."""
        reason = self._backend.refusal("dense", grouped, keys, self.softcap)
        if reason is not None:
            raise ValueError(f"Dense(backend={self.method.backend!r}) cannot run: {reason}")
        self._accepted = True

    def _check_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Also ask the backend before the token is stored: a step it refuses must leave the state unchanged."""
        super()._check_step(query, key, value)
        if not self._accepted:
            B, H, D = self.batch, self.kv_heads, self.head_dim
            self._accept(query.reshape(B, H, query.shape[1] // H, D), key.unsqueeze(2))

    def attend(self, query: torch.Tensor) -> tuple[torch.Tensor, AllTokens]:
        group = self._check_query(query)
        B, H, D = self.batch, self.kv_heads, self.head_dim
        grouped = query.reshape(B, H, group, D)
        if not self._accepted:
            self._accept(grouped, self.keys)
        out = self._backend.dense(grouped, self.keys, self.values, self.scale, self.softcap, checked=False)
        info = AllTokens(self.length, B, H * group, self.device)
        return out.reshape(B, H * group, D), info


register(
    MethodEntry(
        "dense", "vanilla attention over every past token: the reference every method is measured against", Dense,
        origin=__name__, category="baseline", engines=("transformers", "vllm"),
    )
)  # fmt: skip
