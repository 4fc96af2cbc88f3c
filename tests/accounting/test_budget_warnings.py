"""Budgets that make no sense (issue 40.8): σ against one example's bound C and the lot's bound L·C, with numbers."""

import pytest

from keras_dpsgd.accounting.budget import SMALL_NOISE, budget_warnings


def _warn(sigma, lot=256.0, clip=1.0, eps=3.0):
    return budget_warnings(target_epsilon=eps, noise_multiplier=sigma, expected_lot_size=lot, l2_norm_clip=clip)


@pytest.mark.parametrize("sigma", [SMALL_NOISE, 1.0, 2.06, 255.9])
def test_sensible_noise_is_silent(sigma):
    assert _warn(sigma) == []


def test_zero_noise_is_a_deliberate_non_private_run():
    assert _warn(0.0) == []


def test_too_much_noise_names_the_noise_and_the_lots_bound():
    (text,) = _warn(63344.0, lot=256, clip=2.0, eps=0.001)
    # σC = 126688 per coordinate against L·C = 512: 247 times the whole sum's largest norm.
    assert "target ε = 0.001" in text and "σ = 6.334e+04" in text and "σC = 1.267e+05" in text
    assert "L·C = 512" in text and "247 times" in text and "learns nothing" in text
    assert _warn(256.0) != [] and _warn(255.99) == []  # the bound is σ >= L


def test_too_little_noise_names_the_noise_and_one_examples_bound():
    (text,) = _warn(0.077, lot=256, clip=1.0, eps=1000)
    assert "target ε = 1000" in text and "σ = 0.077" in text and "σC = 0.077" in text
    assert "13 times smaller than one example's contribution (up to C = 1)" in text  # 1/0.077 = 12.99
    assert "L·C = 256" in text and "protects little" in text
    assert _warn(SMALL_NOISE * (1 - 1e-9)) != []
