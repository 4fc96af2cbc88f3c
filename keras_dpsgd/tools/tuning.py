"""A hyperparameter search with one privacy budget for the whole search (Papernot & Steinke 2022).

:func:`tune` runs a random number K of DP training runs (trials) on the same private data, each with
hyperparameters drawn at random from a search space, and returns the best trial's model by a score on
held-out data. Publishing the best of several DP runs leaks more than one run (which run won depends on
the data), and publishing the best of a *fixed* number k of runs costs, by composition, k runs
("the naive way"). With K random (Poisson, or a truncated negative binomial) Papernot & Steinke 2022
(Theorems 2 and 6) bound the whole search by a few times one run's cost plus a log E[K] term:
:class:`~keras_dpsgd.accounting.TuningEvent`, :mod:`keras_dpsgd.accounting.tuning`.

:func:`tune` calibrates one noise multiplier σ for every trial so that the search's bound meets the
budget (ε, δ), draws K and each trial's settings from a generator seeded from the operating system,
trains each trial through the library's API (``make_private``, :class:`~keras_dpsgd.PoissonLots`, a
DP optimizer), and records the search in the ledger of the model it returns
(:func:`keras_dpsgd.ledger.record_search`): ``model_epsilon`` of that model is the search's ε, not one
trial's. See the guide, ``docs/tuning.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting import (
    PoissonSampledGaussianEvent,
    TuningEvent,
    calibrate_noise_multiplier,
    check_delta,
    compute_epsilon,
    sample_trials,
)
from keras_dpsgd.accounting.tuning import expected_trials
from keras_dpsgd.dp.refusals import refuse

__all__ = ["SEARCH_KEYS", "TuningResult", "tune"]

# What a search space may set: each key maps to a list of choices, drawn uniformly per trial.
SEARCH_KEYS = ("learning_rate", "l2_norm_clip", "expected_lot_size", "epochs")
_MAX_EXPECTED_TRIALS = 1000.0


@dataclasses.dataclass
class TuningResult:
    """What :func:`tune` releases: the best trial, and the search's privacy.

    Only the best trial is released (the theorem covers that and nothing more): the other trials'
    models, hyperparameters and scores are not returned, and neither is K: the bound holds for the best
    trial with K unknown (given K = k, the best of k runs can cost as much as k runs). Do not publish
    how many trials ran, nor how long the search took (which tells K).

    Attributes:
      model: the best trial's model (its ledger records the search), or None when K = 0 (Poisson: the
        search released nothing, an outcome the bound covers).
      hyperparameters: the best trial's settings (a dict of :data:`SEARCH_KEYS`), or None.
      score: the best trial's score on the validation data, or None.
      noise_multiplier: σ of every trial.
      event: the search's :class:`~keras_dpsgd.accounting.TuningEvent`.
      epsilon: ε of the search at `delta` (the model's ``model_epsilon``).
      delta: δ.
    """

    model: Any
    hyperparameters: Optional[dict]
    score: Optional[float]
    noise_multiplier: float
    event: TuningEvent
    epsilon: float
    delta: float


def _check_space(search_space: Mapping[str, Sequence]) -> dict:
    if not isinstance(search_space, Mapping):
        raise TypeError(f"search_space must be a dict of lists of choices, got {type(search_space).__name__}")
    unknown = sorted(set(search_space) - set(SEARCH_KEYS))
    missing = sorted(set(SEARCH_KEYS) - set(search_space))
    if unknown or missing:
        raise ValueError(
            f"search_space must set exactly the keys {list(SEARCH_KEYS)} (one choice fixes a value), got "
            f"{sorted(search_space)} (unknown {unknown}, missing {missing})"
        )
    space = {}
    for key in SEARCH_KEYS:
        choices = search_space[key]
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
            raise ValueError(f"search_space[{key!r}] must be a non-empty list of choices, got {choices!r}")
        checked = []
        for i, c in enumerate(choices):
            name = f"search_space[{key!r}][{i}]"
            if key == "l2_norm_clip" and c == "normalize":
                checked.append(c)
            elif key in ("expected_lot_size", "epochs"):
                checked.append(V.integer_at_least(1, **{name: c}))
            else:
                checked.append(V.positive(**{name: c}))
        space[key] = checked
    return space


def _trial_candidates(lots_of: Callable[[int], Any], space: dict, sigma: float) -> tuple:
    """One event per distinct (q, steps) a trial may draw, all at noise multiplier σ."""
    plans = set()
    for lot_size, epochs in itertools.product(space["expected_lot_size"], space["epochs"]):
        lots = lots_of(lot_size)
        plans.add((lots.sampling_rate, epochs * lots.lots_per_epoch))
    return tuple(PoissonSampledGaussianEvent(q, sigma, steps, label="tuning trial") for q, steps in sorted(plans))


def _run_trial(build_model, x, y, validation_data, settings, sigma, *, loss, score, optimizer, lots_seed):
    """One DP training run (the docs' step-by-step way, on the model's Keras) and its score on the validation data."""
    import keras_dpsgd
    from keras_dpsgd.ledger import is_keras3

    model = build_model()
    if is_keras3(model):  # the model's Keras decides the front end
        from keras_dpsgd import keras3 as front
    else:
        from keras_dpsgd import tf_keras as front
    model = front.make_private(model)
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=settings["expected_lot_size"], seed=lots_seed)
    optimizer_class = {"sgd": front.DPSGDOptimizer, "adam": front.DPAdamOptimizer}[optimizer]
    clip = settings["l2_norm_clip"]
    dp_optimizer = optimizer_class(
        None if clip == "normalize" else clip,
        sigma,
        clipping="normalize" if clip == "normalize" else "clip",
        learning_rate=settings["learning_rate"],
    )
    model.compile(
        optimizer=lots.configure(dp_optimizer), loss=loss, weighted_metrics=[] if score == "loss" else [score]
    )
    epochs = settings["epochs"]
    # The validation data go through fit, whose check refuses a validation row that is a training row.
    history = model.fit(
        lots.dataset(),
        steps_per_epoch=lots.steps_per_epoch,
        epochs=epochs,
        validation_data=validation_data,
        validation_freq=epochs,
        verbose=0,
    )
    return model, float(history.history[f"val_{score}"][-1])


def tune(
    build_model: Callable[[], Any],
    x: Any,
    y: Any,
    *,
    validation_data: tuple,
    search_space: Mapping[str, Sequence],
    target_epsilon: float,
    target_delta: float,
    loss: Any,
    distribution: str = "truncated_negative_binomial",
    mu: Optional[float] = None,
    eta: Optional[float] = None,
    gamma: Optional[float] = None,
    score: str = "accuracy",
    mode: str = "max",
    optimizer: str = "sgd",
    seed: Optional[int] = None,
) -> TuningResult:
    """Random search over DP training runs with one (ε, δ) budget, releasing the best run.

    The number of trials K is drawn from `distribution` (Papernot & Steinke 2022: "poisson" with mean
    `mu` >= 1, Theorem 6; "truncated_negative_binomial" with `eta` > -1 and `gamma` in (0, 1), Theorem 2,
    `eta` = 0 the logarithmic distribution, `eta` = 1 the geometric with E[K] = 1/`gamma`). Each trial
    draws every key of `search_space` uniformly from its choices, builds a fresh model with
    `build_model()`, trains it with DP-SGD on Poisson lots of the drawn expected size for the drawn
    epochs at the one noise multiplier σ calibrated for the whole search, and scores it on
    `validation_data` (``val_<score>`` of Keras's evaluation). The best score wins (ties: the earlier
    trial).

    Choosing by the score on held-out data is exactly what the theorems cover: the selection is part of
    the released output and is charged. The validation rows themselves are not protected (as everywhere in
    keras_dpsgd, docs/privacy-model.md): they must be held out (fit refuses a shared row). Only the best
    trial is released; a score computed on the training data would not be covered.

    Args:
      build_model: returns a new, uncompiled model (the same architecture every call).
      x: training inputs (arrays).
      y: training labels.
      validation_data: (x_val, y_val), held out from the training data.
      search_space: a dict with exactly the keys of :data:`SEARCH_KEYS`, each a list of choices:
        "learning_rate" (> 0), "l2_norm_clip" (> 0, or "normalize" for per-example normalization),
        "expected_lot_size" and "epochs" (integers >= 1).
      target_epsilon: ε > 0 of the whole search.
      target_delta: δ in (0, 1/N).
      loss: the loss for ``model.compile`` (tf_keras: with ``reduction="none"``).
      distribution: "truncated_negative_binomial" (default) or "poisson".
      mu: the Poisson mean (>= 1).
      eta: η of the truncated negative binomial (> -1).
      gamma: γ of the truncated negative binomial, in (0, 1).
      score: a metric name Keras evaluates (compiled as a weighted metric), or "loss".
      mode: "max" (default; a higher score is better) or "min".
      optimizer: "sgd" (``DPSGDOptimizer``) or "adam" (``DPAdamOptimizer``).
      seed: for tests only: seeds K, the trials' settings and their lots (not the noise). Anyone who
        knows it knows them (K included, which the bound needs secret); default None draws them from the
        operating system's entropy (``secrets``).

    Returns:
      A :class:`TuningResult`.

    Raises:
      ValueError: a bad argument (named, with its range and value); a budget the search cannot meet;
        a trial that spent more than planned (:func:`keras_dpsgd.ledger.check_trial`).
    """
    space = _check_space(search_space)
    target_epsilon = V.positive(target_epsilon=target_epsilon)
    mode = V.one_of(("max", "min"), mode=mode)
    optimizer = V.one_of(("sgd", "adam"), optimizer=optimizer)
    if not isinstance(score, str) or not score:
        raise ValueError(f"score must be a metric name (a non-empty string), got {score!r}")
    if not callable(build_model):
        raise TypeError(f"build_model must be a callable returning a new model, got {type(build_model).__name__}")
    if seed is not None:
        seed = V.integer_at_least(0, seed=seed)
    import keras_dpsgd
    from keras_dpsgd.ledger import check_trial, model_epsilon, record_search

    probe = {}

    def lots_of(lot_size: int):  # the plan of each lot size (q, lots per epoch), as the trials' lots compute it
        if lot_size not in probe:
            probe[lot_size] = keras_dpsgd.PoissonLots(x, y, expected_lot_size=lot_size, seed=0)
        return probe[lot_size]

    n = lots_of(space["expected_lot_size"][0]).num_examples
    target_delta = check_delta(target_delta, n)

    def search(sigma: float) -> TuningEvent:
        return TuningEvent(
            distribution, _trial_candidates(lots_of, space, sigma), mu=mu, eta=eta, gamma=gamma, label="tuning"
        )

    mean = expected_trials(search(1.0))  # validates the distribution's parameters
    if mean > _MAX_EXPECTED_TRIALS:
        raise ValueError(
            f"the distribution's expected number of trials must be <= {_MAX_EXPECTED_TRIALS:g}, got {mean:.6g}"
        )
    sigma = calibrate_noise_multiplier(search, target_epsilon=target_epsilon, target_delta=target_delta)
    event = search(sigma)
    # K from a generator of its own (the released settings say nothing of it), both seeded from OS entropy.
    k_seed, settings_seed = np.random.SeedSequence(secrets.randbits(128) if seed is None else seed).spawn(2)
    k = sample_trials(event, np.random.default_rng(k_seed))
    rng = np.random.default_rng(settings_seed)
    best = None
    for trial in range(k):
        settings = {key: space[key][int(rng.integers(len(space[key])))] for key in SEARCH_KEYS}
        lots_seed = None if seed is None else int(rng.integers(2**31))
        model, value = _run_trial(
            build_model,
            x,
            y,
            validation_data,
            settings,
            sigma,
            loss=loss,
            score=score,
            optimizer=optimizer,
            lots_seed=lots_seed,
        )
        check_trial(model, event)
        if not math.isfinite(value):
            value = -math.inf if mode == "max" else math.inf
        if best is None or (value > best[1] if mode == "max" else value < best[1]):
            best = (model, value, settings)
    epsilon = compute_epsilon(event, target_delta)
    if best is None:
        return TuningResult(None, None, None, sigma, event, epsilon, target_delta)
    model, value, settings = best
    record_search(model, event)
    recorded, _ = model_epsilon(model, target_delta=target_delta)
    if recorded != epsilon:  # fail closed: the model must report the search's ε
        raise refuse(
            "search-not-recorded",
            f"the returned model's ledger reports epsilon {recorded!r}, the search {epsilon!r}",
            RuntimeError,
        )
    return TuningResult(model, dict(settings), value, sigma, event, epsilon, target_delta)
