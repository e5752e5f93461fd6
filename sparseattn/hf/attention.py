"""The ``sparseattn`` attention implementation for transformers' attention registry.

Registered once under :data:`ATTENTION_NAME` together with transformers' ``sdpa_mask`` as its mask
builder (without one, custom implementations get no padding mask). transformers gives an attention
function the attention module but not the cache, so :func:`link_caches` (run by
:func:`sparseattn.hf.apply`) puts forward hooks on the model's attention modules that keep the
``past_key_values`` each call receives on the module for that call only. When that cache's layer
``module.layer_idx`` is a :class:`~sparseattn.hf.cache.SparseLayer`, the layer's decode state answers:
prefill blocks densely (and the state builds its structure), decode steps sparsely. Otherwise (no
cache, a plain ``DynamicCache``, a sliding-window layer, a model not linked) the call is dense,
exactly as transformers' own ``sdpa``. Nothing is kept at module level: several models and caches
can be used at once.

Under tensor parallelism (``from_pretrained(..., tp_plan="auto")``) the attention function sees the
heads of its rank only; :func:`kv_head_shard` reads which of the model's KV heads they are off the
module's sharded parameters, so each state draws per-head randomness as one process would.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.hooks import RemovableHandle
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparseattn.methods.base import LayerSpec
from sparseattn.hf.cache import RowwiseState, SparseLayer
from sparseattn.hf.static_cache import StaticSparseLayer
from sparseattn.ops.attention import soft_cap

ATTENTION_NAME = "sparseattn"

#: The attribute (in the module's ``__dict__``) holding the cache of the call in progress.
CALL_CACHE = "_sparseattn_call_cache"

#: The names an attention module's forward takes its cache under: ``cache`` since transformers 5.24
#: (``past_key_values`` is still accepted through a deprecation shim until 5.40), ``past_key_values`` before.
CACHE_ARGUMENTS = ("cache", "past_key_values")

_UNSUPPORTED_KWARGS = (
    ("s_aux", "learned attention sinks (s_aux, e.g. gpt-oss)"),
    ("position_bias", "additive position bias (e.g. T5-style relative attention)"),
)


def register() -> None:
    """Register the attention function and its mask builder under ``"sparseattn"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, sparse_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _model_name(module: torch.nn.Module) -> str:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) or type(module).__name__


