"""DP optimizers: noise statistics, seeds, configuration, saving, end-to-end training."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd
from keras_dpsgd.tf_keras import DPAdamOptimizer, DPSGDOptimizer, make_dp_optimizer
from keras_dpsgd.backends.tensorflow import per_example_backend as _per_example


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


class _ZeroGradientLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return 0.0 * tf.reduce_sum(y_pred, axis=-1)


def _noise_of_one_step(clip, sigma, batch=4, seed=None):
    """lr=1, zero gradient: the update is -(noise)/B with noise ~ N(0, σ²C²)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(50, input_shape=(40,))])
    w0 = [w.numpy() for w in model.trainable_variables]
    opt = DPSGDOptimizer(clip, sigma, learning_rate=1.0, seed=seed)
    model.compile(optimizer=opt, loss=_ZeroGradientLoss(reduction="none"))
    model.fit(np.ones((batch, 40), "float32"), np.zeros(batch), batch_size=batch, verbose=0)
    return [(a - w.numpy()) * batch for a, w in zip(w0, model.trainable_variables)], opt


def _check_std(samples, expected):
    n = samples.size
    # Sample std of n Gaussians: relative standard error ≈ 1/sqrt(2n); 6 standard errors.
    assert abs(samples.std() / expected - 1.0) < 6.0 / np.sqrt(2 * n)
    assert abs(samples.mean()) < 6.0 * expected / np.sqrt(n)


def test_noise_std_flat():
    noise, opt = _noise_of_one_step(0.7, 1.3)
    _check_std(np.concatenate([n.ravel() for n in noise]), 1.3 * 0.7)
    assert opt.effective_noise_multiplier == 1.3
    assert int(opt.noised_steps.numpy()) == 1


def test_noise_std_per_layer():
    noise, opt = _noise_of_one_step([0.5, 4.0], 2.0)
    _check_std(noise[0].ravel(), 2.0 * 0.5)
    _check_std(noise[1].ravel(), 2.0 * 4.0)
    assert opt.effective_noise_multiplier == pytest.approx(2.0 / np.sqrt(2))


