"""Adaptive per-layer clipping, the part both front ends share (tf_keras and Keras 3).

The math and its privacy derivation are in :mod:`keras_dpsgd.tools.adaptive_clipping`. A front end
puts :class:`AdaptiveClippingCore` before its DP optimizer class and supplies the ``_norm_sums``
variable (created in ``build``); the rest goes through the published hooks both front ends' DP
optimizers have: ``on_per_example_sq_norms`` (the lot's norm sums), ``on_noised_step`` (after the
gradient's release: the norm queries and the next bounds), ``standard_normal`` and ``normalize``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from keras_dpsgd.step import _distribute
from keras_dpsgd import backends
from keras_dpsgd import _validate
from keras_dpsgd.tools.adaptive_clipping import composed_noise_multiplier

__all__ = [
    "AdaptiveClippingCore",
    "ADAPTIVE_DOC",
    "NORM_NOISE_INDEX",
    "adaptive_optimizer_class",
    "initial_clip_bounds",
    "ClipBoundsLoggerCore",
]

# Index folded into the seeded noise stream for the norm queries (the gradient noise uses the
# variable indices 0..V-1).
NORM_NOISE_INDEX = 1 << 30

ADAPTIVE_DOC = """
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
    = (Σ_v 1/σ_v² + Σ_v 1/σ_l2,v²)^(-1/2) per step (the ledger does).
"""


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The adaptive settings (a plain dataclass: untracked by Keras and TensorFlow)."""

    norm_sigmas: tuple
    norm_noise_multiplier: Any  # as given: one float or a list (get_config)
    alpha: float
    beta: float
    min_clip_bound: float


def _check_settings(
    num_bounds: int, norm_noise_multiplier: Any, alpha: Any, beta: Any, min_clip_bound: Any
) -> _Settings:
    if isinstance(norm_noise_multiplier, (list, tuple)):
        if len(norm_noise_multiplier) != num_bounds:
            raise ValueError(
                f"norm_noise_multiplier must have one entry per clip bound ({num_bounds}), "
                f"got {len(norm_noise_multiplier)}"
            )
        sigmas = [
            _validate.nonnegative(**{f"norm_noise_multiplier[{i}]": s}) for i, s in enumerate(norm_noise_multiplier)
        ]
        given = list(sigmas)
    else:
        sigmas = [_validate.nonnegative(norm_noise_multiplier=norm_noise_multiplier)] * num_bounds
        given = sigmas[0]
    return _Settings(
        tuple(sigmas),
        given,
        _validate.positive(alpha=alpha),
        _validate.positive(beta=beta),
        _validate.positive(min_clip_bound=min_clip_bound),
    )


