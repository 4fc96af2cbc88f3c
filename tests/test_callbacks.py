"""Tests of PrivacyLogger and WithinLimit against the accountant's closed answers."""

import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _ledger_helpers import EventLayer, FakeDPOptimizer

from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledGaussianEvent,
    compute_epsilon,
    max_steps_within_budget,
)
from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit


N, Q, SIGMA, DELTA = 200, 0.05, 1.5, 1e-5
X = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
Y = X[:, :1]


def _model(sigma=SIGMA, q=Q, extra=None):
    layers = [keras.Input((3,))] + ([extra] if extra is not None else []) + [keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer=FakeDPOptimizer(sigma, q, q * N), loss="mse")
    return model


def _fit(model, callbacks, epochs, steps_per_epoch=10):
    return model.fit(
        X, Y, batch_size=10, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=0
    )


def _eps(steps, prior=()):
    return compute_epsilon(list(prior) + [PoissonSampledGaussianEvent(Q, SIGMA, steps)], DELTA)


def test_logger_epsilon_equals_the_accountant():
    model = _model()
    hist = _fit(model, [PrivacyLogger(DELTA)], epochs=3)
    assert hist.history["delta"] == [DELTA] * 3
    expected = [_eps(10 * (e + 1)) for e in range(3)]
    np.testing.assert_allclose(hist.history["epsilon"], expected, rtol=1e-12)
    assert expected[0] < expected[1] < expected[2]


def test_logger_agrees_with_dp_accounting():
    dp_accounting = pytest.importorskip("dp_accounting")
    model = _model()
    hist = _fit(model, [PrivacyLogger(DELTA)], epochs=1)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), 10)
    assert hist.history["epsilon"][0] == pytest.approx(acc.get_epsilon(DELTA), rel=0.02)


def test_logger_shows_in_the_progress_bar(capsys):
    model = _model()
    model.fit(X, Y, batch_size=10, epochs=1, steps_per_epoch=2, callbacks=[PrivacyLogger(DELTA)], verbose=2)
    assert "epsilon:" in capsys.readouterr().out


def test_logger_default_delta_and_refusal(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        hist = _fit(model, [PrivacyLogger()], epochs=1)
    assert hist.history["delta"][0] == pytest.approx(min(N**-1.1, 1 / (10 * N)))
    with pytest.raises(ValueError, match="delta must be <"):
        _fit(_model(), [PrivacyLogger(1.0 / N)], epochs=1)


def test_logger_needs_a_dp_optimizer():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="DP optimizer") as err:
        _fit(model, [PrivacyLogger(DELTA)], epochs=1)
    # Issue 40.9: the way out of the one-call API's usual slip (compiling with a plain optimizer) is named.
    assert "got SGD" in str(err.value) and "compile with run.optimizer" in str(err.value)


def _check_stopped_at_the_boundary(model, target, prior=()):
    steps = int(model.optimizer.noised_steps.numpy())
    assert _eps(steps, prior) <= target < _eps(steps + 1, prior)
    return steps


def test_within_limit_stops_mid_epoch_at_the_boundary():
    target = 1.0
    k = max_steps_within_budget(target_epsilon=target, target_delta=DELTA, sampling_rate=Q, noise_multiplier=SIGMA)
    assert k % 10 != 0 and k < 50  # the stop falls inside an epoch
    model = _model()
    limit = WithinLimit(target, DELTA, verbose=0)
    hist = _fit(model, [limit, PrivacyLogger(DELTA)], epochs=20)
    assert _check_stopped_at_the_boundary(model, target) == k
    assert limit.stopped and limit.remaining == 0
    assert len(hist.history["loss"]) == k // 10 + 1
    assert hist.history["epsilon"][-1] <= target


def test_within_limit_counts_other_ledger_events():
    pca = GaussianEvent(4.0, count=1, label="dp-pca")
    target = 1.5
    k = max_steps_within_budget(
        target_epsilon=target, target_delta=DELTA, sampling_rate=Q, noise_multiplier=SIGMA, prior_events=[pca]
    )
    k_alone = max_steps_within_budget(
        target_epsilon=target, target_delta=DELTA, sampling_rate=Q, noise_multiplier=SIGMA
    )
    assert 0 < k < k_alone
    model = _model(extra=EventLayer([pca]))
    _fit(model, [WithinLimit(target, DELTA, verbose=0)], epochs=50)
    assert _check_stopped_at_the_boundary(model, target, [pca]) == k


def test_within_limit_takes_no_step_when_the_budget_is_spent():
    model = _model()
    _fit(model, [WithinLimit(0.8, DELTA, verbose=0)], epochs=50)
    spent = _check_stopped_at_the_boundary(model, 0.8)
    limit = WithinLimit(0.8, DELTA, verbose=0)
    hist = _fit(model, [limit], epochs=3)
    assert limit.stopped and len(hist.history["loss"]) == 1
    assert int(model.optimizer.noised_steps.numpy()) == spent
    # The real train step is back: a larger budget trains again.
    _fit(model, [WithinLimit(1.0, DELTA, verbose=0)], epochs=50)
    assert _check_stopped_at_the_boundary(model, 1.0) > spent


