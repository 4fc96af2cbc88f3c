"""The white-box step audit: the noised release of EVERY DP-SGD step against the claimed Gaussian mechanism.

After Nasr et al. 2023 ("Tight auditing of differentially private machine learning", white box with
gradient canaries). The auditor wraps the published noise hook (``add_noise``, step 4 of both front
ends) with :class:`StepAuditMixin`:

* Dirac canaries (``GradientCanaryMixin``): by default one on every trainable coordinate, all
  "in"; each joins each lot with the lots' sampling rate q and adds ±C at its coordinate to the
  clipped sum before the noise.
* At every step t the auditor reads the hook's input (the clipped sum, without the canaries) and its
  output (the noised sum), and records u = (output − input) / C at every coordinate. Under the
  claimed mechanism u = b + z, z ~ N(0, σ²) i.i.d., b = ±1 where a canary joined the lot, 0
  elsewhere: the projection of the release on a canary's direction is N(0, σ²C²) without it and
  N(±C, σ²C²) with it.
* From all T·d observations, exact Gaussian intervals give, at the stated confidence, an upper bound
  σ_eff_high on the effective noise multiplier (the noise scale over the shift a canary of norm C
  makes): :func:`keras_dpsgd.audit.statistics.noise_multiplier_upper_bound`.
* ε_lower is a LOWER bound on the exact ε(δ) of T Poisson-subsampled Gaussian steps at σ_eff_high
  (dp_accounting's optimistic privacy loss distribution:
  :func:`~keras_dpsgd.audit.statistics.subsampled_gaussian_epsilon_lower`). ε_lower > the reported ε
  flags a bug.

**What is assumed.** The released noise is Gaussian, independent across coordinates and steps and of
the canaries (the form of the claimed mechanism); only its scale is measured. Under a correct
optimizer every assumption holds, so a correct optimizer is flagged with probability at most
1 − confidence. A noise of the right variance but another shape, clipping bugs (the canaries join
after clipping) and sampling bugs (the auditor samples its canaries itself) are outside what it sees:
the one-run audit (:func:`~keras_dpsgd.audit.canary_audit`) assumes nothing about the noise's shape.
One replica and flat clipping only (refused otherwise).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate as V
from keras_dpsgd.audit import statistics
from keras_dpsgd.audit.canaries import GradientCanaryMixin, with_canary_mixin
from keras_dpsgd.audit.one_run import AuditVerdict, _train_with_canaries
from keras_dpsgd.dp.refusals import refuse

__all__ = ["STEP_ASSUMPTION", "StepAuditMixin", "StepAuditResult", "step_audit", "with_step_audit"]

STEP_ASSUMPTION = (
    "the released noise is Gaussian, i.i.d. over coordinates and steps (the claimed mechanism's form); "
    "its scale is measured"
)
# Per step: noise observations n0, Σu² over them; canary joins n1, Σ b·u, Σ (b·u)² over them.
_STATS = 5


class StepAuditMixin(GradientCanaryMixin):
    """Gradient canaries plus the per-step record of the step audit; put before the DP class.

    Build the class with :func:`with_step_audit`, then call :meth:`install_gradient_canaries` (with
    ``steps``) once the model is built and before training; :meth:`step_statistics` after.
    """

    def install_gradient_canaries(
        self,
        var_list: Sequence[Any],
        included: Sequence[bool],
        *,
        rng: np.random.Generator,
        sampling_rate: float | None = None,
        steps: int,
    ) -> None:
        """As :meth:`GradientCanaryMixin.install_gradient_canaries`; `steps`: the noised steps to record.

        Raises:
          ValueError: per-layer clipping, several replicas, or the canaries' own errors. Recording
            more than `steps` steps fails the step (``InvalidArgumentError``).
        """
        if self.per_layer_clipping:
            raise refuse(
                "audit-setup",
                f"{type(self).__name__}: the step audit needs flat clipping (one l2_norm_clip), "
                "got per-layer clipping; audit with a flat l2_norm_clip",
            )
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise refuse(
                "audit-setup",
                "the step audit runs on one replica (each replica adds part of the noise); run it unsharded",
            )
        steps = V.integer_at_least(1, steps=steps)
        super().install_gradient_canaries(var_list, included, rng=rng, sampling_rate=sampling_rate)
        with tf.init_scope():
            self._step_trace = tf.Variable(tf.zeros([steps, _STATS], tf.float64), trainable=False, name="step_audit")
            self._step_count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="step_audit_count")

    def step_statistics(self) -> np.ndarray:
        """The per-step record, shape [steps recorded, 5]: n0, Σu², n1, Σ b·u, Σ (b·u)² (see the module)."""
        return self._step_trace.numpy()[: int(self._step_count.numpy())]

    def _observe_step(self, summed, with_canaries, noised) -> None:
        bound = tf.cast(tf.reduce_max(tf.convert_to_tensor(self.clip_bounds)), tf.float64)
        row = tf.zeros([_STATS], tf.float64)
        for s, w, o in zip(summed, with_canaries, noised):
            s64 = tf.cast(s, tf.float64)
            u = tf.reshape((tf.cast(o, tf.float64) - s64) / bound, [-1])
            b = tf.reshape(tf.sign(tf.cast(w, tf.float64) - s64), [-1])  # ±1 where a canary joined
            joined = tf.abs(b)
            shift = b * u
            size = tf.cast(tf.size(u), tf.float64)
            n1 = tf.reduce_sum(joined)
            row += tf.stack(
                [
                    size - n1,
                    tf.reduce_sum((1.0 - joined) * u * u),
                    n1,
                    tf.reduce_sum(shift),
                    tf.reduce_sum(shift * shift),
                ]
            )
        steps = self._step_trace.shape[0]
        tf.debugging.assert_less(
            self._step_count, tf.constant(steps, tf.int64), message=f"the step audit was installed for {steps} steps"
        )
        self._step_trace.scatter_nd_update(self._step_count[None, None], row[None])
        self._step_count.assign_add(1)


def with_step_audit(optimizer_cls: type) -> type:
    """The subclass of a keras_dpsgd DP optimizer class (tf_keras or Keras 3) that the step audit runs.

    Raises:
      ValueError: if `optimizer_cls` is not a DP optimizer class of this package.
    """
    return with_canary_mixin(StepAuditMixin, optimizer_cls)


@dataclasses.dataclass
class StepAuditResult(AuditVerdict):
    """The outcome of one step audit.

    Attributes:
      epsilon: ε the accountant reports for the run (∞ when σ = 0).
      epsilon_lower_bound: ε_lower at `confidence` (see the module: a lower bound on the exact ε of
        the Gaussian mechanism at the measured noise, under `assumption`).
      delta, confidence: of both numbers; canaries: m; method: "step-gradient".
      noise_multiplier: σ the run claims; noise_multiplier_estimate: the noise's std over C as
        measured; noise_multiplier_upper_bound: σ_eff_high (noise over the canaries' shift, at
        `confidence`); shift_estimate: a canary's measured shift over C (1 when correct).
      observations: T·d projections observed; canary_joins: of which a canary had joined.
      sampling_rate, steps: q and T of the audited mechanism; seconds: wall time; keras: the Keras.
      per_step: [T, 2] the noise multiplier and shift measured at each step (for plots; NaN shift
        when no canary joined).
    """

    epsilon: float
    epsilon_lower_bound: float
    delta: float
    confidence: float
    canaries: int
    method: str
    noise_multiplier: float
    noise_multiplier_estimate: float
    noise_multiplier_upper_bound: float
    shift_estimate: float
    observations: int
    canary_joins: int
    sampling_rate: float
    steps: int
    seconds: float
    keras: str
    assumption: str = STEP_ASSUMPTION
    per_step: np.ndarray = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("per_step")
        return d


def step_audit(
    build_model: Callable[[], Any],
    train: tuple[np.ndarray, np.ndarray],
    *,
    num_classes: int,
    noise_multiplier: float | Callable[[Any, float], float],
    canaries: int | None = None,
    l2_norm_clip: float = 1.0,
    lot_size: int = 256,
    epochs: int = 10,
    learning_rate: float = 0.5,
    momentum: float = 0.9,
    delta: float | None = None,
    confidence: float = 0.95,
    accountant: str = "rdp",
    optimizer_cls: type | None = None,
    seed: int | None = None,
    verbose: int = 0,
) -> StepAuditResult:
    """Trains one model with gradient canaries and audits the noised release of every step.

    `build_model`, `train`, `num_classes`, `noise_multiplier`, `l2_norm_clip`, `lot_size`, `epochs`,
    `learning_rate`, `momentum`, `delta`, `accountant`, `optimizer_cls`, `seed` and `verbose` are as for
    :func:`~keras_dpsgd.audit.canary_audit`.

    Args:
      canaries: m >= 1 Dirac canaries, all included; default one on every trainable coordinate
        (more canary joins: a tighter bound on the shift).
      confidence: 1 − β; a correct optimizer is flagged with probability at most β.

    Returns:
      A :class:`StepAuditResult`.

    Raises:
      ValueError: arguments out of range (the message names the argument), per-layer clipping.
      ImportError: dp_accounting is not installed (checked before training).
    """
    statistics.require_pld()
    if canaries is not None:
        canaries = V.integer_at_least(1, canaries=canaries)
    confidence = statistics.check_confidence(confidence)
    start = time.perf_counter()
    run = _train_with_canaries(
        build_model,
        train,
        num_classes=num_classes,
        canaries=canaries,
        kind="gradient",
        coins=False,
        noise_multiplier=noise_multiplier,
        l2_norm_clip=l2_norm_clip,
        lot_size=lot_size,
        epochs=epochs,
        learning_rate=learning_rate,
        momentum=momentum,
        delta=delta,
        accountant=accountant,
        optimizer_cls=optimizer_cls,
        held_out=None,
        seed=seed,
        verbose=verbose,
        canary_mixin=with_step_audit,
    )
    trace = run.optimizer.step_statistics()
    n0, s0, n1, s1, s2 = trace.sum(axis=0)
    bounds = statistics.noise_multiplier_upper_bound(int(n0), s0, int(n1), s1, s2, confidence=confidence)
    steps = len(trace)
    sigma_high = bounds["noise_multiplier_upper_bound"]
    lower = statistics.subsampled_gaussian_epsilon_lower(sigma_high, run.sampling_rate, steps, run.delta)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_step = np.stack([np.sqrt(trace[:, 1] / trace[:, 0]), trace[:, 3] / trace[:, 2]], axis=1)
    return StepAuditResult(
        epsilon=run.epsilon,
        epsilon_lower_bound=float(lower),
        delta=run.delta,
        confidence=confidence,
        canaries=len(run.included),
        method="step-gradient",
        noise_multiplier=run.noise_multiplier,
        noise_multiplier_estimate=float(bounds["noise_multiplier_estimate"]),
        noise_multiplier_upper_bound=float(sigma_high),
        shift_estimate=float(bounds["shift_estimate"]),
        observations=int(n0 + n1),
        canary_joins=int(n1),
        sampling_rate=run.sampling_rate,
        steps=steps,
        seconds=time.perf_counter() - start,
        keras=run.keras,
        per_step=per_step,
    )
