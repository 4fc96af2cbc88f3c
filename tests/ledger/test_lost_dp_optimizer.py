"""ε of a DP-trained model whose DP optimizer is out of sight: loaded with ``compile=False``, or compiled again
with a plain optimizer. It read 0.0 before (fail open); now the model's copy of the ledger gives the DP history,
a plain optimizer's steps add ε = ∞, and a model carrying no record of its training is refused.

Run for Keras 3 on TensorFlow and tf_keras here, and on JAX and torch in their suites' processes
(tests/backends/{jax,torch}/test_*_lost_dp_optimizer.py import the checks of ``__all__`` with their front).
"""

import math

import numpy as np
import pytest

from keras_dpsgd import model_epsilon, model_privacy_ledger
from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.dp.refusals import refusal_id
from tests._behaviour import built, keras3_front, tf_keras_front

__all__ = [  # the checks of every Keras 3 backend, collected by tests/backends/{jax,torch} too
    "test_a_fresh_model_without_a_dp_optimizer_is_refused_unless_untrained",
    "test_compiled_again_with_a_plain_optimizer_keeps_the_dp_history_then_infinity",
    "test_load_then_compiled_again_before_any_read_keeps_the_history",
    "test_loaded_with_compile_false_is_refused_not_zero",
    "test_plain_steps_stay_in_the_ledger_when_the_model_is_compiled_again",
]

Q, SIGMA, DELTA, STEPS = 0.25, 1.1, 1e-3, 2
FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _dp_trained(front):
    """The behaviour suite's dense model after STEPS noised steps at (Q, SIGMA), and its (x, y)."""
    model, x, y = built(front, "dense")
    front.compiled(
        model,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        learning_rate=0.1,
        sampling_rate=Q,
        expected_lot_size=2.0,  # N = L/q = 8: the default δ resolves
        assume_poisson=True,
    )
    x, y = x[: 2 * STEPS], y[: 2 * STEPS]
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == STEPS
    return model, x, y


def _accountant(steps=STEPS):
    return compute_epsilon(PoissonSampledGaussianEvent(Q, SIGMA, steps), DELTA)


