"""Examples whose rows cancel are clipped on the fast TensorFlow backend, Keras 3 and tf_keras (issue 37).

The sensitivity of a step to removing one example (σ = 0) is at most C (1 + 1e-4) for a Dense on a sequence,
a Conv1D, an Embedding (the rows of one example that nearly cancel: ``tests/_cancelling.py``), with flat,
per-layer, normalized and adaptive clipping and augmentation multiplicity 2; the float32 Gram form alone rounded
their norms to 0 and released them unclipped (up to thousands of C). The control: an ordinary batch still gives
the one-example-at-a-time loop's clipped sum.
"""

import numpy as np
import pytest

from tests import _cancelling as c
from tests._behaviour import keras3_front, tf_keras_front

FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}
CASES = {"dense": c.issue_case, "conv": c.conv_case, "embedding": c.embedding_case}
BOUND = c.CLIP * (1 + c.TOLERANCE)


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


@pytest.mark.parametrize("case, scale", c.CASE_SCALES, ids=c.case_id)
def test_removing_an_example_whose_rows_cancel_moves_the_release_by_at_most_c(front, case, scale):
    assert c.moved(front, lambda: CASES[case](front.keras, scale), per_example_backend="fast") <= BOUND


@pytest.mark.parametrize("scale", [c.SCALES[1], c.SCALES[3]], ids=c.scale_id)
def test_conv_rows_that_cancel_are_clipped_in_the_gram_form_too(front, scale, monkeypatch):
    """The conv case's kernel is materialized by its shape (2 positions, 8 x 4); forced to the Gram form over its
    patches, the cost rule's other branch (``uses.ghost_preferred``), example 0 is still clipped."""
    from keras_dpsgd.backends.tensorflow import uses

    monkeypatch.setattr(uses, "ghost_preferred", lambda t, d, u: True)
    assert c.moved(front, lambda: c.conv_case(front.keras, scale), per_example_backend="fast") <= BOUND


@pytest.mark.parametrize("scale", [c.SCALES[0], c.SCALES[-1]], ids=c.scale_id)
def test_per_layer_normalized_and_adaptive_clipping_bound_the_example_too(front, scale):
    """Per-layer (a kernel and a bias: √2·C), normalization (C = 1), adaptive clipping (the bound in force)."""
    K = front.keras
    with_bias = lambda: c.issue_case(K, scale, bias=True)  # noqa: E731
    per_layer = c.moved(front, with_bias, l2_norm_clip=[c.CLIP, c.CLIP])
    assert per_layer <= np.sqrt(2) * BOUND
    normalized = c.moved(front, lambda: c.issue_case(K, scale), clipping="normalize", l2_norm_clip=None)
    assert normalized <= 1 + c.TOLERANCE
    adaptive_cls = __import__(f"keras_dpsgd.{front.name}", fromlist=["x"]).AdaptiveDPSGDOptimizer
    adaptive = c.moved(
        front, lambda: c.issue_case(K, scale), fresh=True, optimizer_cls=adaptive_cls, norm_noise_multiplier=0.0
    )
    assert adaptive <= BOUND


@pytest.mark.parametrize("scale", [1e3, 2.0**20])
def test_augmentation_views_that_cancel_are_clipped_once(front, scale):
    """Multiplicity 2 with the views x and -x + b: the views' rows cancel in the example's mean gradient."""
    private = dict(augmentation=c.Negated(8), augmentation_multiplicity=2)
    assert c.moved(front, lambda: c.flat_case(front.keras, scale), private=private) <= BOUND


def test_control_an_ordinary_batch_gives_the_one_example_loops_clipped_sum(front):
    """Nothing cancels: the release is the float64 loop's Σ_i clip(g_i) (the margin moves these norms by ~1e-6).
    The clip bound is the median norm (some examples clipped, some not); a large learning rate makes the
    update, not the weights' float32 rounding, the measured quantity."""
    import tensorflow as tf

    K = front.keras
    model, x, y = c.issue_case(K, bias=True)
    x, y = x[1:], y[1:] * 0.1  # the ordinary examples
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x[i : i + 1]) - y[i : i + 1]))
        grads.append([np.asarray(g, np.float64) for g in tape.gradient(loss, model.trainable_variables)])
    norms = [np.sqrt(sum(np.sum(g**2) for g in row)) for row in grads]
    clip = float(np.median(norms))
    expected = np.concatenate([sum(g[v] * min(1.0, clip / n) for g, n in zip(grads, norms)).ravel() for v in (0, 1)])
    build = lambda: c.issue_case(K, bias=True)  # noqa: E731
    model, _, _ = c.compiled(front, build, learning_rate=1e4, l2_norm_clip=clip, per_example_backend="fast")
    np.testing.assert_allclose(c.release(model, x, y, 1e4), expected, rtol=1e-5, atol=1e-7 * np.abs(expected).max())
