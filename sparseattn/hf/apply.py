"""Apply a sparse method to a transformers model: explicit, reversible, no patching on import."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch.utils.hooks import RemovableHandle

from sparseattn.hf.attention import ATTENTION_NAME, link_caches, register, unlink_caches
from sparseattn.hf.cache import SparseCache
from sparseattn.methods.base import SparseMethod

# Models whose attention does not go through transformers' attention registry.
_NO_REGISTRY = ("bloom", "falcon", "mpt", "gpt_neo", "gptj", "xglm")


def check_model(model) -> None:
    """Raise a ValueError naming the model when its attention cannot be routed through sparseattn."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} is not a transformers model (it has no config)")
    model_type = getattr(config, "model_type", type(model).__name__)
    if config.is_encoder_decoder if hasattr(config, "is_encoder_decoder") else False:
        raise ValueError(f"{model_type}: encoder-decoder models are not supported; sparseattn decodes decoder-only models")
    if model_type in _NO_REGISTRY or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{model_type} ({type(model).__name__}) does not use transformers' attention registry, so sparseattn cannot "
            "route its attention; supported are models whose class sets _supports_attention_backend (Llama, Mistral, "
            "Qwen2/3, Phi-3, Gemma and most recent decoder-only models)"
        )


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes ``cache`` to ``model(...)`` and ``model.generate(...)``, as a dict to unpack.

    transformers renamed ``past_key_values`` to ``cache`` in 5.24 (the old name warns, and stops working
    in forward calls at 5.40); this picks the name the installed model's forward takes, so one call
    works on both sides of the rename::

        model.generate(ids, **cache_kwargs(model, sparse.new_cache()), max_new_tokens=8)
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    return {"cache": cache} if "cache" in parameters else {"past_key_values": cache}


@dataclass
class SparseAttention:
    """A sparse method applied to a model: the attention implementation switched to ``"sparseattn"``.

    Make caches with :meth:`new_cache` and pass them to ``model.generate(..., cache=cache)``
    (``past_key_values=cache`` before transformers 5.24; :func:`cache_kwargs` picks the name) or to
    your own forward loop (a ``SparseCache(method, config)`` made by hand works too, and several
    caches can be used in turn). :meth:`remove` (or leaving the ``with`` block, even by an exception)
    restores the model's previous attention implementation and removes the hooks that let the
    attention function find the cache each attention module is called with.
    """

    model: object
    method: SparseMethod
    previous: str | dict | None = None
    active: bool = field(default=False)
    hooks: list[RemovableHandle] = field(default_factory=list, repr=False)

    def new_cache(self) -> SparseCache:
        """A fresh cache for one generation (or one batch of them)."""
        if not self.active:
            raise RuntimeError("this SparseAttention was removed; apply the method again")
        return SparseCache(self.method, config=self.model.config)

    def remove(self) -> None:
        if self.active:
            unlink_caches(self.hooks)
            self.model.set_attn_implementation(self.previous or "sdpa")
            self.active = False

    def __enter__(self) -> SparseAttention:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def apply(model, method: SparseMethod) -> SparseAttention:
    """Route ``model``'s attention through sparseattn with ``method``; returns a handle (also a context manager).

    Switches the attention implementation to ``"sparseattn"`` and hooks each attention module so the
    attention function reaches the cache the module is called with (transformers passes it the module,
    not the cache); no state outside the model and its caches. Example::

        with sparseattn.apply(model, Radar(top_k=8)) as sparse:
            out = model.generate(**inputs, **cache_kwargs(model, sparse.new_cache()), max_new_tokens=64)
    """
    check_model(model)
    if not hasattr(method, "new_state"):
        raise ValueError(f"apply() needs a sparse method with new_state(), got {method!r}")
    register()
    hooks = link_caches(model)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except BaseException:
        unlink_caches(hooks)
        raise
    return SparseAttention(model=model, method=method, previous=previous, active=True, hooks=hooks)
