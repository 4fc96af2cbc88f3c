"""Augmentation multiplicity (De et al. 2022) on both Kerases: K views of each example averaged into one
per-example gradient, clipped once (``keras_dpsgd.step.augment``).

Oracles: a one-example, one-view-at-a-time loop with the same (deterministic) augmentation draws; the
sensitivity of a step's release to removing one example (one clipped vector, not K); K = 1 bit for bit
against no augmentation; the ledger against the same fit without augmentation; the refusal of an
augmentation that mixes the examples (MixUp-like) before any update.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import model_epsilon
from keras_dpsgd.step import augment as _augment
from tests._behaviour import built, keras3_front, tf_keras_front
from tests._keras3_helpers import one_sgd_step

LR = 0.5
FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


class Views:
    """A deterministic augmentation: call j of a trace (j = 0..K-1) is x · a_j + b_j, fixed arrays."""

    def __init__(self, shape, k, seed=3):
        rng = np.random.default_rng(seed)
        self.a = [rng.uniform(0.5, 1.5, size=shape).astype("float32") for _ in range(k)]
        self.b = [rng.normal(size=shape).astype("float32") for _ in range(k)]
        self.calls = 0

    def view(self, j, x):
        return x * self.a[j] + self.b[j]

    def __call__(self, x):
        j, self.calls = self.calls % len(self.a), self.calls + 1
        return self.view(j, x)


def _private(front, model, **kwargs):
    return front.make_private(model, **kwargs)


def _compile(front, model, clip, sigma=0.0, backend="auto", **kwargs):
    kwargs.setdefault("seed", 1)
    opt = front.optimizer_cls(
        l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=LR, per_example_backend=backend, **kwargs
    )
    model.compile(optimizer=opt, loss=front.loss())
    return opt


def _conv(front, seed=0):
    """A convolution whose 6 x 6 output the fast backend materializes per example (its k-row path)."""
    K = front.keras
    K.utils.set_random_seed(seed)
    model = K.Sequential(
        [K.Input((8, 8, 1)), K.layers.Conv2D(2, 3, activation="tanh"), K.layers.Flatten(), K.layers.Dense(3)]
    )
    rng = np.random.default_rng(seed)
    return model, rng.normal(size=(5, 8, 8, 1)).astype("float32"), rng.integers(0, 3, size=5)


def _oracle(front, model, x, y, views, clip, weights):
    """(1/B) Σ_i clip((1/K) Σ_k ∇ℓ(view_k(x_i))), and the mean over real examples of their views' mean loss."""
    loss_fn, variables, k = front.loss(), model.trainable_variables, len(views.a)
    total, losses = [np.zeros(v.shape) for v in variables], []
    for i in range(len(x)):
        grads, loss_i = [np.zeros(v.shape) for v in variables], 0.0
        for j in range(k):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y[i : i + 1], model(views.view(j, x[i : i + 1]), training=True)))
                loss = loss * float(weights[i])
            loss_i += float(loss) / k
            grads = [g + np.asarray(d, np.float64) / k for g, d in zip(grads, tape.gradient(loss, variables))]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        total = [t + g * min(1.0, clip / max(norm, 1e-30)) for t, g in zip(total, grads)]
        if weights[i]:
            losses.append(loss_i)
    return [t / len(x) for t in total], np.mean(losses)


