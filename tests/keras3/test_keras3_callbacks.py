"""PrivacyLogger and WithinLimit on a Keras 3 model made private (closed answers from the accountant)."""

import io
import contextlib

import keras
import numpy as np
import pytest
import tf_keras

import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson
from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit

N, Q, SIGMA, DELTA, BATCH = 200, 0.05, 1.5, 1e-5, 10
X = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
Y = X[:, :1] * 2.0


def _eps(steps):
    return compute_epsilon([PoissonSampledGaussianEvent(Q, SIGMA, steps)], DELTA)


def _model(steps_per_execution=1, sampling_rate=Q):
    model = k3.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    optimizer = k3.DPSGDOptimizer(
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        learning_rate=0.05,
        sampling_rate=sampling_rate,
        expected_lot_size=None if sampling_rate is None else sampling_rate * N,
        seed=0,
    )
    if sampling_rate is not None:  # fixed batches that stand for Poisson lots at q
        assume_poisson(optimizer)
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def _fit(model, callbacks, epochs, steps_per_epoch=10, **kwargs):
    return model.fit(
        X, Y, batch_size=BATCH, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=0, **kwargs
    )


def _steps(model):
    return int(model.optimizer.noised_steps.numpy())


# A budget that 23 steps fit and 24 exceed: the stop falls in the middle of the third epoch.
TARGET = 0.5 * (_eps(23) + _eps(24))


def test_the_callbacks_are_keras3_callbacks_that_speak_tf_keras_protocol():
    for callback in (PrivacyLogger(DELTA), WithinLimit(1.0, DELTA)):
        assert isinstance(callback, keras.callbacks.Callback)
        for kind in ("train", "test", "predict"):  # as tf_keras's own base class computes it
            name = f"_implements_{kind}_batch_hooks"
            assert getattr(callback, name)() == getattr(tf_keras.callbacks.Callback, name)(callback), (callback, kind)
    assert WithinLimit(1.0, DELTA)._implements_train_batch_hooks()  # it counts steps after each batch
    assert not PrivacyLogger(DELTA)._implements_train_batch_hooks()


def test_logger_epsilon_equals_the_accountant_for_the_steps_taken():
    model = _model()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = model.fit(
            X, Y, batch_size=BATCH, epochs=3, steps_per_epoch=10, callbacks=[PrivacyLogger(DELTA)], verbose=2
        )
    assert _steps(model) == 30
    np.testing.assert_allclose(history.history["epsilon"], [_eps(10), _eps(20), _eps(30)], rtol=1e-12)
    assert history.history["delta"] == [DELTA] * 3
    assert "epsilon:" in out.getvalue()  # in the progress bar


@pytest.mark.parametrize("steps_per_execution", [1, 5])
def test_within_limit_stops_exactly_mid_epoch(steps_per_execution):
    model = _model(steps_per_execution)
    limit = WithinLimit(TARGET, DELTA, verbose=0)
    history = _fit(model, [PrivacyLogger(DELTA), limit], epochs=5)
    assert _steps(model) == 23  # 10 + 10 + 3; with 5 steps per execution, the last one cut to 3
    assert limit.stopped and limit.remaining == 0
    assert _eps(23) <= TARGET < _eps(24)
    assert len(history.history["loss"]) == 3  # stopped in the third epoch
    assert model.steps_per_execution == steps_per_execution  # put back after the cut call
    # The model trains on afterwards without the limit (the train function was put back).
    _fit(model, [], epochs=1)
    assert _steps(model) == 33


def test_within_limit_takes_no_step_when_the_budget_is_spent():
    model = _model()
    _fit(model, [], epochs=1, steps_per_epoch=5)
    weights = [w.numpy().copy() for w in model.trainable_weights]
    limit = WithinLimit(_eps(5) * 1.0001, DELTA, verbose=0)
    _fit(model, [limit], epochs=2)
    assert _steps(model) == 5 and limit.stopped
    for before, after in zip(weights, model.trainable_weights):
        np.testing.assert_array_equal(before, after.numpy())


def test_within_limit_refuses_n_larger_than_the_validation_split():
    model = _model(sampling_rate=None)
    with pytest.raises(ValueError, match=r"at most 160 with validation_split=0.2.*num_examples=160"):
        model.fit(
            X,
            Y,
            batch_size=BATCH,
            epochs=1,
            validation_split=0.2,
            verbose=0,
            callbacks=[WithinLimit(5.0, DELTA, num_examples=N, batch_size=BATCH, verbose=0)],
        )
    assert _steps(model) == 0
    logger = PrivacyLogger(DELTA, num_examples=160, batch_size=BATCH)
    model.fit(X, Y, batch_size=BATCH, epochs=1, validation_split=0.2, verbose=0, callbacks=[logger])
    expected = compute_epsilon([PoissonSampledGaussianEvent(BATCH / 160, SIGMA, 16)], DELTA)
    assert _steps(model) == 16 and logger.epsilon == pytest.approx(expected, rel=1e-12)


def test_callbacks_refuse_a_non_private_optimizer():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="DP optimizer"):
        _fit(model, [WithinLimit(1.0, DELTA)], epochs=1)
