"""vLLM's CPU attention backend with sparseattn's paged engine answering the decode tokens.

:class:`SparseCPUAttentionBackend` is vLLM's ``CPUAttentionBackend`` (same name ``CPU_ATTN``, KV-cache
shape and layout) with its own metadata builder, metadata and impl, in vLLM's own shape: the builder
does the per-step work once, every layer reads it from the metadata.

* :class:`SparseCPUAttentionMetadataBuilder` (one per KV-cache group of the engine): at start-up it
  makes the engine use a cache layout the paged engine reads (:func:`~sparseattn.vllm.step.readable_isa`:
  vLLM's ``vec`` kernel where it would pick ``amx``), or refuses to start, saying why, on a CPU whose
  layout it cannot read; it holds the method the decode tokens run (:class:`DecodeMethod`, switched
  by :meth:`~SparseCPUAttentionMetadataBuilder.use`) and the engine's :class:`~sparseattn.vllm.step.Fallbacks`.
  Per step it finds the decode requests (one query token *and* past their prompt:
  :func:`~sparseattn.vllm.step.decode_step`; a prompt's last token computed alone, after a prefix-cache
  hit or as a one-token last chunk, is prefill), narrows vLLM's metadata to a mixed step's prefill
  requests (:func:`prefill_part`) and computes the fused step's plan
  (:func:`~sparseattn.vllm.paged_kernel.step_plan`), all handed to every layer in
  :class:`SparseCPUAttentionMetadata`.
* :class:`SparseCPUAttentionImpl` (one per layer): prefill and chunked prefill run vLLM's kernel
  unchanged; every decode token is answered under the step's method, by the fused C step
  (:mod:`sparseattn.vllm.paged_kernel`) for the policies whose parts it knows, else by
  :func:`~sparseattn.vllm.paged.choose_pages` and vLLM's own paged kernel over the selected pages
  (:func:`kernel_attend_pages`; a merged rest's tokens join the softmax in
  :func:`~sparseattn.vllm.paged.attend_pages` instead). A per-layer method runs each layer's own
  (the layer's index from its name). A decode token never attends its whole sequence: in a mixed step
  (prefill chunks beside decode tokens) vLLM's kernel gets the prefill requests only. The layer's own
  state (the method's prepared parameters, page summaries per physical block) lives on the impl.

A decode step the paged engine cannot answer (any exception: an unforeseen shape, a plan that does
not fit, a kernel refusal) is answered by vLLM's own kernel over the whole step, logged once per
cause and counted: a request never ends an engine that stock vLLM would have served.

The plugin (:mod:`sparseattn.vllm.plugin`) points vLLM's ``CPU_ATTN`` entry at ``CPU_ATTN`` here,
which resolves, each time vLLM looks it up, to vLLM's own class when the config being built asks for
no sparse method, and to :class:`SparseCPUAttentionBackend` when it does.

This module imports vLLM: vLLM loads it, and so do the worker extension (:mod:`sparseattn.vllm.switch`)
and the serving benchmark, inside vLLM's processes. What needs no vLLM is in :mod:`sparseattn.vllm.step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.logger import init_logger
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from sparseattn.vllm.config import WORKER_CLS, MethodRequest, current_request, layer_index, request_from, stores_counted
from sparseattn.vllm.attention import attend_pages
from sparseattn.vllm.cache_format import FP8_FORMATS, KVFormat
from sparseattn.vllm.policy import PagedPolicy
from sparseattn.vllm.selection import PageSummaries, choose_pages
from sparseattn.vllm.paged_kernel import (
    FP8_CODES, PageStore, StepPlan, amx_refusal, fused_decode, kernel_refusal, step_plan,
)  # fmt: skip
from sparseattn.vllm.profile import active, python_part
from sparseattn.vllm.route import Route, route
from sparseattn.vllm.step import SUPPORTED_ISAS, DecodeStep, Fallbacks, decode_step, readable_isa

__all__ = [
    "DecodeMethod", "SparseCPUAttentionBackend", "SparseCPUAttentionImpl", "SparseCPUAttentionMetadata",
    "SparseCPUAttentionMetadataBuilder", "fused_refusal", "kernel_attend_pages", "prefill_part", "sparse_builders",
]

logger = init_logger("vllm.sparseattn")  # under vLLM's logger, which has the handlers


def kernel_attend_pages(
    query: Any, kv_cache: Any, block_table: Any, pages: Any, seq_lens: Any, scale: float, softcap: float | None, isa: str,
    fmt: KVFormat = KVFormat(),
) -> Any:
    """:func:`sparseattn.vllm.paged.attend_pages` computed by vLLM's own CPU paged-attention kernel.

    The kernel attends whole sequences of one block table; a sparse selection differs per KV head
    (and per query head without a shared selection). So every (sequence, KV head, page list) is
    handed to the kernel as a sequence of its own, over a view of the cache with one KV head per
    block: ``[N, H_kv, bs, 2 D]`` read as ``[N * H_kv, 1, bs, 2 D]`` (the same memory; block ``b``
    of head ``h`` is block ``b * H_kv + h``), its block table the listed pages (sinks, selected,
    tail: the partial last page last), its length the listed pages' tokens. The kernel reads the
    bf16/fp16 pages in place and accumulates in float32, as it does for stock vLLM's decode; an fp8
    cache (``fmt``: a :class:`~sparseattn.vllm.paged.KVFormat`) is read with its scales, as vLLM reads it.
    Tested against :func:`~sparseattn.vllm.paged.attend_pages` (tests/test_vllm_plugin.py).
    """
    quant = {"k_scale": fmt.k_scale, "v_scale": fmt.v_scale, "kv_cache_dtype": fmt.dtype}

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
        num_reqs=V, num_heads=g, num_kv_heads=1, head_dim=D, seq_lens=lens, dtype=query.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        kv_cache_dtype=fmt.dtype,
    )
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
        scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=softcap or 0.0,
        scheduler_metadata=metadata, s_aux=None, **quant,
    )
    return out.view(B, H_q, D)


def prefill_part(attn_metadata: CPUAttentionMetadata, step: DecodeStep, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, isa: str, kv_cache_dtype: str) -> tuple[CPUAttentionMetadata, torch.Tensor]:  # fmt: skip
    """vLLM's CPU attention metadata narrowed to the step's prefill requests (those not in ``step``), and their token rows.

    In a mixed step vLLM's kernel then attends the prefill chunks only; the decode tokens are left
    to the paged engine instead of being attended densely and overwritten. The kernel's scheduler
    metadata is computed for the narrowed batch as vLLM's builder computes it for the whole one; the
    builder calls this once per step (:meth:`SparseCPUAttentionMetadataBuilder.build`).
    """
    starts = attn_metadata.query_start_loc
    lengths = starts[1:] - starts[:-1]
    prefill = torch.ones(lengths.numel(), dtype=torch.bool)
    prefill[step.requests] = False
    keep = prefill.nonzero().flatten()
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
    return narrowed, rows


@dataclass(frozen=True)
class DecodeMethod:
    """The method an engine's decode tokens run, as its metadata builder hands it to every layer.

    ``policy``: the method as configured (it may run a method per layer); ``variants``: the distinct
    per-layer policies it runs (one for a method that is the same in every layer), each with its
    :class:`~sparseattn.vllm.route.Route` (the fused C step's mode and store, or why the generic path);
    ``layer_variant[i]``: layer ``i``'s. The builder makes a new one for each method it is told to use,
    so a layer that sees another one than the last drops what it derived from the last (its prepared
    parameters, page summaries and page store).
    """

    policy: PagedPolicy
    variants: tuple[tuple[PagedPolicy, Route], ...]
    layer_variant: tuple[int, ...] = ()

    @classmethod
    def of(cls, policy: PagedPolicy, n_layers: int, refusal: str | None) -> DecodeMethod:
        """``policy`` resolved for each of ``n_layers`` layers; ``refusal``: why the fused kernel cannot run here (None: it can)."""
        if not policy.layered:
            return cls(policy, ((policy, route(policy, refusal)),))
        variants: list[tuple[PagedPolicy, Route]] = []
        index = []
        for layer in range(n_layers):
            leaf = policy.for_layer(layer, n_layers)
            at = next((j for j, (known, _) in enumerate(variants) if known == leaf), None)
            if at is None:
                at = len(variants)
                variants.append((leaf, route(leaf, refusal)))
            index.append(at)
        return cls(policy, tuple(variants), tuple(index))

    def variant(self, layer_idx: int) -> int:
        """The index in :attr:`variants` of what layer ``layer_idx`` runs."""
        if not self.layer_variant:
            return 0
        if not 0 <= layer_idx < len(self.layer_variant):
            raise ValueError(f"layer {layer_idx} is outside the model's {len(self.layer_variant)} layers the method was resolved for")
        return self.layer_variant[layer_idx]

    def describe(self) -> str:
        """Which path each variant runs, for the start-up log line."""
        return "; ".join(f"{leaf.method!r}: {way.describe()}" for leaf, way in self.variants)


@dataclass
class SparseCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU attention metadata and what the builder found once for every layer of the step.

    ``decode``: the step's decode requests (None: prefill only). ``prefill``: a mixed step's prefill
    requests, as vLLM's metadata narrowed to them and their token rows (:func:`prefill_part`); None
    when the step is not mixed, or under vLLM's dynamic causal mask (not narrowed: vLLM's kernel
    attends the whole batch and the decode rows are overwritten). ``plan``: the fused step's plan for
    the decode lengths (None on the generic path). ``plan_error``: why the builder could not narrow or
    plan the step; every layer then leaves it to vLLM's kernel, counted. ``method``: what the decode
    tokens run; ``fallbacks``: the engine's counts, kept by the builder.
    """

    decode: DecodeStep | None = None
    prefill: tuple[CPUAttentionMetadata, torch.Tensor] | None = None
    plans: tuple[StepPlan | None, ...] = ()
    plan_error: Exception | None = None
    method: DecodeMethod | None = None
    fallbacks: Fallbacks | None = None


class SparseCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU builder, run on a layout the paged engine reads, adding what every layer of a step needs.

    At start-up (the engine builds it with its KV cache): where vLLM picked a kernel whose cache layout
    the engine does not read, :func:`~sparseattn.vllm.step.readable_isa` gives the one this engine runs
    instead (logged; its cache writes and vLLM's prefill kernel follow it), or refuses, saying why and
    what to do, before any request; the method the engine was configured with
    (:mod:`sparseattn.vllm.config`) is built, or refused with the paged engine's reason. Per step
    (:meth:`build`): the decode requests with vLLM's ``is_prefilling``, a mixed step's narrowed prefill
    metadata and the fused step's plan, once for all the layers.
    """

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        request = request_from(vllm_config.additional_config)
        if request is None:
            raise ValueError("SparseCPUAttentionMetadataBuilder built with no sparseattn method requested (see sparseattn.vllm.config)")
        self.fallbacks = Fallbacks()
        self.n_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.max_len = vllm_config.model_config.max_model_len  # the longest sequence: where segment "auto" reads the grid
        policy = self.policy(request)
        picked = self.isa
        self.isa = readable_isa(picked, str(self.dtype).removeprefix("torch."), self.block_size, self._amx_refusal(policy))
        if self.isa != picked:
            logger.warning_once(
                "sparseattn: vLLM picked its %r CPU attention kernel for %s here; the paged engine does not read that "
                "cache layout for %r (%s), so this engine runs vLLM's %r kernel and layout instead (prefill included: "
                "slower than %r; docs/serving.md)", picked, str(self.dtype).removeprefix("torch."), policy.name,
                self._amx_refusal(policy), self.isa, picked,
            )  # fmt: skip
            self._set_isa_to_layers(layer_names)
        elif picked == "amx":
            logger.info_once("sparseattn: the engine keeps vLLM's amx kernel and layout (prefill at its speed); the fused "
                             "step reads that layout")  # fmt: skip
        self.use(policy)

    def _amx_refusal(self, policy: PagedPolicy) -> str | None:
        """Why the fused step cannot read ``policy``'s pages in vLLM's amx layout on this engine (None: it can)."""
        if self.kv_cache_dtype != "auto":
            return f"the {self.kv_cache_dtype} cache's amx layout is not read"
        if kernel_refusal() is not None:
            return kernel_refusal()
        return amx_refusal(policy, self.dtype, self.block_size, self.head_dim)

    def policy(self, request: MethodRequest) -> PagedPolicy:
        """``request`` as this engine runs it: a segment of ``"auto"`` resolved for this engine's pages and longest
        sequence (the method's own grid, :func:`~sparseattn.vllm.paged.own_segment`)."""
        return request.policy(self.block_size, self.max_len)

    def use(self, policy: PagedPolicy) -> None:
        """Answer decode tokens with ``policy`` from the next step on (the engine's own method, or a switch).

        Each layer drops what it derived from the last method when it sees the new one
        (:class:`DecodeMethod`). The fused C step runs the policy where it knows its parts and the
        kernel builds here, for a cache of 2- or 4-byte numbers; else the generic path. A per-layer
        method is resolved for each of the model's layers here, once.
        """
        policy.segments_per_page(self.block_size)  # a segment that does not divide the page: refused at start-up
        if self.isa == "amx" and (why := self._amx_refusal(policy)) is not None:
            raise ValueError(f"sparseattn method {policy.name!r} cannot run on this engine, which keeps vLLM's amx cache layout "
                             f"(chosen at start-up for its method): {why}; start an engine with it instead")  # fmt: skip
        refusal = fused_refusal(self.kv_cache_dtype)
        self.method = DecodeMethod.of(policy, self.n_layers, refusal)
        grid = "whole pages" if policy.segments_per_page(self.block_size) == 1 else f"{policy.segment}-token segments"
        logger.info_once("sparseattn: decode tokens run %r in the paged engine on %s of %d-token pages: %s", policy.name,
                         grid, self.block_size, self.method.describe())  # fmt: skip

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> SparseCPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        with python_part("plan"):
            decode = decode_step(base.query_start_loc, base.seq_lens, base.block_table, common_attn_metadata.is_prefilling)
            prefill = plan_error = None
            plans: tuple[StepPlan | None, ...] = ()
            if decode is not None:
                prof = active()
                if prof is not None:
                    prof.steps += 1
                try:
                    if decode.mixed and base.dynamic_causal is None:
                        prefill = prefill_part(base, decode, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                                               self.isa, self.kv_cache_dtype)  # fmt: skip
                    plans = tuple(step_plan(leaf, decode.lens, self.block_size) if way.fused else None
                                  for leaf, way in self.method.variants)  # fmt: skip
                except Exception as error:  # noqa: BLE001 (each layer leaves the step to vLLM's kernel and counts it)
                    plan_error = error
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return SparseCPUAttentionMetadata(**fields, decode=decode, prefill=prefill, plans=plans, plan_error=plan_error,
                                          method=self.method, fallbacks=self.fallbacks)  # fmt: skip


class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` whose decode tokens run the step's sparseattn method over the pages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        request = current_request()
        if request is None:
            raise ValueError("SparseCPUAttentionImpl built with no sparseattn method requested (see sparseattn.vllm.config)")
        refused = [
            why
            for why, bad in (
                ("ALiBi slopes", self.alibi_slopes is not None),
                (f"a sliding window of {self.sliding_window}", self.sliding_window != -1),
                ("attention sinks (s_aux)", self.sinks is not None),
                (f"the {self.kv_cache_dtype} KV cache (sparseattn reads {', '.join(sorted(FP8_FORMATS))})",
                 self.is_fp8_kv_cache and self.kv_cache_dtype not in FP8_FORMATS),
            )
            if bad and self.attn_type == AttentionType.DECODER
        ]
        if refused:
            raise ValueError(f"sparseattn method {request.label!r} cannot run on this layer: it uses {', '.join(refused)}")
        self._heads = _rank_kv_heads(self.num_kv_heads)
        self._layer_idx: int | None = None  # from the layer's name, at its first decode step
        self._start(None)

    def _start(self, method: DecodeMethod | None) -> None:
        """Derive this layer's state from ``method`` from now on: what was derived from the last one is dropped.

        Its prepared parameters, page summaries (rebuilt from the pages on first use: the cached pages
        themselves are the same for every method) and fused-step store.
        """
        self._method = method
        self._prepared: tuple[Any, torch.Generator] | None = None
        self._summaries: PageSummaries | None = None  # this layer's page summaries, per physical block
        self._store: PageStore | None = None  # the fused step's page summaries, per physical block
        self._announced = False  # the first decode step's log line (logged once, not looked up per layer and step)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: SparseCPUAttentionMetadata | None, output,
                output_scale=None, output_block_scale=None):  # fmt: skip
        dense = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None or self.attn_type != AttentionType.DECODER or attn_metadata.decode is None:
            return super().forward(*dense)  # no decode token (prefill chunks only), or not a decoder layer: vLLM's kernel
        if attn_metadata.method is not self._method:  # the engine's first decode step, or a switched method
            self._start(attn_metadata.method)
        error = attn_metadata.plan_error
        if error is None:
            prof = active()
            try:
                if prof is None:
                    self._decode(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
                else:
                    with prof.layer():
                        self._decode(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            except Exception as failure:  # noqa: BLE001 (any failure: vLLM's kernel answers the step, nothing is lost)
                error = failure
        if error is not None:
            attn_metadata.fallbacks.failed(error, layer_index(layer.layer_name), logger)
            # A step that failed half-way may have left this layer's page summaries half-written: rebuilt as needed.
            self._store, self._summaries = None, None
            return super().forward(*dense)
        attn_metadata.fallbacks.answered(logger)
        return output

    def _decode(self, layer, query, key, value, kv_cache, attn_metadata: SparseCPUAttentionMetadata, output, output_scale,
                output_block_scale) -> None:  # fmt: skip
        """The paged engine's answer to the step's decode tokens (and vLLM's kernel's to a mixed step's prefill requests)."""
        step, method = attn_metadata.decode, attn_metadata.method
        layer_idx = self._layer_idx
        if layer_idx is None:
            layer_idx = self._layer_idx = layer_index(layer.layer_name)
        variant = method.variant(layer_idx)
        policy, way = method.variants[variant]
        isa = getattr(layer, "isa", None)
        if isa not in SUPPORTED_ISAS and not (isa == "amx" and way.fused):  # the builder made sure at start-up; a
            # layer it did not see is answered densely
            raise NotImplementedError(f"this layer runs vLLM's {isa!r} CPU kernel, whose cache layout the paged engine does not read")
        if self._prepared is None:
            heads, total = self._heads
            self._prepared = policy.prepare(total, self.head_size, layer_idx, heads=heads)
        if step.mixed:  # a mixed step: vLLM's kernel for the prefill requests only
            with python_part("prefill in mixed steps"):
                if attn_metadata.prefill is None:  # not narrowed (dynamic causal mask): the batch, decode rows overwritten below
                    super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
                else:
                    logger.info_once("sparseattn: a mixed step's prefill requests attended by vLLM's kernel alone")
                    narrowed, part = attn_metadata.prefill
                    prefill_out = output[part]
                    super().forward(layer, query[part], key[part], value[part], kv_cache, narrowed, prefill_out,
                                    output_scale, output_block_scale)  # fmt: skip
                    output[part] = prefill_out
        if not self._announced:
            logger.info_once("sparseattn: first decode step answered by the paged engine (%s)", policy.name)
            self._announced = True
        n, rows = step.lens.shape[0], step.rows
        q = (query[:n] if rows is None else query[rows]).view(n, self.num_heads, self.head_size)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        fmt = KVFormat(self.kv_cache_dtype, layer._k_scale_float, layer._v_scale_float) if self.is_fp8_kv_cache else KVFormat()
        if way.fused:
            if way.keeps_store and (self._store is None or self._store.num_blocks != kv_cache.shape[0]):
                self._store = PageStore.for_policy(policy, kv_cache.shape[0], self.num_kv_heads, self.head_size, kv_cache.shape[2])
                log = logger.info_once if stores_counted() else logger.warning_once  # uncounted: memory beyond what vLLM was given
                log("sparseattn: the fused step's page store holds %.1f MiB per layer beside vLLM's KV cache (%.0f%% of the "
                    "layer's cache: summaries%s; %s)", self._store.nbytes / 2**20,
                    100 * self._store.nbytes / (kv_cache.numel() * kv_cache.element_size()),
                    " and the merged rest's sums" if self._store.sums is not None else "",
                    "counted in the memory vLLM was given" if stores_counted() else
                    f"NOT counted in the memory vLLM was given: start the engine with worker_cls={WORKER_CLS!r} to count it")  # fmt: skip
            # Decode rows 0..n-1 of the output (the model's dtype: bf16, fp16 or float32): the kernel writes them in place.
            direct = rows is None and out.dtype in (torch.float32, torch.bfloat16, torch.float16) and out.is_contiguous()
            result, _ = fused_decode(policy, way.mode, self._store, kv_cache, q, step.table, step.lens, self.scale,
                                     self.logits_soft_cap or None, plan=attn_metadata.plans[variant], out=out[:n] if direct else None,
                                     fmt=fmt, layout="amx" if isa == "amx" else "vec")  # fmt: skip
            if not direct:
                _put_rows(out, rows, result)
            return
        params, generator = self._prepared
        if self._summaries is None or self._summaries.valid.shape[0] != kv_cache.shape[0]:
            self._summaries = PageSummaries(kv_cache.shape[0], kv_cache.shape[2])
        chosen = choose_pages(policy, params, generator, kv_cache, q, step.table, step.lens, self.scale, self._summaries, fmt)
        if chosen.merged is None and chosen.tokens is None:
            result = kernel_attend_pages(q, kv_cache, step.table, chosen.pages, step.lens, self.scale, self.logits_soft_cap or None, isa, fmt)
        else:  # merged tokens, or parts of pages: the torch path (vLLM's kernel attends whole pages, nothing else)
            result = attend_pages(q, kv_cache, step.table, chosen.pages, step.lens, self.scale, self.logits_soft_cap or None, fmt,
                                  chosen.merged, chosen.tokens)  # fmt: skip
        _put_rows(out, rows, result)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self._summaries is not None:  # a block written to (reused, or still filling) is summarised afresh
            self._summaries.invalidate(slot_mapping)
        if self._store is not None:
            self._store.invalidate(slot_mapping, kv_cache.shape[2])


class SparseCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend (name and cache shape unchanged) with :class:`SparseCPUAttentionImpl` and its builder."""

    @staticmethod
    def get_impl_cls() -> type[SparseCPUAttentionImpl]:
        return SparseCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SparseCPUAttentionMetadataBuilder]:
        return SparseCPUAttentionMetadataBuilder


def sparse_builders(model_runner: Any) -> list[SparseCPUAttentionMetadataBuilder]:
    """The sparse metadata builders of a worker's model runner (vLLM's ``attn_groups``): where its method and counts are."""
    return [builder for groups in model_runner.attn_groups for group in groups for builder in group.metadata_builders
            if isinstance(builder, SparseCPUAttentionMetadataBuilder)]  # fmt: skip


def _put_rows(out: torch.Tensor, rows: torch.Tensor | None, result: torch.Tensor) -> None:
    """Write the decode requests' ``result`` into their rows of ``out`` (rows ``0..B-1`` when ``rows`` is None)."""
    if rows is None:
        out[: result.shape[0]] = result.to(out.dtype)
    else:
        out[rows] = result.to(out.dtype)


def fused_refusal(kv_cache_dtype: str) -> str | None:
    """Why the fused C step cannot run an engine whose cache is ``kv_cache_dtype`` (vLLM's ``cache_dtype``), or None."""
    refusal = kernel_refusal()
    if refusal is None and is_quantized_kv_cache(kv_cache_dtype) and kv_cache_dtype not in FP8_CODES:
        refusal = (f"the fused kernel reads float32, bfloat16, float16 and {', '.join(sorted(FP8_CODES))} pages, this cache is "
                   f"{kv_cache_dtype}")  # fmt: skip
    return refusal


def _rank_kv_heads(local_kv_heads: int) -> tuple[list[int] | None, int]:
    """The model's KV heads this tensor-parallel rank holds (None without TP), and the model's total.

    vLLM gives rank ``r`` of ``tp`` the heads from ``r * total // tp`` on (``total / tp`` of them, or one
    replicated head when ``tp > total``); the paged engine draws its random parameters for all heads
    and keeps these rows, so a head's selection is the same at every TP size.
    """
    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        return None, local_kv_heads
    total = get_current_vllm_config().model_config.get_total_num_kv_heads()
    first = get_tensor_model_parallel_rank() * total // tp
    return list(range(first, first + local_kv_heads)), total


def __getattr__(name: str) -> type:
    """``CPU_ATTN`` (the name the plugin registers): vLLM's own CPU backend class when the config being built
    asks for no sparse method, else :class:`SparseCPUAttentionBackend`; looked up by vLLM each time it picks one."""
    if name == "CPU_ATTN":
        return CPUAttentionBackend if current_request() is None else SparseCPUAttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
