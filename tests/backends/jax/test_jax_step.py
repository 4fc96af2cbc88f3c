"""The private step on JAX beyond the behaviour suite (test_jax_behaviour.py): non-finite examples,
per-example normalization, a Dropout mask per example, seeded noise, the library's sampler.

The oracle is the behaviour suite's one-example loop (tests/_keras3_helpers.py: jax.grad on a batch
of one, no vmap, clipped in numpy); σ = 0 makes the step exact.
"""

import jax.numpy as jnp
import keras
import numpy as np

import keras_dpsgd.keras3 as k3
from tests._behaviour import built, keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5
FRONT = keras3_front()


def compiled(model, **dp_kwargs):
    return FRONT.compiled(model, learning_rate=LR, **dp_kwargs)


def assert_step(model, x, y, expected):
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def test_nonfinite_example_contributes_exactly_zero():
    """An example whose gradient is NaN is zeroed (factor 0, NaN not propagated) and counted."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=0.3)
    x = x.copy()
    x[2, 0] = np.nan
    keep = np.arange(len(x)) != 2
    expected = [g * (keep.sum() / len(x)) for g in loop_clipped_mean(model, x[keep], y[keep], FRONT.loss(), 0.3)]
    assert_step(model, x, y, expected)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_per_example_normalization():
    """clipping='normalize': each gradient scaled by 1/(||g|| + γ), sensitivity 1."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    expected = loop_clipped_mean(model, x, y, FRONT.loss(), 1.0, stability=0.05)
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


def test_seeded_noise_is_reproducible_and_unseeded_is_not():
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    a, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    b, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    c, _ = _noise_only(x, l2_norm_clip=1.0, noise_multiplier=1.0)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_clipped_sum_zeroes_nonfinite_rows_exactly():
    from keras_dpsgd.backends.jax._per_example import clipped_sum
    from keras_dpsgd.backends.jax.ops import JAX_OPS
    from keras_dpsgd.dp.clip import clip_factors

    g = jnp.asarray([[1.0, 0.0], [jnp.nan, jnp.inf], [0.0, 3.0]])
    summed, norms = clipped_sum([g], lambda sq: clip_factors(JAX_OPS, sq, jnp.asarray([1.0]), [0]))
    np.testing.assert_allclose(np.asarray(summed[0]), [1.0, 1.0], rtol=2e-6)  # the norms' certified margin
    assert not np.isfinite(np.asarray(norms)[1, 0])


def test_unweighted_metrics_count_the_real_rows_only():
    """Rows of weight 0 (the padding of Poisson lots) are out of `metrics=["accuracy"]`, as on TensorFlow:
    before, JAX's unweighted metrics counted them (the logged loss did not)."""
    model, x, y = built(FRONT, "dense")
    x = np.concatenate([x[:4]] * 2)
    predicted = np.argmax(np.asarray(model.predict(x, verbose=0)), axis=1)
    y = np.concatenate([predicted[:4], (predicted[4:] + 1) % 3])  # the real rows right, the padding wrong
    weights = np.array([1.0] * 4 + [0.0] * 4, "float32")
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.0),
        loss=FRONT.loss(),
        metrics=["accuracy"],
    )
    k3.make_private(model)
    history = model.fit(x, y, sample_weight=weights, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert history.history["accuracy"][0] == 1.0  # 0.5 with the padding counted


def test_the_optimizer_keeps_its_local_state_in_keras_variables_not_tensorflow_ones():
    """On JAX the DP optimizer makes no tf.Variable (TensorFlow is not its backend): its local state (the lot
    size's mirror, the non-finite count, the ledger offset) is optimizer variables, made when it is built."""
    import sys

    optimizer = k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
    dp = optimizer._dp
    assert (dp.lot, dp.nonfinite, dp.ledger_offset, dp.generator) == (None, None, None, None)
    optimizer.expected_lot_size = 32  # before build: kept, mirrored when built
    optimizer.build([keras.Variable(np.zeros((3,), np.float32))])
    local = (dp.lot, dp.nonfinite, dp.ledger_offset)
    assert all(isinstance(v, keras.Variable) for v in local) and float(dp.lot.numpy()) == 32.0
    tf = sys.modules.get("tensorflow")
    assert tf is None or not any(isinstance(v, tf.Variable) for v in local)