class AdaptiveClippingCore:
    """Adaptive per-layer clipping (Three Tools, Sec. 3), shared by both front ends.

    Per lot: the gradient of variable v is clipped to the bound in force C_v
    (``clip_bounds``), noised with N(0, σ_v² C_v²) and released (the usual
    sanitizer); in the same step each variable's norm query
    Σ_i min(‖g_i^v‖, β C_v) + N(0, σ_l2² β² C_v²) is released, and the bounds of the
    next lot become C_v ← max(α · query / L, min_clip_bound) (L: the same
    normalizer as the gradient: expected_lot_size, else the realized lot).

    ``effective_noise_multiplier`` is (Σ_v 1/σ_v² + Σ_v 1/σ_l2,v²)^(-1/2) (see
    :mod:`keras_dpsgd.tools.adaptive_clipping`), so the ledger, which charges the
    optimizer's σ_eff, charges the norm queries too.
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
        self._adaptive = _check_settings(len(self.l2_norm_clip), norm_noise_multiplier, alpha, beta, min_clip_bound)
        # Untracked (no Keras or TensorFlow tracking): the per-replica norm sums between two hooks of one step.
        object.__setattr__(self, "_adaptive_replica_state", threading.local())

    @property
    def norm_noise_multiplier(self):
        return self._adaptive.norm_noise_multiplier

    @property
    def alpha(self) -> float:
        return self._adaptive.alpha

    @property
    def beta(self) -> float:
        return self._adaptive.beta

    @property
    def min_clip_bound(self) -> float:
        return self._adaptive.min_clip_bound

    @property
    def release_noise_multipliers(self) -> tuple[float, ...]:
        """σ of each Gaussian release of one step: the gradient groups, then the norm queries."""
        sigmas = self.noise_multiplier
        if not isinstance(sigmas, list):
            sigmas = [sigmas] * len(self._adaptive.norm_sigmas)
        return tuple(sigmas) + tuple(self._adaptive.norm_sigmas)

    @property
    def effective_noise_multiplier(self) -> float:
        """σ_eff of one step: gradient releases and norm queries composed (Three Tools Sec. 3)."""
        sigmas = self.release_noise_multipliers
        split = len(sigmas) - len(self._adaptive.norm_sigmas)
        return composed_noise_multiplier(sigmas[:split], sigmas[split:])

    def on_per_example_sq_norms(self, sq_norms: tf.Tensor) -> None:
        """Accumulates Σ_i min(‖g_i^v‖, β C_v) over the lot (non-finite examples count 0).

        Under R > 1 replicas (Keras 3, where a lot is one batch there) each replica keeps the sums
        of its share of the lot for this step's release (:meth:`_update_clip_bounds`)."""
        super().on_per_example_sq_norms(sq_norms)
        finite = tf.reduce_all(tf.math.is_finite(sq_norms), axis=1, keepdims=True)
        norms = tf.where(finite, tf.sqrt(tf.maximum(sq_norms, 0.0)), tf.zeros_like(sq_norms))
        query_bounds = self.beta * tf.convert_to_tensor(self.clip_bounds)
        sums = tf.reduce_sum(tf.minimum(norms, query_bounds[None, :]), axis=0)
        if _distribute.num_replicas() > 1:  # one batch per lot: accumulation is refused under R > 1
            self._replica_state().norm_sums = sums
        else:
            self._norm_sums.assign_add(sums)

    def _replica_state(self) -> threading.local:
        """This replica's trace-time state (MirroredStrategy traces each replica in a thread of its own)."""
        return self.__dict__["_adaptive_replica_state"]

    def _update_clip_bounds(self, num_examples: tf.Tensor) -> None:
        """Releases the norm queries of the lot and sets the next bounds (call after the gradient's release).

        Under R replicas the query is split like the gradient's release (``keras_dpsgd.step._distribute``):
        replica r adds N(0, σ_l2² β² C_v² / R) to the sums of its share under a key of its own, the
        noised sums are summed across the replicas once (an all-reduce: ΣS_r + N(0, σ_l2² β² C_v²),
        the one-device release), and every replica sets the same next bounds from that sum.
        """
        bounds = tf.convert_to_tensor(self.clip_bounds)
        noise = self.standard_normal(tf.shape(bounds), NORM_NOISE_INDEX)  # this replica's own key
        sigmas = tf.constant(self._adaptive.norm_sigmas, tf.float32) * _distribute.replica_noise_scale()
        if _distribute.num_replicas() > 1:
            state = self._replica_state()
            sums, state.norm_sums = state.norm_sums, None
        else:
            sums = tf.convert_to_tensor(self._norm_sums)
        noisy = _distribute.global_sum(sums + sigmas * (self.beta * bounds) * noise)
        new_bounds = tf.maximum(self.alpha * self.normalize([noisy], num_examples)[0], self.min_clip_bound)
        self.clip_bounds.assign(new_bounds)
        if _distribute.num_replicas() == 1:
            self._norm_sums.assign(tf.zeros_like(noisy))

    def discard_partial_lot(self, where: str = "") -> int:
        """Drops an incomplete lot, and its norm sums: a discarded example never enters a later lot's
        norm query (it was not sampled into that lot; counting it would double the query's sensitivity)."""
        parent = getattr(super(), "discard_partial_lot", None)
        batches = parent(where) if parent is not None else 0
        if batches and getattr(self, "_norm_sums", None) is not None:
            with tf.init_scope():
                self._norm_sums.assign(tf.zeros_like(tf.convert_to_tensor(self._norm_sums)))
        return batches

    def on_noised_step(self, num_examples: tf.Tensor) -> None:
        """After the gradient's release (with the bounds in force): the norm queries and the next bounds."""
        super().on_noised_step(num_examples)
        self._update_clip_bounds(num_examples)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            norm_noise_multiplier=self.norm_noise_multiplier,
            alpha=self.alpha,
            beta=self.beta,
            min_clip_bound=self.min_clip_bound,
        )
        return config


