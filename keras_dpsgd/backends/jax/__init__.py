"""The JAX backend of keras_dpsgd (Keras 3 with ``KERAS_BACKEND=jax``).

Per-example gradients under ``jax.vmap`` (``_per_example``), with norm rules for the common layers
(ghost norms and book-keeping sums: ``_ghost``, ``_rules``), the library's Gaussian sampler on
``jax.random`` bits (``_noise``) and the optimizer's JAX-only state (``state``). The stateless private train
step that ``keras_dpsgd.keras3.make_private`` installs when ``keras.config.backend() == "jax"``
(``keras_dpsgd.backends.is_jax``) is the Keras 3 front end's (``keras_dpsgd.keras3._jax_train_step``,
DataParallel's part in ``keras3._jax_distribute``, adaptive clipping's in ``keras3._adaptive_values``).
What is not built on JAX yet is refused by name
(:func:`not_built` names it in the refusal a front end raises: ``keras_dpsgd.dp.refusals``): ``keras.distribution`` other than ``DataParallel``, optimizer hooks of one's own,
the audit callback and a model's own train step
(``private_update``/``sanitized_gradients``).
"""

from typing import Any

from keras_dpsgd.backends.jax._noise import add_gaussian, seeded_key, standard_normal
from keras_dpsgd.backends.jax.ops import JAX_OPS as OPS
from keras_dpsgd.backends.jax.ops import make_local_state

__all__ = [
    "JAX_UNSUPPORTED",
    "OPS",
    "PER_EXAMPLE_CHOICES",
    "add_gaussian",
    "make_local_state",
    "per_example",
    "seeded_key",
    "not_built",
    "standard_normal",
]

JAX_UNSUPPORTED = "is not supported on the JAX backend yet; use KERAS_BACKEND=tensorflow"

# The seam's interface (keras_dpsgd.backends). "auto": the layers with rules (_ghost) take their norms and
# clipped sums from their inputs and output gradients, every other variable its gradient under jax.vmap;
# "reference": every variable's gradient under jax.vmap (each example its own batch of one). "fast" names
# TensorFlow's graph analysis and is refused here.
PER_EXAMPLE_CHOICES = ("auto", "reference")


def per_example(name: str, jacobian_fallback: str) -> Any:
    """The per-example computation: ``_per_example`` (vmap); `jacobian_fallback` has nothing to fall back from."""
    from keras_dpsgd.backends.jax import _per_example

    return _per_example


def not_built(feature: str) -> str:
    """The detail of the refusal of a feature not built on JAX, naming it (``refuse(kind, not_built(...))``)."""
    return f"{feature} {JAX_UNSUPPORTED} (KERAS_BACKEND=jax is set)"
