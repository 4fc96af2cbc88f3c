"""Tests of the model privacy ledger: events, segments, fallbacks, checkpoints."""

import logging

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _ledger_helpers import EventLayer, FakeDPOptimizer

from keras_dpsgd import ledger as L
from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    compute_epsilon,
)


def _model(optimizer, extra_layer=None):
    inner = keras.Sequential([extra_layer or keras.layers.Lambda(lambda t: t), keras.layers.Dense(2)])
    model = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _train(model, steps, batch=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 3)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=batch, epochs=1, verbose=0, shuffle=False)


def test_ledger_has_optimizer_steps_and_nested_layer_events():
    pca = GaussianEvent(4.0, count=1, label="dp-pca")
    model = _model(FakeDPOptimizer(1.3, sampling_rate=0.05), EventLayer([pca]))
    _train(model, 7)
    ledger = L.model_privacy_ledger(model)
    assert ledger.events == (pca, PoissonSampledGaussianEvent(0.05, 1.3, count=7, label="dp-sgd"))


def test_untrained_model_has_an_empty_dp_sgd_part():
    model = _model(FakeDPOptimizer(1.0, sampling_rate=0.1))
    assert L.model_privacy_ledger(model).events == ()
    assert L.model_epsilon(model, target_delta=1e-5) == (0.0, 1e-5)


def test_segments_when_sigma_changes_between_reads():
    opt = FakeDPOptimizer(2.0, sampling_rate=0.1)
    model = _model(opt)
    _train(model, 3)
    L.model_privacy_ledger(model)  # read under sigma = 2
    opt.effective_noise_multiplier = 1.0
    L.model_privacy_ledger(model)  # read right after the change: no ambiguity
    _train(model, 2)
    events = L.model_privacy_ledger(model).events
    assert events == (
        PoissonSampledGaussianEvent(0.1, 2.0, 3, "dp-sgd"),
        PoissonSampledGaussianEvent(0.1, 1.0, 2, "dp-sgd"),
    )


def test_unobserved_change_is_charged_at_the_worst_case():
    opt = FakeDPOptimizer(2.0, sampling_rate=0.1)
    model = _model(opt)
    _train(model, 3)
    L.model_privacy_ledger(model)
    _train(model, 2)  # taken with sigma = 2, but the ledger did not look
    opt.effective_noise_multiplier = 3.0
    opt.sampling_rate = 0.2
    _train(model, 4)
    events = L.model_privacy_ledger(model).events
    assert [e.count for e in events] == [3, 6]
    assert (events[1].sampling_rate, events[1].noise_multiplier) == (0.2, 2.0)  # larger q, smaller sigma
    truth = [PoissonSampledGaussianEvent(0.1, 2.0, 5), PoissonSampledGaussianEvent(0.2, 3.0, 4)]
    assert compute_epsilon(events, 1e-5) >= compute_epsilon(truth, 1e-5)


def test_unknown_sampling_rate_assumes_poisson_and_says_so_once(caplog):
    model = _model(FakeDPOptimizer(1.0))
    _train(model, 2)
    with pytest.raises(ValueError, match="sampling_rate is unknown"):
        L.model_privacy_ledger(model)
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        a = L.model_privacy_ledger(model, num_examples=1000, batch_size=37)
        b = L.model_privacy_ledger(model, num_examples=1000, batch_size=37)
    assert a == b and a.events[0].sampling_rate == pytest.approx(0.037)
    warnings = [r for r in caplog.records if "ASSUMES POISSON" in r.getMessage()]
    assert len(warnings) == 1 and "PoissonLots" in warnings[0].getMessage()


def test_non_private_optimizer_reports_infinite_epsilon():
    model = _model(keras.optimizers.SGD(0.01))
    _train(model, 2)
    events = L.model_privacy_ledger(model).events
    assert events == (GaussianEvent(0.0, count=2, label="non-private training"),)
    assert L.model_epsilon(model, target_delta=1e-5)[0] == np.inf


def test_default_delta_is_announced_and_large_delta_refused(caplog):
    opt = FakeDPOptimizer(1.0, sampling_rate=0.01, expected_lot_size=5.0)  # N = 500
    model = _model(opt)
    _train(model, 1)
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        _, delta = L.model_epsilon(model)
    assert delta == pytest.approx(1 / 5000)  # min(1/N^1.1, 1/(10·N))
    assert any("delta = min(1/N^1.1, 1/(10·N))" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="delta must be <"):
        L.model_epsilon(model, target_delta=1 / 500)
    with pytest.raises(ValueError, match="num_examples"):
        L.resolve_delta(None, None)


