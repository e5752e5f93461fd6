"""vLLM's CPU attention backend with sparseattn's paged engine answering the decode tokens.

:class:`SparseCPUAttentionBackend` is vLLM's ``CPUAttentionBackend`` (same name ``CPU_ATTN``, metadata
builder, KV-cache shape and layout) with its own impl: prefill and chunked prefill run vLLM's kernel
unchanged; every request with exactly one query token this step (a decode token) is answered by
:func:`sparseattn.vllm.paged.select_pages` under the method the engine was configured with
(:mod:`sparseattn.vllm.config`): by the fused C step (:mod:`sparseattn.vllm.paged_kernel`) for the
policies whose parts it knows, else by :func:`sparseattn.vllm.paged.select_pages` and vLLM's own paged
kernel over the selected pages (:func:`kernel_attend_pages`). A decode token never attends its whole
sequence: in a mixed step (prefill chunks beside decode tokens) vLLM's kernel gets the prefill
requests only (:func:`prefill_part`).

The plugin (:mod:`sparseattn.vllm.plugin`) points vLLM's ``CPU_ATTN`` entry at :data:`CPU_ATTN`,
which resolves, each time vLLM looks it up, to vLLM's own class when the config being built asks for
no sparse method, and to :class:`SparseCPUAttentionBackend` when it does.

vLLM is imported on first attribute access, not on import: ``import sparseattn.vllm.backend`` works
without vLLM (the main test suite imports every module for its doctests).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CPU_ATTN", "SUPPORTED_ISAS", "DecodeStep", "SparseCPUAttentionBackend", "SparseCPUAttentionImpl", "decode_step",
    "kernel_attend_pages", "prefill_part",
]  # noqa: F822 (the classes are built on first access, see __getattr__)

#: vLLM CPU kernel ISAs whose cache layout (keys transposed per page) the paged engine reads; the
#: ``amx``/``neon``/... layouts are not verified here and are refused.
SUPPORTED_ISAS = ("vec", "vec16")


def kernel_attend_pages(
    query: Any, kv_cache: Any, block_table: Any, pages: Any, seq_lens: Any, scale: float, softcap: float | None, isa: str,
) -> Any:
    """:func:`sparseattn.vllm.paged.attend_pages` computed by vLLM's own CPU paged-attention kernel.

    The kernel attends whole sequences of one block table; a sparse selection differs per KV head
    (and per query head without a shared selection). So every (sequence, KV head, page list) is
    handed to the kernel as a sequence of its own, over a view of the cache with one KV head per
    block: ``[N, H_kv, bs, 2 D]`` read as ``[N * H_kv, 1, bs, 2 D]`` (the same memory; block ``b``
    of head ``h`` is block ``b * H_kv + h``), its block table the listed pages (sinks, selected,
    tail: the partial last page last), its length the listed pages' tokens. The kernel reads the
    bf16/fp16 pages in place and accumulates in float32, as it does for stock vLLM's decode.
    Tested against :func:`~sparseattn.vllm.paged.attend_pages` (tests/test_vllm_plugin.py).
    """
    import torch
    from vllm import _custom_ops as ops

    B, H_q, D = query.shape
    N, H, bs, _ = kv_cache.shape
    Gs, P = pages.shape[2], pages.shape[3]
    g = H_q // H // Gs
    V = B * H * Gs  # the kernel's sequences
    phys = block_table.long().gather(1, pages.clamp(min=0).view(B, -1)).view(B, H, Gs, P)
    table = (phys * H + torch.arange(H).view(1, H, 1, 1)).view(V, P).to(torch.int32)
    n_pages = (seq_lens.long() + bs - 1) // bs
    short = (n_pages * bs - seq_lens.long()).view(B, 1, 1)  # unused slots of each sequence's last page
    lens = ((pages >= 0).sum(-1) * bs - short).view(V).to(torch.int32)
    key_cache, value_cache = kv_cache.view(N * H, 1, 2 * bs, D).chunk(2, dim=2)
    q = query.reshape(V, g, D).contiguous()
    starts = torch.arange(V + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=V, num_heads=g, num_kv_heads=1, head_dim=D, seq_lens=lens, dtype=kv_cache.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=softcap or 0.0,
        scheduler_metadata=metadata, s_aux=None,
    )
    return out.view(B, H_q, D)


#: The last mixed step's prefill part, shared by every layer: ``[vLLM's metadata, (narrowed metadata, token rows)]``.
_LAST_PREFILL: list = []


def prefill_part(attn_metadata: Any, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any, isa: str,
                 kv_cache_dtype: str) -> tuple[Any, Any]:  # fmt: skip
    """vLLM's CPU attention metadata narrowed to the requests with more than one query token, and their token rows.

    In a mixed step vLLM's kernel then attends the prefill chunks only; the decode tokens are left
    to the paged engine instead of being attended densely and overwritten. The metadata is the same
    object for every layer of a step, so the first layer narrows it (and computes the kernel's
    scheduler metadata for the narrowed batch, as vLLM's builder does for the whole one) and the
    others reuse it; the reference is held, so the object's id cannot be reused meanwhile.
    """
    import dataclasses

    import torch
    from vllm import _custom_ops as ops
    from vllm import envs

    if _LAST_PREFILL and _LAST_PREFILL[0] is attn_metadata:
        return _LAST_PREFILL[1]
    starts = attn_metadata.query_start_loc
    lengths = starts[1:] - starts[:-1]
    keep = (lengths != 1).nonzero().flatten()
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in keep.tolist()])
    query_start_loc = torch.zeros(keep.numel() + 1, dtype=starts.dtype)
    torch.cumsum(lengths[keep], 0, out=query_start_loc[1:])
    seq_lens = attn_metadata.seq_lens[keep]
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=keep.numel(), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start_loc, causal=attn_metadata.causal, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    narrowed = dataclasses.replace(
        attn_metadata, num_actual_tokens=rows.numel(), max_query_len=int(lengths[keep].max()), query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=attn_metadata.block_table[keep],
        slot_mapping=attn_metadata.slot_mapping[rows], scheduler_metadata=scheduler_metadata,
    )  # fmt: skip
    _LAST_PREFILL[:] = [attn_metadata, (narrowed, rows)]
    return narrowed, rows


@dataclass(frozen=True)
class DecodeStep:
    """The decode requests of one step (one query token each), as every layer's forward reads them.

    ``requests``: their indices in the batch; ``rows``: their token rows, None when the step is
    decode tokens only (then they are rows ``0..B-1``: the query and output rows are sliced, not
    gathered); ``table``, ``lens``: their block-table rows and lengths (the current token included);
    ``mixed``: other requests of the step have several query tokens (prefill chunks).
    """

    requests: Any
    rows: Any
    table: Any
    lens: Any
    mixed: bool


#: The last step's decode requests, shared by every layer: ``[vLLM's metadata, its seq_lens (a copy), DecodeStep | None]``.
_LAST_DECODE: list = []


def decode_step(attn_metadata: Any) -> DecodeStep | None:
    """The step's :class:`DecodeStep` (None: no decode token), computed by the first layer of a step, reused by the others.

    vLLM hands every layer of a step the same metadata object, so the first layer finds the decode
    requests (and copies their table rows) and the other 29 reuse them: per layer only the query and
    output rows and the kernel call remain. The key is the object (its reference held, so its id is
    not reused meanwhile) and its lengths (a copy: should vLLM refill the same object's buffers for
    the next step, the lengths have grown and the step is computed afresh).
    """
    import torch

    if _LAST_DECODE and _LAST_DECODE[0] is attn_metadata and torch.equal(_LAST_DECODE[1], attn_metadata.seq_lens):
        return _LAST_DECODE[2]
    starts = attn_metadata.query_start_loc
    lengths = starts[1:] - starts[:-1]
    requests = (lengths == 1).nonzero().flatten()
    n = requests.numel()
    if n == 0:
        step = None
    elif n == lengths.numel():  # decode tokens only: request i is token row i
        step = DecodeStep(requests, None, attn_metadata.block_table[:n], attn_metadata.seq_lens[:n], False)
    else:
        step = DecodeStep(requests, starts[requests].long(), attn_metadata.block_table[requests],
                          attn_metadata.seq_lens[requests], True)  # fmt: skip
    _LAST_DECODE[:] = [attn_metadata, attn_metadata.seq_lens.clone(), step]
    return step


#: The policies built in this process, by request label: one object for every layer (see :func:`_shared_policy`).
_POLICIES: dict[str, Any] = {}


def _shared_policy(request: Any) -> Any:
    """One :class:`~sparseattn.vllm.paged.PagedPolicy` per requested method for every layer of the process.

    The step plan's cache then finds the last plan's policy by identity, not by comparing the
    method's parts field by field in each of the 30 layers. The label names the method and every
    option given (the registry types the values), so equal labels build equal policies.
    """
    from sparseattn.vllm.paged import PagedPolicy

    policy = _POLICIES.get(request.label)
    if policy is None:
        policy = _POLICIES[request.label] = PagedPolicy(request.build(), request.label)
    return policy


#: The last step's plan, shared by every layer of the process: ``(decode lengths, block size, policy, plan)``.
_LAST_PLAN: list = []


def _plan_for_step(policy: Any, lens: Any, block_size: int) -> Any:
    """The fused step's plan for these decode lengths: computed by the first layer of a step, reused by the others.

    A plan depends only on the lengths (and the policy, the page size), so equal lengths are the key,
    not vLLM's metadata object (whose tensors may be buffers reused between steps).
    """
    import torch

    from sparseattn.vllm.paged_kernel import step_plan

    if _LAST_PLAN:
        last_lens, last_bs, last_policy, plan = _LAST_PLAN
        if last_bs == block_size and (last_policy is policy or last_policy == policy) and torch.equal(last_lens, lens):
            return plan
    plan = step_plan(policy, lens, block_size)
    _LAST_PLAN[:] = [lens.clone(), block_size, policy, plan]
    return plan


def _put_rows(out: Any, rows: Any, result: Any) -> None:
    """Write the decode requests' ``result`` into their rows of ``out`` (rows ``0..B-1`` when ``rows`` is None)."""
    if rows is None:
        out[: result.shape[0]] = result.to(out.dtype)
    else:
        out[rows] = result.to(out.dtype)


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else 0


def _rank_kv_heads(local_kv_heads: int) -> tuple[list[int] | None, int]:
    """The model's KV heads this tensor-parallel rank holds (None without TP), and the model's total.

    vLLM gives rank ``r`` of ``tp`` the heads from ``r * total // tp`` on (``total / tp`` of them, or one
    replicated head when ``tp > total``); the paged engine draws its random parameters for all heads
    and keeps these rows, so a head's selection is the same at every TP size.
    """
    from vllm.config import get_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return None, local_kv_heads
    total = get_current_vllm_config().model_config.get_total_num_kv_heads()
    first = get_tensor_model_parallel_rank() * total // tp
    return list(range(first, first + local_kv_heads)), total


@functools.lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    import torch
    from vllm.logger import init_logger
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
    )

    from sparseattn.vllm.config import current_request
    from sparseattn.vllm.paged import PageSummaries, select_pages
    from sparseattn.vllm.paged_kernel import FIXED, PageStore, fused_decode, fused_mode, kernel_refusal, step_plan

    logger = init_logger("vllm.sparseattn")  # under vLLM's logger, which has the handlers

    class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
        """``CPUAttentionBackendImpl`` whose decode tokens run the configured sparseattn policy over the pages."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            request = current_request()
            if request is None:
                raise ValueError("SparseCPUAttentionImpl built with no sparseattn method requested (see sparseattn.vllm.config)")
            self.policy = _shared_policy(request)
            refused = [
                why
                for why, bad in (
                    ("ALiBi slopes", self.alibi_slopes is not None),
                    (f"a sliding window of {self.sliding_window}", self.sliding_window != -1),
                    ("attention sinks (s_aux)", self.sinks is not None),
                    (f"the {self.kv_cache_dtype} KV cache", self.is_fp8_kv_cache),
                )
                if bad and self.attn_type == AttentionType.DECODER
            ]
            if refused:
                raise ValueError(f"sparseattn method {request.label!r} cannot run on this layer: it uses {', '.join(refused)}")
            self._heads = _rank_kv_heads(self.num_kv_heads)
            self._prepared: tuple[Any, torch.Generator] | None = None
            self._summaries: PageSummaries | None = None  # this layer's page summaries, per physical block
            # The fused C step where it knows the policy's parts (and builds here), else the generic path.
            refusal = kernel_refusal()
            self._fused = None if refusal is not None else fused_mode(self.policy)
            self._store: PageStore | None = None  # the fused step's page summaries, per physical block
            self._announced = False  # the first decode step's log line (logged once, not looked up per layer and step)
            logger.info_once("sparseattn: decode tokens run %r in the paged engine (%r), %s", request.label, self.policy.method,
                             "the generic path: " + (refusal or "the fused kernel does not know its parts")
                             if self._fused is None else "the fused kernel")

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
            if attn_metadata is None or self.attn_type != AttentionType.DECODER:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            isa = getattr(layer, "isa", None)
            if isa not in SUPPORTED_ISAS:
                raise NotImplementedError(
                    f"sparseattn's paged engine reads the CPU cache layouts of the {SUPPORTED_ISAS} kernels; this layer "
                    f"runs {isa!r}, whose key layout is not verified (see docs/serving.md)"
                )
            if self._prepared is None:
                heads, total = self._heads
                self._prepared = self.policy.prepare(total, self.head_size, _layer_index(layer.layer_name), heads=heads)
            step = decode_step(attn_metadata)
            if step is None:  # prefill (chunks) only: vLLM's kernel
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            if step.mixed:  # a mixed step: vLLM's kernel for the prefill requests only
                if attn_metadata.dynamic_causal is not None:  # not narrowed: the batch, decode rows overwritten below
                    super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
                else:
                    logger.info_once("sparseattn: a mixed step's prefill requests attended by vLLM's kernel alone")
                    narrowed, part = prefill_part(attn_metadata, self.num_heads, self.num_kv_heads, self.head_size,
                                                  query.dtype, isa, self.kv_cache_dtype)  # fmt: skip
                    prefill_out = output[part]
                    super().forward(layer, query[part], key[part], value[part], kv_cache, narrowed, prefill_out,
                                    output_scale, output_block_scale)  # fmt: skip
                    output[part] = prefill_out
            if not self._announced:
                logger.info_once("sparseattn: first decode step answered by the paged engine (%s)", self.policy.name)
                self._announced = True
            n, rows = step.lens.shape[0], step.rows
            q = (query[:n] if rows is None else query[rows]).view(n, self.num_heads, self.head_size)
            out = output.view(output.shape[0], self.num_heads, self.head_size)
            if self._fused is not None:
                if self._fused != FIXED and (self._store is None or self._store.num_blocks != kv_cache.shape[0]):
                    self._store = PageStore(kv_cache.shape[0], self.num_kv_heads, self.head_size, self._fused)
                plan = _plan_for_step(self.policy, step.lens, kv_cache.shape[2])
                # Decode rows 0..n-1 of a float32 output: the kernel writes them in place.
                direct = rows is None and out.dtype == torch.float32 and out.is_contiguous()
                result, _ = fused_decode(self.policy, self._fused, self._store, kv_cache, q, step.table, step.lens, self.scale,
                                         self.logits_soft_cap or None, plan=plan, out=out[:n] if direct else None)
                if not direct:
                    _put_rows(out, rows, result)
                return output
            params, generator = self._prepared
            if self._summaries is None or self._summaries.valid.shape[0] != kv_cache.shape[0]:
                self._summaries = PageSummaries(kv_cache.shape[0], kv_cache.shape[2])
            pages = select_pages(self.policy, params, generator, kv_cache, q, step.table, step.lens, self.scale, self._summaries)
            _put_rows(out, rows, kernel_attend_pages(q, kv_cache, step.table, pages, step.lens, self.scale,
                                                     self.logits_soft_cap or None, isa))  # fmt: skip
            return output

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if self._summaries is not None:  # a block written to (reused, or still filling) is summarised afresh
                self._summaries.invalidate(slot_mapping)
            if self._store is not None:
                self._store.invalidate(slot_mapping, kv_cache.shape[2])

    class SparseCPUAttentionBackend(CPUAttentionBackend):
        """vLLM's CPU backend (name, builder, cache shape unchanged) with :class:`SparseCPUAttentionImpl`."""

        @staticmethod
        def get_impl_cls() -> type:
            return SparseCPUAttentionImpl

    for cls in (SparseCPUAttentionImpl, SparseCPUAttentionBackend):  # importable (and picklable) by name
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {"SparseCPUAttentionImpl": SparseCPUAttentionImpl, "SparseCPUAttentionBackend": SparseCPUAttentionBackend}


def _resolve_cpu_attn() -> type:
    """vLLM's own CPU backend class when no sparse method is requested, else :class:`SparseCPUAttentionBackend`."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from sparseattn.vllm.config import current_request

    return CPUAttentionBackend if current_request() is None else _classes()["SparseCPUAttentionBackend"]


def __getattr__(name: str) -> Any:
    if name == "CPU_ATTN":
        return _resolve_cpu_attn()
    if name in ("SparseCPUAttentionBackend", "SparseCPUAttentionImpl"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
