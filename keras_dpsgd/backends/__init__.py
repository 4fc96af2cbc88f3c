"""Per-example gradients and the noise source, one sub-package per backend.

:mod:`keras_dpsgd.backends.tensorflow` serves Keras 3 on TensorFlow and tf_keras (the fast backend:
ghost norms and per-example rules, and the reference backend: per-example Jacobians).
:mod:`keras_dpsgd.backends.jax` serves Keras 3 on JAX (``KERAS_BACKEND=jax``): per-example gradients under
``jax.vmap``, the library's sampler on ``jax.random`` bits, the stateless private train step.
"""
