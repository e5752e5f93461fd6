"""The xformers backend: a placeholder that explains why it does not run.

xformers has no segment-sparse decode op, and sparseattn has no xformers path yet, so this backend
declares ``segment_attention`` with no device, dtype or head dim: a name ``SegmentSearch(backend=...)``
accepts, whose every call is refused with the reason. ``auto`` does not walk it unless xformers is
installed (and then it refuses, and ``auto`` goes on).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import BackendBase, Capability, declared_refusal, not_installed


@dataclass(frozen=True)
class XformersBackend(BackendBase):
    """Refuses every call, saying whether xformers is installed."""

    name: ClassVar[str] = "xformers"
    REQUIRES: ClassVar[tuple[str, ...]] = ("xformers",)
    CAPABILITIES: ClassVar[Mapping[str, Capability]] = {
        "segment_attention": Capability(devices=(), dtypes=(), head_dims=()),
    }

    def refusal(self, op: str, q: torch.Tensor, keys: torch.Tensor, softcap: float | None = None) -> str | None:
        missing = not_installed(self)
        if missing is not None:
            return missing
        if op not in self.CAPABILITIES:
            return declared_refusal(self, op, q)
        return f"xformers is installed, but sparseattn has no xformers path for {op}"
