"""Argument checks for the package: one helper, so every error names the argument and the fix."""

from __future__ import annotations

import math
from typing import Any


def check_arg(
    ok: bool, name: str, value: Any, must: str, fix: str = "", error: type[Exception] = ValueError
) -> None:
    """Raise ``error("<name> must be <must>, got <value!r>; <fix>")`` unless ``ok`` (``ValueError`` for a bad
    value, ``TypeError`` for a bad type)."""
    if not ok:
        raise error(f"{name} must be {must}, got {value!r}" + (f"; {fix}" if fix else ""))


def is_int(value: Any) -> bool:
    """``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """``value`` is a real number (``int`` or ``float``, not ``bool``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_pair(value: Any, name: str, low: float, high: float | None, what: str) -> tuple[float, float]:
    """``value`` as ``(min, max)`` finite floats with ``low < min <= max`` (``<= high`` when given)."""
    check_arg(
        isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(v) for v in value),
        name,
        value,
        f"a (min, max) pair of numbers ({what})",
        error=TypeError,
    )
    lo, hi = float(value[0]), float(value[1])
    bound = f"{low} < min <= max" + (f" <= {high}" if high is not None else "")
    ok = math.isfinite(hi) and low < lo <= hi and (high is None or hi <= high)
    check_arg(ok, name, value, f"a finite range with {bound}")
    return lo, hi


def check_bool(value: Any, name: str, *, none_ok: bool = False, fix: str = "") -> None:
    """``TypeError`` unless ``value`` is a ``bool`` (or ``None`` where ``none_ok``): ``"false"`` is truthy."""
    must = "True, False or None" if none_ok else "True or False"
    check_arg(isinstance(value, bool) or (none_ok and value is None), name, value, must, fix, TypeError)


def _must(kind: str, what: str, none_ok: bool, low: Any, high: Any, low_open: bool, high_open: bool) -> str:
    bounds = [f"{'>' if low_open else '>='} {low:g}"] if low is not None else []
    bounds += [f"{'<' if high_open else '<='} {high:g}"] if high is not None else []
    return " ".join(p for p in (kind, " and ".join(bounds), what) if p) + (" or None" if none_ok else "")


def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    none_ok: bool = False,
    also: tuple[str, ...] = (),
    what: str = "",
    fix: str = "",
) -> None:
    """``TypeError`` unless an ``int`` (not a ``bool``), ``ValueError`` unless in bounds; ``None`` passes where
    ``none_ok``, the strings of ``also`` too; ``what`` follows the bounds in the message."""
    must = " or ".join([*(repr(a) for a in also), _must("an int", what, none_ok, low, high, False, False)])
    if (none_ok and value is None) or (isinstance(value, str) and value in also):
        return
    check_arg(is_int(value) or (bool(also) and isinstance(value, str)), name, value, must, fix, TypeError)
    ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    check_arg(ok, name, value, must, fix)


def check_float(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    none_ok: bool = False,
    what: str = "",
    fix: str = "",
) -> float | None:
    """``value`` as a float: ``TypeError`` unless a real number (not a ``bool``), ``ValueError`` unless finite
    and in bounds (``low_open``/``high_open`` make a bound exclusive); ``None`` passes where ``none_ok``."""
    must = _must("a finite number", what, none_ok, low, high, low_open, high_open)
    if none_ok and value is None:
        return None
    check_arg(is_number(value), name, value, must, fix, TypeError)
    x = float(value)
    in_range = (
        math.isfinite(x)
        and (low is None or (x > low if low_open else x >= low))
        and (high is None or (x < high if high_open else x <= high))
    )
    check_arg(in_range, name, value, must, fix)
    return x


def check_choice(value: Any, name: str, choices: tuple[str, ...], *, fix: str = "") -> None:
    """``TypeError`` unless ``value`` is a ``str``, ``ValueError`` unless it is one of ``choices``."""
    must = "one of " + ", ".join(repr(c) for c in choices)
    check_arg(isinstance(value, str), name, value, must, fix, TypeError)
    check_arg(value in choices, name, value, must, fix)


def check_batch_array(images: Any, shape: tuple[int, ...], name: str) -> None:
    """``images`` must be a writable C-contiguous uint8 numpy array of ``shape`` (a batch ``read_into`` fills)."""
    import numpy as np

    array = isinstance(images, np.ndarray)
    check_arg(
        array and images.dtype == np.uint8 and images.shape == shape and images.flags.c_contiguous
        and images.flags.writeable,
        name,
        f"{images.dtype} {images.shape}" if array else type(images).__name__,
        f"a writable C-contiguous uint8 array of shape {shape}",
    )  # fmt: skip
