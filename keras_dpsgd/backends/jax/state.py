"""The JAX backend's optimizer state: what TensorFlow keeps in local ``tf.Variable``s, as optimizer variables.

JAX's train step is stateless (``train_step(state, data)``): whatever the step changes must be one of
the optimizer's variables, which Keras threads through the step. Four are added when a DP optimizer
is built on JAX (:func:`add_variables`):

* ``dp_noise_key`` (uint32 [2]): the noise key of an optimizer without a seed, drawn from OS entropy
  and split at every release. Never saved (a file holds zeros) and drawn afresh from OS entropy on
  load, so restoring a file twice never replays noise (as the TF generator, never checkpointed).
* ``dp_nonfinite_examples``: the examples zeroed for a non-finite gradient, an un-noised count over
  the private data kept in this process only: never saved (a file holds 0), reset on load.
* ``dp_ledger_offset``: the releases the model's ledger recorded before this optimizer's counter began,
  which the ledger writes before every fit (``DPState.ledger_offset`` is this variable on JAX); a seeded
  key is a function of (seed, ``dp_ledger_offset + noised_steps``), the release's position in the model's
  ledger. Saved with ``noised_steps``, so that a restored counter and its offset belong together.
* ``dp_expected_lot_size``: the traced mirror of ``expected_lot_size`` (0 = unset), which the
  optimizer's setter writes (``DPState.lot`` is this variable on JAX).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_dpsgd.backends.jax._noise import entropy_key

__all__ = ["add_variables", "save_variables", "saved_store", "after_load", "UNSAVED"]

UNSAVED = ("dp_noise_key", "dp_nonfinite_examples")


def add_variables(optimizer: Any) -> None:
    """Makes the JAX-only variables of a DP optimizer (called from its ``build``)."""
    dp = optimizer._dp
    lot = 0.0 if dp.expected_lot_size is None else float(dp.expected_lot_size)
    optimizer._jax_lot = optimizer.add_variable(
        (), initializer=keras.initializers.Constant(lot), dtype="float32", name="dp_expected_lot_size"
    )
    optimizer._jax_nonfinite = optimizer.add_variable(
        (), initializer="zeros", dtype="int32", name="dp_nonfinite_examples"
    )
    optimizer._jax_key = optimizer.add_variable((2,), initializer="zeros", dtype="uint32", name="dp_noise_key")
    optimizer._jax_key.assign(entropy_key())
    optimizer._jax_offset = optimizer.add_variable((), initializer="zeros", dtype="int32", name="dp_ledger_offset")
    dp.lot, dp.nonfinite, dp.ledger_offset = optimizer._jax_lot, optimizer._jax_nonfinite, optimizer._jax_offset


def _unsaved(optimizer: Any) -> set:
    return {id(getattr(optimizer, a)) for a in ("_jax_key", "_jax_nonfinite") if hasattr(optimizer, a)}


def save_variables(optimizer: Any, store: Any) -> None:
    """Keras's ``Optimizer.save_own_variables``, with zeros for the noise key and the non-finite count."""
    unsaved = _unsaved(optimizer)
    for i, variable in enumerate(optimizer.variables):
        value = variable.numpy()
        store[str(i)] = np.zeros_like(value) if id(variable) in unsaved else value


def saved_store(optimizer: Any, store: Any) -> Any:
    """The store Keras's ``Optimizer.load_own_variables`` reads: a file of 0.2.0 holds every variable but
    ``dp_ledger_offset`` (added since: the last of the DP state, before the variables a mixin builds after it,
    as adaptive clipping's ``adaptive_norm_sums``), which Keras would answer by skipping every variable
    (``noised_steps``, the bounds, the slots) with a warning. Such a store gets the offset 0 at its place: the
    ledger writes the offset before every fit (``keras_dpsgd.ledger``), so 0 here is never used for a key."""
    offset = getattr(optimizer, "_jax_offset", None)
    variables = list(optimizer.variables)
    at = next((i for i, v in enumerate(variables) if v is offset), None)
    if at is None or len(store.keys()) != len(variables) - 1:
        return store
    saved = [store[str(i)] for i in range(len(variables) - 1)]  # Keras's keys: the variables' positions
    return {str(i): value for i, value in enumerate(saved[:at] + [np.zeros((), np.int32)] + saved[at:])}


def after_load(optimizer: Any) -> None:
    """A fresh OS-entropy key and a zero non-finite count after a load (never what the file held)."""
    if hasattr(optimizer, "_jax_key"):
        optimizer._jax_key.assign(entropy_key())
        optimizer._jax_nonfinite.assign(0)
