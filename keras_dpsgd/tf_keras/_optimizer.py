"""Differentially private tf_keras optimizers (DP-SGD, Abadi et al. 2016).

Usage: the only change from non-private Keras training is the optimizer and an
unreduced (per-example) loss::

    opt = keras_dpsgd.tf_keras.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                     learning_rate=0.1)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction="none"))
    model.fit(x, y, batch_size=256)

Argument names follow TF Privacy's ``DPKerasSGDOptimizer``. The sanitizer
(clip → sum → noise → normalize) lives in ``keras_dpsgd.tf_keras._sanitizer`` and is
shared by every optimizer made private with :func:`make_dp_optimizer`: the
descent rule only post-processes the sanitized gradient.
"""

from __future__ import annotations

from typing import Any

import tf_keras as keras

from keras_dpsgd.tf_keras._sanitizer import DPSanitizerMixin
from keras_dpsgd.step.classes import init_private, make_dp_class
from keras_dpsgd.step.clipping import DEFAULT_STABILITY

__all__ = ["DPSGDOptimizer", "DPAdamOptimizer", "make_dp_optimizer"]

_DP_DOC = """
    Privacy arguments (Abadi et al. 2016, Algorithm 1):
      l2_norm_clip: C > 0 (float: flat clipping of the whole gradient), or one
        bound per trainable variable (list in `model.trainable_variables`
        order, kernel and bias separately), or a dict by variable name
        (per-layer clipping).
      noise_multiplier: σ >= 0; the noise on variable v is N(0, σ_v² C_v²).
      clipping: "clip" (default: the bound(s) of l2_norm_clip) or "normalize":
        per-example normalization (automatic clipping, Bu et al. 2023; De et
        al. 2022), g_i / (||g_i|| + stability). Every example then has norm
        < 1: the sensitivity of the sum is 1 and the noise is N(0, σ²), so
        the privacy guarantee and the accountant's (q, σ) are those of
        clipping with C = 1; there is no C (pass l2_norm_clip=None), the
        learning rate absorbs the scale. Flat only (one group).
      stability: γ > 0 of "normalize" (default 0.01); refused with "clip".
        With per-layer clipping it may be one σ per variable. The accountant
        must be charged `effective_noise_multiplier` (σ/√V for V variables
        clipped separately with one σ).
      gradient_accumulation_steps: k >= 1 batches form one lot: clipped
        gradients are summed over k batches, noise is added and the update
        applied once per lot (`noised_steps` counts lots). An incomplete lot
        is never released nor carried into another lot: it is discarded (and
        counted in `discarded_lots`/`discarded_batches`, with a warning) at
        every epoch start and end of fit, after an interruption, and on load.
      expected_lot_size: divide the noised sum by this L (Poisson lots);
        None divides by the realized number of examples in the lot.
      sampling_rate: q, read by the accountant (not used by the step).
      per_example_backend: "auto", "reference" or "fast".
      jacobian_fallback: "warn" (default) or "refuse": what the fast backend
        does with a variable none of its per-example rules reads. "warn": it
        takes exact per-example jacobians (about B times the cost of its
        gradient) and each traced step logs one warning naming the variables
        and the op that stopped the analysis; "refuse": ValueError at the
        first step, before any update. `per_example_report` holds the last
        traced step's report (which variables, which op, why).
      num_microbatches: None only (TF Privacy's default: per-example
        clipping); any other value is refused (no microbatch clipping).
      seed: None (noise from OS entropy; never checkpointed, so a restored
        checkpoint never replays noise) or an integer (noise is a function of
        seed, the release's position in the model's ledger and variable:
        reproducible and resumable on the same device and compilation mode,
        as XLA draws other numbers than the non-XLA kernels; a new optimizer
        on the same model, or a run resumed without its optimizer state,
        continues the ledger's positions instead of replaying noise; keep the
        seed secret, anyone who knows it can remove the noise).

    Saving: `.keras`, h5 and `tf.train.Checkpoint` keep the optimizer state
    (`noised_steps`, `clip_bounds`, slots; accumulators, whose incomplete lot
    is discarded on load). `nonfinite_examples` is a local diagnostic, never
    saved. tf_keras's SavedModel format restores only the configuration (for
    every tf_keras optimizer): `noised_steps` restarts at 0 there, and the
    model's copy of the ledger carries the history (`keras_dpsgd.ledger`).

    Distribution: under `tf.distribute.MirroredStrategy` or
    `MultiWorkerMirroredStrategy` (build and compile in its scope) each replica
    clips its share of the lot and adds noise σC/√R with its own key; the
    cross-replica sum is the one-device release, normalized by the global
    expected_lot_size. Other strategies, adaptive clipping, and weight_decay or
    use_ema with accumulation are refused under several replicas.

    The loss must be per example (`reduction="none"`); a scalar loss raises a
    ValueError at the first step. BatchNormalization in training mode is
    refused (a frozen one, `trainable = False`, runs in inference mode and
    is accepted).
    Regularization: see `keras_dpsgd.tf_keras._sanitizer` (weight_decay, or a
    (per_example_loss, regularization_loss) pair with a persistent tape).
"""

