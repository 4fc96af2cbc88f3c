"""The ledger on JAX beyond the behaviour suite (test_jax_behaviour.py: ε = the accountant across save, load
and resume, accumulated lots): the noise key kept out of a file, the privacy callbacks, Poisson lots' q."""

import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import PoissonLots, PrivacyLogger, WithinLimit, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built, keras3_front

Q, SIGMA, DELTA = 0.25, 1.1, 1e-3
FRONT = keras3_front()


def _eps(steps, q=Q, sigma=SIGMA):
    return compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), DELTA)


def _trained(steps=3, **dp_kwargs):
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, sampling_rate=Q, **dp_kwargs)
    x, y = np.concatenate([x] * 2)[: 2 * steps], np.concatenate([y] * 2)[: 2 * steps]
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    return model, x, y


def test_keras_file_holds_no_noise_key(tmp_path):
    """The unseeded noise key and the non-finite count are never in the file; a load draws a fresh key."""
    model, x, y = _trained(3)
    key_before = np.array(model.optimizer._jax_key.numpy())
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    with h5py.File(tmp_path / "model.weights.h5") as f:
        saved = [np.asarray(f["optimizer/vars"][k]) for k in f["optimizer/vars"]]
    assert not any(s.dtype == np.uint32 and s.shape == (2,) and s.any() for s in saved)
    assert not np.array_equal(np.asarray(loaded.optimizer._jax_key.numpy()), key_before)


def test_privacy_logger_logs_the_ledger_epsilon():
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, sampling_rate=Q)
    x, y = np.concatenate([x] * 2)[:8], np.concatenate([y] * 2)[:8]
    history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[PrivacyLogger(DELTA)])
    assert history.history["epsilon"][0] == pytest.approx(_eps(4), rel=1e-9)
    assert history.history["epsilon"][1] == pytest.approx(_eps(8), rel=1e-9)


def test_within_limit_stops_before_the_budget():
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, sampling_rate=Q)
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


def test_poisson_lots_train_and_charge_their_q():
    model, x, y = built(FRONT, "dense")
    x, y = np.concatenate([x] * 4), np.concatenate([y] * 4)
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
