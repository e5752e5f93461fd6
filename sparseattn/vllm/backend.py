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

Its metadata builder does two things once per step and once per engine: it finds the decode requests
(one query token *and* past their prompt: :func:`decode_step`; a prompt's last token computed alone,
after a prefix-cache hit or as a one-token last chunk, is prefill) and hands them to every layer in
the metadata; and at start-up it makes the engine use a cache layout the paged engine reads
(:func:`readable_isa`: vLLM's ``vec`` kernel where it would pick ``amx``), or refuses to start, saying
why, on a CPU whose layout it cannot read. A decode step the paged engine cannot answer (any
exception: an unforeseen shape, a plan that does not fit, a kernel refusal) is answered by vLLM's
own kernel over the whole step, logged once per cause and counted (:class:`Fallbacks`): a request
never ends an engine that stock vLLM would have served.

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

from sparseattn.vllm.paged import KVFormat

__all__ = [
    "CPU_ATTN", "FALLBACKS", "SUPPORTED_ISAS", "DecodeStep", "Fallbacks", "SparseCPUAttentionBackend",
    "SparseCPUAttentionImpl", "SparseCPUAttentionMetadataBuilder", "decode_step", "kernel_attend_pages", "prefill_part",
    "readable_isa",
]  # noqa: F822 (the classes are built on first access, see __getattr__)

#: vLLM CPU kernel ISAs whose cache layout (keys transposed per page) the paged engine reads.
SUPPORTED_ISAS = ("vec", "vec16")

#: What to do on a CPU whose layout the engine does not read, by the ISA vLLM picks there.
_INSTEAD = {
    "neon": "serve this model without a sparseattn method (stock vLLM) on this Arm CPU, where vLLM picks 'neon' for every dtype, "
    "or use an x86-64 CPU",
}


def readable_isa(isa: str, dtype: str, block_size: int) -> str:
    """The CPU attention ISA a sparse engine runs where vLLM picked ``isa`` for ``dtype`` and ``block_size``.

    ``vec``/``vec16``: as picked. ``amx`` (bfloat16 on Intel CPUs with AMX): ``vec`` (``vec16`` for a block
    size vLLM's ``vec`` kernel does not take), the AVX-512 kernel and layout vLLM runs on x86-64 CPUs
    without AMX: the paged engine reads that layout, the amx one is not verified (its keys are stored in
    pairs of channels, not transposed). vLLM then prefills with that kernel too (slower than AMX).
    Any other (``neon``, ``vsx``, ``vxe``, ``rvv``): NotImplementedError naming the ISA, the dtype and what
    to do, raised when the engine builds its attention metadata, at start-up.

    Example:
        >>> readable_isa("amx", "bfloat16", 128), readable_isa("vec16", "float32", 16)
        ('vec', 'vec16')
    """
    if isa in SUPPORTED_ISAS:
        return isa
    if isa == "amx":
        return "vec" if block_size % 32 == 0 else "vec16"
    instead = _INSTEAD.get(isa, "set a block size that is not a multiple of 32 (e.g. --block-size 16), for which vLLM "
                                "picks its 'vec16' kernel, or serve this model without a sparseattn method (stock vLLM)")  # fmt: skip
    raise NotImplementedError(
        f"sparseattn's paged engine cannot run here: vLLM picks its {isa!r} CPU attention kernel on this CPU for {dtype} "
        f"with blocks of {block_size} tokens, and the engine reads only the KV cache layouts of vLLM's "
        f"{' and '.join(map(repr, SUPPORTED_ISAS))} kernels; {instead} (docs/serving.md)"
    )


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
    import torch
    from vllm import _custom_ops as ops

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


def prefill_part(attn_metadata: Any, step: DecodeStep, num_heads: int, num_kv_heads: int, head_dim: int, dtype: Any,
                 isa: str, kv_cache_dtype: str) -> tuple[Any, Any]:  # fmt: skip
    """vLLM's CPU attention metadata narrowed to the step's prefill requests (those not in ``step``), and their token rows.

    In a mixed step vLLM's kernel then attends the prefill chunks only; the decode tokens are left
    to the paged engine instead of being attended densely and overwritten. The metadata is the same
    object for every layer of a step, so the first layer narrows it (and computes the kernel's
    scheduler metadata for the narrowed batch, as vLLM's builder does for the whole one) and keeps
    the result on it (``attn_metadata.prefill``) for the others.
    """
    import dataclasses

    import torch
    from vllm import _custom_ops as ops
    from vllm import envs

    cached = getattr(attn_metadata, "prefill", None)
    if cached is not None:
        return cached
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
    if hasattr(attn_metadata, "prefill"):
        attn_metadata.prefill = (narrowed, rows)
    return narrowed, rows


@dataclass(frozen=True)
class DecodeStep:
    """The decode requests of one step (one query token each, past their prompt), as every layer's forward reads them.

    ``requests``: their indices in the batch; ``rows``: their token rows, None when the step is
    decode tokens only (then they are rows ``0..B-1``: the query and output rows are sliced, not
    gathered); ``table``, ``lens``: their block-table rows and lengths (the current token included);
    ``mixed``: other requests of the step are prefilling (chunks, or a prompt's last token alone).
    """

    requests: Any
    rows: Any
    table: Any
    lens: Any
    mixed: bool


def decode_step(query_start_loc: Any, seq_lens: Any, block_table: Any, prefilling: Any = None) -> DecodeStep | None:
    """The step's :class:`DecodeStep` (None: no decode token), from its metadata's tensors.

    A decode request has one query token and has computed its whole prompt: ``prefilling[i]`` (vLLM's
    ``is_prefilling``, ``computed tokens < prompt tokens``) marks a request whose one query token is its
    prompt's last (a prefix-cache hit leaving one token, or a chunked prefill's one-token last chunk):
    that token is prefill, attended by vLLM's kernel, and its output is the first generated token's.
    Without ``prefilling`` every one-token request is taken for a decode token. The metadata builder
    calls this once per step (:class:`SparseCPUAttentionMetadataBuilder`); every layer reads the result.
    """
    import torch

    starts = query_start_loc
    lengths = starts[1:] - starts[:-1]
    decoding = lengths == 1
    if prefilling is not None:
        decoding &= ~prefilling[: lengths.numel()].to(device=decoding.device, dtype=torch.bool)
    requests = decoding.nonzero().flatten()
    n = requests.numel()
    if n == 0:
        return None
    if n == lengths.numel():  # decode tokens only: request i is token row i
        return DecodeStep(requests, None, block_table[:n], seq_lens[:n], False)
    return DecodeStep(requests, starts[requests].long(), block_table[requests], seq_lens[requests], True)


class Fallbacks:
    """Decode layer-steps the paged engine answered, and those it could not (answered by vLLM's kernel), by cause.

    :meth:`failed` logs a cause the first time it is seen, with the reason, and a metrics line (at most
    every ``every`` seconds); :meth:`answered` logs once when the paged engine answers again after a
    fallback. One per process (:data:`FALLBACKS`): a server's log shows every worker's.
    """

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.answered_steps = 0
        self.causes: dict[str, int] = {}
        self._last_metrics = float("-inf")
        self._falling_back = False

    @property
    def total(self) -> int:
        return sum(self.causes.values())

    def metrics(self) -> str:
        causes = "; ".join(f"{n} x {cause}" for cause, n in self.causes.items()) or "none"
        return (f"sparseattn metrics: {self.answered_steps} decode layer-steps answered by the paged engine, "
                f"{self.total} by vLLM's dense kernel after a failure ({causes})")  # fmt: skip

    def failed(self, error: BaseException, layer: int, logger: Any) -> None:
        import time

        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        first = cause not in self.causes
        self.causes[cause] = self.causes.get(cause, 0) + 1
        self._falling_back = True
        if first:
            logger.warning("sparseattn: a decode step (layer %d) fell back to vLLM's dense kernel: %s (logged once per "
                           "cause, counted in the metrics line)", layer, cause)  # fmt: skip
        now = time.monotonic()
        if first or now - self._last_metrics >= self.every:
            self._last_metrics = now
            logger.warning(self.metrics())

    def answered(self, logger: Any) -> None:
        self.answered_steps += 1
        if self._falling_back:
            self._falling_back = False
            logger.info("sparseattn: decode steps answered by the paged engine again; %s", self.metrics())


#: This process's counts (every layer of every sparse engine in it).
FALLBACKS = Fallbacks()


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
    import dataclasses

    import torch
    from vllm.logger import init_logger
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadata,
        CPUAttentionMetadataBuilder,
    )

    from sparseattn.vllm.config import current_request
    from sparseattn.vllm.paged import FP8_FORMATS, PageSummaries, select_pages
    from sparseattn.vllm.paged_kernel import FIXED, PageStore, fused_decode, fused_mode, kernel_refusal

    logger = init_logger("vllm.sparseattn")  # under vLLM's logger, which has the handlers

    @dataclasses.dataclass
    class SparseCPUAttentionMetadata(CPUAttentionMetadata):
        """vLLM's CPU metadata and, found once per step by the builder, the step's decode requests; ``prefill`` is
        the narrowed metadata of a mixed step's prefill requests, made by the step's first layer (:func:`prefill_part`)."""

        decode: DecodeStep | None = None
        prefill: Any = None

    class SparseCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
        """vLLM's CPU builder, run on a layout the paged engine reads, adding each step's decode requests.

        At start-up (the engine builds it with its KV cache): where vLLM picked a kernel whose cache layout
        the engine does not read, :func:`readable_isa` gives the one this engine runs instead (logged; its
        cache writes and vLLM's prefill kernel follow it), or refuses, saying why and what to do, before any
        request. Per step: :func:`decode_step` with vLLM's ``is_prefilling``, once for all the layers.
        """

        def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            picked = self.isa
            self.isa = readable_isa(picked, str(self.dtype).removeprefix("torch."), self.block_size)
            if self.isa != picked:
                logger.warning_once(
                    "sparseattn: vLLM picked its %r CPU attention kernel for %s here; the paged engine does not read that "
                    "cache layout, so this engine runs vLLM's %r kernel and layout instead (prefill included: slower than "
                    "%r; docs/serving.md)", picked, str(self.dtype).removeprefix("torch."), self.isa, picked,
                )  # fmt: skip
                self._set_isa_to_layers(layer_names)

        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
            base = super().build(common_prefix_len, common_attn_metadata, fast_build)
            prefilling = getattr(common_attn_metadata, "is_prefilling", None)
            decode = decode_step(base.query_start_loc, base.seq_lens, base.block_table, prefilling)
            fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
            return SparseCPUAttentionMetadata(**fields, decode=decode)

    class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
        """``CPUAttentionBackendImpl`` whose decode tokens run the configured sparseattn policy over the pages."""

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
            self.use(request)

        def use(self, request: Any) -> None:
            """Answer decode tokens with ``request``'s method from the next step on (the engine's own, or a switch).

            Everything derived from the last method is dropped: its prepared parameters, page summaries
            (rebuilt from the pages on first use: the cached pages themselves are the same for every
            method) and fused-step store. Raises before changing anything when the method cannot run
            in the paged engine.
            """
            policy = _shared_policy(request)
            # The fused C step where it knows the policy's parts (and builds here), else the generic path.
            refusal = kernel_refusal()
            if refusal is None and self.is_fp8_kv_cache:
                refusal = f"the fused kernel reads float32, bfloat16 and float16 pages, this cache is {self.kv_cache_dtype}"
            self.policy, self.label = policy, request.label
            self._fused = None if refusal is not None else fused_mode(policy)
            self._prepared: tuple[Any, torch.Generator] | None = None
            self._summaries: PageSummaries | None = None  # this layer's page summaries, per physical block
            self._store: PageStore | None = None  # the fused step's page summaries, per physical block
            self._announced = False  # the first decode step's log line (logged once, not looked up per layer and step)
            logger.info_once("sparseattn: decode tokens run %r in the paged engine (%r), %s", request.label, policy.method,
                             "the generic path: " + (refusal or "the fused kernel does not know its parts")
                             if self._fused is None else "the fused kernel")

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
            dense = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
            if attn_metadata is None or self.attn_type != AttentionType.DECODER:
                return super().forward(*dense)
            if isinstance(attn_metadata, SparseCPUAttentionMetadata):
                step = attn_metadata.decode
            else:  # metadata not from this backend's builder: one-token requests taken for decode tokens
                step = decode_step(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table)
            if step is None:  # prefill (chunks) only: vLLM's kernel
                return super().forward(*dense)
            try:
                self._decode(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale, step)
            except Exception as error:  # noqa: BLE001 (any failure: vLLM's kernel answers the step, nothing is lost)
                FALLBACKS.failed(error, _layer_index(layer.layer_name), logger)
                # A step that failed half-way may have left this layer's page summaries half-written: rebuilt as needed.
                self._store, self._summaries = None, None
                return super().forward(*dense)
            FALLBACKS.answered(logger)
            return output

        def _decode(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale, step) -> None:
            """The paged engine's answer to the step's decode tokens (and vLLM's kernel's to a mixed step's prefill requests)."""
            isa = getattr(layer, "isa", None)
            if isa not in SUPPORTED_ISAS:  # the builder made sure at start-up; a layer it did not see is answered densely
                raise NotImplementedError(f"this layer runs vLLM's {isa!r} CPU kernel, whose cache layout the paged engine does not read")
            if self._prepared is None:
                heads, total = self._heads
                self._prepared = self.policy.prepare(total, self.head_size, _layer_index(layer.layer_name), heads=heads)
            if step.mixed:  # a mixed step: vLLM's kernel for the prefill requests only
                if attn_metadata.dynamic_causal is not None:  # not narrowed: the batch, decode rows overwritten below
                    super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
                else:
                    logger.info_once("sparseattn: a mixed step's prefill requests attended by vLLM's kernel alone")
                    narrowed, part = prefill_part(attn_metadata, step, self.num_heads, self.num_kv_heads, self.head_size,
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
                return
            params, generator = self._prepared
            if self._summaries is None or self._summaries.valid.shape[0] != kv_cache.shape[0]:
                self._summaries = PageSummaries(kv_cache.shape[0], kv_cache.shape[2])
            fmt = KVFormat(self.kv_cache_dtype, layer._k_scale_float, layer._v_scale_float) if self.is_fp8_kv_cache else KVFormat()
            pages = select_pages(self.policy, params, generator, kv_cache, q, step.table, step.lens, self.scale, self._summaries, fmt)
            _put_rows(out, rows, kernel_attend_pages(q, kv_cache, step.table, pages, step.lens, self.scale,
                                                     self.logits_soft_cap or None, isa, fmt))  # fmt: skip

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            if self._summaries is not None:  # a block written to (reused, or still filling) is summarised afresh
                self._summaries.invalidate(slot_mapping)
            if self._store is not None:
                self._store.invalidate(slot_mapping, kv_cache.shape[2])

    class SparseCPUAttentionBackend(CPUAttentionBackend):
        """vLLM's CPU backend (name and cache shape unchanged) with :class:`SparseCPUAttentionImpl` and its builder."""

        @staticmethod
        def get_impl_cls() -> type:
            return SparseCPUAttentionImpl

        @staticmethod
        def get_builder_cls() -> type:
            return SparseCPUAttentionMetadataBuilder

    classes = (SparseCPUAttentionMetadata, SparseCPUAttentionMetadataBuilder, SparseCPUAttentionImpl, SparseCPUAttentionBackend)
    for cls in classes:  # importable (and picklable) by name
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {cls.__name__: cls for cls in classes}


def _resolve_cpu_attn() -> type:
    """vLLM's own CPU backend class when no sparse method is requested, else :class:`SparseCPUAttentionBackend`."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from sparseattn.vllm.config import current_request

    return CPUAttentionBackend if current_request() is None else _classes()["SparseCPUAttentionBackend"]


def __getattr__(name: str) -> Any:
    if name == "CPU_ATTN":
        return _resolve_cpu_attn()
    if name in ("SparseCPUAttentionBackend", "SparseCPUAttentionImpl", "SparseCPUAttentionMetadataBuilder", "SparseCPUAttentionMetadata"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
