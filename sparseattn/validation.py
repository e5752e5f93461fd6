"""Checks of user-given fields, shared by every part and method: one message shape everywhere.

Each raises a ``ValueError`` naming ``Owner.field``, the value given and what is allowed, e.g.
``H2O.budget must be an int >= 1, got 0``. A ``bool`` is never taken for a number (``budget=True``
is a mistake, not 1), nor a number for a flag. Pure Python: the lowest layer of the package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real


def _field(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def check_int(owner: str, name: str, value, minimum: int, why: str = "") -> None:
    """Raise unless ``value`` is an int ``>= minimum``; ``why`` explains a minimum that depends on other fields.

    Example:
        >>> check_int("H2O", "budget", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: H2O.budget must be an int >= 1, got 0
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{_field(owner, name)} must be an int >= {minimum}, got {value!r}{reason}")


def check_real(owner: str, name: str, value, *, above: float | None = None, at_least: float | None = None) -> None:
    """Raise unless ``value`` is a finite real number ``> above`` / ``>= at_least`` (when given)."""
    bound = f" > {above}" if above is not None else f" >= {at_least}" if at_least is not None else ""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        raise ValueError(f"{_field(owner, name)} must be a finite number{bound}, got {value!r}")


def check_number(owner: str, name: str, value, allowed: str, ok: Callable[[float], bool]) -> None:
    """Raise unless ``value`` is a finite real number with ``ok(value)``; ``allowed`` states the range,
    e.g. ``"a number in [0, 1)"``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{_field(owner, name)} must be {allowed}, got {value!r}")


def check_bool(owner: str, name: str, value) -> None:
    """Raise unless ``value`` is True or False (a 0/1 or a string is a mistake, not a flag)."""
    if not isinstance(value, bool):
        raise ValueError(f"{_field(owner, name)} must be True or False, got {value!r}")
