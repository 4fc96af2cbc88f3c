"""make_private_with_epsilon: one call from model and data to a calibrated private run, on both Kerases."""

import keras
import numpy as np
import pytest
import tf_keras

import keras_dpsgd
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

dp_accounting = pytest.importorskip("dp_accounting")

TARGET_EPSILON = 2.0


def _blobs(n=400, seed=0):
    """Two well-separated Gaussian classes in 2-D: linearly separable up to a few points."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n)
    x = rng.normal(size=(n, 2)) * 0.5 + np.where(y[:, None] == 1, 1.5, -1.5)
    return x.astype("float32"), y.astype("int64")


def _oracle_epsilon(q, sigma, steps, delta):
    """dp_accounting's RDP accountant over the same Poisson-subsampled Gaussian steps."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("kmod", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_one_call_trains_within_the_target_epsilon(kmod):
    x, y = _blobs()
    model = kmod.Sequential([kmod.Input((2,)), kmod.layers.Dense(2)])
    run = keras_dpsgd.make_private_with_epsilon(
        model,
        x,
        y,
        target_epsilon=TARGET_EPSILON,
        epochs=3,
        expected_lot_size=50,
        l2_norm_clip=1.0,
        optimizer=kmod.optimizers.SGD(0.5),
        seed=1,
        verbose=0,
    )
    assert run.delta == pytest.approx(1 / 4000) and "min(1/N^1.1, 1/(10·N))" in run.notes[0]  # the default δ, announced
    reduction = {} if kmod is keras else {"reduction": "none"}
    loss = kmod.losses.SparseCategoricalCrossentropy(from_logits=True, **reduction)
    run.model.compile(optimizer=run.optimizer, loss=loss, weighted_metrics=["accuracy"])
    history = run.fit(verbose=0)
    assert "epsilon" in history.history  # the PrivacyLogger was added

    steps = int(run.optimizer.noised_steps.numpy())
    assert steps == run.planned_steps == 3 * 8
    epsilon, delta = keras_dpsgd.model_epsilon(run.model, target_delta=run.delta)
    oracle = _oracle_epsilon(50 / 400, run.noise_multiplier, steps, delta)
    assert epsilon == pytest.approx(oracle, rel=1e-6)
    # Calibrated: never above the target, and not wastefully below it (the bisection's tolerance).
    assert TARGET_EPSILON * (1 - 1e-4) <= epsilon <= TARGET_EPSILON
    assert epsilon == pytest.approx(run.epsilon, rel=1e-9)
    x_test, y_test = _blobs(200, seed=1)
    accuracy = np.mean(np.argmax(np.asarray(run.model(x_test)), axis=-1) == y_test)
    assert accuracy > 0.9  # chance is 0.5


def test_one_call_counts_what_the_model_already_spent():
    """A DPNormalization inside the model is in the budget: σ is calibrated on top of its release."""
    x, y = _blobs()
    norm = keras_dpsgd.keras3.DPNormalization(4.0, lower=-4.0, upper=4.0, seed=0)
    norm.adapt(x)
    model = keras.Sequential([keras.Input((2,)), norm, keras.layers.Dense(2)])
    run = keras_dpsgd.make_private_with_epsilon(
        model, x, y, target_epsilon=3.0, epochs=2, expected_lot_size=40, l2_norm_clip=1.0, verbose=0
    )
    (release,) = norm.privacy_events
    steps = PoissonSampledGaussianEvent(0.1, run.noise_multiplier, run.planned_steps)
    assert compute_epsilon([release, steps], run.delta) == pytest.approx(run.epsilon, rel=1e-9)
    assert run.epsilon <= 3.0 and compute_epsilon([steps], run.delta) < 3.0 - 0.1


def test_one_call_refuses_a_budget_the_model_has_spent():
    x, y = _blobs()
    norm = keras_dpsgd.keras3.DPNormalization(0.5, lower=-4.0, upper=4.0, seed=0)
    norm.adapt(x)
    model = keras.Sequential([keras.Input((2,)), norm, keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"target_epsilon 1 is already spent by the model's recorded events"):
        _call(model=model, x=x, y=y)


def _call(**overrides):
    x, y = _blobs(100)
    kwargs = dict(target_epsilon=1.0, epochs=1, expected_lot_size=10, l2_norm_clip=1.0, verbose=0)
    kwargs.update(overrides)
    model = kwargs.pop("model", None) or keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    return keras_dpsgd.make_private_with_epsilon(model, kwargs.pop("x", x), kwargs.pop("y", y), **kwargs)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"target_epsilon": 0.0}, ValueError, r"target_epsilon must be a finite number > 0, got 0.0"),
        ({"target_epsilon": "3"}, TypeError, r"target_epsilon must be a finite number > 0, got '3'"),
        ({"epochs": 2.0}, TypeError, r"epochs must be an integer >= 1, got 2.0"),
        ({"expected_lot_size": 101}, ValueError, r"expected_lot_size must be in \(0, 100\], got 101"),
        ({"l2_norm_clip": -1.0}, ValueError, r"l2_norm_clip must be a finite number > 0, got -1.0"),
        ({"target_delta": 0.5}, ValueError, r"delta must be < 1/num_examples = 0.01 \(N = 100\), got 0.5"),
        ({"accountant": "nope"}, ValueError, r"accountant must be one of"),
        ({"optimizer": "rmsprop"}, ValueError, r"optimizer must be one of \('sgd', 'adam'\), got 'rmsprop'"),
        ({"optimizer": tf_keras.optimizers.SGD()}, TypeError, r"a keras3 optimizer class or instance"),
        ({"optimizer": keras_dpsgd.keras3.DPSGDOptimizer}, TypeError, r"non-private optimizer"),
        ({"model": object()}, TypeError, r"model must be a Keras 3 or tf_keras Model, got object"),
        ({"y": np.zeros(7)}, ValueError, r"x and y must be arrays sharing their first dimension"),
        ({"verbose": 2}, ValueError, r"verbose must be one of"),
    ],
)
def test_bad_arguments_are_named(overrides, error, message):
    with pytest.raises(error, match=message):
        _call(**overrides)


def test_fit_refuses_arguments_the_plan_fixes():
    run = _call()
    with pytest.raises(ValueError, match=r"fit arguments \['epochs'\] are fixed by the plan"):
        run.fit(epochs=5)


@pytest.mark.parametrize("target, fragment", [(1000.0, "protects little"), (0.001, "learns nothing")])
def test_a_budget_that_makes_no_sense_warns_with_the_numbers(target, fragment):
    """Issue 40.8: a target ε whose σ is below 0.5 or above L passed without a word."""
    x, y = _blobs()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="make_private_with_epsilon: target ε") as caught:
        run = keras_dpsgd.make_private_with_epsilon(
            model, x, y, target_epsilon=target, epochs=3, expected_lot_size=50, l2_norm_clip=1.0, verbose=0
        )
    (text,) = [str(w.message) for w in caught if "make_private_with_epsilon" in str(w.message)]
    assert fragment in text and f"σ = {run.noise_multiplier:.4g}" in text and "L·C = 50" in text
    assert not (0.5 <= run.noise_multiplier < 50)  # what the warning says is true
