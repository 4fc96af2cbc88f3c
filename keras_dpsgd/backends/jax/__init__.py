"""The JAX backend of keras_dpsgd (Keras 3 with ``KERAS_BACKEND=jax``).

Per-example gradients under ``jax.vmap`` (``_per_example``), the library's Gaussian sampler on
``jax.random`` bits (``_noise``), the optimizer's JAX-only state (``_state``) and the stateless private
train step (``_train_step``) that ``keras_dpsgd.keras3.make_private`` installs when
``keras.config.backend() == "jax"``. What is not built on JAX yet is refused by name
(:func:`unsupported`): ``keras.distribution`` (DataParallel), adaptive clipping and optimizer hooks,
the audit callback, DPPCA/DPNormalization layers, keras_dpsgd's BackupAndRestore, a model's own
train step (``private_update``/``sanitized_gradients``) and the CLI.
"""

from keras_dpsgd.backends.jax._train_step import (
    JAX_UNSUPPORTED,
    prepare_fit,
    private_train_step,
    unsupported,
    values_kept_on_refusal,
)

__all__ = ["JAX_UNSUPPORTED", "prepare_fit", "private_train_step", "unsupported", "values_kept_on_refusal"]
