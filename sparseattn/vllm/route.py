"""Which path a policy's decode step takes in the paged engine: one decision, read by everything that needs it.

:func:`route` gives a :class:`Route`: the fused C step's mode (:class:`FusedMode`), the page store that mode
keeps and why the generic path runs instead (``refusal``). The backend (the step it runs per layer), the worker
(the stores it sizes the KV cache for), the fused step (the arguments it checks) and the catalogue (``sparseattn
methods``: the vLLM step each method takes) all read it; none decides on its own.

Parts declare what they are to the fused step, as the transformers engine's parts declare their needs
(:data:`~sparseattn.methods.segment_state.KERNEL_CAPABILITIES`): a summary, selector, rest or allocation class
sets ``paged_kernel`` to the name of the C implementation whose arithmetic is its own (:data:`KERNELS`). The
declaration is the class's own, not inherited (:func:`declared`): a subclass may rank otherwise, so it runs the
generic path until it declares the same. A new part that computes what a C implementation computes runs fused
by declaring its name, with no other file edited.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sparseattn.vllm.policy import PagedPolicy

__all__ = ["KERNELS", "FusedMode", "Route", "declared", "route"]


class FusedMode(enum.IntEnum):
    """The fused step's modes, numbered as ``paged_kernels.c`` numbers them.

    ``BOUND``: quest (the per-channel bound of every candidate page, each selection's top k), ``FIXED``: dense and
    streamingllm (the pages attended do not depend on the query), ``SPLIT``: radar+ in every form (centroid scores,
    the KV group's shortlist reranked, any allocation, a merged rest). BOUND and SPLIT run through ``sa_paged_split``,
    FIXED through ``sa_paged_decode``.
    """

    BOUND = 1
    FIXED = 2
    SPLIT = 3

    @property
    def keeps_store(self) -> bool:
        """Whether this mode scores pages, so keeps a page store (their summaries per physical block): all but FIXED."""
        return self is not FusedMode.FIXED


def declared(part: Any) -> str | None:
    """The C implementation ``part``'s own class declares it is (its ``paged_kernel``), or None: a subclass of a
    declaring class declares nothing until it says so itself.

    >>> from sparseattn.summaries import MinMaxBound
    >>> class Widened(MinMaxBound):  # scores otherwise, perhaps: not the kernel's bound until it says it is
    ...     pass
    >>> declared(MinMaxBound()), declared(Widened()), declared(None)
    ('bound', None, None)
    """
    return None if part is None else type(part).__dict__.get("paged_kernel")


def _centroid(summary: Any) -> str | None:
    if summary.dtype not in (None, torch.float32, torch.bfloat16):
        return f"its centroids are stored in {summary.dtype}; the fused step stores float32 or bfloat16 ones"
    return None


def _rerank(summary: Any) -> str | None:
    if declared(summary.coarse) != "centroid":
        return f"it shortlists with {type(summary.coarse).__name__}; the fused step shortlists with centroids"
    if not summary.per_group or summary.shortlist <= 0 or summary.prefilter or summary.unit:
        return ("the fused step reranks one shortlist of single segments per KV group (per_group=True, shortlist > 0, no "
                f"prefilter, no unit); this is per_group={summary.per_group}, shortlist={summary.shortlist}, "
                f"prefilter={summary.prefilter}, unit={summary.unit}")  # fmt: skip
    return _centroid(summary.coarse)


#: The fused step's implementations of parts, by the name a part class declares: what kind of part each is, the mode
#: it runs in (summaries), and why an instance's settings keep it off that implementation (None: they do not).
KERNELS: dict[str, tuple[str, FusedMode | None, Callable[[Any], str | None]]] = {
    "rerank": ("summary", FusedMode.SPLIT, _rerank),  # a centroid shortlist per KV group, reranked by exact log masses
    "centroid": ("coarse", None, _centroid),  # the mean key (Jensen's bound), as Rerank's shortlisting summary
    "bound": ("summary", FusedMode.BOUND, lambda _: None),  # quest's per-channel bound
    "top_k": ("selector", None, lambda _: None),  # the k best, ties to the earlier segments
    "merged": ("rest", None, lambda _: None),  # the rest merged from per-segment sums
    "uniform": ("allocation", None, lambda _: None),  # every head k segments: top-k over the shortlist in C
    "pooled": ("allocation", None, lambda _: None),  # PooledMass: each head's width over the shortlist in C
}


@dataclass(frozen=True)
class Route:
    """Where a policy's decode step runs: the fused C step in ``mode``, or the generic torch path (``mode`` None) for
    ``refusal``'s reason. ``summary_dtype``: the storage of the page store's summaries (bfloat16 for centroids stored
    so)."""

    mode: FusedMode | None
    refusal: str | None = None
    summary_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if (self.mode is None) == (self.refusal is None):
            raise ValueError(f"Route: mode {self.mode!r} with refusal {self.refusal!r}; a route is fused (a mode) or has a "
                             "reason not to be")  # fmt: skip

    @property
    def fused(self) -> bool:
        return self.mode is not None

    @property
    def keeps_store(self) -> bool:
        """Whether the step keeps a page store (summaries per physical block): every fused mode that scores pages."""
        return self.mode is not None and self.mode.keeps_store

    @property
    def bound(self) -> bool:
        """Whether the store keeps two summaries per segment (quest's min and max)."""
        return self.mode == FusedMode.BOUND

    def describe(self) -> str:
        return "the fused kernel" if self.fused else f"the generic path ({self.refusal})"


def _generic(why: str) -> Route:
    return Route(None, why)


def route(policy: PagedPolicy, engine_refusal: str | None = None) -> Route:
    """The path ``policy``'s decode step takes; ``engine_refusal``: why the engine cannot run the fused step at all
    (its kernel not built, a cache dtype it does not read: :func:`~sparseattn.vllm.backend.fused_refusal`), None
    when it can (the method's own route: what the catalogue shows).

    >>> from sparseattn import registry
    >>> [route(PagedPolicy(registry.build(n), n)).mode.name for n in ("dense", "streamingllm", "radar+", "quest")]
    ['FIXED', 'FIXED', 'SPLIT', 'BOUND']
    >>> route(PagedPolicy(registry.build("radar"), "radar")).refusal
    'PerformerFeatures declares no fused implementation'
    >>> route(PagedPolicy(registry.build("radar+", split="pooled", rest="merged"), "radar+"), "no compiler").refusal
    'no compiler'
    """
    if policy.layered:
        raise ValueError(f"route: {policy.name!r} runs a method per layer; ask for each layer's policy (PagedPolicy.for_layer)")
    if engine_refusal is not None:
        return _generic(engine_refusal)
    if policy.fixed:
        return Route(FusedMode.FIXED)
    m = policy.method
    for role, part in (("selector", m.selector), ("rest", m.rest)):
        if part is None:
            continue
        name = declared(part)
        if name not in KERNELS or KERNELS[name][0] != role:
            return _generic(f"{type(part).__name__} declares no fused implementation of a {role}")
    name = declared(m.summary)
    if name not in KERNELS or KERNELS[name][0] != "summary":
        return _generic(f"{type(m.summary).__name__} declares no fused implementation")
    _, mode, check = KERNELS[name]
    if (why := check(m.summary)) is not None:
        return _generic(f"{type(m.summary).__name__}: {why}")
    if mode == FusedMode.BOUND and (not m.allocation.uniform or m.rest is not None):
        return _generic("the fused bound step gives every head the same k pages and drops the rest")
    coarse = getattr(m.summary, "coarse", None)
    stored = torch.bfloat16 if mode == FusedMode.SPLIT and coarse.dtype == torch.bfloat16 else torch.float32
    return Route(mode, summary_dtype=stored)


def generic_refusal(method: Any, label: str) -> str | None:
    """Why vLLM's paged engine runs ``method`` on its generic torch path rather than the fused C step (the first
    layer's reason, for a method whose layers differ), or None where every layer runs fused."""
    from sparseattn.vllm.paged import PagedPolicy, layer_methods

    return next((way.refusal for leaf in layer_methods(method) if not (way := route(PagedPolicy(leaf, label))).fused), None)

