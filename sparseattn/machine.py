"""The CPU a run is on, read once from Linux's ``/proc/cpuinfo`` (empty elsewhere).

Three readers need it: the C kernels' build key (a library compiled with ``-march=native`` is only
valid for the feature flags it was built for), and the benchmarks' and serving runs' records (the
model name, and the instruction sets that decide whether a bfloat16 engine has a fast path).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

#: The CPU features that decide the speed of a bf16 engine on x86 (no avx512_bf16/amx: bf16 GEMMs take a slow path).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache
def cpu_fields() -> dict[str, str]:
    """``key: value`` fields of ``/proc/cpuinfo`` (the last core's entry wins; the cores of one machine
    are alike); ``{}`` where the file cannot be read."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The ``key: value`` lines of a ``/proc/cpuinfo`` text, stripped (a later key wins)."""
    fields = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel lists them (x86 ``flags``, Arm ``Features``); ``""`` if unknown."""
    fields = cpu_fields()
    return fields.get("flags") or fields.get("Features") or ""


def cpu_model() -> dict[str, Any]:
    """The CPU's model name (None if unknown) and which of :data:`ISA_FLAGS` it has."""
    flags = set(cpu_flags().split())
    return {"cpu": cpu_fields().get("model name"), "isa": [f for f in ISA_FLAGS if f in flags]}


__all__ = ["ISA_FLAGS", "cpu_fields", "cpu_flags", "cpu_model", "parse_cpuinfo"]
