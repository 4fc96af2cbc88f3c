"""The memorization test (Three Tools, tool 1): are the privacy parameters strong enough?

Van der Veen et al. 2018, Section 2, after Zhang et al. 2017 ("Understanding
deep learning requires rethinking generalization"): a deep net trained
non-privately reaches ~100 % train accuracy on random-noise inputs with random
labels, i.e. it memorizes individual examples. A DP model should not: if the
same model, trained with DP-SGD at the chosen (C, σ, L, epochs), fits random
labels above chance, the noise is too small to hide single examples.

Mode "noise" (:func:`memorization_test`): trains the same architecture on
uniform-noise inputs with uniform labels (the real data's shape and class
count), with and without DP, and reports the train accuracy after each epoch
against chance 1/K, with an exact one-sided Clopper–Pearson lower bound and
binomial p-value (see :mod:`keras_dpsgd.tools._stats`). Verdicts:

- DP lower bound > chance: "memorizes → privacy parameters too weak".
- non-private lower bound <= chance: inconclusive (the model or the number of
  epochs is too small to memorize even without noise, so the DP result says
  nothing).
- else: pass (the non-private model memorizes, the DP model stays at chance).

The decision uses the final epoch's accuracy (one test; the per-epoch bounds
are pointwise, not simultaneous).

Privacy: mode "noise" touches no real data, so it costs none of the data's
privacy budget; the ε it reports is the nominal cost the same settings would
have on a real data set of the same size (useful to compare settings).

Mode "real" (:func:`real_task_test`): trains both on the real task and reports
test accuracy and the train–test gap (in the paper, CIFAR-10's gap falls from
~0.24 to ~0.05 under DP). This mode DOES touch the real data: the DP run is
accounted and its ε reported, and the non-private run has no guarantee at all
(ε = ∞). Hyperparameter probes on real data cost privacy: every run whose
results inform a choice must be charged to the budget (or use the noise mode /
public data to tune).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, TypedDict, Unpack

import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.tools import data as _data
from keras_dpsgd.tools._training import RunResult, train_run

__all__ = [
    "DPSettings",
    "MemorizationReport",
    "RunOptions",
    "convnet_builder",
    "memorization_test",
    "mlp_builder",
    "real_task_test",
]

NOISE_PRIVACY_NOTE = (
    "The memorization test trains on uniform random noise with uniform random labels: it touches no real "
    "data and costs none of the data's privacy budget. The DP run's epsilon is nominal: what the same "
    "settings would cost on a real data set of the same size."
)
REAL_PRIVACY_NOTE = (
    "Real-task mode trains on the real data. The DP run is accounted (epsilon below, at delta). The "
    "non-private run has no privacy guarantee (epsilon = inf): do not release it or anything derived from "
    "it. Hyperparameter probes on real data cost privacy: charge every run whose result informs a choice "
    "to the budget, or tune with the noise mode or public data."
)


@dataclasses.dataclass
class DPSettings:
    """DP-SGD settings of the DP run (Abadi et al. 2016, Algorithm 1).

    Attributes:
      l2_norm_clip: clip bound C > 0.
      noise_multiplier: σ >= 0.
      batch_size: expected lot size L (Poisson sampling, q = L / N).
      learning_rate: SGD learning rate.
      momentum: SGD momentum (the paper uses momentum).
      physical_batch_size: rows per physical batch; a lot larger than that is
        split into gradient-accumulation steps (None: one batch per lot).
    """

    l2_norm_clip: float = 1.0
    noise_multiplier: float = 1.1
    batch_size: int = 64
    learning_rate: float = 0.05
    momentum: float = 0.9
    physical_batch_size: int | None = None

    def __post_init__(self):
        _validate.positive(l2_norm_clip=self.l2_norm_clip)
        _validate.nonnegative(noise_multiplier=self.noise_multiplier)
        _validate.integer_at_least(1, batch_size=self.batch_size)
        _validate.positive(learning_rate=self.learning_rate)
        _validate.in_range(0, 1, "[)", momentum=self.momentum)
        if self.physical_batch_size is not None:
            _validate.integer_at_least(1, physical_batch_size=self.physical_batch_size)


@dataclasses.dataclass
class MemorizationReport:
    """Result of the memorization test (mode "noise") or of the real-task comparison (mode "real")."""

    mode: str
    num_examples: int
    num_classes: int
    chance: float
    confidence: float
    delta: float
    nonprivate: RunResult
    dp: RunResult
    nonprivate_memorizes: bool
    dp_memorizes: bool
    conclusive: bool
    verdict: str
    privacy_note: str
    settings: dict

    @property
    def train_test_gap(self) -> dict[str, float] | None:
        if self.dp.test_accuracy is None:
            return None
        return {r.name: r.train_accuracy[-1] - r.test_accuracy[-1] for r in (self.nonprivate, self.dp)}

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["nonprivate"] = self.nonprivate.to_dict()
        d["dp"] = self.dp.to_dict()
        d["train_test_gap"] = self.train_test_gap
        d["touches_real_data"] = self.mode == "real"
        return d

    def summary(self) -> str:
        lines = [
            f"memorization test ({self.mode}): {self.num_examples} examples, {self.num_classes} classes, "
            f"chance {self.chance:.3f}, one-sided {self.confidence:.0%} Clopper-Pearson bounds"
        ]
        for r in (self.nonprivate, self.dp):
            accs = " ".join(f"{a:.2f}" for a in r.train_accuracy)
            lines.append(f"  {r.name:>11} train acc per epoch: {accs}")
            lines.append(
                f"  {'':>11} final {r.train_accuracy[-1]:.3f} (lower bound {r.train_lower_bound[-1]:.3f}, "
                f"p = {r.train_p_value[-1]:.2g})"
            )
            if r.test_accuracy is not None:
                lines.append(
                    f"  {'':>11} test acc {r.test_accuracy[-1]:.3f}, "
                    f"train-test gap {r.train_accuracy[-1] - r.test_accuracy[-1]:+.3f}"
                )
        eps = self.dp.epsilon
        if eps is not None:
            kind = "nominal " if self.mode == "noise" else ""
            lines.append(
                f"  DP run: sigma_eff {self.dp.noise_multiplier:.4g}, {self.dp.noised_steps} noised steps, "
                f"{kind}epsilon {eps:.3g} at delta {self.delta:.3g}"
            )
        lines.append(f"verdict: {self.verdict}")
        lines.append(f"privacy: {self.privacy_note}")
        return "\n".join(lines)


def _keras(keras_module: Any) -> Any:
    from keras_dpsgd.tools import front as _front

    return keras_module or _front.active().keras


def mlp_builder(
    input_shape: Sequence[int], num_classes: int, width: int = 256, depth: int = 2, keras_module: Any = None
) -> Callable:
    """A builder of a small MLP (logits output) that memorizes small noise sets quickly, on
    `keras_module` (default Keras 3 unless ``TF_USE_LEGACY_KERAS=1``)."""
    keras = _keras(keras_module)

    def build():
        layers = [keras.Input(shape=tuple(input_shape)), keras.layers.Flatten()]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        layers.append(keras.layers.Dense(num_classes))
        return keras.Sequential(layers)

    return build


def convnet_builder(input_shape: Sequence[int], num_classes: int, keras_module: Any = None) -> Callable:
    """A builder of a small convnet (two conv layers, logits output), a tiny cousin of the paper's AlexNet,
    on `keras_module` (default Keras 3 unless ``TF_USE_LEGACY_KERAS=1``)."""
    keras = _keras(keras_module)

    def build():
        return keras.Sequential(
            [
                keras.Input(shape=tuple(input_shape)),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(num_classes),
            ]
        )

    return build


def _default_dp_optimizer(front, dp: DPSettings, lots, seed: int | None):
    from keras_dpsgd.tools import front as _front

    return front.dp_sgd(
        l2_norm_clip=dp.l2_norm_clip,
        noise_multiplier=dp.noise_multiplier,
        learning_rate=dp.learning_rate,
        momentum=dp.momentum,
        expected_lot_size=lots.expected_lot_size,
        sampling_rate=lots.sampling_rate,
        seed=seed,
        **_front.dp_optimizer_kwargs(front, lots.gradient_accumulation_steps),
    )


def _dp_epsilon(model, optimizer, delta: float) -> tuple[float | None, float | None, int | None]:
    """ε of the DP run from the model's privacy ledger (None if its optimizer counts no noised steps).

    The ledger (:func:`keras_dpsgd.ledger.model_privacy_ledger`) charges the
    optimizer's own step counter at its σ_eff (adaptive clipping's norm
    queries included) and any layer with privacy events (e.g. DP-PCA).
    """
    from keras_dpsgd.ledger import is_dp_optimizer, model_privacy_ledger

    if not is_dp_optimizer(optimizer) or getattr(optimizer, "effective_noise_multiplier", None) is None:
        return None, None, None
    from keras_dpsgd.accounting import compute_epsilon

    ledger = model_privacy_ledger(model)
    return (
        float(compute_epsilon(ledger, delta)),
        float(optimizer.effective_noise_multiplier),
        int(optimizer.noised_steps.numpy()),
    )


def _require_accounting(factory):
    """Real data: refuse, before training, a DP optimizer whose steps cannot be accounted."""

    def make(lots):
        opt = factory(lots)
        if getattr(opt, "noised_steps", None) is None or getattr(opt, "effective_noise_multiplier", None) is None:
            raise ValueError(
                "real-task mode needs a DP optimizer exposing noised_steps and "
                "effective_noise_multiplier, so that its epsilon is accounted; got "
                f"{type(opt).__name__}"
            )
        return opt

    return make


class RunOptions(TypedDict, total=False):
    """The keyword options of both runs of :func:`memorization_test` and :func:`real_task_test`.

    Each is described, with its default, in :func:`memorization_test`.
    """

    dp: DPSettings | None
    epochs: int
    nonprivate_batch_size: int
    nonprivate_learning_rate: float
    confidence: float
    delta: float | None
    dp_optimizer_factory: Callable[[Any], Any] | None
    nonprivate_optimizer_factory: Callable[[], Any] | None
    loss: Callable[[str], Any] | None
    seed: int | None
    verbose: int


def _check_options(function: str, options: dict) -> None:
    unknown = sorted(set(options) - set(RunOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"{function}() got unexpected keyword arguments {unknown}; allowed: {sorted(RunOptions.__annotations__)}"
        )


def _run_pair(
    mode,
    build_model,
    train,
    test,
    num_classes,
    *,
    dp=None,
    epochs=20,
    nonprivate_batch_size=32,
    nonprivate_learning_rate=0.003,
    dp_optimizer_factory=None,
    nonprivate_optimizer_factory=None,
    loss=None,
    confidence=0.95,
    delta=None,
    seed=None,
    verbose=0,
):
    from keras_dpsgd.accounting import check_delta, default_delta
    from keras_dpsgd.tools import front as _front

    dp = dp or DPSettings()
    n = len(train[0])
    if dp.batch_size > n:
        raise ValueError(f"batch_size must be <= the number of examples {n}, got {dp.batch_size}")
    _validate.integer_at_least(1, epochs=epochs)
    _validate.in_range(0, 1, "()", confidence=confidence)
    delta = default_delta(n) if delta is None else check_delta(delta, n)
    # Noise mode: labels are balanced, so a prediction independent of the labels is right on at most
    # max_k count_k examples in expectation (= N/K when K divides N); real mode: nominal 1/K.
    counts = np.bincount(train[1], minlength=num_classes)
    chance = float(counts.max() / n) if mode == "noise" else 1.0 / num_classes
    rng = np.random.default_rng(seed)
    front = _front.of_model(build_model())  # the Keras of the user's models (Keras 3 or tf_keras)
    make_loss = loss or (lambda reduction: front.cross_entropy(per_example=reduction == "none"))
    nonpriv_factory = nonprivate_optimizer_factory or (lambda: front.keras.optimizers.Adam(nonprivate_learning_rate))
    child = None if seed is None else int(rng.integers(2**31 - 1))
    dp_factory = dp_optimizer_factory or (lambda lots: _default_dp_optimizer(front, dp, lots, child))
    if mode == "real":
        dp_factory = _require_accounting(dp_factory)
    common = dict(
        epochs=int(epochs),
        chance=chance,
        confidence=confidence,
        test=test,
        verbose=verbose,
        rng=rng,
        seeded=seed is not None,
        front=front,
    )

    def nonprivate_run():
        return train_run(
            "non-private",
            build_model,
            lambda _: nonpriv_factory(),
            make_loss("auto"),
            train,
            batch_size=nonprivate_batch_size,
            poisson=False,
            **common,
        )

    def dp_run():
        return train_run(
            "dp",
            build_model,
            dp_factory,
            make_loss("none"),
            train,
            batch_size=dp.batch_size,
            poisson=True,
            physical_batch_size=dp.physical_batch_size,
            **common,
        )

    if mode == "real":  # The DP run first: an optimizer that cannot be accounted is refused before any training.
        dpres, dp_model, dp_opt = dp_run()
        nonpriv, _, _ = nonprivate_run()
    else:
        nonpriv, _, _ = nonprivate_run()
        dpres, dp_model, dp_opt = dp_run()
    dpres.epsilon, dpres.noise_multiplier, dpres.noised_steps = _dp_epsilon(dp_model, dp_opt, delta)
    nonpriv.epsilon = float("inf")
    np_mem = bool(nonpriv.train_lower_bound[-1] > chance)
    dp_mem = bool(dpres.train_lower_bound[-1] > chance)
    if mode == "noise":
        at = _privacy_context(dpres, delta, dp, epochs)
        if dp_mem:
            verdict = (
                f"FAIL: the DP model memorizes random labels (train accuracy {dpres.train_accuracy[-1]:.3f}, "
                f"lower bound {dpres.train_lower_bound[-1]:.3f} > chance {chance:.3f}) {at} "
                "-> privacy parameters too weak to prevent memorization: epsilon-DP still lets a model fit a "
                "label up to about e^epsilon times as often as without it. For a PASS, lower epsilon: a larger "
                "--noise-multiplier (8 passes on 1,000 noise examples), fewer --epochs or a smaller --lot-size"
            )
        elif not np_mem:
            verdict = (
                "INCONCLUSIVE: the non-private model does not memorize random labels either "
                "(use a larger model, more epochs or fewer examples)"
            )
        else:
            verdict = (
                f"PASS: the non-private model memorizes (train accuracy {nonpriv.train_accuracy[-1]:.3f}) "
                f"while the DP model stays at chance ({dpres.train_accuracy[-1]:.3f} vs {chance:.3f}) {at}"
            )
        note = NOISE_PRIVACY_NOTE
    else:
        gap_np = nonpriv.train_accuracy[-1] - nonpriv.test_accuracy[-1]
        gap_dp = dpres.train_accuracy[-1] - dpres.test_accuracy[-1]
        verdict = (
            f"train-test gap: non-private {gap_np:+.3f}, DP {gap_dp:+.3f}; test accuracy: non-private "
            f"{nonpriv.test_accuracy[-1]:.3f}, DP {dpres.test_accuracy[-1]:.3f} "
            f"(DP epsilon {dpres.epsilon:.3g} at delta {delta:.3g})"
        )
        note = REAL_PRIVACY_NOTE
    settings = dict(
        dataclasses.asdict(dp),
        epochs=int(epochs),
        nonprivate_batch_size=nonprivate_batch_size,
        nonprivate_learning_rate=nonprivate_learning_rate,
        seed=seed,
    )
    return MemorizationReport(
        mode=mode,
        num_examples=n,
        num_classes=num_classes,
        chance=chance,
        confidence=confidence,
        delta=delta,
        nonprivate=nonpriv,
        dp=dpres,
        nonprivate_memorizes=np_mem,
        dp_memorizes=dp_mem,
        conclusive=(mode == "real") or dp_mem or np_mem,
        verdict=verdict,
        privacy_note=note,
        settings=settings,
    )


def _privacy_context(dpres: Any, delta: float, dp: "DPSettings", epochs: int) -> str:
    """Where the DP run stands: "at epsilon = ... (delta, sigma, lots, epochs)"."""
    eps = "not accounted" if dpres.epsilon is None else f"{dpres.epsilon:.3g}"
    return (
        f"at epsilon = {eps} (delta = {delta:.3g}; noise multiplier {dp.noise_multiplier:g}, expected lot "
        f"size {dp.batch_size}, {epochs} epochs)"
    )


def memorization_test(
    build_model: Callable[[], Any],
    *,
    input_shape: Sequence[int],
    num_classes: int,
    num_examples: int = 1000,
    **options: Unpack[RunOptions],
) -> MemorizationReport:
    """Trains the model on random noise with random labels, with and without DP (Three Tools, Sec. 2).

    Args:
      build_model: callable returning a fresh, uncompiled model (Keras 3 or tf_keras:
        the runs train with the model's Keras; a Keras 3 DP run gets
        ``keras_dpsgd.keras3.make_private``) whose outputs are logits over
        `num_classes` classes.
      input_shape: shape of one input (the real data's shape), e.g. (8, 8, 1).
      num_classes: number of classes K >= 2; chance accuracy is 1/K.
      num_examples: number of noise examples.
      **options: the :class:`RunOptions` of both runs:

        - dp: the DP run's settings (default :class:`DPSettings`()).
        - epochs: epochs of both runs (default 20).
        - nonprivate_batch_size: batch size of the non-private run (default 32).
        - nonprivate_learning_rate: Adam learning rate of the non-private run
          (default 0.003: high, to memorize fast).
        - confidence: one-sided confidence level of the bounds (default 0.95).
        - delta: δ for the nominal ε (default `accounting.default_delta(num_examples)`).
        - dp_optimizer_factory: optional callable taking the run's
          `keras_dpsgd.step.lots.PoissonLots` and returning the DP optimizer
          (default: `DPSGDOptimizer` from `dp`, with the lots'
          gradient_accumulation_steps); it should expose `noised_steps` and
          `effective_noise_multiplier` for ε to be reported.
        - nonprivate_optimizer_factory: optional callable returning the non-private optimizer.
        - loss: optional callable taking a Keras reduction ("auto" for the
          non-private run, "none" for the DP run, which needs the per-example
          loss) and returning the loss (on Keras 3 map "auto" to
          "sum_over_batch_size"); default sparse categorical cross-entropy on
          logits.
        - seed: optional seed of the noise data, sampling and DP noise (None: OS entropy).
        - verbose: Keras fit verbosity (default 0).

    Returns:
      A :class:`MemorizationReport` (mode "noise") with the verdict.

    Raises:
      TypeError: an option that is not one of :class:`RunOptions`.
    """
    _check_options("memorization_test", options)
    seed = options.pop("seed", None)
    rng = np.random.default_rng(seed)
    train = _data.random_noise_data(num_examples, input_shape, num_classes, rng)
    sub_seed = None if seed is None else int(rng.integers(2**31 - 1))
    return _run_pair("noise", build_model, train, None, int(num_classes), seed=sub_seed, **options)


def real_task_test(
    build_model: Callable[[], Any],
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    *,
    num_classes: int,
    **options: Unpack[RunOptions],
) -> MemorizationReport:
    """Trains the model on the real task with and without DP; reports test accuracy and train-test gap.

    This touches the real training data: the DP run's ε (at δ) is reported
    from the optimizer's own step count; the non-private run has ε = ∞. See
    the module docstring on the privacy cost of hyperparameter probes.

    The arguments are as for :func:`memorization_test` (`build_model`, `num_classes` and the
    :class:`RunOptions`), plus `train` and `test` as (x, y) numpy pairs with integer labels.

    Returns:
      A :class:`MemorizationReport` (mode "real").

    Raises:
      TypeError: an option that is not one of :class:`RunOptions`.
    """
    _check_options("real_task_test", options)
    return _run_pair("real", build_model, train, test, int(num_classes), **options)
