"""Examples whose rows cancel are clipped on JAX (issue 37): the Dense rule's Gram and direct forms, the Conv
rule, the Embedding rule, with flat, per-layer, normalized and adaptive clipping (``tests/_cancelling.py``).

The sensitivity of a step to removing one example (σ = 0) is at most C (1 + 1e-4); the float32 Gram form alone
rounded such an example's norm to 0 (clamped) and released it unclipped. The control: an ordinary batch still
gives the one-example-at-a-time loop's clipped sum.
"""

import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from tests import _cancelling as c
from tests._behaviour import keras3_front
from tests._keras3_helpers import example_grads

FRONT = keras3_front()
CASES = {"dense": c.issue_case, "conv": c.conv_case, "embedding": c.embedding_case}
BOUND = c.CLIP * (1 + c.TOLERANCE)


@pytest.mark.parametrize("case, scale", c.CASE_SCALES, ids=c.case_id)
def test_removing_an_example_whose_rows_cancel_moves_the_release_by_at_most_c(case, scale):
    assert c.moved(FRONT, lambda: CASES[case](FRONT.keras, scale)) <= BOUND


def test_the_direct_form_bounds_the_exact_norm_too():
    """Dense(2) on 2 rows of 8: T(i + j) >= ij, the direct product (released apart, by one vjp over the batch)."""
    K = FRONT.keras

    def build():
        model, x, y = c.issue_case(K, c.SCALES[1])
        narrow = c._frozen_head(K, K.layers.Dense(2, use_bias=False), K.Input((2, 8)))
        return narrow, x, y

    assert c.moved(FRONT, build) <= BOUND


@pytest.mark.parametrize("scale", [c.SCALES[0], c.SCALES[-1]], ids=c.scale_id)
def test_per_layer_normalized_and_adaptive_clipping_bound_the_example_too(scale):
    """Per-layer (a kernel and a bias: √2·C), normalization (C = 1), adaptive clipping (the bound in force)."""
    K = FRONT.keras
    per_layer = c.moved(FRONT, lambda: c.issue_case(K, scale, bias=True), l2_norm_clip=[c.CLIP, c.CLIP])
    assert per_layer <= np.sqrt(2) * BOUND
    normalized = c.moved(FRONT, lambda: c.issue_case(K, scale), clipping="normalize", l2_norm_clip=None)
    assert normalized <= 1 + c.TOLERANCE
    adaptive = c.moved(
        FRONT,
        lambda: c.issue_case(K, scale),
        fresh=True,
        optimizer_cls=k3.AdaptiveDPSGDOptimizer,
        norm_noise_multiplier=0.0,
    )
    assert adaptive <= BOUND


def test_control_an_ordinary_batch_gives_the_one_example_loops_clipped_sum():
    """Nothing cancels: the release is the loop's Σ_i clip(g_i) (the margin moves these norms by ~1e-6). The clip
    bound is the median norm; a large learning rate makes the update, not the weights' rounding, the measure."""
    K = FRONT.keras
    model, x, y = c.issue_case(K, bias=True)
    x, y = x[1:], y[1:] * 0.1
    grads = example_grads(model, x, y, K.losses.MeanSquaredError(reduction="none"))
    norms = [np.sqrt(sum(np.sum(np.square(g)) for g in row)) for row in grads]
    clip = float(np.median(norms))
    expected = np.concatenate(
        [sum(np.asarray(g[v], np.float64) * min(1.0, clip / n) for g, n in zip(grads, norms)).ravel() for v in (0, 1)]
    )
    model, _, _ = c.compiled(FRONT, lambda: c.issue_case(K, bias=True), learning_rate=1e4, l2_norm_clip=clip)
    np.testing.assert_allclose(c.release(model, x, y, 1e4), expected, rtol=1e-5, atol=1e-7 * np.abs(expected).max())
