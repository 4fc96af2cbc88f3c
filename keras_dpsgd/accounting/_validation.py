"""Input validation shared by the accountant: ValueError naming argument, range and value."""

from __future__ import annotations

import math
import numbers


def is_real(value) -> bool:
    """True for a real scalar of any type (numbers.Real: float, np.float32, ...); False for bool and str."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """True for an integer scalar of any type (numbers.Integral: int, np.int64, ...); False for bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_float(name: str, value) -> float:
    """Any real scalar (Python, numpy: numbers.Real) as a float; bool and str are refused."""
    if not is_real(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_sampling_rate(value, name: str = "sampling_rate") -> float:
    q = _as_float(name, value)
    if math.isnan(q) or not 0.0 < q <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return q


def check_noise_multiplier(value, name: str = "noise_multiplier") -> float:
    """σ >= 0 and finite (σ = ∞ is no noise distribution anyone draws from)."""
    sigma = _as_float(name, value)
    if math.isnan(sigma) or sigma < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if math.isinf(sigma):
        raise ValueError(f"{name} must be finite (>= 0), got {value!r}")
    return sigma


def check_delta(value, name: str = "delta") -> float:
    delta = _as_float(name, value)
    if math.isnan(delta) or not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return delta


def check_epsilon(value, name: str = "target_epsilon") -> float:
    eps = _as_float(name, value)
    if math.isnan(eps) or not 0.0 < eps < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return eps


def check_positive_int(value, name: str) -> int:
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_nonnegative_int(value, name: str) -> int:
    if not is_integer(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def check_positive_float(value, name: str) -> float:
    x = _as_float(name, value)
    if math.isnan(x) or not 0.0 < x < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return x
