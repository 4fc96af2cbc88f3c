"""The TensorFlow backend (Keras 3 on TensorFlow, and tf_keras): its side of :mod:`keras_dpsgd.backends`.

Per-example computation (``per_example``): ``FastBackend`` (``_backend``) implements the protocol of
``keras_dpsgd.backends.tensorflow.per_example_backend``: ``clipped_sum(loss, var_list, tape, clip_factors) ->
(summed, sq_norms)`` with fast per-example clipping (ghost norms and book-keeping). It gives the same
numbers as the per-example jacobian (reference) path, without materializing per-example gradients
for the layers that carry most parameters. See ``_backend`` for the algorithm. ``ReferenceBackend``
(``_reference``) is the always-exact per-example jacobian path it falls back to for a variable
without a rule (announced: ``_report``). How a new op gets a per-example rule:
``_handlers.register_rule``.

Array table and noise source (``ops``): ``OPS``, the :class:`keras_dpsgd.dp.ops.ArrayOps` the DP core runs
over on TensorFlow; the core's sampler (``keras_dpsgd.dp.noise``) under stateless TensorFlow keys
(``seeded_key``); an optimizer without a seed draws its keys from a ``tf.random.Generator`` of OS entropy,
never checkpointed (``make_local_state``).
"""

from __future__ import annotations

from typing import Any

from keras_dpsgd.backends.tensorflow._backend import FastBackend
from keras_dpsgd.backends.tensorflow.per_example_backend import PER_EXAMPLE_CHOICES, resolve_backend
from keras_dpsgd.backends.tensorflow._reference import ReferenceBackend
from keras_dpsgd.backends.tensorflow.ops import TF_OPS as OPS
from keras_dpsgd.backends.tensorflow.ops import add_gaussian, make_local_state, seeded_key, standard_normal

__all__ = [
    "FastBackend",
    "OPS",
    "PER_EXAMPLE_CHOICES",
    "ReferenceBackend",
    "add_gaussian",
    "make_local_state",
    "per_example",
    "seeded_key",
    "standard_normal",
]


def per_example(name: str, jacobian_fallback: str) -> Any:
    """The per-example computation `name` (``_per_example.resolve_backend``)."""
    return resolve_backend(name, jacobian_fallback)
