"""Budgets that make no sense: the noise a calibrated σ adds per step, against the signal it hides.

A DP-SGD step adds Gaussian noise of standard deviation σC to every coordinate of a lot's clipped sum
(Abadi et al. 2016, Algorithm 1). Two numbers bound what that sum can hold: one example contributes at
most C (its clipped gradient's norm), and the whole lot at most L·C (L the expected lot size). A target ε
whose σ falls outside [``SMALL_NOISE``, L] is almost certainly a mistake, and is said with the numbers:

* σ < ``SMALL_NOISE``: one example's contribution (up to C) stands more than 1/σ noise standard deviations
  out of a single step's release; the guarantee is that of a very large ε (ε ≈ 50 and above in the setups
  of the docs), which protects little.
* σ >= L: the noise on each coordinate is at least the largest norm the whole lot's sum can have; the
  model learns nothing, whatever ε says.

Pure Python: the CLI and ``make_private_with_epsilon`` ask it after calibrating σ.
"""

from __future__ import annotations

__all__ = ["SMALL_NOISE", "budget_warnings"]

SMALL_NOISE = 0.5


def budget_warnings(
    *, target_epsilon: float, noise_multiplier: float, expected_lot_size: float, l2_norm_clip: float
) -> list[str]:
    """The sentences to warn with when σ calibrated for `target_epsilon` makes no sense (else none).

    Args:
      target_epsilon: the budget σ was calibrated for.
      noise_multiplier: σ, the calibrated noise multiplier.
      expected_lot_size: L, the expected number of examples in a lot.
      l2_norm_clip: C, the bound on one example's clipped gradient (1 for per-example normalization).

    Returns:
      Zero or one sentence naming σ, σC, C, L·C and the target ε.
    """
    sigma, lot, clip = float(noise_multiplier), float(expected_lot_size), float(l2_norm_clip)
    noise = sigma * clip
    if sigma >= lot:
        return [
            f"target ε = {target_epsilon:g} needs σ = {sigma:.4g}: the noise on each coordinate of a lot's "
            f"gradient sum (std σC = {noise:.4g}) is {sigma / lot:.3g} times the largest norm the whole sum can "
            f"have (L·C = {lot * clip:.4g} for lots of L = {lot:g}), so training learns nothing; raise the target "
            f"ε, or use larger lots or fewer steps"
        ]
    if 0 < sigma < SMALL_NOISE:
        return [
            f"target ε = {target_epsilon:g} needs only σ = {sigma:.4g}: the noise on a lot's gradient sum "
            f"(std σC = {noise:.4g} per coordinate) is {1 / sigma:.3g} times smaller than one example's "
            f"contribution (up to C = {clip:g}) and {lot / sigma:.3g} times smaller than the lot's (L·C = "
            f"{lot * clip:.4g}): single examples show in every step, and an ε this large protects little"
        ]
    return []
