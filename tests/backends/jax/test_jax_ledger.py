"""The ledger on JAX: ε equal to the accountant, .keras save/load and resume, the privacy callbacks, lots."""

import zipfile

import h5py
import keras
import numpy as np
import pytest
from _jax_helpers import LR, built, compiled, loop_clipped_mean

import keras_dpsgd
import keras_dpsgd.keras3 as k3
from keras_dpsgd import PoissonLots, PrivacyLogger, WithinLimit, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

Q, SIGMA, DELTA = 0.25, 1.1, 1e-3


def _eps(steps, q=Q, sigma=SIGMA):
    return compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), DELTA)


def _trained(steps=3, **dp_kwargs):
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, sampling_rate=Q, **dp_kwargs)
    x, y = np.concatenate([x] * 2)[: 2 * steps], np.concatenate([y] * 2)[: 2 * steps]
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    return model, x, y


def test_ledger_epsilon_equals_the_accountant():
    model, _, _ = _trained(3)
    eps, delta = model_epsilon(model, target_delta=DELTA)
    assert delta == DELTA
    assert eps == pytest.approx(_eps(3), rel=1e-9)


def test_keras_file_keeps_the_ledger_and_resumes(tmp_path):
    """Saved after 3 lots, loaded, trained 3 more: ε of 6 lots; the file holds no noise key."""
    model, x, y = _trained(3)
    key_before = np.array(model.optimizer._jax_key.numpy())
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.noised_steps.numpy()) == 3
    assert model_epsilon(loaded, target_delta=DELTA)[0] == pytest.approx(_eps(3), rel=1e-9)
    # The unseeded noise key and the non-finite count are never in the file; a load draws a fresh key.
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    with h5py.File(tmp_path / "model.weights.h5") as f:
        saved = [np.asarray(f["optimizer/vars"][k]) for k in f["optimizer/vars"]]
    assert not any(s.dtype == np.uint32 and s.shape == (2,) and s.any() for s in saved)
    assert not np.array_equal(np.asarray(loaded.optimizer._jax_key.numpy()), key_before)
    k3.make_private(loaded)
    loaded.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert int(loaded.optimizer.noised_steps.numpy()) == 6
    assert model_epsilon(loaded, target_delta=DELTA)[0] == pytest.approx(_eps(6), rel=1e-9)


def test_privacy_logger_logs_the_ledger_epsilon():
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, sampling_rate=Q)
    x, y = np.concatenate([x] * 2)[:8], np.concatenate([y] * 2)[:8]
    history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[PrivacyLogger(DELTA)])
    assert history.history["epsilon"][0] == pytest.approx(_eps(4), rel=1e-9)
    assert history.history["epsilon"][1] == pytest.approx(_eps(8), rel=1e-9)


def test_within_limit_stops_before_the_budget():
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, sampling_rate=Q)
    target = (_eps(5) + _eps(6)) / 2  # 5 steps fit, the 6th would not
    x, y = np.concatenate([x] * 2)[:8], np.concatenate([y] * 2)[:8]
    callback = WithinLimit(target, DELTA, verbose=0)
    model.fit(x, y, batch_size=2, epochs=4, verbose=0, callbacks=[callback])
    assert callback.stopped
    assert int(model.optimizer.noised_steps.numpy()) == 5
    assert model_epsilon(model, target_delta=DELTA)[0] <= target
    # A fit with no budget left runs no step (the callback skips the call: JAX's train_function(state, it)).
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.noised_steps.numpy()) == 5


# ------------------------------------------------------------ lots
def _accumulated(k, batch, **dp_kwargs):
    model, x, y = built("dense")
    x = np.concatenate([x] * 3)[: k * batch]
    y = np.concatenate([y] * 3)[: k * batch]
    return compiled(model, gradient_accumulation_steps=k, **dp_kwargs), x, y


def test_accumulated_lot_equals_one_big_batch():
    """k = 3 batches of 4: one release, the clipped mean of the 12 examples (σ = 0)."""
    model, x, y = _accumulated(3, 4, l2_norm_clip=0.3)
    expected = loop_clipped_mean(model, x, y, 0.3)
    before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert int(model.optimizer.noised_steps.numpy()) == 1
    assert int(model.optimizer.iterations.numpy()) == 1


def test_accumulated_lot_noise_is_drawn_once():
    """k = 2 batches, L = 8: the update is N(0, (σC/L)²), not k separately noised batches."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])
    x = np.random.default_rng(1).normal(size=(8, 40)).astype("float32")
    y = np.asarray(model.predict(x, verbose=0))
    opt = k3.DPSGDOptimizer(
        l2_norm_clip=0.7, noise_multiplier=1.3, learning_rate=1.0, expected_lot_size=8.0, gradient_accumulation_steps=2
    )
    k3.make_private(model)
    model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError(reduction="none"))
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    noise = (before - np.asarray(model.trainable_variables[0].numpy())).ravel()
    assert abs(noise.std() / (1.3 * 0.7 / 8.0) - 1.0) < 0.03
    assert int(opt.noised_steps.numpy()) == 1


def test_partial_lots_are_discarded_and_the_ledger_counts_lots():
    """5 batches per epoch, k = 2: 2 lots per epoch, the odd batch discarded at each epoch's end."""
    model, x, y = _accumulated(2, 4, l2_norm_clip=1.0, noise_multiplier=1.1)
    x, y = np.concatenate([x] * 3)[:20], np.concatenate([y] * 3)[:20]
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    opt = model.optimizer
    assert int(opt.noised_steps.numpy()) == 4
    assert (opt.discarded_lots, opt.discarded_batches) == (2, 2)
    assert int(opt._accum_batches.numpy()) == 0


def test_poisson_lots_train_and_charge_their_q():
    model, x, y = built("dense")
    x, y = np.concatenate([x] * 10), np.concatenate([y] * 10)
    lots = PoissonLots(x, y, expected_lot_size=8, physical_batch_size=4, seed=0)
    opt = lots.configure(
        k3.DPSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=SIGMA, gradient_accumulation_steps=lots.gradient_accumulation_steps
        )
    )
    k3.make_private(model)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    steps = int(opt.noised_steps.numpy())
    assert steps == lots.lots_per_epoch
    eps = compute_epsilon(PoissonSampledGaussianEvent(lots.sampling_rate, SIGMA, steps), DELTA)
    assert model_epsilon(model, target_delta=DELTA)[0] == pytest.approx(eps, rel=1e-9)
    assert keras_dpsgd.__name__ == "keras_dpsgd"
