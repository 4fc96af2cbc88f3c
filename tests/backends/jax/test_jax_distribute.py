"""keras.distribution.DataParallel on JAX (issue 29 item 4), on 2 host CPU devices (conftest's XLA_FLAGS).

The per-example part runs per device under jax.shard_map and the clipped sums are psum-ed; the noise
is drawn once per lot. With σ = 0 the 2-device step is the 1-device step (itself the one-example
loop's, test_jax_behaviour.py), flat and per layer, a CNN, Dense with Dropout; seeded, Poisson lots with
padding rows give the 1-device update too; the noise std is σC/L (not √2·σC/L); ε is the accountant's for
one event per lot.
"""

import jax
import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import PoissonLots, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built, keras3_front

FRONT = keras3_front()
LR = 0.5


@pytest.fixture(scope="module", autouse=True)
def two_devices():
    assert len(jax.devices()) == 2, "the JAX suite runs with XLA_FLAGS=--xla_force_host_platform_device_count=2"


def _run(distributed, build, fit, loss=None, **dp_kwargs):
    """(weights before, after, model): `build()` then `fit(model)`, under DataParallel on 2 devices or not."""
    scope = keras.distribution.DataParallel().scope() if distributed else _nothing()
    with scope:
        model, x, y = build()
        FRONT.compiled(model, learning_rate=LR, **dp_kwargs)
        if loss is not None:
            model.compile(optimizer=model.optimizer, loss=loss)
        before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        fit(model, x, y)
        after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    return before, after, model


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _dropout():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dropout(0.5), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, size=8)


BUILDS = {
    "dense": lambda: built(FRONT, "dense"),  # Poisson lots
    "conv2d": lambda: _even(built(FRONT, "conv2d")),
    "dropout": _dropout,
}


def _even(model_x_y):
    model, x, y = model_x_y  # 5 examples: 4 (the batch is split over 2 devices)
    return model, x[:4], y[:4]


def _one_batch(model, x, y):
    model.fit(x[: len(x) // 2 * 2], y[: len(y) // 2 * 2], batch_size=len(x) // 2 * 2, shuffle=False, verbose=0)


@pytest.mark.parametrize(
    "name, clip",
    [("conv2d", 0.3), ("conv2d", "per_layer"), ("dropout", 0.2)],
)
def test_two_device_step_equals_one_device_step(name, clip):
    """σ = 0: the DataParallel step on 2 devices is the 1-device step (before issue 29: GSPMD gave wrong
    per-example conv-kernel gradients; a shard_map without a varying cast gives each example its device
    group's summed gradient)."""
    model, _, _ = BUILDS[name]()
    if clip == "per_layer":
        clip = [float(c) for c in np.random.default_rng(5).uniform(0.05, 0.5, size=len(model.trainable_variables))]
    b1, a1, _ = _run(False, BUILDS[name], _one_batch, l2_norm_clip=clip)
    b2, a2, m2 = _run(True, BUILDS[name], _one_batch, l2_norm_clip=clip)
    assert int(m2.optimizer.noised_steps.numpy()) == 1
    for u, v, w, z in zip(b1, a1, b2, a2):
        np.testing.assert_array_equal(u, w)
        assert np.abs(u - v).max() > 1e-4  # the step moved the weights
        # The clip factors may differ by ~1e-5 (relative) where the two steps bound a norm by different certified
        # forms (closed form or materialized: keras_dpsgd.dp.rounding); an entry where examples cancel moves
        # by that much of the update's scale.
        np.testing.assert_allclose(w - z, u - v, rtol=1e-5, atol=2e-5 * np.abs(u - v).max())


def test_noise_std_is_sigma_c_over_lot_on_two_devices():
    """One draw of N(0, (σC/L)²) per lot on the psum-ed sum: not one per device (std √2·σC/L)."""

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])
        x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
        return model, x, np.asarray(model.predict(x, verbose=0))

    def fit(model, x, y):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    mse = keras.losses.MeanSquaredError(reduction="none")
    before, after, model = _run(True, build, fit, loss=mse, l2_norm_clip=0.7, noise_multiplier=1.3, seed=None)
    noise = (before[0] - after[0]).ravel() / LR
    expected = 1.3 * 0.7 / 8
    assert abs(noise.std() / expected - 1.0) < 0.03  # 10,000 coordinates: P(miss) < 1e-4
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_poisson_lots_with_padding_rows_on_two_devices():
    """Lots of odd realized size padded to batches of 4 (2 per device): padding rows have factor 0 on
    whichever device holds them. Seeded noise (a function of seed, step, tensor): the 2-device update is the
    1-device one, noise included (one draw per lot, not one per device), and ε is the accountant's for one
    event per lot."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(40, 5)).astype("float32"), rng.integers(0, 3, size=40)
    lots = PoissonLots(x, y, expected_lot_size=5, physical_batch_size=4, seed=3)
    k = lots.gradient_accumulation_steps
    real_rows = [int(np.sum(w != 0)) for _, _, w in lots.dataset().take(2 * k).as_numpy_iterator()]
    lot_sizes = [sum(real_rows[:k]), sum(real_rows[k:])]
    assert any(size % 2 for size in lot_sizes), lot_sizes  # not divisible by the device count

    def fit(model, _x, _y):
        lots = PoissonLots(x, y, expected_lot_size=5, physical_batch_size=4, seed=3)  # the same lots
        lots.configure(model.optimizer)
        model.fit(lots.dataset(), steps_per_epoch=2 * k, verbose=0)

    dp = dict(l2_norm_clip=0.3, noise_multiplier=1.1, seed=4, gradient_accumulation_steps=k)
    b1, a1, m1 = _run(False, BUILDS["dense"], fit, **dp)
    b2, a2, m2 = _run(True, BUILDS["dense"], fit, **dp)
    assert int(m2.optimizer.noised_steps.numpy()) == int(m1.optimizer.noised_steps.numpy()) == 2
    for u, v, w, z in zip(b1, a1, b2, a2):
        np.testing.assert_array_equal(u, w)
        np.testing.assert_allclose(w - z, u - v, rtol=1e-5, atol=1e-6)
    eps = compute_epsilon(PoissonSampledGaussianEvent(lots.sampling_rate, 1.1, 2), 1e-3)
    assert model_epsilon(m2, target_delta=1e-3)[0] == pytest.approx(eps, rel=1e-9)


def test_model_parallel_is_refused_by_name():
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], keras.distribution.list_devices())
    layouts = keras.distribution.LayoutMap(mesh)
    with keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch").scope():
        model, x, y = built(FRONT, "dense")
        FRONT.compiled(model, l2_norm_clip=1.0)
        with pytest.raises(ValueError, match="keras.distribution.ModelParallel .*is not supported on the JAX"):
            model.fit(x[:4], y[:4], batch_size=4, verbose=0)


def test_adaptive_clipping_under_data_parallel_is_refused_by_name():
    """Its norm queries are not split over the devices yet: refused before any weight changes."""
    with keras.distribution.DataParallel().scope():
        model, x, y = built(FRONT, "dense")
        FRONT.compiled(model, k3.AdaptiveDPSGDOptimizer, l2_norm_clip=1.0, norm_noise_multiplier=1.0)
        before = [np.array(v.numpy()) for v in model.trainable_variables]
        with pytest.raises(ValueError, match="adaptive clipping .*under keras.distribution.DataParallel"):
            model.fit(x[:4], y[:4], batch_size=4, verbose=0)
        for b, v in zip(before, model.trainable_variables):
            np.testing.assert_array_equal(b, np.asarray(v.numpy()))
