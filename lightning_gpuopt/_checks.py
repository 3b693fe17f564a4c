"""Argument checks for the package: one helper, so every error names the argument and the fix."""

from __future__ import annotations

from typing import Any


def check_arg(
    ok: bool, name: str, value: Any, must: str, fix: str = "", error: type[Exception] = ValueError
) -> None:
    """Raise ``error("<name> must be <must>, got <value!r>; <fix>")`` unless ``ok``.

    Args:
        ok: the condition the argument meets.
        name: the argument as the user wrote it (``"num_workers"``, ``"augment.scale"``).
        value: what the user passed.
        must: what the argument must be.
        fix: what to pass instead, when that is not obvious from ``must``.
        error: ``ValueError`` for a bad value, ``TypeError`` for a bad type.
    """
    if not ok:
        raise error(f"{name} must be {must}, got {value!r}" + (f"; {fix}" if fix else ""))


def is_int(value: Any) -> bool:
    """``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """``value`` is a real number (``int`` or ``float``, not ``bool``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_pair(value: Any, name: str, low: float, high: float | None, what: str) -> tuple[float, float]:
    """``value`` as ``(min, max)`` floats with ``low < min <= max`` (``<= high`` when given)."""
    check_arg(
        isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(v) for v in value),
        name,
        value,
        f"a (min, max) pair of numbers ({what})",
        error=TypeError,
    )
    lo, hi = float(value[0]), float(value[1])
    bound = f"{low} < min <= max" + (f" <= {high}" if high is not None else "")
    check_arg(low < lo <= hi and (high is None or hi <= high), name, value, f"a range with {bound}")
    return lo, hi