def _cache_position(module: torch.nn.Module) -> int | None | bool:
    """Where ``module.forward`` takes its cache (``cache`` or ``past_key_values``): its positional index,
    None if only by keyword (``**kwargs`` or keyword-only), False if not at all."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(parameters):
        if p.name in CACHE_ARGUMENTS:
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional and all(q.kind != q.VAR_POSITIONAL for q in parameters[:i]) else None
    return None if any(p.kind == p.VAR_KEYWORD for p in parameters) else False


def link_caches(model: torch.nn.Module) -> list[RemovableHandle]:
    """Hook every attention module of ``model`` (a module with an integer ``layer_idx`` whose forward takes
    a cache, see :data:`CACHE_ARGUMENTS`) so that, while it runs, the cache it was called with is on the module.

    Returns the hook handles (remove them to unlink). Raises a ValueError when no module qualifies.
    """
    handles: list[RemovableHandle] = []
    for module in model.modules():
        if not isinstance(getattr(module, "layer_idx", None), int) or isinstance(module.layer_idx, bool):
            continue
        position = _cache_position(module)
        if position is False:
            continue

        def enter(module, args, kwargs, position=position):
            named = [kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
            if named:
                cache = named[0]
            else:
                cache = args[position] if position is not None and len(args) > position else None
            module.__dict__[CALL_CACHE] = cache

        def leave(module, args, kwargs, output):
            module.__dict__.pop(CALL_CACHE, None)

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    if not handles:
        raise ValueError(
            f"{_model_name(model)}: no attention module with an integer layer_idx whose forward takes a cache "
            "(cache or past_key_values); "
            "sparseattn cannot link its attention to the cache"
        )
    return handles


def unlink_caches(handles: list[RemovableHandle]) -> None:
    """Remove the hooks :func:`link_caches` returned."""
    for handle in handles:
        handle.remove()
    handles.clear()


def sparse_layer_of(module: torch.nn.Module, key: torch.Tensor) -> SparseLayer | StaticSparseLayer | None:
    """The :class:`SparseLayer` (or :class:`StaticSparseLayer`) ``module`` is attending with: layer ``module.layer_idx``
    of the cache the module was called with, when it is one (it then checks ``key`` is what it returned); None otherwise."""
    cache = module.__dict__.get(CALL_CACHE)
    layers = getattr(cache, "layers", None)
    index = getattr(module, "layer_idx", None)
    if layers is None or not isinstance(index, int) or not 0 <= index < len(layers):
        return None
    layer = layers[index]
    if not isinstance(layer, (SparseLayer, StaticSparseLayer)):
        return None
    layer.claim(key)
    return layer


def left_padding(attention_mask: torch.Tensor | None, batch: int, kv_length: int, model: str) -> list[int] | None:
    """Leading pad tokens per row, read off the last query row of a 4-D mask; None when nothing is padded.

    Raises when a row's masked keys are not a prefix (right padding, holes): decoding needs left padding.
    """
    if attention_mask is None:
        return None
    allowed = attention_mask[:, 0, -1, :kv_length]
    if allowed.dtype != torch.bool:  # an additive float mask: 0 where allowed, very negative where not
        allowed = allowed > torch.finfo(allowed.dtype).min / 2
    allowed = allowed.expand(batch, kv_length)
    pads = (~allowed).long().cumprod(-1).sum(-1)  # length of each row's masked prefix
    if bool((allowed.sum(-1) != kv_length - pads).any()):
        raise ValueError(
            f"{model}: the attention mask hides tokens that are not a left-padding prefix (right padding or holes); "
            "sparse decoding needs left padding (tokenizer.padding_side = 'left')"
        )
    if bool((pads >= kv_length).any()):
        raise ValueError(f"{model}: a batch row is padding only; every row needs at least one real token")
    return None if not bool(pads.any()) else [int(p) for p in pads.tolist()]


def dense_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Dense attention as transformers' ``sdpa`` computes it; soft-capped logits take a math path."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"{_model_name(module)}: dropout with soft-capped logits is not supported by sparseattn")
    groups = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    logits = soft_cap(query.float() @ k.transpose(-1, -2) * scale, softcap)
    if attention_mask is not None:
        # The most negative finite value, as eager attention does: a fully masked (padding) query row gets
        # uniform weights instead of NaN, and NaN never reaches the padded keys of later layers.
        if attention_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attention_mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + attention_mask.float()
    elif query.shape[2] > 1:
        T, L = query.shape[2], key.shape[2]
        visible = torch.arange(L, device=query.device) <= L - T + torch.arange(T, device=query.device).view(-1, 1)
        logits = logits.masked_fill(~visible, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query: [B, H_q, T, D]``, ``key, value: [B, H_kv, L, D]``.

    Returns ``([B, T, H_q, D], None)``.
    """
    layer = sparse_layer_of(module, key)
    softcap = kwargs.pop("softcap", None)
    if layer is None:
        return dense_attention_forward(module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs)
    model = _model_name(module)
    for name, feature in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{model}: sparseattn does not support {feature}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{model}: layer {layer.layer_idx} has a sliding window but holds a sparse state")
    if dropout and module.training:
        raise NotImplementedError(f"{model}: sparseattn is for inference; call model.eval() (attention dropout is on)")
    if isinstance(layer, StaticSparseLayer):  # a fixed-shape step: its state knows the scale and soft-cap already
        return layer.attend(query), None
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    T = query.shape[2]
    if layer.state is None:
        _create_state(layer, module, attention_mask, scale, softcap, model)
    elif T > 1 and attention_mask is not None:
        _check_no_new_padding(attention_mask, layer.seen, T, model)
    if T == 1:
        out, info = layer.state.attend(query[:, :, 0])
        layer.record_step(info)
        return out.to(query.dtype).unsqueeze(1), None
    out = layer.state.attend_block(query)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _create_state(layer: SparseLayer, module, attention_mask, scale: float, softcap: float | None, model: str) -> None:
    keys, values = layer._pending
    layer._pending = None
    B, H, L, D = keys.shape
    pads = left_padding(attention_mask, B, L, model)
    offset, total = kv_head_shard(module, H, model)
    n_layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)

    def new_state(batch: int):
        spec = LayerSpec(batch, H, D, layer.layer_idx or 0, keys.device, keys.dtype, scale, softcap, offset, total, n_layers)
        return layer.method.new_state(spec)

    layer.state = new_state(B) if pads is None else RowwiseState([new_state(1) for _ in range(B)], pads)
    layer.state.append(keys, values)


