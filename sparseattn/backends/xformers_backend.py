"""The xformers backend: a placeholder that explains why it does not run.

xformers has no segment-sparse decode op, and sparseattn has no xformers path yet, so this backend
always refuses; it is in the priority list so that dispatch reports it, like every other backend.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparseattn.backends.base import refuse_or_check
from sparseattn.ops.layout import SegmentLayout


@dataclass(frozen=True)
class XformersBackend:
    """Refuses every call, saying whether xformers is installed."""

    name: ClassVar[str] = "xformers"
    SUPPORTED_DEVICES: ClassVar[tuple[str, ...]] = ()
    SUPPORTED_DTYPES: ClassVar[tuple[torch.dtype, ...]] = ()
    SUPPORTED_HEAD_DIMS: ClassVar[tuple[int, ...]] = ()

    def refusal(
        self, q: torch.Tensor, keys: torch.Tensor, layout: SegmentLayout, segments: torch.Tensor, softcap: float | None = None
    ) -> str | None:
        if importlib.util.find_spec("xformers") is None:
            return "xformers is not installed"
        return "xformers is installed, but sparseattn has no xformers path for segment-sparse decode"

    def segment_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        layout: SegmentLayout,
        segments: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Always raises ValueError with the reason (see :meth:`refusal`)."""
        refuse_or_check(self, q, keys, values, layout, segments, softcap)
        raise AssertionError("unreachable: the xformers backend refuses every call")
