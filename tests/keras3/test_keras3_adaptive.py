"""Adaptive per-layer clipping on Keras 3: the bound update (closed form), the norm queries' noise,
the ledger's ε (steps and norm queries composed) and the .keras round trip."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import keras_dpsgd.keras3 as k3
from keras_dpsgd import accounting
from keras_dpsgd.ledger import assume_poisson, model_epsilon, model_privacy_ledger
from keras_dpsgd.tools import adaptive_clipping as ac

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32") * 3, (np.arange(n) % 2).astype("int64")


def _norms(model, x, y):
    """One example at a time: ‖g_i^v‖ of each example i and variable v."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(LOSS(y[i : i + 1], model(x[i : i + 1], training=True)))
        rows.append([float(tf.norm(g)) for g in tape.gradient(loss, model.trainable_variables)])
    return np.array(rows)


def _private(opt, seed=0):
    model = k3.make_private(_model(seed))
    model.compile(optimizer=opt, loss=LOSS)
    return model


@pytest.mark.parametrize("lot", [None, 5.0])
def test_bound_is_alpha_times_clipped_mean_norm_without_noise(lot):
    x, y = _data(8)
    bounds = np.array([0.3, 0.05, 0.2, 0.08])  # small: the β·C clip is active for some examples
    alpha, beta = 1.3, 2.0
    opt = k3.AdaptiveDPSGDOptimizer(
        list(bounds), 0.0, 0.0, alpha=alpha, beta=beta, learning_rate=0.1, expected_lot_size=lot, seed=3
    )
    model = _private(opt)
    clipped = False
    for _ in range(3):
        norms = _norms(model, x, y)
        expected = alpha * np.minimum(norms, beta * bounds[None, :]).sum(axis=0) / (lot or len(x))
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        np.testing.assert_allclose(opt.clip_bounds.numpy(), expected, rtol=1e-4)
        clipped |= bool(np.any(norms > beta * bounds[None, :]))
        bounds = expected
    assert clipped  # the norm query's β·C clip mattered
    assert int(opt.noised_steps.numpy()) == 3


def test_norm_query_noise_is_gaussian_with_scale_sigma_l2_beta_c():
    """z = (L·C_new/α − Σ min(‖g‖, βC)) / (σ_l2 β C) is N(0, 1) (lr = 0: gradients fixed)."""
    x, y = _data(16)
    sigma_l2, beta = 1.0, 2.0
    opt = k3.AdaptiveDPSGDOptimizer([1.0] * 4, 1.0, sigma_l2, beta=beta, learning_rate=0.0, min_clip_bound=1e-9, seed=7)
    model = _private(opt)
    norms = _norms(model, x, y)
    zs, prev = [], np.ones(4)
    for _ in range(8):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
        new = opt.clip_bounds.numpy()
        zs.extend((len(x) * new - np.minimum(norms, beta * prev[None, :]).sum(axis=0)) / (sigma_l2 * beta * prev))
        prev = new
    zs = np.array(zs)
    assert abs(zs.mean()) < 4 / math.sqrt(len(zs))
    assert 0.6 < zs.std() < 1.4
    assert stats.kstest(zs, "norm").pvalue > 1e-4


Q, SIGMA, SIGMA_L2, STEPS = 0.5, 1.2, 3.0, 4


@pytest.fixture(scope="module")
def trained():
    """One adaptive run (4 noised steps at q = 0.5) shared by the ledger and the .keras checks."""
    x, y = _data(8)
    opt = k3.AdaptiveDPSGDOptimizer(
        [1.0] * 4, SIGMA, SIGMA_L2, alpha=1.1, learning_rate=0.1, sampling_rate=Q, expected_lot_size=4.0
    )
    assume_poisson(opt)  # fixed batches that stand for Poisson lots at q
    model = _private(opt)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    return model, opt


