"""The private step on JAX beyond the behaviour suite (test_jax_behaviour.py): the checks JAX and torch share
(tests/_step_checks.py: non-finite examples, per-example normalization, a Dropout mask per example), seeded noise,
the clipped sum's non-finite rows, unweighted metrics, the optimizer's local state.

The oracle is the behaviour suite's one-example loop (tests/_keras3_helpers.py: jax.grad on a batch
of one, no vmap, clipped in numpy); σ = 0 makes the step exact.
"""

import jax.numpy as jnp
import keras
import numpy as np

import keras_dpsgd.keras3 as k3
from tests._behaviour import built
from tests._step_checks import *  # noqa: F403 (the checks JAX and torch share, collected here)
from tests._step_checks import FRONT, noise_only, update


def test_seeded_noise_is_reproducible_and_unseeded_is_not():
    a = update(*noise_only(seed=7))
    b = update(*noise_only(seed=7))
    c = update(*noise_only())
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