_DP_CLASSES: dict[type, type] = {}


def _register(cls: type) -> type:
    return keras.saving.register_keras_serializable(package="keras_dpsgd", name=cls.__name__)(cls)


@_register
class DPSGDOptimizer(DPSanitizerMixin, keras.optimizers.SGD):
    __doc__ = "DP-SGD: the SGD (momentum, Nesterov) descent rule on sanitized gradients.\n" + _DP_DOC

    def __init__(
        self,
        l2_norm_clip: float | list[float] | dict[str, float] | None,
        noise_multiplier: float | list[float],
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        gradient_accumulation_steps: int = 1,
        expected_lot_size: float | None = None,
        sampling_rate: float | None = None,
        per_example_backend: str = "auto",
        seed: int | None = None,
        name: str = "DPSGDOptimizer",
        jacobian_fallback: str = "warn",
        num_microbatches: None = None,
        clipping: str = "clip",
        stability: float = DEFAULT_STABILITY,
        **kwargs: Any,
    ):
        base_kwargs = dict(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, name=name, **kwargs)
        dp_args = (gradient_accumulation_steps, expected_lot_size, sampling_rate, per_example_backend, seed)
        init_private(
            self,
            super().__init__,
            l2_norm_clip,
            noise_multiplier,
            *dp_args,
            num_microbatches,
            base_kwargs,
            jacobian_fallback,
            clipping=clipping,
            stability=stability,
        )


_DP_CLASSES[keras.optimizers.SGD] = DPSGDOptimizer


def make_dp_optimizer(optimizer_cls: type, *, name: str | None = None) -> type:
    """Returns a private version of a tf_keras optimizer class.

    The returned class takes `l2_norm_clip` and `noise_multiplier` first, the
    DP keyword arguments of :class:`DPSGDOptimizer`, and every argument of
    `optimizer_cls` as keywords. It is registered for serialization under
    package "keras_dpsgd" (call this function before loading a model saved
    with it). The same class is returned for the same `optimizer_cls`.

    Args:
      optimizer_cls: a subclass of `tf_keras.optimizers.Optimizer` (not a
        legacy optimizer).
      name: class name; default "DP<Name>Optimizer".

    Raises:
      ValueError: if `optimizer_cls` is not a tf_keras (2.11+) optimizer class.
    """
    if isinstance(optimizer_cls, type) and optimizer_cls.__module__.startswith("keras."):
        raise ValueError(
            f"optimizer_cls {optimizer_cls.__name__} is a Keras 3 optimizer class (import keras); this "
            "make_dp_optimizer is for tf_keras. Use keras_dpsgd.keras3.make_dp_optimizer (and "
            "keras_dpsgd.keras3.make_private(model))."
        )
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, keras.optimizers.Optimizer)):
        raise ValueError(  # not a privacy refusal: an argument of the wrong type
            "optimizer_cls must be a subclass of tf_keras.optimizers.Optimizer (legacy "
            f"optimizers are not supported), got {optimizer_cls!r}"
        )
    doc = f"Private {optimizer_cls.__name__}: its descent rule on sanitized gradients.\n" + _DP_DOC
    kinds = dict(module=__name__, register=_register, cache=_DP_CLASSES, error=ValueError)
    return make_dp_class(optimizer_cls, DPSanitizerMixin, name=name, doc=doc, **kinds)


DPAdamOptimizer = make_dp_optimizer(keras.optimizers.Adam, name="DPAdamOptimizer")
