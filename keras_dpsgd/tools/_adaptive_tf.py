"""Adaptive per-layer clipping in TensorFlow: the optimizer mode, initial bounds, logging callback.

The math and its privacy derivation are in :mod:`keras_dpsgd.tools.adaptive_clipping`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tensorflow.core.framework import summary_pb2

from keras_dpsgd import _per_example
from keras_dpsgd._sanitizer import DPSanitizerMixin
from keras_dpsgd.optimizer import DPSGDOptimizer
from keras_dpsgd.tools.adaptive_clipping import composed_noise_multiplier

# Index folded into the seeded noise stream for the norm queries (the gradient
# noise uses the variable indices 0..V-1).
_NORM_NOISE_INDEX = 1 << 30


def _check_finite_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class AdaptiveClippingMixin:
    """Adaptive per-layer clipping (Three Tools, Sec. 3) for a DP optimizer; put before it in the bases.

    Per lot: the gradient of variable v is clipped to the bound in force C_v
    (``clip_bounds``), noised with N(0, σ_v² C_v²) and released (the usual
    sanitizer); in the same step each variable's norm query
    Σ_i min(‖g_i^v‖, β C_v) + N(0, σ_l2² β² C_v²) is released, and the bounds of the
    next lot become C_v ← max(α · query / L, min_clip_bound) (L: the same
    normalizer as the gradient: expected_lot_size, else the realized lot).
    Runs inside the traced train step, with any per-example backend (it only
    needs the backend's [B, V] squared norms), and with gradient accumulation
    (the norm sums are accumulated over the lot's physical batches).

    ``effective_noise_multiplier`` is (Σ_v 1/σ_v² + Σ_v 1/σ_l2,v²)^(-1/2) (see
    :mod:`keras_dpsgd.tools.adaptive_clipping`), so a ledger that charges the
    optimizer's σ_eff charges the norm queries too.
    """

    def _init_adaptive(
        self, norm_noise_multiplier: float | Sequence[float], alpha: float, beta: float, min_clip_bound: float
    ) -> None:
        if not self.per_layer_clipping:
            raise ValueError(
                "adaptive clipping is per variable: l2_norm_clip must be a list (one initial bound per "
                "trainable variable, e.g. from keras_dpsgd.tools.initial_clip_bounds) or a dict by "
                f"variable name, got the single bound {self.l2_norm_clip!r}"
            )
        num = len(self.l2_norm_clip)
        if isinstance(norm_noise_multiplier, (list, tuple)):
            if len(norm_noise_multiplier) != num:
                raise ValueError(
                    f"norm_noise_multiplier must have one entry per clip bound ({num}), "
                    f"got {len(norm_noise_multiplier)}"
                )
            s2 = [float(s) for s in norm_noise_multiplier]
        else:
            s2 = [float(norm_noise_multiplier)] * num
        for i, s in enumerate(s2):
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"norm_noise_multiplier[{i}] must be a finite number >= 0, got {s!r}")
        self._norm_sigmas = self._no_dependency(s2)
        self._norm_noise_multiplier = (
            list(norm_noise_multiplier) if isinstance(norm_noise_multiplier, (list, tuple)) else s2[0]
        )
        self.alpha = _check_finite_positive("alpha", alpha)
        self.beta = _check_finite_positive("beta", beta)
        self.min_clip_bound = _check_finite_positive("min_clip_bound", min_clip_bound)

    @property
    def norm_noise_multiplier(self):
        return self._norm_noise_multiplier

    @property
    def effective_noise_multiplier(self) -> float:
        """σ_eff of one step: gradient releases and norm queries composed (Three Tools Sec. 3)."""
        sigmas = self.noise_multiplier
        if not isinstance(sigmas, list):
            sigmas = [sigmas] * len(self._norm_sigmas)
        return composed_noise_multiplier(sigmas, self._norm_sigmas)

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        super().build(var_list)
        # An optimizer variable (checkpointed): a lot interrupted by a restart keeps its partial norm sums.
        self._norm_sums = self.add_variable([len(var_list)], tf.float32, name="adaptive_norm_sums")

    def on_per_example_sq_norms(self, sq_norms: tf.Tensor) -> None:
        """Accumulates Σ_i min(‖g_i^v‖, β C_v) over the lot (non-finite examples count 0)."""
        super().on_per_example_sq_norms(sq_norms)
        finite = tf.reduce_all(tf.math.is_finite(sq_norms), axis=1, keepdims=True)
        norms = tf.where(finite, tf.sqrt(tf.maximum(sq_norms, 0.0)), tf.zeros_like(sq_norms))
        query_bounds = self.beta * self.clip_bounds
        self._norm_sums.assign_add(tf.reduce_sum(tf.minimum(norms, query_bounds[None, :]), axis=0))

    def _release(self, summed, num_examples, reg_grads):
        """Releases the gradient with the bounds in force, then the norm queries and the next bounds."""
        grads = super()._release(summed, num_examples, reg_grads)
        bounds = self.clip_bounds.read_value()
        query_bounds = self.beta * bounds
        noise = self._standard_normal(tf.shape(bounds), tf.float32, _NORM_NOISE_INDEX)
        noisy = self._norm_sums.read_value() + tf.constant(self._norm_sigmas, tf.float32) * query_bounds * noise
        denominator = tf.where(self._lot_size > 0.0, self._lot_size, tf.cast(num_examples, tf.float32))
        new_bounds = tf.maximum(self.alpha * noisy / denominator, self.min_clip_bound)
        self.clip_bounds.assign(new_bounds)
        self._norm_sums.assign(tf.zeros_like(self._norm_sums))
        return grads

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            norm_noise_multiplier=self._norm_noise_multiplier,
            alpha=self.alpha,
            beta=self.beta,
            min_clip_bound=self.min_clip_bound,
        )
        return config


_ADAPTIVE_DOC = """
    Adaptive clipping arguments (van der Veen et al. 2018, Sec. 3):
      l2_norm_clip: initial bound per trainable variable (list or dict), e.g.
        from `initial_clip_bounds` (random noise: no privacy cost).
      norm_noise_multiplier: σ_l2 >= 0 of each variable's norm query (one or
        one per variable). 0 makes the queries non-private (ε = ∞).
      alpha: C_t = α · (noisy mean norm of the previous lot), > 0 (default 1.0).
      beta: the norm query clips at β · C_{t-1}, > 0 (default 2).
      min_clip_bound: floor of the bounds (a negative noisy estimate is
        post-processed to it), > 0.
    The accountant must be charged `effective_noise_multiplier`
    = (Σ_v 1/σ_v² + Σ_v 1/σ_l2,v²)^(-1/2) per step.
"""


@keras.saving.register_keras_serializable(package="keras_dpsgd", name="AdaptiveDPSGDOptimizer")
class AdaptiveDPSGDOptimizer(AdaptiveClippingMixin, DPSGDOptimizer):
    __doc__ = "DP-SGD with gradient-aware adaptive per-layer clipping.\n" + _ADAPTIVE_DOC

    def __init__(
        self,
        l2_norm_clip: list[float] | dict[str, float],
        noise_multiplier: float | list[float],
        norm_noise_multiplier: float | list[float],
        *,
        alpha: float = 1.0,
        beta: float = 2.0,
        min_clip_bound: float = 1e-6,
        name: str = "AdaptiveDPSGDOptimizer",
        **kwargs: Any,
    ):
        super().__init__(l2_norm_clip, noise_multiplier, name=name, **kwargs)
        self._init_adaptive(norm_noise_multiplier, alpha, beta, min_clip_bound)


_ADAPTIVE_CLASSES: dict[type, type] = {DPSGDOptimizer: AdaptiveDPSGDOptimizer}


def make_adaptive_optimizer(dp_optimizer_cls: type) -> type:
    """Adds adaptive per-layer clipping to a DP optimizer class (e.g. `DPAdamOptimizer`).

    Args:
      dp_optimizer_cls: a class from `keras_dpsgd.tf_keras.make_dp_optimizer` or `DPSGDOptimizer`.

    Returns:
      A class taking (l2_norm_clip, noise_multiplier, norm_noise_multiplier,
      alpha=1.0, beta=2.0, min_clip_bound=1e-6, **the DP class's arguments),
      registered for serialization under package "keras_dpsgd".
    """
    if not (isinstance(dp_optimizer_cls, type) and issubclass(dp_optimizer_cls, DPSanitizerMixin)):
        raise ValueError(f"dp_optimizer_cls must be a keras_dpsgd DP optimizer class, got {dp_optimizer_cls!r}")
    if dp_optimizer_cls in _ADAPTIVE_CLASSES:
        return _ADAPTIVE_CLASSES[dp_optimizer_cls]
    cls_name = f"Adaptive{dp_optimizer_cls.__name__}"

    def __init__(self, l2_norm_clip, noise_multiplier, norm_noise_multiplier, *, alpha=1.0, beta=2.0,
                 min_clip_bound=1e-6, **kwargs):
        kwargs.setdefault("name", cls_name)
        dp_optimizer_cls.__init__(self, l2_norm_clip, noise_multiplier, **kwargs)
        self._init_adaptive(norm_noise_multiplier, alpha, beta, min_clip_bound)

    cls = type(cls_name, (AdaptiveClippingMixin, dp_optimizer_cls),
               {"__init__": __init__, "__doc__": f"{dp_optimizer_cls.__name__} with adaptive per-layer clipping.\n"
                + _ADAPTIVE_DOC, "__module__": __name__})
    cls = keras.saving.register_keras_serializable(package="keras_dpsgd", name=cls_name)(cls)
    _ADAPTIVE_CLASSES[dp_optimizer_cls] = cls
    return cls


def initial_clip_bounds(
    model: keras.Model,
    *,
    num_classes: int | None = None,
    loss: Callable[[Any, Any], Any] | None = None,
    batch_size: int = 128,
    seed: int | None = None,
    per_example_backend: str = "auto",
) -> list[float]:
    """Initial per-variable bounds C_0: mean per-example gradient norms on random noise (public data).

    Three Tools Sec. 3: "C_l2 starts from the mean norm of one iteration on
    random noise". One batch of uniform [0, 1) inputs of the model's input
    shape with uniform random labels; no real data is touched, so this costs
    no privacy.

    Args:
      model: a built tf_keras model (logits output for the default loss).
      num_classes: classes of the random labels (default: the model's last
        output dimension).
      loss: per-example loss (y_true, y_pred) -> [B] (default sparse
        categorical cross-entropy on logits, unreduced).
      batch_size: number of noise examples.
      seed: optional seed (None: OS entropy).
      per_example_backend: backend computing the per-example norms.

    Returns:
      One bound per trainable variable, in `model.trainable_variables` order
      (pass it as `l2_norm_clip`). A variable whose noise gradients are all 0
      gets 1e-6 (the floor of the optimizer's bounds).
    """
    if not model.built:
        raise ValueError("model must be built (call it once or give it an input shape) before initial_clip_bounds")
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    classes = int(num_classes if num_classes is not None else model.output_shape[-1])
    if classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {classes}")
    rng = np.random.default_rng(seed)
    shape = (int(batch_size),) + tuple(int(d) for d in model.input_shape[1:])
    x = tf.constant(rng.random(shape, dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, size=int(batch_size)))
    loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = list(model.trainable_variables)
    backend = _per_example.resolve_backend(per_example_backend)
    with tf.GradientTape(persistent=True) as tape:
        per_example = loss(y, model(x, training=True))
    _, sq_norms = backend.clipped_sum(per_example, variables, tape, tf.zeros_like)
    means = np.mean(np.sqrt(np.maximum(sq_norms.numpy(), 0.0)), axis=0)
    return [max(float(m), 1e-6) for m in means]


_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


class ClipBoundsLogger(keras.callbacks.Callback):
    """Writes the optimizer's per-variable clip bounds to the logs and to TensorBoard (Three Tools Fig. 4).

    Adds ``clip_bound/<variable name>`` entries to each epoch's logs (so they
    land in History and CSVLogger) and, with `log_dir`, writes them as
    TensorBoard scalars every `update_freq` batches and at each epoch end.

    Args:
      log_dir: optional TensorBoard log directory.
      update_freq: write scalars every this many batches (0: epochs only).
    """

    def __init__(self, log_dir: str | None = None, update_freq: int = 0):
        super().__init__()
        if isinstance(update_freq, bool) or int(update_freq) != update_freq or update_freq < 0:
            raise ValueError(f"update_freq must be an integer >= 0, got {update_freq!r}")
        self.log_dir = log_dir
        self.update_freq = int(update_freq)
        self._writer = None
        self._batches = 0
        self.history: list[dict[str, float]] = []

    def _bounds(self) -> dict[str, float] | None:
        opt = self.model.optimizer
        bounds = getattr(opt, "clip_bounds", None)
        if bounds is None:
            return None
        names = [v.name[:-2] if v.name.endswith(":0") else v.name for v in self.model.trainable_variables]
        return {f"clip_bound/{n}": float(b) for n, b in zip(names, bounds.numpy())}

    def _write(self, values: dict[str, float], step: int) -> None:
        if self.log_dir is None:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default():
            for k, v in values.items():
                # What tf.summary.scalar writes, without needing the tensorboard package.
                tf.summary.write(k, tf.constant(v, tf.float32), step=step, metadata=_SCALAR_METADATA)
        self._writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.update_freq and self._batches % self.update_freq == 0:
            values = self._bounds()
            if values:
                self._write(values, self._batches)

    def on_epoch_end(self, epoch, logs=None):
        values = self._bounds()
        if not values:
            return
        self.history.append(values)
        if logs is not None:
            logs.update(values)
        self._write(values, self._batches)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
