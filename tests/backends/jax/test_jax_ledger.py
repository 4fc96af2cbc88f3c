"""The ledger on JAX beyond the behaviour suite (test_jax_behaviour.py: ε = the accountant across save, load
and resume, accumulated lots): the noise key kept out of a file, the privacy callbacks (Poisson lots' q: test_jax_distribute.py)."""

import zipfile

import h5py
import keras
import numpy as np
import pytest

from keras_dpsgd import PrivacyLogger, WithinLimit, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built, keras3_front

Q, SIGMA, DELTA = 0.25, 1.1, 1e-3
FRONT = keras3_front()


def _eps(steps, q=Q, sigma=SIGMA):
    return compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), DELTA)


def _trained(steps=3, **dp_kwargs):
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(
        model,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        learning_rate=0.1,
        sampling_rate=Q,
        assume_poisson=True,
        **dp_kwargs,
    )
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


def test_privacy_logger_and_within_limit():
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, sampling_rate=Q, assume_poisson=True)
    target = (_eps(5) + _eps(6)) / 2  # 5 steps fit, the 6th would not
    x, y = np.concatenate([x] * 2)[:8], np.concatenate([y] * 2)[:8]
    callback = WithinLimit(target, DELTA, verbose=0)
    history = model.fit(x, y, batch_size=2, epochs=4, verbose=0, callbacks=[PrivacyLogger(DELTA), callback])
    assert history.history["epsilon"][0] == pytest.approx(_eps(4), rel=1e-9)  # the ledger's ε, logged
    assert callback.stopped
    assert int(model.optimizer.noised_steps.numpy()) == 5
    assert model_epsilon(model, target_delta=DELTA)[0] <= target
    # A fit with no budget left runs no step (the callback skips the call: JAX's train_function(state, it)).
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.noised_steps.numpy()) == 5
