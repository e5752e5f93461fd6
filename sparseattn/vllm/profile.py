"""Where a paged decode step's time goes: the fused C step's phases, with the bytes each reads, and the Python around them.

The C kernels (``paged_kernels.c``) keep, while the profile is on, each phase's thread time and the bytes it
reads from memory, counted in whole 64-byte lines (a 4-token segment of a 32-token page's transposed keys
costs the page's lines: that is what the memory moves). The Python side adds its own parts (the plan, the
split step's allocation when it runs in Python, and the glue: argument checks, ctypes calls, scratch). A
:class:`StepProfile` collects them over the calls made inside it::

    with StepProfile() as prof:
        fused_decode(...)
    prof.rows(bandwidth_gbps=15.0)   # per phase: us per call, MB per call, GB/s, share of the bandwidth

Thread time: with one thread (vLLM's CPU worker on a 2-core machine) the phases add up to the call's time.
The profile costs two clock reads per phase and work item while on, nothing while off.
"""

from __future__ import annotations

import ctypes
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

from sparseattn.vllm.paged_library import library

__all__ = ["C_PHASES", "PHASE_WHAT", "StepProfile", "active", "python_part"]

#: The C kernels' phases, in the order of ``paged_kernels.c``'s enum.
C_PHASES = (
    "summarise", "score", "shortlist", "rerank", "always_mass", "allocate", "attend_always", "attend_selected", "rest", "setup",
)  # fmt: skip
#: What each part is, for the tables.
PHASE_WHAT = {
    "summarise": "summaries (and the merged rest's sums) of pages seen for the first time",
    "score": "every candidate's coarse score (centroid, or quest's bound)",
    "shortlist": "the KV group's shortlist (log-sum-exp over its heads, top-m)",
    "rerank": "the shortlisted pages' key logits and exact log masses",
    "always_mass": "the sinks' and the tail's log mass (the allocation's denominator)",
    "allocate": "each head's segments (pooled split, top-k of the exact masses)",
    "attend_always": "attention over the sinks and the tail (keys and values)",
    "attend_selected": "attention over the selected segments (values; keys not kept)",
    "rest": "the merged rest: block sums and one token per block",
    "setup": "per (sequence, KV head): the scaled query, the softmax state, writing the output",
    "plan": "the step plan (per sequence: sinks, candidates, k, m), once per step for every layer",
    "allocate (python)": "the allocation in Python (any other than PooledMass over a shortlist)",
    "glue": "Python and ctypes around the C calls: checks, scratch, conversions",
    "layer": "the attention layer's own Python around the fused step (vLLM's forward, the metadata, the output rows)",
    "prefill in mixed steps": "vLLM's kernel over the prefill requests of a step that also decodes (continuous batching)",
}

_ACTIVE: StepProfile | None = None


def active() -> StepProfile | None:
    """The profile being collected, or None (the usual case: nothing is timed)."""
    return _ACTIVE


@contextmanager
def python_part(name: str) -> Iterator[None]:
    """Time the enclosed Python as part ``name`` of the active profile (nothing when none is)."""
    prof = _ACTIVE
    if prof is None:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        prof.python_ns[name] += time.perf_counter_ns() - start


class StepProfile:
    """The phases of every fused paged step called inside ``with StepProfile() as prof:`` (not reentrant).

    ``ns[phase]`` and ``bytes[phase]``: totals of the C phases; ``python_ns[part]``: the Python parts;
    ``wall_ns``: each timed call's wall time (:meth:`call`, used by the callers of the fused step), from which
    ``glue`` is what the C phases and the Python parts do not account for.
    """

    def __init__(self) -> None:
        self.ns: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.python_ns: dict[str, float] = defaultdict(float)
        self.wall_ns = 0.0
        self.calls = 0
        #: In an engine (:mod:`sparseattn.vllm.backend`): the decode steps seen, and the attention layers' whole
        #: forward calls on them (the fused step's calls are inside).
        self.steps = 0
        self.layer_ns = 0.0

    def __enter__(self) -> StepProfile:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("StepProfile: a profile is already being collected (profiles do not nest)")
        library().sa_paged_profile(1, None)
        _ACTIVE = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        lib = library()
        n = len(C_PHASES)
        out = (ctypes.c_double * (2 * n))()
        if lib.sa_paged_profile(0, out) != n:
            raise RuntimeError("StepProfile: the kernel's phases do not match sparseattn.vllm.profile.C_PHASES")
        for i, name in enumerate(C_PHASES):
            self.ns[name] += out[i]
            self.bytes[name] += out[n + i]
        _ACTIVE = None

    def call(self):
        """Time one whole call of the fused step (its wall time, against which the parts are held)."""
        return self._timed("wall_ns", "calls")

    def layer(self):
        """Time one attention layer's whole forward call on a decode step (in an engine)."""
        return self._timed("layer_ns", None)

    @contextmanager
    def _timed(self, total: str, count: str | None) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter_ns() - start)
            if count is not None:
                setattr(self, count, getattr(self, count) + 1)

    def rows(self, bandwidth_gbps: float | None = None, calls: int | None = None) -> list[dict]:
        """One row per part with time: ``part``, ``us`` per call, ``mb`` read per call, ``gbps`` and its ``of_bandwidth``.

        ``calls``: what to divide by (default: the calls timed with :meth:`call`, at least 1; an engine's profile
        divides by its steps). ``glue`` is the wall time of the fused calls the other parts leave over (only where
        calls were timed); ``layer`` the attention layers' forward calls less the fused calls in them.
        """
        per = max(calls or self.calls, 1)
        parts = [(name, self.ns[name], self.bytes[name]) for name in C_PHASES if self.ns[name] or self.bytes[name]]
        parts += [(name, ns, 0.0) for name, ns in self.python_ns.items()]
        if self.calls:
            outside = ("plan", "prefill in mixed steps")  # per step, or in the layer: outside the fused calls
            accounted = sum(ns for name, ns, _ in parts if name not in outside)
            parts.append(("glue", max(self.wall_ns - accounted, 0.0), 0.0))
        if self.layer_ns:  # the layers' forward calls less the fused calls and a mixed step's prefill (own parts)
            layer = self.layer_ns - self.wall_ns - self.python_ns.get("prefill in mixed steps", 0.0)
            parts.append(("layer", max(layer, 0.0), 0.0))
        rows = []
        for name, ns, nbytes in parts:
            gbps = nbytes / ns if ns > 0 else 0.0  # bytes per ns = GB/s
            rows.append({
                "part": name, "us": ns / per / 1e3, "mb": nbytes / per / 1e6, "gbps": gbps,
                "of_bandwidth": gbps / bandwidth_gbps if bandwidth_gbps and nbytes else None,
            })  # fmt: skip
        return rows

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())
