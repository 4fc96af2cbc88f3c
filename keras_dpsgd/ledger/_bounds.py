"""The worst case the ledger has charged, kept in the DP optimizer's variables where the segments are not.

A ``.keras`` file of tf_keras keeps the optimizer's variables, not the ledger's segments: besides ``noised_steps``
the optimizer keeps the largest q and the smallest σ_eff charged so far, which charge steps whose segments were
lost (the sub-sampled Gaussian's ε grows with q and shrinks with σ: never under-reported).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.ledger._holders import is_dp_optimizer, is_keras3, noised_steps


# The optimizer variables that keep the ledger's worst case where its segments are not saved (a
# .keras file): (name, initial value), in the order they are saved. 0 and inf: nothing charged yet.
BOUND_VARIABLES = (("ledger_max_sampling_rate", 0.0), ("ledger_min_noise_multiplier", math.inf))


def add_bound_variables(optimizer: Any) -> list:
    """Makes `optimizer`'s saved worst-case bounds [largest q charged, smallest σ_eff charged].

    Made with the optimizer's own ``add_variable`` (tf_keras or Keras 3), so that its Keras saves
    them with its other variables (``.keras``, h5, checkpoints); the front end keeps them under its
    attribute names (the checkpoint keys) and exposes them as ``ledger_max_sampling_rate`` and
    ``ledger_min_noise_multiplier`` (tf.Variables), which the ledger reads and widens.
    """

    def constant(value: float):
        return lambda shape, dtype=None: tf.fill(shape, tf.constant(value, dtype or "float64"))

    return [
        optimizer.add_variable(shape=(), dtype=_bound_dtype(optimizer), initializer=constant(value), name=name)
        for name, value in BOUND_VARIABLES
    ]


def _bound_dtype(optimizer: Any) -> str:
    """float64, or float32 on JAX without x64 (the ledger rounds it outward: :func:`_outward`)."""
    if is_keras3(optimizer):
        from keras_dpsgd import backends

        if backends.is_jax():
            import jax

            return "float64" if jax.config.jax_enable_x64 else "float32"
    return "float64"


def _bound_variables(optimizer: Any) -> Optional[tuple]:
    """The optimizer's (largest q, smallest σ) variables, or None if it has none."""
    q_max = getattr(optimizer, "ledger_max_sampling_rate", None)
    sigma_min = getattr(optimizer, "ledger_min_noise_multiplier", None)
    if all(hasattr(v, "assign") and hasattr(v, "numpy") for v in (q_max, sigma_min)):
        return q_max, sigma_min  # tf.Variables; Keras 3 variables on JAX
    return None


def _read_bounds(variables: Optional[tuple]) -> Optional[tuple]:
    return None if variables is None else tuple(float(v.numpy()) for v in variables)


def _outward(value: float, dtype: Any, up: bool) -> Any:
    """`value` in the variable's dtype, rounded away from an under-reported ε: q up, σ down.

    JAX without x64 keeps the float64 bounds in float32, whose nearest value may be a smaller q
    (or a larger σ) than the one charged.
    """
    if np.dtype(dtype) == np.float64 or not math.isfinite(value):
        return value
    rounded = np.float32(value)
    if (float(rounded) < value) if up else (float(rounded) > value):
        rounded = np.nextafter(rounded, np.float32(np.inf if up else -np.inf))
    return rounded


def _write_bounds(variables: Optional[tuple], values: Optional[tuple]) -> None:
    if variables is None:
        return
    for up, variable, value in zip((True, False), variables, values):
        value = _outward(value, getattr(variable.dtype, "as_numpy_dtype", variable.dtype), up)
        if float(variable.numpy()) != float(value):
            variable.assign(value)


def note_sampling_rate_change(optimizer: Any, previous_sampling_rate: float) -> None:
    """Keeps the steps already taken at `previous_sampling_rate` charged at least at it.

    Called by a DP optimizer's ``sampling_rate`` setter when a known q
    changes. The ledger charges steps it has not attributed to a segment at
    the worst case in the optimizer's saved bounds, so a change of q before
    the ledger was ever read cannot under-report ε.
    """
    variables = _bound_variables(optimizer)
    if variables is None or not is_dp_optimizer(optimizer) or noised_steps(optimizer) == 0:
        return
    with tf.init_scope():
        sigma = float(optimizer.effective_noise_multiplier)
        _write_bounds(variables, S.widen_bounds(_read_bounds(variables), previous_sampling_rate, sigma))