def test_steps_remaining_is_the_exact_boundary():
    prior = PrivacyLedger([GaussianEvent(10.0, count=2, label="dp-pca")])
    q, sigma, delta, target = 0.02, 0.9, 1e-5, 2.0
    k = L.steps_remaining(prior, target_epsilon=target, target_delta=delta, sampling_rate=q, noise_multiplier=sigma)
    assert k > 0
    assert compute_epsilon(list(prior) + [PoissonSampledGaussianEvent(q, sigma, k)], delta) <= target
    assert compute_epsilon(list(prior) + [PoissonSampledGaussianEvent(q, sigma, k + 1)], delta) > target
    with pytest.raises(ValueError, match="sampling_rate and noise_multiplier"):
        L.steps_remaining(prior, target_epsilon=1.0, target_delta=delta)


def test_steps_remaining_of_a_model_counts_its_ledger():
    pca = GaussianEvent(3.0, count=1, label="dp-pca")
    model = _model(FakeDPOptimizer(1.1, sampling_rate=0.05), EventLayer([pca]))
    _train(model, 5)
    k = L.steps_remaining(model, target_epsilon=2.0, target_delta=1e-5)
    prior = [pca, PoissonSampledGaussianEvent(0.05, 1.1, 5)]
    assert compute_epsilon(prior + [PoissonSampledGaussianEvent(0.05, 1.1, k)], 1e-5) <= 2.0
    assert compute_epsilon(prior + [PoissonSampledGaussianEvent(0.05, 1.1, k + 1)], 1e-5) > 2.0


def _two_segments(sigma, *, steps, read_before=False):
    """A model whose ledger holds 3 steps at σ = 2, then `steps` at `sigma` (its σ changed mid-run).

    `read_before`: the ledger is read right after the change too (a segment closed with no step in it).
    """
    opt = FakeDPOptimizer(2.0, sampling_rate=0.1)
    model = _model(opt)
    _train(model, 3)
    L.model_privacy_ledger(model)
    opt.effective_noise_multiplier = sigma
    if read_before:
        L.model_privacy_ledger(model)
    _train(model, steps)
    return model, L.model_privacy_ledger(model)


def test_checkpoint_restores_steps_and_segments(tmp_path):
    model, saved = _two_segments(1.0, steps=2)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    opt2 = FakeDPOptimizer(1.0, sampling_rate=0.1)
    model2 = _model(opt2)
    _train(model2, 1)  # creates the slots; restored over below
    tf.train.Checkpoint(model=model2).restore(path)
    assert L.model_privacy_ledger(model2) == saved
    _train(model2, 4)
    events = L.model_privacy_ledger(model2).events
    assert sum(e.count for e in events) == 3 + 2 + 4


def test_restore_before_the_state_is_attached_is_deferred(tmp_path):
    model, saved = _two_segments(1.5, steps=1, read_before=True)
    model.save_weights(str(tmp_path / "w"))

    model2 = _model(FakeDPOptimizer(1.5, sampling_rate=0.1))
    model2.load_weights(str(tmp_path / "w"))
    assert L.model_privacy_ledger(model2) == saved


def test_a_new_optimizer_adds_to_the_history():
    model = _model(FakeDPOptimizer(2.0, sampling_rate=0.1))
    _train(model, 4)
    L.model_privacy_ledger(model)
    model.compile(optimizer=FakeDPOptimizer(1.0, sampling_rate=0.2), loss="mse")
    _train(model, 4)  # the new counter reaches the old one: still new steps
    events = L.model_privacy_ledger(model).events
    assert events[0] == PoissonSampledGaussianEvent(0.1, 2.0, 4, "dp-sgd")
    # The new steps were not observed at the change: charged at the worst of both (here the new values).
    assert (events[1].sampling_rate, events[1].noise_multiplier, events[1].count) == (0.2, 1.0, 4)
    assert len(events) == 2


def test_state_attached_after_a_first_checkpoint_is_still_saved(tmp_path):
    opt = FakeDPOptimizer(1.0, sampling_rate=0.1)
    model = _model(opt)
    _train(model, 2)
    ckpt = tf.train.Checkpoint(model=model)
    ckpt.save(str(tmp_path / "before"))  # the optimizer caches its checkpoint children here
    L.model_privacy_ledger(model)  # attaches the state holders
    path = ckpt.save(str(tmp_path / "after"))
    keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    assert any(k.startswith("model/optimizer/_dpsgd_ledger_state/") for k in keys)
    assert any(k.startswith("model/_dpsgd_ledger_state/") for k in keys)
