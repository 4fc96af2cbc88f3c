"""The private step on JAX: exact clipped steps against a one-example loop, the noise, non-finite examples.

The oracle computes each example's gradient alone (jax.grad on a batch of one, no vmap) and clips it
in numpy; σ = 0 makes the step exact.
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from _jax_helpers import assert_step, built, compiled, loop_clipped_mean

import keras_dpsgd.keras3 as k3
from keras_dpsgd.backends.jax import _noise


def test_backend_is_jax():
    assert keras.backend.backend() == "jax"


def test_make_private_trains_on_jax():
    """Before issue 29 make_private refused the JAX backend (and earlier the step failed with a TypeError)."""
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=1.0)
    history = model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(model.optimizer.noised_steps.numpy()) == 1


@pytest.mark.parametrize("name", ["dense", "conv2d", "lstm", "transformer", "subclassed"])
def test_flat_clipped_step_matches_loop(name):
    model, x, y = built(name)
    compiled(model, l2_norm_clip=0.3)
    assert_step(model, x, y, loop_clipped_mean(model, x, y, 0.3))


@pytest.mark.parametrize("name", ["conv2d"])
def test_per_layer_clipped_step_matches_loop(name):
    model, x, y = built(name)
    clip = [float(c) for c in np.random.default_rng(5).uniform(0.05, 0.5, size=len(model.trainable_variables))]
    compiled(model, l2_norm_clip=clip)
    assert_step(model, x, y, loop_clipped_mean(model, x, y, clip, per_layer=True))


def test_batch_size_one():
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=0.2)
    assert_step(model, x[:1], y[:1], loop_clipped_mean(model, x[:1], y[:1], 0.2))


def test_nonfinite_example_contributes_exactly_zero():
    """An example whose gradient is NaN is zeroed (factor 0, NaN not propagated) and counted."""
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=0.3)
    x = x.copy()
    x[2, 0] = np.nan
    keep = np.arange(len(x)) != 2
    expected = [g * (keep.sum() / len(x)) for g in loop_clipped_mean(model, x[keep], y[keep], 0.3)]
    assert_step(model, x, y, expected)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_weight_regularizer_gradient_is_added_unclipped():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5))])
    # A reduced compiled loss (the step takes it unreduced): Keras's own build of an unreduced loss plus
    # model.losses fails on JAX (ops.sum of a [B] and a scalar), with or without DP.
    compiled(model, l2_norm_clip=0.1, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, size=6)
    expected = loop_clipped_mean(model, x, y, 0.1)
    expected[0] = expected[0] + 2 * 0.5 * model.trainable_variables[0].numpy()
    assert_step(model, x, y, expected)


def test_per_example_normalization():
    """clipping='normalize': each gradient scaled by 1/(||g|| + γ), sensitivity 1."""
    model, x, y = built("dense")
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    from _jax_helpers import example_grads

    grads = example_grads(model, x, y)
    expected = [np.zeros(v.shape) for v in model.trainable_variables]
    for g in grads:
        norm = np.sqrt(sum(np.sum(a**2) for a in g))
        expected = [e + a / (norm + 0.05) / len(x) for e, a in zip(expected, g)]
    assert_step(model, x, y, expected)


def test_each_example_draws_its_own_dropout_mask():
    """8 copies of one example through Dropout(0.5): with one mask for the batch about half the kernel's
    update would be exactly 0; with a mask per example a coordinate is 0 only if all 8 dropped it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
        ]
    )
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=100.0, noise_multiplier=0.0, learning_rate=0.01),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    x, y = np.ones((8, 64), "float32"), np.zeros((8, 1), "float32")
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    update = before - np.asarray(model.trainable_variables[0].numpy())
    assert np.mean(update == 0) < 0.2


# ------------------------------------------------------------------- noise
def _wide():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])


def _noise_only(x, **dp_kwargs):
    """The update of one step when every gradient is 0 (mse at y = f(x)): the noise / L."""
    model = _wide()
    y = np.asarray(model.predict(x, verbose=0))
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(learning_rate=1.0, **dp_kwargs),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return (before - np.asarray(model.trainable_variables[0].numpy())).ravel(), model


def _assert_std(noise, expected):
    # 10,000 coordinates: the sample std is within 3% of the truth with probability > 0.9999 (chi-square).
    assert abs(noise.std() / expected - 1.0) < 0.03
    assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)


def test_noise_std_is_sigma_c_over_batch():
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    noise, model = _noise_only(x, l2_norm_clip=0.7, noise_multiplier=1.3)
    _assert_std(noise, 1.3 * 0.7 / 8)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_seeded_noise_is_reproducible_and_unseeded_is_not():
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    a, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    b, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    c, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_sampler_is_the_library_sampler():
    """Box–Muller from full words, refined where x0 = 0: the TF sampler's values, tails past TF's 5.68."""
    import tensorflow as tf

    from keras_dpsgd.step import _noise as tf_noise

    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(4, 64), dtype=np.uint64).astype(np.uint32)
    words[0, :3] = 0  # the refined pairs
    words[2, :3] = [0, 1, 2**31]
    got = np.asarray(_noise.box_muller(*words))
    want = tf_noise.box_muller(*[tf.constant(w) for w in words]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got).max() > 5.7  # TF's clamped sampler never goes past 5.68


def test_sampler_moments():
    z = np.asarray(_noise.standard_normal((200_000,), _noise.seeded_key(3, 0, 0)))
    assert abs(z.mean()) < 4 / np.sqrt(z.size)
    assert abs(z.std() - 1) < 0.01


def test_clipped_sum_zeroes_nonfinite_rows_exactly():
    from keras_dpsgd.backends.jax._per_example import clip_factors, clipped_sum

    g = jnp.asarray([[1.0, 0.0], [jnp.nan, jnp.inf], [0.0, 3.0]])
    summed, norms = clipped_sum([g], lambda sq: clip_factors(sq, jnp.asarray([1.0]), [0]))
    np.testing.assert_allclose(np.asarray(summed[0]), [1.0, 1.0])
    assert not np.isfinite(np.asarray(norms)[1, 0])
