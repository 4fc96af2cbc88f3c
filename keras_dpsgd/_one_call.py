"""One call from a Keras model and its data to a private training run (Opacus's ``make_private_with_epsilon``).

:func:`make_private_with_epsilon` does the four steps of the quick start's step-by-step form: it
gives the model the private step (``make_private``), draws Poisson lots (:class:`PoissonLots`),
calibrates σ so that the planned steps spend the target ε (:func:`compute_noise_multiplier`, on top
of what the model's ledger already holds, e.g. a ``DPNormalization``), and makes the optimizer
private and configured for the lots. One implementation serves both Kerases: the model's own Keras
(Keras 3 or tf_keras) picks the front end.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Optional

from keras_dpsgd import _validate
from keras_dpsgd.dp.refusals import refuse

__all__ = ["PrivateTraining", "make_private_with_epsilon"]

OPTIMIZER_NAMES = ("sgd", "adam")
# fit arguments that would change the lots or the number of steps the ε was planned for.
_FIXED_FIT_ARGS = ("x", "y", "batch_size", "epochs", "steps_per_epoch", "sample_weight", "shuffle")


def _lot_seed(seed: Optional[int], model: Any) -> Optional[int]:
    """The lots' seed: `seed` on a model whose ledger records no DP-SGD step, else one derived from
    (seed, the steps it records), so that a second call with one seed never draws the first call's
    lots (identical lots are no independent Poisson sampling: the accountant would under-count).

    Raises:
      ValueError: a seed below 0 (PoissonLots' range).
    """
    from keras_dpsgd.ledger import recorded_releases

    if seed is None:
        return None
    seed = _validate.integer_at_least(0, seed=seed)
    position = recorded_releases(model)
    if position == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed, position]).generate_state(1, np.uint64)[0] >> 1)


@dataclasses.dataclass(frozen=True)
class PrivateTraining:
    """What :func:`make_private_with_epsilon` returns: the private model, its optimizer and the plan.

    Attributes:
      model: the model with the private train step (compile it with `optimizer`).
      optimizer: the DP optimizer, configured for `lots`.
      lots: the :class:`keras_dpsgd.PoissonLots` of the training data.
      noise_multiplier: σ, calibrated so that `epochs` epochs spend at most `target_epsilon`.
      epsilon: the ε (at `delta`) of the model's ledger after the planned steps (<= `target_epsilon`).
      target_epsilon: the budget.
      delta: δ (the given one, or the default min(1/N^1.1, 1/(10·N))).
      epochs: the planned epochs.
      steps_per_epoch: physical batches per epoch (``fit(steps_per_epoch=...)``).
      planned_steps: the DP-SGD steps (lots) of the plan.
      accountant: the accountant σ was calibrated with.
      notes: sentences about the choices made for the user (the default δ), printed unless verbose=0.
    """

    model: Any
    optimizer: Any
    lots: Any
    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    delta: float
    epochs: int
    steps_per_epoch: int
    planned_steps: int
    accountant: str
    notes: tuple = ()

    def dataset(self) -> Any:
        """The endless ``tf.data.Dataset`` of Poisson lots (``lots.dataset()``)."""
        return self.lots.dataset()

    @property
    def fit_kwargs(self) -> dict:
        """The arguments of ``model.fit`` that the plan fixes: ``model.fit(**run.fit_kwargs, callbacks=...)``."""
        return {
            "x": self.dataset(),
            "epochs": self.epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "shuffle": False,  # the lots are random already
        }

    def fit(self, **kwargs) -> Any:
        """``model.fit`` on the planned lots and epochs, with ε in the logs; returns the History.

        A :class:`keras_dpsgd.PrivacyLogger` (ε in the progress bar and History) and a
        :class:`keras_dpsgd.WithinLimit` (stops before a step beyond the budget) are added
        unless `callbacks` holds one already.

        Args:
          **kwargs: other ``fit`` arguments (``callbacks``, ``validation_data``, ``verbose``...).

        Raises:
          ValueError: an argument the plan fixes (x, y, batch_size, epochs, steps_per_epoch,
            sample_weight, shuffle): the ε was planned for these lots and epochs.
        """
        from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit

        fixed = sorted(set(kwargs) & set(_FIXED_FIT_ARGS))
        if fixed:
            raise refuse(
                "plan-fixed-fit",
                f"fit arguments {fixed} are fixed by the plan (ε = {self.epsilon:.4g} was calibrated for "
                f"{self.epochs} epochs of these Poisson lots); call make_private_with_epsilon again to change them",
            )
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, PrivacyLogger) for c in callbacks):
            callbacks.append(PrivacyLogger(self.delta, accountant=self.accountant))
        if not any(isinstance(c, WithinLimit) for c in callbacks):
            callbacks.append(WithinLimit(self.target_epsilon, self.delta, accountant=self.accountant))
        return self.model.fit(**self.fit_kwargs, callbacks=callbacks, **kwargs)


def _front_end(model: Any) -> str:
    import keras

    if isinstance(model, keras.Model):
        return "keras3"
    tf_keras = sys.modules.get("tf_keras")  # a tf_keras model exists only once tf_keras is imported
    if tf_keras is not None and isinstance(model, tf_keras.Model):
        return "tf_keras"
    raise TypeError(f"model must be a Keras 3 or tf_keras Model, got {type(model).__name__}")


def _optimizer_class_and_config(optimizer: Any, keras: Any, front: str) -> tuple[type, dict]:
    """The plain optimizer class of `optimizer` (a name, a class or an instance) and its arguments."""
    if isinstance(optimizer, str):
        optimizer = _validate.one_of(OPTIMIZER_NAMES, optimizer=optimizer.lower())
        return {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer], {}
    base = keras.optimizers.Optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, base):
        cls, config = optimizer, {}
    elif isinstance(optimizer, base):
        cls, config = type(optimizer), dict(optimizer.get_config())
    else:
        raise TypeError(
            f"optimizer must be one of {list(OPTIMIZER_NAMES)}, or a {front} optimizer class or instance "
            f"(the model is a {front} model), got {optimizer!r}"
        )
    if hasattr(cls, "l2_norm_clip"):
        raise TypeError(
            f"optimizer must be a non-private optimizer (make_private_with_epsilon makes it private and "
            f"calibrates its noise), got the DP optimizer {cls.__name__}"
        )
    for key in ("name", "gradient_accumulation_steps"):  # the DP class names itself; the lots set accumulation
        config.pop(key, None)
    return cls, config


def make_private_with_epsilon(
    model: Any,
    x: Any,
    y: Any,
    *,
    target_epsilon: float,
    epochs: int,
    expected_lot_size: float,
    l2_norm_clip: float,
    optimizer: Any = "sgd",
    target_delta: Optional[float] = None,
    sample_weight: Any = None,
    physical_batch_size: Optional[int] = None,
    max_physical_batch_size: Optional[int] = None,
    accountant: str = "rdp",
    seed: Optional[int] = None,
    verbose: int = 1,
) -> PrivateTraining:
    """Makes `model` private for `epochs` epochs of Poisson lots of (x, y) within (ε, δ), in one call.

    The steps of the quick start, in order: the private train step
    (``make_private``), Poisson lots of expected size L (q = L/N,
    :class:`keras_dpsgd.PoissonLots`), σ calibrated so that ``epochs · ceil(1/q)``
    steps together with the events the model's ledger already holds (a
    ``DPNormalization`` or ``DPPCA`` layer) spend at most `target_epsilon`
    (:func:`keras_dpsgd.compute_noise_multiplier`, never below the exact σ),
    and the optimizer made private with that σ and clip, configured for the lots.

    Usage (Keras 3; on tf_keras the loss is given with ``reduction="none"``)::

        run = keras_dpsgd.make_private_with_epsilon(
            model, x_train, y_train, target_epsilon=3.0, epochs=10, expected_lot_size=256,
            l2_norm_clip=1.0, optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
        run.model.compile(optimizer=run.optimizer, loss=..., weighted_metrics=["accuracy"])
        run.fit()                      # or run.model.fit(**run.fit_kwargs, callbacks=[...])

    Args:
      model: a Keras 3 or tf_keras model; its Keras picks the front end. Its recorded events are counted; a
        model with no record of its training (no DP optimizer nor ledger) is taken as new: load an earlier DP
        run's model with ``compile=True``, since one loaded with ``compile=False`` carries no ledger.
      x: the training inputs, an array (or a nested structure of arrays) of first dimension N.
      y: the training targets, of the same first dimension N.
      target_epsilon: ε > 0 of the whole run.
      epochs: planned epochs of ceil(N/L) lots each, >= 1.
      expected_lot_size: L in (0, N].
      l2_norm_clip: C > 0, the per-example gradient norm bound.
      optimizer: "sgd" or "adam" (Keras defaults), or a non-private optimizer class or instance of
        the model's Keras (its arguments are kept), made private here.
      target_delta: δ in (0, 1/N); default min(1/N^1.1, 1/(10·N)) (as the CLI), announced in `notes`.
      sample_weight: optional per-example weights (N,), >= 0.
      physical_batch_size: rows per physical batch (gradient accumulation); None: one per lot.
      max_physical_batch_size: the most rows per physical batch (a memory bound; exclusive with
        `physical_batch_size`): each lot split into as few equal physical batches as that allows
        (:class:`keras_dpsgd.PoissonLots`).
      accountant: "rdp" (default), "moments" or "pld".
      seed: None (OS entropy) or an integer >= 0 for reproducible lots and noise (keep it secret). The
        noise keys and the lots' seed are functions of (seed, the position of the run's first step in the
        model's ledger): a fresh model reproduces a run; a second call on one model draws fresh ones.
      verbose: 1 prints the plan and the notes, 0 prints nothing.

    Returns:
      A :class:`PrivateTraining` (model, optimizer, lots, σ, planned ε, δ, ``fit``).

    Raises:
      TypeError: a model or optimizer of no known Keras, or a DP optimizer.
      ValueError: an argument out of range (the message names it), or a target ε that the
        model's recorded events already spend.

    Warns:
      UserWarning: a target ε whose σ makes no sense, with the numbers: σ < 0.5 (one example's clipped
        gradient stands out of a step's noise) or σ >= L (the noise exceeds the whole lot's bound L·C).
    """
    from keras_dpsgd.accounting import check_delta, compute_epsilon, compute_noise_multiplier, default_delta
    from keras_dpsgd.accounting.planning import DEFAULT_DELTA_RULE
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent, accountant_names
    from keras_dpsgd.accounting.budget import budget_warnings
    from keras_dpsgd.ledger import model_privacy_ledger
    from keras_dpsgd.step.lots import PoissonLots

    front = _front_end(model)
    target_epsilon = _validate.positive(target_epsilon=target_epsilon)
    epochs = _validate.integer_at_least(1, epochs=epochs)
    l2_norm_clip = _validate.positive(l2_norm_clip=l2_norm_clip)
    accountant = _validate.one_of(accountant_names(), accountant=accountant)
    verbose = _validate.one_of((0, 1), verbose=verbose)
    if front == "keras3":
        import keras

        from keras_dpsgd.keras3 import make_dp_optimizer, make_private
    else:
        import tf_keras as keras

        from keras_dpsgd.tf_keras import make_dp_optimizer, make_private as _make_private
        from keras_dpsgd.tf_keras import weight_regularization_terms

        def make_private(m):  # needed (and only allowed) for weight regularizers
            return _make_private(m) if weight_regularization_terms(m) else m

    optimizer_cls, optimizer_config = _optimizer_class_and_config(optimizer, keras, front)
    lot_seed = _lot_seed(seed, model)
    lots = PoissonLots(
        x,
        y,
        expected_lot_size=expected_lot_size,
        sample_weight=sample_weight,
        physical_batch_size=physical_batch_size,
        max_physical_batch_size=max_physical_batch_size,
        seed=lot_seed,
    )
    n = lots.num_examples
    notes = []
    if target_delta is None:
        delta = default_delta(n)
        notes.append(f"δ = {DEFAULT_DELTA_RULE} = {delta:.3g} (N = {n}; the default: give target_delta to choose it)")
    else:
        delta = check_delta(target_delta, n)
    # What the model records (a DPNormalization's release, an earlier DP run) is counted in the budget. A model
    # with no record at all is taken as new: its initial weights are the caller's (docs/privacy-model.md); one
    # loaded with compile=False carries no record of its DP training (docs/saving.md).
    prior = model_privacy_ledger(model, untrained=True).events
    prior_epsilon = compute_epsilon(prior, delta, accountant=accountant) if prior else 0.0
    if prior and prior_epsilon >= target_epsilon:
        raise refuse(
            "epsilon-already-spent",
            f"target_epsilon {target_epsilon:g} is already spent by the model's recorded events "
            f"({', '.join(sorted({e.label or type(e).__name__ for e in prior}))}: ε = "
            f"{prior_epsilon:.4g} at δ = {delta:.3g}); raise the target or "
            "add more noise to the preprocessing",
        )
    planned_steps = epochs * lots.lots_per_epoch
    sigma = float(
        compute_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sampling_rate=lots.sampling_rate,
            steps=planned_steps,
            accountant=accountant,
            prior_events=prior,
        )
    )
    for warning in budget_warnings(
        target_epsilon=target_epsilon,
        noise_multiplier=sigma,
        expected_lot_size=lots.expected_lot_size,
        l2_norm_clip=l2_norm_clip,
    ):
        warnings.warn(f"make_private_with_epsilon: {warning}", UserWarning, stacklevel=2)
    events = list(prior) + [PoissonSampledGaussianEvent(lots.sampling_rate, sigma, planned_steps)]
    epsilon = float(compute_epsilon(events, delta, accountant=accountant))
    private_optimizer = make_dp_optimizer(optimizer_cls)(
        l2_norm_clip,
        sigma,
        gradient_accumulation_steps=lots.gradient_accumulation_steps,
        seed=seed,
        **optimizer_config,
    )
    lots.configure(private_optimizer)
    run = PrivateTraining(
        model=make_private(model),
        optimizer=private_optimizer,
        lots=lots,
        noise_multiplier=sigma,
        epsilon=epsilon,
        target_epsilon=target_epsilon,
        delta=delta,
        epochs=epochs,
        steps_per_epoch=lots.steps_per_epoch,
        planned_steps=planned_steps,
        accountant=accountant,
        notes=tuple(notes),
    )
    if verbose:
        print(
            f"keras_dpsgd: {planned_steps} DP-SGD steps ({epochs} epochs of {lots.lots_per_epoch} Poisson lots, "
            f"expected size {lots.expected_lot_size:g} of N = {n}), σ = {sigma:.4g}, C = {l2_norm_clip:g}: "
            f"ε = {epsilon:.4g} at δ = {delta:.3g} (target ε = {target_epsilon:g}, accountant {accountant})"
        )
        for note in notes:
            print(f"keras_dpsgd: {note}")
    return run
