"""A spy on what crosses between host and device in a call: what a captured (CUDA-graph) step must not do."""

from __future__ import annotations

import torch

#: What reads a device tensor back to the host, or copies Python data to the device (``lift_fresh``: a tensor made
#: from a Python number, e.g. ``t[i] = n``): on a GPU a sync, and a step no CUDA graph can capture.
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
              "aten.masked_scatter.default", "aten.repeat_interleave.Tensor", "aten._unique2.default",
              "aten.lift_fresh.default"}  # fmt: skip


def host_reads(fn) -> list[str]:
    """The aten calls of ``fn()`` that cross between host and device: those above, and indexing with a bool mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            masked = name.startswith("aten.index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
            if name in HOST_READS and not (name == "aten.repeat_interleave.Tensor" and (kwargs or {}).get("output_size") is not None) or masked:
                found.append(name)
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return found