def _tensor_parallel_rank(module: torch.nn.Module, model: str) -> tuple[int, int] | None:
    """``(rank, size)`` on the tensor-parallel mesh dimension ``module``'s parameters are sharded over, or
    None when none is (no process group, or parameters that are not sharded DTensors)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor  # only once a process group exists

    for param in module.parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        if "tp" in names:
            dim = names.index("tp")
        elif mesh.ndim == 1:
            dim = 0
        else:
            raise NotImplementedError(
                f"{model}: attention parameters are sharded over a {mesh.ndim}-D device mesh {names or ''} without a "
                "'tp' dimension; sparseattn finds its KV heads on a 1-D tensor-parallel mesh or the 'tp' dimension"
            )
        if param.placements[dim].is_shard():
            return mesh.get_local_rank(dim), mesh.size(dim)
    return None


def kv_head_shard(module: torch.nn.Module, kv_heads: int, model: str) -> tuple[int, int]:
    """``(offset, total)``: this process holds the model's KV heads ``offset .. offset + kv_heads - 1`` of ``total``.

    ``(0, kv_heads)`` unless ``module`` is tensor-parallel (transformers' ``tp_plan`` shards q/k/v
    column-wise, so the attention function sees ``kv_heads = total / tp_size`` local heads and rank
    ``r`` holds the ``r``-th block of them). Raises when the local heads are not such a block.
    """
    config = getattr(module, "config", None)
    declared = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if declared == kv_heads:
        return 0, kv_heads
    shard = _tensor_parallel_rank(module, model)
    if shard is None:
        return 0, kv_heads
    rank, size = shard
    if declared is not None and kv_heads * size != declared:
        fix = (
            f"use a tensor-parallel size that divides {declared}" if declared % size
            else "the model's sharding plan splits them some other way, which sparseattn does not support"
        )
        raise ValueError(
            f"{model}: layer {getattr(module, 'layer_idx', '?')} holds {kv_heads} KV heads on rank {rank} of a {size}-way "
            f"tensor-parallel mesh, but the model has {declared}: not an even split of {declared} // {size} per rank, "
            f"so sparseattn cannot tell which of the model's heads these are; {fix}"
        )
    return rank * kv_heads, kv_heads * size


def _check_no_new_padding(attention_mask: torch.Tensor, seen: int, T: int, model: str) -> None:
    allowed = attention_mask[:, 0, -1, seen - T : seen]
    if allowed.dtype != torch.bool:
        allowed = allowed > torch.finfo(allowed.dtype).min / 2
    if not bool(allowed.all()):
        raise ValueError(f"{model}: padding after the first prefill block is not supported; pad on the left of the prompt")


__all__ = [
    "ATTENTION_NAME",
    "CALL_CACHE",
    "dense_attention_forward",
    "kv_head_shard",
    "left_padding",
    "link_caches",
    "register",
    "sparse_attention_forward",
    "sparse_layer_of",
    "unlink_caches",
]
