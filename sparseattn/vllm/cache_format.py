"""vLLM's CPU KV cache as the paged engine reads it: the page layouts (``vec``/``vec16``, ``amx``) and the fp8 formats.

One layer's cache is ``[num_blocks, H_kv, block_size, 2 * D]``; per (block, KV head) its ``2 * block_size * D``
elements are the page's keys stored *transposed*, ``[D, block_size]``, then its values ``[block_size, D]``
(:func:`page_views`, checked against vLLM's ``cpu_attn_reshape_and_cache``); the ``amx`` kernel's layout holds the
same numbers otherwise (:func:`amx_layout`, :func:`vec_layout`). An fp8 cache holds each number divided by its
layer's scale in one byte (:class:`KVFormat`). No vLLM import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FP8_FORMATS", "KVFormat", "amx_layout", "page_views", "vec_layout"]


#: vLLM's fp8 KV cache dtypes (``kv_cache_dtype``) and the float8 format its uint8 cache holds (checked against
#: vLLM's CPU cache-update op: tests/test_vllm_plugin.py).
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class KVFormat:
    """How a layer's paged cache stores its keys and values.

    ``dtype``: vLLM's ``kv_cache_dtype``: ``"auto"`` (the cache holds the model's dtype) or one of
    :data:`FP8_FORMATS` (a uint8 cache of float8 numbers); ``k_scale``, ``v_scale``: the layer's scales
    (a stored number times its scale is the key or value; vLLM's ``layer._k_scale_float``).

    Example:
        >>> KVFormat("fp8_e5m2", 0.5).fp8
        torch.float8_e5m2
    """

    dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in FP8_FORMATS:
            raise ValueError(f"KVFormat.dtype must be 'auto' or one of {sorted(FP8_FORMATS)}, got {self.dtype!r}")
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"KVFormat.{name} must be a finite number > 0, got {value!r}")

    @property
    def fp8(self) -> torch.dtype | None:
        """The float8 format of an fp8 cache, None for ``"auto"``."""
        return FP8_FORMATS.get(self.dtype)


def page_views(kv_cache: torch.Tensor, fmt: KVFormat = KVFormat()) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[N, H_kv, D, bs]`` (transposed) and values ``[N, H_kv, bs, D]`` of a CPU cache ``[N, H_kv, bs, 2 D]`` (views, no copy).

    An fp8 cache (uint8, ``fmt.dtype`` one of :data:`FP8_FORMATS`) is viewed as its float8 format: the
    numbers as stored, which the reader multiplies by ``fmt.k_scale`` / ``fmt.v_scale``.
    """
    if (kv_cache.dtype == torch.uint8) != (fmt.fp8 is not None):
        raise ValueError(f"a {kv_cache.dtype} KV cache read as {fmt.dtype!r}: an fp8 kv_cache_dtype needs vLLM's uint8 cache, and only it")
    if fmt.fp8 is not None:
        kv_cache = kv_cache.view(fmt.fp8)
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache.view(n, h, 2, bs * d)
    return pages[:, :, 0].view(n, h, d, bs), pages[:, :, 1].view(n, h, bs, d)


def amx_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """A cache in the ``vec`` layout (:func:`page_views`) rewritten in the layout of vLLM's ``amx`` kernel (bfloat16, pages
    and head dims of multiples of 32): per (block, KV head), keys ``[bs/16, D/2, 16, 2]`` (groups of 16 tokens, each
    token's keys of a pair of channels side by side) then values ``[D/16, bs/2, 16, 2]`` (blocks of 16 channels, each
    channel's values of a pair of tokens side by side). A copy; checked against vLLM's own cache-update op for
    ``amx`` (tests/test_vllm_plugin.py). The paged kernel reads it in place (``fused_decode(..., layout="amx")``);
    :func:`vec_layout` is the way back.

    >>> cache = torch.randn(3, 2, 32, 2 * 64).to(torch.bfloat16)
    >>> torch.equal(vec_layout(amx_layout(cache)), cache)
    True
    """
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    if bs % 32 or d % 32:
        raise ValueError(f"amx_layout: pages of {bs} tokens, head dim {d}; allowed: multiples of 32 (vLLM's amx kernel)")
    keys_t, values = page_views(kv_cache)
    out = torch.empty_like(kv_cache).view(n, h, 2, bs * d)
    out[:, :, 0] = keys_t.reshape(n, h, d // 2, 2, bs // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(n, h, bs * d)
    out[:, :, 1] = values.reshape(n, h, bs // 2, 2, d // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(n, h, bs * d)
    return out.view(kv_cache.shape)


def vec_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`amx_layout`: an ``amx``-layout cache in the ``vec`` layout (a copy)."""
    n, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    pages = kv_cache.view(n, h, 2, bs * d)
    out = torch.empty_like(kv_cache).view(n, h, 2, bs * d)
    out[:, :, 0] = pages[:, :, 0].reshape(n, h, bs // 16, d // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, h, bs * d)
    out[:, :, 1] = pages[:, :, 1].reshape(n, h, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(n, h, bs * d)
    return out.view(kv_cache.shape)
