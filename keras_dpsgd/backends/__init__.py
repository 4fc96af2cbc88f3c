"""The backend seam: where keras_dpsgd's DP step differs by array library, behind one small interface.

The DP step is the same math on every backend (the core ``keras_dpsgd.dp``: clip factors, the lot, noise
scales, the sampler, normalization, written once over a table of array operations). Three things are
written per array library: the table (``OPS``), the per-example computation ("the clipped sum and squared
norms of a per-example loss") and the noise source's random words and keys. A backend is a sub-package of ``keras_dpsgd.backends`` that exposes
them; :func:`load` picks it by the Keras backend, as Keras picks its own backend modules
(``keras.config.backend()``), and imports it only when it is chosen.

=============== ==================================== =============================================
Keras           keras_dpsgd backend                  module
=============== ==================================== =============================================
tf_keras        ``tensorflow``                       :mod:`keras_dpsgd.backends.tensorflow`
Keras 3 + TF    ``tensorflow``                       :mod:`keras_dpsgd.backends.tensorflow`
Keras 3 + JAX   ``jax``                              ``keras_dpsgd.backends.jax``
Keras 3 + torch ``torch``                            ``keras_dpsgd.backends.torch``
numpy, openvino refused by name (:func:`name_for`: ValueError naming the supported backends)
=============== ==================================== =============================================

The interface (module attributes of a backend, :data:`INTERFACE`; :func:`load` checks them):

``PER_EXAMPLE_CHOICES``: tuple[str, ...]
  The values of the optimizers' ``per_example_backend`` argument it accepts ("auto" among them).
``per_example(name: str, jacobian_fallback: str) -> PerExample``
  The per-example computation called `name`. ``PerExample.clipped_sum(loss, variables, recorder,
  clip_factors) -> (summed, sq_norms)``: with ``sq_norms[i, v] = ||g_i[v]||²`` (float32 [B, V], one
  column per trainable variable, g_i the gradient of example i's loss) and
  ``factors = clip_factors(sq_norms)`` ([B, V]), ``summed[v] = Σ_i factors[i, v] · g_i[v]`` (one
  dense array per variable, shaped like it). Unnoised: the optimizer adds the noise. An example
  whose factor is 0 contributes exactly 0 to ``summed``, even when its gradient holds NaN or Inf.
  The arguments differ by backend, the contract above does not. TensorFlow:
  ``clipped_sum(loss, variables, recorder, clip_factors)``, `loss` the [B] loss tensor and `recorder`
  the ``tf.GradientTape`` that recorded it (the backend derives the per-example gradients). JAX:
  ``clipped_sum(grads, clip_factors)``, `grads` the per-example gradients themselves (one
  [B, *shape] array per variable), which the JAX train step computes under ``jax.vmap`` of a
  stateless call on a batch of one (``keras_dpsgd.keras3._jax_train_step``): a stateless backend
  has no tape to hand over.
``OPS``
  The backend's :class:`keras_dpsgd.dp.ops.ArrayOps`, the table the DP core (``keras_dpsgd.dp``: clip
  factors, the lot, the release, the sampler) runs over.
``add_gaussian(x, stddev, key) -> x + N(0, stddev² I)``, ``standard_normal(shape, key, dtype)``
  The core's Gaussian sampler over ``OPS`` (``keras_dpsgd.dp.noise``: tails to 11.6 standard
  deviations, not a clamped or truncated library normal), a pure function of `key`.
``seeded_key(seed: int, step, index: int) -> key``
  The key of the noise on tensor `index` of the release at position `step` of the model's ledger
  (every optimizer's releases counted: ``DPSettingsMixin._ledger_position``) under an integer `seed`:
  reproducible and resumable, never repeated within a model's ledger. Without a seed, keys come from OS entropy and are
  never saved; where that state lives is the backend's (TensorFlow: a ``tf.random.Generator`` of
  the optimizer, never checkpointed; a stateless backend: an optimizer variable it keeps out of
  every file).

``make_local_state(state)``
  Makes the optimizer's local state of ``keras_dpsgd.step.settings.DPState`` (never saved) where the
  backend keeps state (TensorFlow: ``tf.Variable``s; JAX: nothing until the optimizer is built).

Everything else a backend does (its train step, the checks of a traced step) is its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["BACKENDS", "INTERFACE", "is_jax", "is_torch", "keras_backend_of", "load", "name_for", "per_example"]

# keras_dpsgd backend -> its module, imported only when chosen.
BACKENDS = {
    "tensorflow": "keras_dpsgd.backends.tensorflow",
    "jax": "keras_dpsgd.backends.jax",
    "torch": "keras_dpsgd.backends.torch",
}
# Keras backend -> keras_dpsgd backend ("tf_keras" stands for tf_keras, which runs on TensorFlow).
_FOR_KERAS = {"tensorflow": "tensorflow", "tf_keras": "tensorflow", "jax": "jax", "torch": "torch"}
# Keras 3 backends without a keras_dpsgd backend, refused by name.
_REFUSED = ("numpy", "openvino")
INTERFACE = (
    "PER_EXAMPLE_CHOICES",
    "per_example",
    "OPS",
    "add_gaussian",
    "standard_normal",
    "seeded_key",
    "make_local_state",
)


def name_for(keras_backend: str | None = None) -> str:
    """The keras_dpsgd backend that serves `keras_backend` (default: ``keras.config.backend()``).

    Args:
      keras_backend: a Keras 3 backend name ("tensorflow", "jax", ...) or "tf_keras".

    Raises:
      ValueError: a Keras backend keras_dpsgd has no backend for (numpy, openvino refused by
        name), naming the supported ones and how to choose one.
    """
    if keras_backend is None:
        import keras

        keras_backend = keras.config.backend()
    if keras_backend in _FOR_KERAS:
        return _FOR_KERAS[keras_backend]
    known = "a backend keras_dpsgd does not support yet" if keras_backend in _REFUSED else "an unknown backend"
    raise ValueError(
        f"keras_dpsgd has no DP-SGD backend for the Keras backend {keras_backend!r} ({known}): its per-example "
        f"gradients and noise are written for {sorted(set(_FOR_KERAS) - {'tf_keras'})}. Set KERAS_BACKEND="
        "tensorflow, jax or torch before importing keras, or use tf_keras (TF_USE_LEGACY_KERAS=1)."
    )


def is_jax(keras_backend: str | None = None) -> bool:
    """Whether `keras_backend` (default: ``keras.config.backend()``) is JAX: the JAX backend's train step,
    state and refusals apply. Never raises (numpy and openvino are refused by :func:`name_for`
    where a DP step is built, not here).
    """
    if keras_backend is None:
        import keras

        keras_backend = keras.config.backend()
    return keras_backend == "jax"


def is_torch(keras_backend: str | None = None) -> bool:
    """Whether `keras_backend` (default: ``keras.config.backend()``) is torch: the torch train step (eager)
    and its refusals apply. Never raises."""
    if keras_backend is None:
        import keras

        keras_backend = keras.config.backend()
    return keras_backend == "torch"


def keras_backend_of(obj: Any) -> str:
    """The Keras backend of a Keras object or class: "tf_keras" for tf_keras's, else ``keras.config.backend()``.

    A Keras 3 object runs on the one backend of its process; tf_keras runs on TensorFlow whatever
    ``KERAS_BACKEND`` says.
    """
    cls = obj if isinstance(obj, type) else type(obj)
    if any(k.__module__.split(".")[0] == "tf_keras" for k in cls.__mro__):
        return "tf_keras"
    import keras

    return keras.config.backend()


def load(keras_backend: str | None = None) -> ModuleType:
    """The backend module that serves `keras_backend` (default: Keras 3's), imported on first use.

    Raises:
      ValueError: as :func:`name_for`.
      ImportError: the backend's array library is not installed (its own message).
      TypeError: the module lacks part of :data:`INTERFACE` (a keras_dpsgd bug, named).
    """
    module_name = BACKENDS[name_for(keras_backend)]
    module = importlib.import_module(module_name)
    missing = [name for name in INTERFACE if not hasattr(module, name)]
    if missing:
        raise TypeError(f"{module_name} is not a keras_dpsgd backend: it lacks {missing} (see keras_dpsgd.backends)")
    return module


def per_example(name: str, jacobian_fallback: str, keras_backend: str | None = None) -> Any:
    """The per-example computation `name` ("auto", ...) of the backend serving `keras_backend`.

    Raises:
      ValueError: `name` is not one of the backend's ``PER_EXAMPLE_CHOICES`` (naming them), or as
        :func:`name_for`.
    """
    backend = load(keras_backend)
    if name not in backend.PER_EXAMPLE_CHOICES:
        raise ValueError(f"per_example_backend must be one of {backend.PER_EXAMPLE_CHOICES}, got {name!r}")
    return backend.per_example(name, jacobian_fallback)
