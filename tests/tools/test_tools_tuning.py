"""The tuner (keras_dpsgd.tools.tuning.tune) end to end on a tiny problem, and its argument checks.

The search's bound itself is checked in tests/accounting/test_tuning.py (against a second implementation
of Papernot & Steinke 2022's theorems); here: the returned model's ledger reports exactly that bound,
within the budget, through a save and a load, and charges later steps on top.
"""

import importlib.util
import math
import os

import keras
import numpy as np
import pytest

import keras_dpsgd
from keras_dpsgd.accounting import (
    PoissonSampledGaussianEvent,
    TuningEvent,
    compute_epsilon,
    lots_per_epoch,
    rdp_poisson_subsampled_gaussian,
)
from keras_dpsgd.ledger import check_trial, model_privacy_ledger
from keras_dpsgd.tools.tuning import tune

DELTA = 1e-5
SPACE = {"learning_rate": [0.3, 1.0], "l2_norm_clip": [1.0, "normalize"], "expected_lot_size": [64, 128], "epochs": [1]}


def _data():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 8)).astype("float32")
    labels = rng.integers(3, size=900)
    x = centers[labels] + 0.5 * rng.normal(size=(900, 8)).astype("float32")
    return x[:700], labels[:700], x[700:], labels[700:]


def _build():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def result():
    x, y, xv, yv = _data()
    # seed: for the test only (K and the settings reproducible); geometric K with E[K] = 2
    return tune(
        _build,
        x,
        y,
        validation_data=(xv, yv),
        search_space=SPACE,
        target_epsilon=2.0,
        target_delta=DELTA,
        loss=LOSS,
        eta=1.0,
        gamma=0.5,
        seed=5,
    )


def test_the_returned_models_ledger_is_the_search_within_the_budget(result):
    assert result.model is not None and not hasattr(result, "num_trials")  # K stays secret
    epsilon, _ = keras_dpsgd.model_epsilon(result.model, target_delta=DELTA)
    assert epsilon == result.epsilon == compute_epsilon(result.event, DELTA)
    assert 0.99 * 2.0 < epsilon <= 2.0  # σ calibrated to the budget (bisection to 1e-7), never over it
    assert [type(e) for e in model_privacy_ledger(result.model).events] == [TuningEvent]
    # the search's trial is every (q, steps) a trial may draw, at the one σ; the winner ran one of them
    n = 700
    plans = {(lot / n, lots_per_epoch(n, lot)) for lot in (64, 128)}
    assert {(c.sampling_rate, c.count) for c in result.event.candidates} == plans
    assert {c.noise_multiplier for c in result.event.candidates} == {result.noise_multiplier}
    assert set(result.hyperparameters) == set(SPACE) and math.isfinite(result.score)
    # one trial alone costs less than the search: the selection is charged
    alone = compute_epsilon([PoissonSampledGaussianEvent(128 / n, result.noise_multiplier, 6)], DELTA)
    assert alone < epsilon


