"""Keyword validators for every public argument of keras_dpsgd (pure Python, no TensorFlow).

One rule set and one message form everywhere::

    q = in_range(0, 1, "(]", sampling_rate=q)     # -> float, or raises
    sigma = nonnegative(noise_multiplier=sigma)    # finite, >= 0
    steps = integer_at_least(1, steps=steps)       # -> int

Each validator takes exactly one keyword argument, ``name=value``, so the
message names the argument: ``"sampling_rate must be in (0, 1], got 1.5"``.
Rules shared by all of them:

* bool is never a number (``True`` is refused where a rate or a count is
  expected), and neither is a string (``"0.5"``);
* numpy scalars are numbers (``np.float32(0.5)``, ``np.int64(3)``); floats are
  never integers (``3.0`` is not a count);
* NaN is outside every range; infinity is outside every range whose upper end
  is finite, and refused by :func:`positive` and :func:`nonnegative`.

A value of the wrong type raises :class:`ArgumentTypeError` (a ``TypeError``
that is also a ``ValueError``, so callers that catch either see it); a number
out of range raises ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

__all__ = [
    "ArgumentTypeError",
    "in_range",
    "integer_at_least",
    "integer_in_range",
    "is_integer",
    "is_real",
    "nonnegative",
    "one_of",
    "positive",
]

_BOUNDS = ("[]", "[)", "(]", "()")


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (bool, str, None, ... where a number is expected)."""


def is_real(value: Any) -> bool:
    """True for a real scalar of any type (numbers.Real: float, np.float32, ...); False for bool and str."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """True for an integer scalar of any type (numbers.Integral: int, np.int64, ...); False for bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _one(named: dict) -> tuple[str, Any]:
    if len(named) != 1:
        raise TypeError(f"a validator takes exactly one keyword argument name=value, got {sorted(named)}")
    return next(iter(named.items()))


def _fmt(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _real(name: str, value: Any, what: str) -> float:
    if not is_real(value):
        raise ArgumentTypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return float(value)


def _integer(name: str, value: Any, what: str) -> int:
    if not is_integer(value):
        raise ArgumentTypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return int(value)


def in_range(low: float, high: float, bounds: str = "[]", **named: Any) -> float:
    """The one keyword argument as a float, if it lies in the interval; raises otherwise.

    Args:
      low: lower end of the interval (may be ``-math.inf``).
      high: upper end (may be ``math.inf``).
      bounds: which ends are included, in interval notation: "[]", "[)",
        "(]" or "()".
      **named: exactly one ``name=value``.

    Returns:
      ``float(value)``.

    Raises:
      ArgumentTypeError: the value is not a real number (bool and str are not).
      ValueError: the value is NaN or outside the interval.
    """
    if bounds not in _BOUNDS:
        raise ValueError(f"bounds must be one of {_BOUNDS}, got {bounds!r}")
    name, value = _one(named)
    what = f"in {bounds[0]}{_fmt(low)}, {_fmt(high)}{bounds[1]}"
    x = _real(name, value, what)
    above = x >= low if bounds[0] == "[" else x > low
    below = x <= high if bounds[1] == "]" else x < high
    if not (above and below):  # False for NaN
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return x


def _finite_from(what: str, strict: bool, named: dict) -> float:
    name, value = _one(named)
    x = _real(name, value, what)
    if not ((0.0 < x if strict else 0.0 <= x) and x < math.inf):  # False for NaN
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return x


def positive(**named: Any) -> float:
    """The one keyword argument as a float, if it is finite and > 0."""
    return _finite_from("a finite number > 0", True, named)


def nonnegative(**named: Any) -> float:
    """The one keyword argument as a float, if it is finite and >= 0."""
    return _finite_from("a finite number >= 0", False, named)


def integer_at_least(low: int, **named: Any) -> int:
    """The one keyword argument as an int, if it is an integer >= `low` (bool and 3.0 are not)."""
    name, value = _one(named)
    what = f"an integer >= {low}"
    n = _integer(name, value, what)
    if n < low:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return n


def integer_in_range(low: int, high: int, **named: Any) -> int:
    """The one keyword argument as an int, if it is an integer in [low, high]."""
    name, value = _one(named)
    what = f"an integer in [{low}, {high}]"
    n = _integer(name, value, what)
    if not low <= n <= high:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return n


def one_of(choices: Iterable[Any], **named: Any) -> Any:
    """The one keyword argument, if it is one of `choices` (compared with ==, bools apart)."""
    name, value = _one(named)
    choices = tuple(choices)
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
