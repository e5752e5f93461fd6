"""transformers integration: the ``sparseattn`` attention implementation, a sparse ``Cache``, model loading."""

from sparseattn.hf.apply import SparseAttention, apply, cache_kwargs, check_model
from sparseattn.hf.attention import ATTENTION_NAME, register
from sparseattn.hf.cache import SparseCache, SparseLayer
from sparseattn.hf.loop import LoopResult, generate
from sparseattn.hf.static_cache import StaticSparseCache
from sparseattn.hf.models import (
    DEFAULT_MODEL,
    ModelSourceError,
    default_model_available,
    default_model_unavailable_reason,
    load_model,
    local_model_dir,
    resolve_model_source,
)

__all__ = [
    "ATTENTION_NAME",
    "DEFAULT_MODEL",
    "LoopResult",
    "ModelSourceError",
    "SparseAttention",
    "SparseCache",
    "SparseLayer",
    "StaticSparseCache",
    "apply",
    "cache_kwargs",
    "check_model",
    "default_model_available",
    "default_model_unavailable_reason",
    "generate",
    "load_model",
    "local_model_dir",
    "register",
    "resolve_model_source",
]