def _second_implementation():
    """tests/accounting/test_tuning.py: Papernot & Steinke's bound written again in mpmath."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "accounting", "test_tuning.py")
    spec = importlib.util.spec_from_file_location("accounting_test_tuning", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tuners_epsilon_is_the_papers_bound_computed_independently(result):
    # the trial's curve: the larger, at every order, of the two plans (lots of 64 and 128, one epoch) at σ
    n, sigma = 700, result.noise_multiplier
    curves = [lots_per_epoch(n, lot) * rdp_poisson_subsampled_gaussian(lot / n, sigma) for lot in (64, 128)]
    expected = _second_implementation()._paper_epsilon(
        np.max(curves, axis=0), "truncated_negative_binomial", DELTA, eta=1.0, gamma=0.5
    )
    assert result.epsilon == pytest.approx(expected, rel=1e-9)


def test_a_file_that_would_lose_the_search_is_refused(result, tmp_path):
    with pytest.raises(ValueError, match="also records the hyperparameter search"):
        result.model.save(str(tmp_path / "best.h5"))


def test_the_search_travels_with_a_keras_file_and_later_steps_are_charged_on_top(result, tmp_path):
    path = str(tmp_path / "best.keras")
    result.model.save(path)
    loaded = keras.models.load_model(path)
    assert keras_dpsgd.model_epsilon(loaded, target_delta=DELTA)[0] == result.epsilon
    # a search's trial bound does not cover a model that holds the search already
    with pytest.raises(ValueError, match="spends more than one trial of the search may"):
        check_trial(loaded, result.event)
    # training on: the new steps are charged on top of the search
    x, y, _, _ = _data()
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=100)
    keras_dpsgd.make_private(loaded)
    lots.configure(loaded.optimizer)
    loaded.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    more = PoissonSampledGaussianEvent(lots.sampling_rate, result.noise_multiplier, lots.lots_per_epoch)
    assert keras_dpsgd.model_epsilon(loaded, target_delta=DELTA)[0] == compute_epsilon([result.event, more], DELTA)


def test_a_poisson_search_may_run_no_trial_and_releases_nothing_then(monkeypatch):
    import keras_dpsgd.tools.tuning as tuning

    monkeypatch.setattr(tuning, "sample_trials", lambda event, generator: 0)  # K = 0 (probability e^-1 here)
    x, y, xv, yv = _data()
    out = tune(
        lambda: pytest.fail("a trial ran"),
        x,
        y,
        validation_data=(xv, yv),
        search_space=SPACE,
        target_epsilon=1.0,
        target_delta=DELTA,
        loss=LOSS,
        distribution="poisson",
        mu=1.0,
    )
    assert out.model is None and out.hyperparameters is None and out.score is None
    assert out.epsilon == compute_epsilon(out.event, DELTA) <= 1.0


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"search_space": dict(SPACE, momentum=[0.9])},
            r"search_space must set exactly the keys .*unknown \['momentum'\]",
        ),
        (
            {"search_space": dict(SPACE, learning_rate=[0.1, -1.0])},
            r"search_space\['learning_rate'\]\[1\] must be a finite number > 0, got -1.0",
        ),
        ({"search_space": dict(SPACE, epochs=[])}, r"search_space\['epochs'\] must be a non-empty list"),
        (
            {"search_space": dict(SPACE, expected_lot_size=[64.0])},
            r"search_space\['expected_lot_size'\]\[0\] must be an integer >= 1",
        ),
        ({"target_epsilon": 0.0}, r"target_epsilon must be a finite number > 0, got 0.0"),
        ({"target_delta": 0.01}, r"delta must be < 1/num_examples"),
        ({"gamma": 1.5}, r"gamma must be in \(0, 1\), got 1.5"),
        ({"distribution": "poisson", "eta": None, "gamma": None, "mu": 0.5}, r"mu must be in \[1, inf\), got 0.5"),
        ({"mode": "best"}, r"mode must be one of \('max', 'min'\), got 'best'"),
        ({"gamma": 1e-4}, r"expected number of trials must be <= 1000"),
    ],
)
def test_bad_arguments_are_refused_before_any_training(change, match):
    x, y, xv, yv = _data()
    kwargs = dict(
        validation_data=(xv, yv),
        search_space=SPACE,
        target_epsilon=1.0,
        target_delta=DELTA,
        loss=LOSS,
        eta=1.0,
        gamma=0.5,
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        tune(lambda: pytest.fail("trained before refusing"), x, y, **kwargs)


def test_check_trial_refuses_a_model_that_trained_beyond_its_plan():
    x, y, _, _ = _data()
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=128)
    model = keras_dpsgd.make_private(_build())
    model.compile(optimizer=lots.configure(keras_dpsgd.DPSGDOptimizer(1.0, 1.5, learning_rate=0.5)), loss=LOSS)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=2, verbose=0)
    planned = PoissonSampledGaussianEvent(lots.sampling_rate, 1.5, 2 * lots.lots_per_epoch)
    check_trial(model, TuningEvent("poisson", planned, mu=2.0))  # within its plan: accepted
    one_epoch = PoissonSampledGaussianEvent(lots.sampling_rate, 1.5, lots.lots_per_epoch)
    with pytest.raises(ValueError, match="spends more than one trial of the search may"):
        check_trial(model, TuningEvent("poisson", one_epoch, mu=2.0))