@pytest.mark.parametrize("name, backend", [("dense", "fast"), ("conv", "fast"), ("dense", "reference")])
def test_update_is_the_mean_over_views_clipped_once(front, name, backend):
    """One step: lr × (1/B) Σ_i clip(mean of the K views' gradients of example i); the logged loss is
    the mean over the real examples of their views' mean (a padding row of weight 0 excluded)."""
    model, x, y = _conv(front) if name == "conv" else built(front, "dense")
    views = Views(x.shape[1:], 3)
    _private(front, model, augmentation=views, augmentation_multiplicity=3)
    clip = 0.3  # small: most clips are active
    _compile(front, model, clip, backend=backend)
    weights = np.ones(len(x), "float32")
    weights[-1] = 0.0
    expected, loss = _oracle(front, model, x, y, views, clip, weights)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    history = model.fit(x, y, sample_weight=weights, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert history.history["loss"][0] == pytest.approx(loss, rel=1e-5)
    if backend == "fast":
        assert not model.optimizer.per_example_report.fallback  # the views' rows proven, ghost/materialized rules


def test_accumulated_lot_counts_examples_not_views(front):
    """gradient_accumulation_steps = 2: two batches of 3 examples (K = 2 views each) are one lot of 6, released once
    as lr × (1/6) Σ_i clip(mean of example i's views' gradients)."""
    model, x, y = built(front, "dense")
    x, y = x[:6], y[:6]
    views = Views(x.shape[1:], 2)
    _private(front, model, augmentation=views, augmentation_multiplicity=2)
    clip = 0.3
    _compile(front, model, clip, gradient_accumulation_steps=2)
    expected, _ = _oracle(front, model, x, y, views, clip, np.ones(len(x)))
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=3, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    assert int(model.optimizer.noised_steps.numpy()) == 1
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def test_sensitivity_is_one_clipped_vector_per_example(front):
    """Removing one example moves the release's clipped sum by its one clipped gradient: <= C, and = C when
    its clip is active (K clipped views would move it by up to K·C)."""
    clip, lot = 0.5, 7.0

    def release(x, y):
        model, _, _ = built(front, "dense")
        _private(front, model, augmentation=Views(x.shape[1:], 4), augmentation_multiplicity=4)
        _compile(front, model, clip, expected_lot_size=lot)
        before, after = one_sgd_step(model, x, y, LR)
        return np.concatenate([((b - a) / LR * lot).ravel() for b, a in zip(before, after)])

    _, x, y = built(front, "dense")
    x = x.copy()
    x[0] *= 1e3
    moved = np.linalg.norm(release(x, y) - release(x[1:], y[1:]))
    assert moved == pytest.approx(clip, rel=1e-4)


def test_multiplicity_one_is_the_plain_step_bit_for_bit(front):
    """K = 1 with an identity augmentation, σ > 0 (seeded): the same weights as no augmentation."""
    out = []
    for kwargs in ({}, dict(augmentation=lambda x: x, augmentation_multiplicity=1)):
        model, x, y = built(front, "dense")
        _private(front, model, **kwargs)
        _compile(front, model, 1.0, sigma=1.1)
        model.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
        out.append([v.numpy() for v in model.trainable_variables])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_ledger_is_that_of_the_step_without_augmentation(front):
    """K = 4 charges nothing more: ε and the noised steps equal the same fit's without augmentation."""
    eps = []
    for kwargs in ({}, dict(augmentation=Views((5,), 4), augmentation_multiplicity=4)):
        model, x, y = built(front, "dense")
        _private(front, model, **kwargs)
        _compile(front, model, 1.0, sigma=1.1)  # q = B/N = 3/6 from fit
        model.fit(x[:6], y[:6], batch_size=3, epochs=2, shuffle=False, verbose=0)
        assert int(model.optimizer.noised_steps.numpy()) == 4
        eps.append(model_epsilon(model, target_delta=1e-5)[0])
    assert eps[0] == eps[1]


def test_augmentation_that_mixes_examples_is_refused(front):
    """MixUp with the batch reversed: an example's views carry another example's data (refused, no update)."""
    model, x, y = built(front, "dense")
    _private(front, model, augmentation=lambda v: 0.5 * v + 0.5 * tf.reverse(v, axis=[0]), augmentation_multiplicity=2)
    _compile(front, model, 1.0)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="mix"):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def test_keras_random_layers_draw_different_views(front):
    """RandomTranslation + RandomFlip (+ pad and RandomCrop on Keras 3; tf_keras's crop is an op the analysis does
    not know, refused) as the augmentation: proven per example by the fast rules; each call draws its own
    transforms, so the K views of one example differ."""
    K = front.keras
    model, x, y = _conv(front)
    crop = [K.layers.ZeroPadding2D(1), K.layers.RandomCrop(8, 8)] if front.name == "keras3" else []
    layers = K.Sequential([K.layers.RandomTranslation(0.2, 0.2), K.layers.RandomFlip("horizontal"), *crop])
    _private(front, model, augmentation=layers, augmentation_multiplicity=4)
    _compile(front, model, 1.0, backend="fast")
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert not model.optimizer.per_example_report.fallback
    drawn = _augment.views(tf.constant(x), 4, lambda v: layers(v, training=True)).numpy().reshape(len(x), 4, -1)
    assert all(len({d.tobytes() for d in drawn[i]}) > 1 for i in range(len(x)))


_K = "augmentation_multiplicity must be an integer in [1, 256], got "


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(augmentation_multiplicity=0), ValueError, _K + "0"),
        (dict(augmentation_multiplicity=257), ValueError, _K + "257"),
        (dict(augmentation_multiplicity=2.0), TypeError, _K + "2.0"),
        (dict(augmentation_multiplicity=True), TypeError, _K + "True"),
        (dict(augmentation="flip"), TypeError, "augmentation must be None, a Keras layer or a callable"),
    ],
)
def test_bad_arguments_are_refused_by_name(front, kwargs, error, message):
    model, _, _ = built(front, "dense")
    with pytest.raises(error) as info:
        front.make_private(model, **kwargs)
    assert message in str(info.value)


def test_views_are_example_major_and_the_mean_undoes_the_repeat():
    """Row i·K + k is view k of example i; repeat keeps targets with their views; the mean is per example."""
    x = tf.reshape(tf.range(12.0), [4, 3])
    calls = iter(range(3))
    got = _augment.views(x, 3, lambda v: v + 100.0 * next(calls)).numpy()
    for i in range(4):
        for k in range(3):
            np.testing.assert_array_equal(got[i * 3 + k], x.numpy()[i] + 100.0 * k)
    np.testing.assert_array_equal(_augment.repeat(tf.constant([5, 6]), 3).numpy(), [5, 5, 5, 6, 6, 6])
    assert _augment.repeat(None, 3) is None
    per_view = tf.constant([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    np.testing.assert_allclose(_augment.mean_over_views(per_view, 3).numpy(), [2.0, 20.0])
    with pytest.raises(ValueError, match="reduced over the batch"):
        _augment.mean_over_views(tf.constant(1.0), 3)
