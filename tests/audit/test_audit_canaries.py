"""The one-run canary audit: the canary hook in closed form, power, soundness, bug detection.

Setup choices (2 CPU cores): scikit-learn digits, a small MLP, two epochs of
lots of 64 for the gradient canaries. Gradient (Dirac) canaries need no
memorization, so they audit the step cheaply; l2_norm_clip = 10 makes the
canaries' norm C large against the data's own (unclipped) per-coordinate
gradients, which are the main noise of the score without DP noise. Input
canaries need memorization: 30 epochs of a 256-unit MLP without noise
(C = 100: clipping inactive).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from keras_dpsgd.data.datasets import load_digits
from keras_dpsgd.accounting import compute_noise_multiplier
from keras_dpsgd.audit import with_gradient_canaries
from keras_dpsgd.tf_keras import DPSGDOptimizer
from tests._audit_helpers import gradient_audit, input_canary_audit, without_noise


@pytest.fixture(scope="module")
def digits():
    return load_digits()


NoNoiseDPSGD = without_noise(DPSGDOptimizer)


# -------------------------------------------------------------- the hook
@pytest.mark.parametrize("per_layer", [False, True])
def test_gradient_canaries_add_plus_minus_c_at_their_coordinates(per_layer):
    """σ = 0, q = 1: the noised sum is the input plus ±C_v at each included canary's coordinate."""
    variables = [tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([5]))]
    clip = [2.0, 3.0] if per_layer else 2.0
    opt = with_gradient_canaries(DPSGDOptimizer)(l2_norm_clip=clip, noise_multiplier=0.0)
    opt.build(variables)
    included = np.array([True, False, True, True, False, True, True, True])
    opt.install_gradient_canaries(variables, included, rng=np.random.default_rng(0), sampling_rate=1.0)
    summed = [tf.fill([3, 4], 0.5), tf.fill([5], -0.25)]
    out = opt.add_noise(summed)
    delta = np.concatenate([(out[0] - summed[0]).numpy().ravel(), (out[1] - summed[1]).numpy().ravel()])
    bounds = np.r_[np.full(12, 2.0), np.full(5, 3.0 if per_layer else 2.0)]
    moved = np.flatnonzero(delta)
    assert len(moved) == included.sum()  # one coordinate per included canary, none for the others
    np.testing.assert_allclose(np.abs(delta[moved]), bounds[moved])
    # score = sign × observed coordinate: C_v + sign × (the data's value there) when included,
    # ± the data's value when not.
    scores = opt.canary_scores()
    data = np.r_[np.full(12, 0.5), np.full(5, -0.25)]
    offset = [0, 12]
    for v, (ids, flat) in enumerate(opt._canary_coords):
        for i, k in zip(ids, flat + offset[v]):
            expected_abs = abs(data[k]) if not included[i] else None
            if included[i]:
                np.testing.assert_allclose(abs(scores[i] - bounds[k]), abs(data[k]), rtol=1e-6)
            else:
                np.testing.assert_allclose(abs(scores[i]), expected_abs, rtol=1e-6)
    np.testing.assert_array_equal(opt.canary_inclusions(), included.astype(int))


def test_gradient_canaries_refuse_a_non_dp_class_and_missing_install():
    import tf_keras as keras

    with pytest.raises(ValueError, match="optimizer_cls"):
        with_gradient_canaries(keras.optimizers.SGD)
    opt = with_gradient_canaries(DPSGDOptimizer)(l2_norm_clip=1.0, noise_multiplier=1.0)
    opt.build([tf.Variable(tf.zeros([2]))])
    with pytest.raises(ValueError, match="install_gradient_canaries"):
        opt.add_noise([tf.zeros([2])])
    with pytest.raises(ValueError, match="canaries must be in"):
        opt.install_gradient_canaries(
            [tf.Variable(tf.zeros([2]))], np.ones(3, bool), rng=np.random.default_rng(0), sampling_rate=0.5
        )


# -------------------------------------------------------------- acceptance
def test_power_input_canaries_without_noise(digits):
    """σ = 0 with out-of-distribution input canaries: ε_emp clearly above 1 at 95% (memorization is seen)."""
    result = input_canary_audit(tf_keras, digits, canaries=200, epochs=30)
    assert result.epsilon == float("inf")
    assert result.epsilon_lower_bound > 2.0, result
    assert not result.is_violation


def test_bug_detection_noise_off_while_the_ledger_charges_sigma_1(digits):
    """A broken optimizer (no noise, σ = 1 charged) is flagged: ε_emp > reported ε."""
    result = gradient_audit(tf_keras, digits, 1.0, seed=1, optimizer_cls=NoNoiseDPSGD)
    assert result.noise_multiplier == 1.0 and 2.0 < result.epsilon < 3.5  # what the ledger charges
    assert result.is_violation, result
    assert result.epsilon_lower_bound > result.epsilon + 0.4
    assert result.verdict().startswith("BUG")


@pytest.mark.parametrize("target", [1.0, 4.0])
def test_soundness_dp_training(digits, target):
    """DP-SGD calibrated to ε = 1 and ε = 4 (δ = 1e-5): ε_emp <= ε over a few seeds."""

    def sigma(lots, delta):
        return compute_noise_multiplier(
            target_epsilon=target, target_delta=delta, sampling_rate=lots.sampling_rate, steps=2 * lots.lots_per_epoch
        )

    for seed in (1, 2):
        result = gradient_audit(tf_keras, digits, sigma, seed=seed)
        assert result.epsilon <= target * (1 + 1e-6)
        assert result.epsilon_lower_bound <= result.epsilon, result
        assert not result.is_violation
