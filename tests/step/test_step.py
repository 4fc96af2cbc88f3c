"""The pure step functions of keras_dpsgd.step._math against closed forms (numpy)."""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd.step import _math as _step

SQ = np.array([[9.0, 16.0], [0.25, 0.0], [np.nan, 1.0], [1.0, np.inf]], np.float32)


def test_flat_is_one_group():
    factors = _step.clip_factors(tf.constant(SQ), tf.constant([2.0]), _step.clip_groups(2, False)).numpy()
    # Row 0: ||g|| = 5 > 2 -> 0.4; row 1: 0.5 <= 2 -> 1; rows 2, 3 are non-finite -> 0.
    np.testing.assert_allclose(factors, [[0.4, 0.4], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], rtol=1e-6)


def test_per_layer_is_one_group_per_variable():
    factors = _step.clip_factors(tf.constant(SQ), tf.constant([2.0, 8.0]), _step.clip_groups(2, True)).numpy()
    np.testing.assert_allclose(factors, [[2.0 / 3.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], rtol=1e-6)


def test_groups_of_several_variables():
    sq = tf.constant([[1.0, 3.0, 16.0]])
    factors = _step.clip_factors(sq, tf.constant([1.0, 2.0]), [0, 0, 1]).numpy()
    np.testing.assert_allclose(factors, [[0.5, 0.5, 0.5]], rtol=1e-6)


def test_overflowing_group_norm_gets_factor_zero():
    big = np.float32(3e38)
    factors = _step.clip_factors(tf.constant([[big, big]]), tf.constant([1.0]), [0, 0]).numpy()
    np.testing.assert_array_equal(factors, [[0.0, 0.0]])


def test_given_finite_mask_is_used():
    finite = tf.constant([[False], [True], [True], [True]])
    sq = tf.constant(np.nan_to_num(SQ, nan=1.0, posinf=1.0))
    factors = _step.clip_factors(sq, tf.constant([10.0]), [0, 0], finite).numpy()
    np.testing.assert_array_equal(factors[:, 0], [0.0, 1.0, 1.0, 1.0])


def test_noise_stddevs_are_sigma_times_group_bound():
    np.testing.assert_allclose(_step.noise_stddevs([1.5, 0.5], tf.constant([2.0]), [0, 0]).numpy(), [3.0, 1.0])
    np.testing.assert_allclose(_step.noise_stddevs([1.0, 2.0], tf.constant([2.0, 3.0]), [0, 1]).numpy(), [2.0, 6.0])


@pytest.mark.parametrize("lot, expected", [(0.0, 4.0), (8.0, 8.0)])
def test_normalize_by_expected_lot_else_realized(lot, expected):
    (out,) = _step.normalize([tf.constant([8.0])], tf.constant(4.0), tf.constant(lot))
    np.testing.assert_allclose(out.numpy(), [8.0 / expected])
