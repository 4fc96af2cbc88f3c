"""The one-run canary audit of a DP-SGD training run (Steinke, Nasr, Jagielski 2023).

:func:`canary_audit` draws m fair coins, trains ONE model with the canaries
whose coin came up "in", scores every canary from the training output, and
turns the guesses into ε_emp with :func:`keras_dpsgd.audit.statistics.one_run_audit`.
A correct implementation has ε_emp <= ε (the accountant's) except with
probability at most 1 − confidence; ε_emp > ε flags a bug (noise missing or
too small, clipping skipped, lots counted wrong, ...).

The audit run is itself a training run on the data it is given: its ε is its
own (reported as ``epsilon``) and it must be budgeted like any other run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.audit import statistics
from keras_dpsgd.audit.canaries import CANARY_KINDS

__all__ = ["CanaryAuditResult", "canary_audit", "mlp_builder"]


class AuditVerdict:
    """The verdict of an audit result (a dataclass with epsilon, epsilon_lower_bound, confidence)."""

    @property
    def is_violation(self) -> bool:
        """True when ε_emp > ε: the run leaked more than the accountant allows (a bug)."""
        return self.epsilon_lower_bound > self.epsilon

    def verdict(self) -> str:
        if self.is_violation:
            return (
                f"BUG: the audit proves ε >= {self.epsilon_lower_bound:.3g} at {self.confidence:.0%} confidence, "
                f"more than the reported ε = {self.epsilon:.3g}: the implementation leaks more than it accounts"
            )
        return (
            f"consistent: ε_emp = {self.epsilon_lower_bound:.3g} <= reported ε = {self.epsilon:.3g} "
            "(an audit can only find leaks, never prove their absence)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict()
        d["violation"] = self.is_violation
        return d


@dataclasses.dataclass
class CanaryAuditResult(AuditVerdict):
    """The outcome of one audited training run.

    Attributes:
      epsilon: ε the accountant reports for the run (∞ when σ = 0).
      epsilon_lower_bound: ε_emp at `confidence`.
      delta: δ of both numbers.
      confidence: 1 − β.
      canaries: m.
      method: "one-run-gradient", "one-run-ood" or "one-run-mislabeled".
      auc: ROC AUC of the canary scores (included vs not), 0.5 = no signal.
      guesses: the number of guesses behind ε_emp; correct: how many were right.
      noise_multiplier: σ of the run; steps: noised steps; seconds: wall time.
      keras: the Keras the run trained with, as every ``--json`` key "keras" writes it
        (``keras_dpsgd.tools.front.FrontEnd.label``): e.g. "3.15.0" (Keras 3) or "tf_keras 2.21.0".
    """

    epsilon: float
    epsilon_lower_bound: float
    delta: float
    confidence: float
    canaries: int
    method: str
    auc: float
    guesses: int
    correct: int
    noise_multiplier: float
    steps: int
    seconds: float
    keras: str


def canary_audit(
    build_model: Callable[[], Any],
    train: tuple[np.ndarray, np.ndarray],
    *,
    num_classes: int,
    canaries: int = 500,
    kind: str = "gradient",
    noise_multiplier: float | Callable[[Any, float], float],
    l2_norm_clip: float = 1.0,
    lot_size: int = 256,
    epochs: int = 10,
    learning_rate: float = 0.5,
    momentum: float = 0.9,
    delta: float | None = None,
    confidence: float = 0.95,
    accountant: str = "rdp",
    optimizer_cls: type | None = None,
    held_out: tuple[np.ndarray, np.ndarray] | None = None,
    seed: int | None = None,
    verbose: int = 0,
) -> CanaryAuditResult:
    """Trains one model with canaries and audits it.

    Args:
      build_model: returns a fresh uncompiled model that outputs logits: Keras 3 (the run gets
        ``keras_dpsgd.keras3.make_private``) or tf_keras.
      train: (x, y) training data (integer labels).
      num_classes: K.
      canaries: m >= 2 (each included with probability 1/2).
      kind: "gradient" (Dirac canaries in the clipped sum), "ood" or
        "mislabeled" (input canaries; "mislabeled" takes its images from
        `held_out`).
      noise_multiplier: σ >= 0 (0: non-private, ε = ∞), or a function of the
        run's (`PoissonLots`, δ) returning σ (to calibrate to a target ε).
      optimizer_cls: a keras_dpsgd DP optimizer class of the model's Keras taking
        (l2_norm_clip, noise_multiplier, learning_rate=, momentum=, seed=; tf_keras also
        gradient_accumulation_steps=); default that Keras's DPSGDOptimizer.
      delta: δ; default min(1/N^1.1, 1/(10·N)) with N the public size of the training set
        (plus m/2 with input canaries: q, the normalizer and δ never depend
        on the coins).
      seed: reproducible coins, lots, noise and initialization (tests); None:
        OS entropy.

    Returns:
      A :class:`CanaryAuditResult`.

    Raises:
      ValueError: arguments out of range (the message names the argument).
    """
    from keras_dpsgd.audit.canaries import per_example_loss

    if kind not in CANARY_KINDS:
        raise ValueError(f"kind must be one of {list(CANARY_KINDS)}, got {kind!r}")
    canaries = V.integer_at_least(2, canaries=canaries)
    confidence = statistics.check_confidence(confidence)
    start = time.perf_counter()
    run = _train_with_canaries(
        build_model,
        train,
        num_classes=num_classes,
        canaries=canaries,
        kind=kind,
        coins=True,
        noise_multiplier=noise_multiplier,
        l2_norm_clip=l2_norm_clip,
        lot_size=lot_size,
        epochs=epochs,
        learning_rate=learning_rate,
        momentum=momentum,
        delta=delta,
        accountant=accountant,
        optimizer_cls=optimizer_cls,
        held_out=held_out,
        seed=seed,
        verbose=verbose,
    )
    optimizer, included, delta = run.optimizer, run.included, run.delta
    if kind == "gradient":
        scores = optimizer.canary_scores()
    else:
        scores = -per_example_loss(run.model, *run.input_canaries)
    audit = statistics.one_run_audit(scores, included, delta=delta, confidence=confidence)
    return CanaryAuditResult(
        epsilon=run.epsilon,
        epsilon_lower_bound=float(audit["epsilon_lower_bound"]),
        delta=float(delta),
        confidence=confidence,
        canaries=int(canaries),
        method=f"one-run-{kind}",
        auc=statistics.roc_auc(scores, included),
        guesses=int(audit["guesses"]),
        correct=int(audit["correct"]),
        noise_multiplier=run.noise_multiplier,
        steps=int(optimizer.noised_steps.numpy()),
        seconds=time.perf_counter() - start,
        keras=run.keras,
    )


@dataclasses.dataclass
class _Run:
    """A trained audit run (:func:`_train_with_canaries`)."""

    model: Any
    optimizer: Any
    included: np.ndarray
    input_canaries: tuple | None
    delta: float
    epsilon: float
    noise_multiplier: float
    sampling_rate: float
    keras: str


def _train_with_canaries(
    build_model,
    train,
    *,
    num_classes,
    canaries,
    kind,
    coins,
    noise_multiplier,
    l2_norm_clip,
    lot_size,
    epochs,
    learning_rate,
    momentum,
    delta,
    accountant,
    optimizer_cls,
    held_out,
    seed,
    verbose,
    canary_mixin=None,
) -> _Run:
    """Trains one model with m canaries, shared by the one-run and the step audit.

    `coins`: each canary included by a fair coin drawn before training (one-run), else all
    included (the step audit, which tests the released noise, not membership; `canaries` None:
    one on every trainable coordinate). `canary_mixin`:
    the function that makes the gradient-canary class (default :func:`with_gradient_canaries`).
    """
    from keras_dpsgd.accounting import check_delta, default_delta
    from keras_dpsgd.audit.canaries import make_input_canaries, with_gradient_canaries
    from keras_dpsgd.ledger import model_epsilon
    from keras_dpsgd.step.lots import PoissonLots
    from keras_dpsgd.tools import front as _front

    rng = np.random.default_rng(seed)
    if seed is not None:
        _front.set_random_seed(seed)
    included = rng.random(int(canaries)) < 0.5 if coins else None  # the coins, drawn before training
    x, y = np.asarray(train[0], np.float32), np.asarray(train[1], np.int64)
    input_canaries = None
    if kind != "gradient":
        input_canaries = make_input_canaries(
            kind, int(canaries), input_shape=x.shape[1:], num_classes=num_classes, rng=rng, pool=held_out
        )
        cx, cy = input_canaries
        x, y = np.concatenate([x, cx[included]]), np.concatenate([y, cy[included]])
    # The run's parameters must not depend on the coins: q, the normalizer and δ use the public size
    # N + m/2 (the expected size with input canaries), not the realized one.
    n = len(train[0]) + (len(included) // 2 if kind != "gradient" else 0)
    if not 1 <= lot_size <= n:
        raise ValueError(f"lot_size must be in [1, N = {n}], got {lot_size}")
    delta = default_delta(n) if delta is None else check_delta(delta, n)
    sub_seed = lambda: None if seed is None else int(rng.integers(2**31 - 1))  # noqa: E731
    lots = PoissonLots(x, y, sampling_rate=min(1.0, lot_size / n), seed=sub_seed())
    sigma = float(noise_multiplier(lots, delta) if callable(noise_multiplier) else noise_multiplier)
    model = build_model()
    front = _front.of_model(model)  # Keras 3 or tf_keras: whichever built the model
    if included is None:  # no coins: every canary in; None canaries: one on every trainable coordinate
        total = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        included = np.ones(total if canaries is None else int(canaries), bool)
    cls = optimizer_cls or front.dp_sgd
    if kind == "gradient":
        cls = (canary_mixin or with_gradient_canaries)(cls)
    optimizer = cls(
        l2_norm_clip,
        sigma,
        learning_rate=learning_rate,
        momentum=momentum,
        seed=sub_seed(),
        **_front.dp_optimizer_kwargs(front, lots.gradient_accumulation_steps),
    )
    lots.configure(optimizer)
    optimizer.expected_lot_size = float(lot_size)
    model = front.private(model)
    model.compile(optimizer=optimizer, loss=front.cross_entropy(per_example=True))
    if kind == "gradient":
        steps = {} if canary_mixin is None else {"steps": epochs * lots.lots_per_epoch}
        optimizer.install_gradient_canaries(model.trainable_variables, included, rng=rng, **steps)
    model.fit(lots.dataset(), epochs=epochs, steps_per_epoch=lots.steps_per_epoch, verbose=verbose)
    epsilon, delta = model_epsilon(model, target_delta=delta, num_examples=n, accountant=accountant)
    return _Run(
        model=model,
        optimizer=optimizer,
        included=included,
        input_canaries=input_canaries,
        delta=float(delta),
        epsilon=float(epsilon),
        noise_multiplier=sigma,
        sampling_rate=float(lots.sampling_rate),
        keras=front.label,
    )


def mlp_builder(input_shape, num_classes: int, width: int = 32, keras_module: Any = None) -> Callable[[], Any]:
    """A builder of the small MLP of ``keras-dpsgd train`` (``keras_dpsgd.data.models``), on `keras_module`
    (default: Keras 3 unless ``TF_USE_LEGACY_KERAS=1``)."""
    from keras_dpsgd.data.models import build_model
    from keras_dpsgd.tools import front as _front

    module = keras_module or _front.active().keras
    return lambda: build_model("mlp", input_shape, num_classes, width=width, keras_module=module)