def test_ledger_epsilon_is_the_composition_of_steps_and_norm_queries(trained):
    model, opt = trained
    assert int(opt.noised_steps.numpy()) == STEPS
    sigma_eff = (4 / SIGMA**2 + 4 / SIGMA_L2**2) ** -0.5
    assert opt.effective_noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)
    (event,) = model_privacy_ledger(model).events
    assert (event.sampling_rate, event.count) == (Q, STEPS)
    assert event.noise_multiplier == pytest.approx(sigma_eff, rel=1e-12)
    eps, _ = model_epsilon(model, target_delta=1e-5)
    composed = ac.adaptive_clipping_event(
        noise_multiplier=SIGMA, norm_noise_multiplier=SIGMA_L2, num_layers=4, sampling_rate=Q, steps=STEPS
    )
    assert eps == pytest.approx(accounting.compute_epsilon([composed], 1e-5), rel=1e-9)
    gradients_only = accounting.PoissonSampledGaussianEvent(Q, SIGMA / 2, count=STEPS)  # σ/√V, no norm queries
    assert accounting.compute_epsilon([gradients_only], 1e-5) < eps


def test_keras_file_keeps_the_bounds_and_settings(trained, tmp_path):
    model, opt = trained
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is k3.AdaptiveDPSGDOptimizer
    assert (loaded.optimizer.alpha, loaded.optimizer.norm_noise_multiplier) == (1.1, SIGMA_L2)
    np.testing.assert_allclose(loaded.optimizer.clip_bounds.numpy(), opt.clip_bounds.numpy())
    assert not np.allclose(opt.clip_bounds.numpy(), 1.0)  # the bounds moved: the file kept the new ones
    assert int(loaded.optimizer.noised_steps.numpy()) == STEPS
    assert loaded.optimizer.effective_noise_multiplier == opt.effective_noise_multiplier


def test_other_descent_rules_validation_logger_and_initial_bounds(tmp_path):
    adam_cls = k3.make_adaptive_optimizer(k3.DPAdamOptimizer)
    assert adam_cls is k3.make_adaptive_optimizer(k3.DPAdamOptimizer)
    assert adam_cls([1.0, 1.0], 1.0, 2.0).effective_noise_multiplier == pytest.approx((2 + 2 / 4) ** -0.5)
    with pytest.raises(ValueError, match="Keras 3 DP optimizer class"):
        k3.make_adaptive_optimizer(keras.optimizers.SGD)
    with pytest.raises(ValueError, match="clipping='normalize' has no bound"):
        k3.AdaptiveDPSGDOptimizer(None, 1.0, 1.0, clipping="normalize")
    with pytest.raises(ValueError, match="beta must be"):
        k3.AdaptiveDPSGDOptimizer([1.0], 1.0, 1.0, beta=-1.0)
    model = _model()
    bounds = k3.initial_clip_bounds(model, batch_size=6, seed=11)
    rng = np.random.default_rng(11)
    np.testing.assert_allclose(
        bounds, _norms(model, rng.random((6, 4), dtype=np.float32), rng.integers(0, 2, size=6)).mean(axis=0), rtol=1e-5
    )
    opt = k3.AdaptiveDPSGDOptimizer(bounds, 1.0, 5.0, learning_rate=0.1)
    model = _private(opt)
    logger = k3.ClipBoundsLogger(log_dir=str(tmp_path), update_freq=1)
    hist = model.fit(*_data(8), batch_size=4, epochs=2, verbose=0, callbacks=[logger])
    key = "clip_bound/" + model.trainable_variables[0].path
    assert hist.history[key][-1] == pytest.approx(float(opt.clip_bounds.numpy()[0]))
    assert list(tmp_path.glob("events.out.tfevents*"))


def test_release_noise_multipliers_list_gradient_groups_then_norm_queries():
    opt = k3.AdaptiveDPSGDOptimizer([1.0, 2.0, 3.0], [1.0, 2.0, 0.5], 2.5)
    assert opt.release_noise_multipliers == (1.0, 2.0, 0.5, 2.5, 2.5, 2.5)
    assert opt.effective_noise_multiplier == pytest.approx((1 + 1 / 4 + 4 + 3 / 2.5**2) ** -0.5, rel=1e-12)