@pytest.mark.parametrize("seed", [None, 7])
def test_noise_is_fresh_every_step_and_variable(seed):
    """30 fit steps with zero gradients: the noise of every (step, variable) is an independent draw."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(50, input_shape=(40,))])
    opt = DPSGDOptimizer(1.0, 1.0, learning_rate=1.0, seed=seed)
    model.compile(optimizer=opt, loss=_ZeroGradientLoss(reduction="none"))
    snapshots = [np.concatenate([w.numpy().ravel() for w in model.trainable_variables])]
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_: snapshots.append(
            np.concatenate([w.numpy().ravel() for w in model.trainable_variables])
        )
    )
    model.fit(np.ones((120, 40), "float32"), np.zeros(120), batch_size=4, shuffle=False, verbose=0, callbacks=[record])
    noise = -np.diff(np.array(snapshots), axis=0) * 4  # [30 steps, 2050]: N(0, 1) each
    assert noise.shape == (30, 2050)
    _check_std(noise, 1.0)
    kernel, bias = noise[:, :2000], noise[:, 2000:]
    corr = np.corrcoef(kernel)[np.triu_indices(30, 1)]  # 435 pairs of steps
    assert np.abs(corr).max() < 5.0 / np.sqrt(2000)
    # The bias is not a copy of (part of) the kernel's draw, in any step.
    cross = [abs(np.corrcoef(bias[t], kernel[t, :50])[0, 1]) for t in range(30)]
    assert max(cross) < 5.0 / np.sqrt(50)


def test_effective_noise_multiplier_per_variable_sigmas():
    opt = DPSGDOptimizer([1.0, 1.0, 1.0], [1.0, 2.0, 2.0])
    assert opt.effective_noise_multiplier == pytest.approx((1 + 0.25 + 0.25) ** -0.5)
    assert DPSGDOptimizer([1.0, 1.0], [0.0, 3.0]).effective_noise_multiplier == 0.0


def _noise_only(seed, steps=1):
    """The sanitized gradient of a zero per-example loss (a traced step): pure noise."""
    variable = tf.Variable(tf.zeros([30]))
    opt = DPSGDOptimizer(1.0, 1.0, seed=seed)

    @tf.function(autograph=False)  # straight-line code; autograph's conversion of the library is most of a trace
    def step(x):
        with tf.GradientTape() as tape:
            loss = x * tf.reduce_sum(variable)
        ((grad, _),) = opt.compute_gradients(loss, [variable], tape)
        return grad

    for _ in range(steps):
        grad = step(tf.zeros([3]))
    return grad.numpy()


def test_seed_reproducible_and_none_is_not():
    np.testing.assert_array_equal(_noise_only(42), _noise_only(42))
    assert not np.allclose(_noise_only(42), _noise_only(43))
    # Each noised step draws fresh noise from the seed.
    assert not np.allclose(_noise_only(42), _noise_only(42, steps=2))
    assert not np.allclose(_noise_only(None), _noise_only(None))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"l2_norm_clip": 0.0, "noise_multiplier": 1.0}, "l2_norm_clip must be a finite number > 0"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": -1.0}, "noise_multiplier must be a finite number >= 0"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": [1.0]}, "only with a list l2_norm_clip"),
        ({"l2_norm_clip": {"a": 1.0}, "noise_multiplier": [1.0]}, "only with a list l2_norm_clip"),
        ({"l2_norm_clip": [1.0, 2.0], "noise_multiplier": [1.0]}, "one entry per clip bound"),
        (
            {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "gradient_accumulation_steps": 0},
            "gradient_accumulation_steps",
        ),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "expected_lot_size": -2}, "expected_lot_size"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "sampling_rate": 1.5}, "sampling_rate must be in"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "seed": 1.5}, "seed must be"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "per_example_backend": "x"}, "per_example_backend"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSGDOptimizer(**kwargs)


def test_settable_attributes():
    opt = DPSGDOptimizer(1.0, 1.0)
    opt.expected_lot_size = 128
    opt.sampling_rate = 0.01
    assert (opt.expected_lot_size, opt.sampling_rate) == (128.0, 0.01)
    with pytest.raises(ValueError, match="sampling_rate"):
        opt.sampling_rate = 0.0


@pytest.mark.parametrize(
    "opt",
    [
        lambda: DPSGDOptimizer(1.5, 0.9, learning_rate=0.2, momentum=0.5, nesterov=True, seed=7),
        lambda: DPSGDOptimizer(
            [1.0, 2.0], [1.0, 3.0], gradient_accumulation_steps=4, expected_lot_size=64, sampling_rate=0.1
        ),
        lambda: DPSGDOptimizer({"dense/kernel": 1.0, "dense/bias": 0.5}, 1.1),
        lambda: DPAdamOptimizer(1.0, 1.1, learning_rate=0.003, beta_1=0.8),
    ],
)
def test_config_round_trip(opt):
    opt = opt()
    config = opt.get_config()
    restored = type(opt).from_config(config)
    assert restored.get_config() == config
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt), use_legacy_optimizer=False)
    assert type(again) is type(opt) and again.get_config() == config
    assert not any("generator" in key or "state" in key for key in config)


def test_make_dp_optimizer():
    assert make_dp_optimizer(keras.optimizers.Adam) is DPAdamOptimizer
    assert make_dp_optimizer(keras.optimizers.SGD) is DPSGDOptimizer
    rms = make_dp_optimizer(keras.optimizers.RMSprop)
    opt = rms(1.0, 0.5, learning_rate=0.01, rho=0.8)
    assert isinstance(opt, keras.optimizers.RMSprop) and opt.rho == 0.8
    assert type(opt).__name__ == "DPRMSpropOptimizer"
    with pytest.raises(ValueError, match="legacy"):
        make_dp_optimizer(keras.optimizers.legacy.SGD)


def test_resolve_backend():
    assert isinstance(_per_example.resolve_backend("reference"), _per_example.ReferenceBackend)
    with pytest.raises(ValueError, match="per_example_backend"):
        _per_example.resolve_backend("nope")


def _trained_model(x, y, **opt_kwargs):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.layers.Dense(5, input_shape=(4,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=DPSGDOptimizer(1.0, 0.5, learning_rate=0.1, momentum=0.9, seed=3, **opt_kwargs), loss=_loss()
    )
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("fmt", ["model.keras", "model.h5"])
def test_save_load_keeps_optimizer_state_and_trains(tmp_path, fmt):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8)
    model = _trained_model(x, y, gradient_accumulation_steps=2)
    path = os.path.join(tmp_path, fmt)
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, DPSGDOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.noised_steps.numpy()) == 1
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.noised_steps.numpy()) == 2
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_savedmodel_loads_and_trains(tmp_path):
    """tf_keras's SavedModel format restores the config, not optimizer state."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8)
    model = _trained_model(x, y)
    path = os.path.join(tmp_path, "saved")
    model.save(path, save_format="tf")
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, DPSGDOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    before = loaded.trainable_variables[0].numpy()
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not np.allclose(before, loaded.trainable_variables[0].numpy())


def test_checkpoint_tracks_counters(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, 8)
    model = _trained_model(x, y)
    path = tf.train.Checkpoint(model=model).save(os.path.join(tmp_path, "ckpt"))
    fresh = _trained_model(x[:4], y[:4])
    fresh.optimizer.noised_steps.assign(0)
    tf.train.Checkpoint(model=fresh).restore(path)
    assert int(fresh.optimizer.noised_steps.numpy()) == 2
    np.testing.assert_array_equal(fresh.optimizer.clip_bounds.numpy(), model.optimizer.clip_bounds.numpy())


def test_digits_trains_with_dp():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(64,)), keras.layers.Dense(10)])
    model.compile(
        optimizer=DPSGDOptimizer(1.0, 1.0, learning_rate=0.5, momentum=0.5), loss=_loss(), metrics=["accuracy"]
    )
    model.fit(x[:1400], y[:1400], batch_size=64, epochs=8, verbose=0)
    _, accuracy = model.evaluate(x[1400:], y[1400:], verbose=0)
    assert accuracy > 0.8
    assert int(model.optimizer.noised_steps.numpy()) == 8 * 22


def test_public_names():
    for name in ("DPSGDOptimizer", "DPAdamOptimizer", "make_dp_optimizer"):
        assert name in keras_dpsgd.__all__ and getattr(keras_dpsgd, name) is not None