def test_within_limit_with_steps_per_execution_stops_exactly():
    target = 0.5 * (_eps(23) + _eps(24))  # 23 steps fit: executions of 4 + 4 + 2 per epoch, then 3 of a 4
    model = _model()
    model.compile(optimizer=FakeDPOptimizer(SIGMA, Q, Q * N), loss="mse", steps_per_execution=4)
    _fit(model, [WithinLimit(target, DELTA, verbose=0)], epochs=50)
    assert _check_stopped_at_the_boundary(model, target) == 23
    assert int(model._steps_per_execution.numpy()) == 4  # put back after the cut call


def test_within_limit_validation():
    with pytest.raises(ValueError, match=r"target_epsilon must be in \(0, inf\]"):
        WithinLimit(0.0)


def test_within_limit_counts_a_real_dppca_layer_and_extra_events():
    from keras_dpsgd.preprocessing.pca import DPPCA

    pca = DPPCA(2, noise_multiplier=6.0)
    pca.adapt(X)
    outside = GaussianEvent(8.0, count=1, label="outside the model")
    prior = [outside] + list(pca.privacy_events)
    assert len(prior) == 2
    target = 1.6
    k = max_steps_within_budget(
        target_epsilon=target, target_delta=DELTA, sampling_rate=Q, noise_multiplier=SIGMA, prior_events=prior
    )
    assert 0 < k < 50
    model = keras.Sequential([keras.Input((3,)), pca, keras.layers.Dense(1)])
    model.compile(optimizer=FakeDPOptimizer(SIGMA, Q, Q * N), loss="mse")
    hist = _fit(
        model,
        [WithinLimit(target, DELTA, extra_events=[outside], verbose=0), PrivacyLogger(DELTA, extra_events=[outside])],
        epochs=50,
    )
    assert _check_stopped_at_the_boundary(model, target, prior) == k
    assert hist.history["epsilon"][-1] == pytest.approx(_eps(k, prior), rel=1e-12)


def test_shuffled_batches_are_reported_with_a_poisson_warning(caplog):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=FakeDPOptimizer(SIGMA), loss="mse")  # sampling_rate unknown
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(10).repeat()
    with pytest.raises(ValueError, match="sampling_rate is unknown"):  # no size known: refused before a step
        model.fit(data, epochs=1, steps_per_epoch=10, callbacks=[PrivacyLogger(DELTA)], verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 0
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        hist = _fit(model, [PrivacyLogger(DELTA, num_examples=N, batch_size=10)], epochs=2)
    # q = B/N = 10/200 = Q: the same ε as real Poisson lots, but flagged as an assumption, once.
    np.testing.assert_allclose(hist.history["epsilon"], [_eps(10), _eps(20)], rtol=1e-12)
    assert sum("ASSUMES POISSON" in r.getMessage() for r in caplog.records) <= 1


def test_callbacks_listed_after_the_logger_see_epsilon():
    seen = []
    probe = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    _fit(_model(), [PrivacyLogger(DELTA), probe], epochs=2)
    assert [log["epsilon"] for log in seen] == [_eps(10), _eps(20)]
    assert all(log["delta"] == DELTA for log in seen)


def test_epsilon_reaches_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    model = _model()
    _fit(model, [PrivacyLogger(DELTA), keras.callbacks.TensorBoard(str(tmp_path))], epochs=2)
    tags = set()
    for path in (tmp_path / "train").glob("events.out.tfevents.*"):
        for record in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(v.tag for v in record.summary.value)
    assert {"epoch_epsilon", "epoch_delta"} <= tags


def test_within_limit_replans_when_sigma_changes_mid_training():
    from keras_dpsgd.ledger import model_privacy_ledger

    model = _model()
    opt = model.optimizer

    def lower_sigma(batch, logs):
        if int(opt.noised_steps.numpy()) == 4:
            opt.effective_noise_multiplier = 1.2

    changer = keras.callbacks.LambdaCallback(on_train_batch_end=lower_sigma)
    _fit(model, [changer, WithinLimit(1.2, DELTA, verbose=0)], epochs=50)
    events = list(model_privacy_ledger(model).events)
    steps = int(opt.noised_steps.numpy())
    assert sum(e.count for e in events) == steps > 4
    assert events[0] == PoissonSampledGaussianEvent(Q, SIGMA, 3, "dp-sgd")  # step 4 is charged at sigma 1.2
    assert compute_epsilon(events, DELTA) <= 1.2
    assert compute_epsilon(events + [PoissonSampledGaussianEvent(Q, 1.2, 1)], DELTA) > 1.2


def test_within_limit_on_a_fresh_model_with_the_budget_already_spent():
    model = _model()
    spent = GaussianEvent(0.5, count=1, label="dp-pca")  # ε > 5 on its own
    hist = _fit(model, [WithinLimit(1.0, DELTA, extra_events=[spent], verbose=0)], epochs=3)
    assert int(model.optimizer.noised_steps.numpy()) == 0  # not a single step
    assert hist.epoch == [0]