def _plain_compile(front, model):
    """`model` compiled with a plain SGD and a reduced loss (Keras's own step on JAX needs a scalar)."""
    model.compile(
        optimizer=front.keras.optimizers.SGD(0.1),
        loss=front.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def _plain_fit(front, model, x, y):
    """One step of a plain SGD (Keras's own train step: the private one takes DP optimizers only)."""
    _plain_compile(front, model)
    for method in ("train_step", "fit", "train_on_batch"):  # Keras 3: make_private's instance methods undone
        vars(model).pop(method, None)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1


def _assert_refused(model):
    for read in (model_epsilon, model_privacy_ledger):
        with pytest.raises(ValueError, match=r"compile=True.*untrained=True") as err:
            read(model, target_delta=DELTA) if read is model_epsilon else read(model)
        assert refusal_id(err.value) == "model-without-ledger"


def test_compiled_again_with_a_plain_optimizer_keeps_the_dp_history_then_infinity(front):
    model, x, y = _dp_trained(front)
    dp_events = (PoissonSampledGaussianEvent(Q, SIGMA, STEPS, "dp-sgd"),)
    assert model_privacy_ledger(model).events == dp_events
    default_delta = model_epsilon(model)[1]  # N = L/q of the DP optimizer
    assert default_delta == pytest.approx(1 / 80)
    _plain_compile(front, model)  # no step yet: ε read 0.0 before
    assert model_privacy_ledger(model).events == dp_events
    eps, delta = model_epsilon(model, target_delta=DELTA)
    assert delta == DELTA and eps == pytest.approx(_accountant(), rel=1e-12) and eps > 0
    assert model_epsilon(model)[1] == default_delta  # N still from the DP optimizer that trained the model

    _plain_fit(front, model, x, y)  # a noiseless step: ε = ∞, the DP history still listed first
    assert model_privacy_ledger(model).events == dp_events + (
        GaussianEvent(0.0, count=1, label="non-private training"),
    )
    assert math.isinf(model_epsilon(model, target_delta=DELTA)[0])


def test_plain_steps_stay_in_the_ledger_when_the_model_is_compiled_again(front):
    """DP training, a plain optimizer's step, then the model compiled again (a plain optimizer, then a DP one): the
    plain step stays in the model's ledger, ε = ∞. It was lost before (ε the DP history's, finite: fail open)."""
    model, x, y = _dp_trained(front)
    _plain_fit(front, model, x, y)
    dp_events = (PoissonSampledGaussianEvent(Q, SIGMA, STEPS, "dp-sgd"),)
    plain_events = dp_events + (GaussianEvent(0.0, count=1, label="non-private training"),)
    model.compile(optimizer=model.optimizer, loss=model.loss)  # the same plain optimizer: its step counted once
    assert model_privacy_ledger(model).events == plain_events
    _plain_compile(front, model)  # a new plain optimizer, no step yet
    assert model_privacy_ledger(model).events == plain_events
    assert math.isinf(model_epsilon(model, target_delta=DELTA)[0])

    front.compiled(
        model, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, sampling_rate=Q, assume_poisson=True
    )
    model.fit(x[:2], y[:2], batch_size=2, epochs=1, verbose=0)  # one more DP step, after the plain one
    assert model_privacy_ledger(model).events == plain_events + (PoissonSampledGaussianEvent(Q, SIGMA, 1, "dp-sgd"),)
    assert math.isinf(model_epsilon(model, target_delta=DELTA)[0])


def test_loaded_with_compile_false_is_refused_not_zero(front, tmp_path):
    model, _, _ = _dp_trained(front)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = front.keras.models.load_model(path, compile=False)
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])
    assert getattr(loaded, "optimizer", None) is None
    _assert_refused(loaded)
    # Compiled with a plain optimizer that has not stepped: still no record.
    _plain_compile(front, loaded)
    _assert_refused(loaded)
    # The caller's statement: no training outside the (empty) ledger.
    assert model_privacy_ledger(loaded, untrained=True).events == ()
    # compile=True restores the DP optimizer and its ledger: the run's ε.
    restored = front.keras.models.load_model(path)
    assert model_epsilon(restored, target_delta=DELTA)[0] == pytest.approx(_accountant(), rel=1e-12)


def test_load_then_compiled_again_before_any_read_keeps_the_history(front, tmp_path):
    """Loading the DP optimizer attaches the ledger to the model, so a compile right after the load (a plain
    optimizer, or a new DP one) keeps the loaded steps (the plain one read 0.0, the DP one restarted at 0)."""
    model, _, _ = _dp_trained(front)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = front.keras.models.load_model(path)
    _plain_compile(front, loaded)
    assert model_epsilon(loaded, target_delta=DELTA)[0] == pytest.approx(_accountant(), rel=1e-12)
    again = front.keras.models.load_model(path)
    front.compiled(again, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, sampling_rate=Q)
    assert model_epsilon(again, target_delta=DELTA)[0] == pytest.approx(_accountant(), rel=1e-12)


def test_tf_keras_saved_model_loaded_with_compile_false_reads_the_models_copy(tmp_path):
    """A tf_keras SavedModel keeps the model's copy of the ledger: compile=False reads it (it crashed before)."""
    front = tf_keras_front()
    model, _, _ = _dp_trained(front)
    model.save(str(tmp_path / "saved"))
    loaded = front.keras.models.load_model(str(tmp_path / "saved"), compile=False)
    # A revived skeleton of the DP optimizer (its counter, no σ): its steps are the copy's, not plain ones.
    assert type(loaded.optimizer).__name__ == "RestoredOptimizer"
    assert model_privacy_ledger(loaded).events == (PoissonSampledGaussianEvent(Q, SIGMA, STEPS, "dp-sgd"),)
    assert model_epsilon(loaded, target_delta=DELTA)[0] == pytest.approx(_accountant(), rel=1e-12)


def test_a_fresh_model_without_a_dp_optimizer_is_refused_unless_untrained(front):
    """Nothing shows whether a model without a DP optimizer and a ledger was trained: stated, not guessed."""
    model, _, _ = built(front, "dense")
    _assert_refused(model)
    assert model_epsilon(model, target_delta=DELTA, untrained=True) == (0.0, DELTA)