def adaptive_optimizer_class(
    dp_optimizer_cls: type, mixin: type, register: Callable, module: str, cache: dict[type, type]
) -> type:
    """The class ``Adaptive<dp_optimizer_cls name>``: `mixin` (a front end's adaptive mixin) before
    `dp_optimizer_cls`, registered with `register` (the front end's ``register_keras_serializable``)
    under package "keras_dpsgd"; the same class for the same `dp_optimizer_cls` (`cache`)."""
    if issubclass(dp_optimizer_cls, AdaptiveClippingCore):
        raise ValueError(f"dp_optimizer_cls already clips adaptively: {dp_optimizer_cls.__name__}")
    if dp_optimizer_cls in cache:
        return cache[dp_optimizer_cls]
    cls_name = f"Adaptive{dp_optimizer_cls.__name__}"

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier,
        norm_noise_multiplier,
        *,
        alpha=1.0,
        beta=2.0,
        min_clip_bound=1e-6,
        **kwargs,
    ):
        kwargs.setdefault("name", cls_name)
        dp_optimizer_cls.__init__(self, l2_norm_clip, noise_multiplier, **kwargs)
        self._init_adaptive(norm_noise_multiplier, alpha, beta, min_clip_bound)

    doc = f"{dp_optimizer_cls.__name__} with gradient-aware adaptive per-layer clipping.\n" + ADAPTIVE_DOC
    cls = type(cls_name, (mixin, dp_optimizer_cls), {"__init__": __init__, "__doc__": doc, "__module__": module})
    cache[dp_optimizer_cls] = register(package="keras_dpsgd", name=cls_name)(cls)
    return cache[dp_optimizer_cls]


def _is_keras3(model: Any) -> bool:
    import keras

    return isinstance(model, keras.Model)


def _losses_module(model: Any):
    if _is_keras3(model):
        import keras
    else:
        import tf_keras as keras
    return keras.losses


def initial_clip_bounds(
    model: Any,
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
      model: a built tf_keras or Keras 3 model (logits output for the default loss).
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
    batch_size = _validate.integer_at_least(1, batch_size=batch_size)
    classes = int(num_classes if num_classes is not None else model.output_shape[-1])
    if classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {classes}")
    rng = np.random.default_rng(seed)
    shape = (int(batch_size),) + tuple(int(d) for d in model.input_shape[1:])
    x = tf.constant(rng.random(shape, dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, size=int(batch_size)))
    loss = loss or _losses_module(model).SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = [getattr(v, "value", v) if _is_keras3(model) else v for v in model.trainable_variables]
    backend = backends.per_example(per_example_backend, "warn", "tensorflow")  # the traced probe below is TF code

    # Traced, as in training, with the batch as the step's arguments: the per-example backend's
    # graph checks run (they find the batch among the step's inputs).
    @tf.function
    def sq_norms(x, y):
        with tf.GradientTape(persistent=True) as tape:
            per_example = loss(y, model(x, training=True))
        return backend.clipped_sum(per_example, variables, tape, tf.zeros_like)[1]

    means = np.mean(np.sqrt(np.maximum(sq_norms(x, y).numpy(), 0.0)), axis=0)
    return [max(float(m), 1e-6) for m in means]


class ClipBoundsLoggerCore:
    """Writes the optimizer's per-variable clip bounds to the logs and to TensorBoard (Three Tools Fig. 4).

    Adds ``clip_bound/<variable name>`` entries to each epoch's logs (so they
    land in History and CSVLogger) and, with `log_dir`, writes them as
    TensorBoard scalars every `update_freq` batches and at each epoch end.
    Each front end combines it with its own ``Callback`` class.

    Args:
      log_dir: optional TensorBoard log directory.
      update_freq: write scalars every this many batches (0: epochs only).
    """

    def __init__(self, log_dir: str | None = None, update_freq: int = 0):
        super().__init__()
        update_freq = _validate.integer_at_least(0, update_freq=update_freq)
        self.log_dir = log_dir
        self.update_freq = int(update_freq)
        self._writer = None
        self._batches = 0
        self.history: list[dict[str, float]] = []

    def _variable_names(self) -> list[str]:
        names = [getattr(v, "path", None) or v.name for v in self.model.trainable_variables]
        return [n[:-2] if n.endswith(":0") else n for n in names]

    def _bounds(self) -> dict[str, float] | None:
        bounds = getattr(self.model.optimizer, "clip_bounds", None)
        if bounds is None:
            return None
        values = np.asarray(tf.convert_to_tensor(bounds))
        return {f"clip_bound/{n}": float(b) for n, b in zip(self._variable_names(), values)}

    def _write(self, values: dict[str, float], step: int) -> None:
        if self.log_dir is None:
            return
        from tensorflow.core.framework import summary_pb2

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        ).SerializeToString()
        with self._writer.as_default():
            for k, v in values.items():
                # What tf.summary.scalar writes, without needing the tensorboard package.
                tf.summary.write(k, tf.constant(v, tf.float32), step=step, metadata=metadata)
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
