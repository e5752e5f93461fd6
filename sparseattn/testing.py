"""Helpers for testing sparse methods against their references (used by our tests, useful for yours)."""

from __future__ import annotations

import torch

#: Relative error allowed when comparing a fast path run in ``dtype`` with a float64 reference.
#: fp32 accumulates O(sqrt(t)) rounding steps of 2^-24; fp16/bf16 inputs are rounded once on entry.
RELATIVE_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in float64 (0 when both are zero)."""
    a, r = actual.double(), reference.double()
    denom = r.norm().item()
    return (a - r).norm().item() / denom if denom > 0 else (a - r).norm().item()


def assert_close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype | None = None, *, what: str = "output") -> None:
    """Assert no NaN/inf in ``actual`` and a relative error within the tolerance of ``dtype``.

    Args:
        actual: the fast path's result.
        reference: the naive reference's result (ideally float64).
        dtype: the dtype the fast path ran in (default: ``actual.dtype``).
    """
    dtype = actual.dtype if dtype is None else dtype
    if actual.shape != reference.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference shape {tuple(reference.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(actual)).sum())} non-finite values")
    err = relative_error(actual, reference)
    tol = RELATIVE_TOLERANCE[dtype]
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3e} exceeds the {dtype} tolerance {tol:.1e}")
