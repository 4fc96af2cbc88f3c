"""Keras 3 gradient accumulation under a MirroredStrategy with 2 replicas (issue 15): k = 2 batches
per lot, one noise draw per GLOBAL lot.

The shared MirroredStrategy process of the distribution tests (tests/_dist_helpers.strategy_runs:
tests/dist_scripts/keras3_accumulate.py, 2 logical CPU devices, hard timeout) runs every check and
writes JSON; the tests assert on the numbers:

* σ = 0: the lot's update equals the one-example-at-a-time oracle on the same global lot (with a
  weight regularizer), applied once, after the lot's last batch; two lots with momentum and a
  non-idempotent constraint equal the same lots on one device;
* noised_steps, iterations and ε count lots once (ε equal to the accountant's to 1e-12);
* the noise of the released lot has stddev σC/L (statistical bound), seeded as the sum of two
  independent replica draws of σC/√R;
* weight_decay and use_ema with accumulation are refused under R > 1.
"""

import math

import numpy as np
import pytest

from tests._dist_helpers import strategy_runs


@pytest.fixture(scope="module")
def run():
    return strategy_runs()["mirrored"]["keras3_accumulate"]


def test_the_lot_update_equals_the_one_example_oracle_once(run):
    assert run["replicas"] == 2
    out = run["oracle"]
    assert out["max_error"] < 1e-6 * max(1.0, out["scale"]) and out["scale"] > 1e-3
    assert out["moved_after_first_batch"] == 0.0  # the lot's first batch moves nothing
    assert out["noised_steps"] == 1 and out["iterations"] == 1


def test_two_lots_equal_the_one_device_run(run):
    out = run["one_device"]
    assert out["moved"] > 1e-2 and out["max_error"] < 1e-6
    assert out["noised_steps"] == out["iterations"] == out["single_iterations"] == 2
    assert out["ledger_steps"] == 2


@pytest.mark.parametrize("check", ["noise_seeded", "noise_unseeded"])
def test_the_released_lot_has_noise_stddev_sigma_c_over_l_and_counts_once(run, check):
    out = run[check]
    # 10 000 coordinates: the sample stddev is within 5 % (its own sd is ~0.7 %); noise per replica
    # unsplit (√2·σC/L), or one replica's only (σC/(√2·L)), is 41 % / 29 % away.
    assert out["n"] == 10_000
    assert abs(out["std"] / out["expected"] - 1) < 0.05, (out["std"], out["expected"])
    assert abs(out["mean"]) < 5 * out["expected"] / math.sqrt(out["n"])
    assert out["moved_after_first_batch"] == 0.0
    assert out["noised_steps"] == 1 and out["iterations"] == 1
    assert out["epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12)


def test_seeded_lot_noise_is_the_sum_of_two_independent_replica_draws(run):
    """-(n_0 + n_1)/L with n_r ~ N(0, σ²C²/2) under noise_key(seed, step 0, variable 0) with r folded in (the release's first key)."""
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow import ops as _noise
    from keras_dpsgd.dp import release

    out = run["noise_seeded"]
    lot, std = 16, out["expected"] * 16 / math.sqrt(2)
    draws = []
    for r in range(2):
        key = tf.random.experimental.stateless_fold_in(
            _noise.seeded_key(4, tf.constant(0, tf.int64), 0), tf.constant(r, tf.int64)
        )
        kernels = [tf.zeros([100, 100]), tf.zeros([100, 1])]  # the release: both kernels, one draw under the key
        draws.append(release.add_gaussians(_noise.TF_OPS, kernels, [std, std], key)[0].numpy().ravel()[:8])
    np.testing.assert_allclose(out["first"], -(draws[0] + draws[1]) / lot, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("option", ["weight_decay", "use_ema"])
def test_weight_decay_and_ema_with_accumulation_are_refused(run, option):
    message = run["refusals"][option]
    assert f"{option}=" in message and "gradient_accumulation_steps=2) under 2 replicas" in message, message
