"""Fail closed in the traced step (issue 12, holes 1 and 4).

Property: for every op pattern, removing one example moves the clipped sum (σ = 0) by at most C,
for the fast and the reference backends, or the step refuses (ValueError naming the layer).
Where the model is per example, the reference backend (per-example jacobians) is the oracle.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _fast_helpers import assert_same, flat_factors, per_example_loss, run_traced

from keras_dpsgd.tf_keras import DPSGDOptimizer
from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow.per_example_backend import ReferenceBackend

L = keras.layers
CLIP = 0.05
B = 8


def _halves(h, b):
    return h[:b] + h[b:]


def _segment_sum(h, ids):
    return tf.math.unsorted_segment_sum(h, ids, num_segments=tf.shape(h)[0])


def _random_crop(h):
    start = tf.random.stateless_uniform([], seed=[1, 2], minval=0, maxval=3, dtype=tf.int32)  # same in both steps
    return tf.pad(h, [[0, 0], [1, 1]])[:, start : start + 4]


# pattern(h [B, 4], dense) -> [B, 3]; expected outcome: "fast" (no fallback), "reference"
# (the whole step on per-example jacobians: reordered rows) or "raise".
PATTERNS = {
    # Benign: the examples stay apart and in order.
    "identity": ("fast", lambda h, d: d(h)),
    "elementwise": ("fast", lambda h, d: d(tf.nn.relu(2.0 * h + 1.0) - tf.square(h))),
    "concat_features": ("fast", lambda h, d: d(tf.concat([h, h**2], axis=1)[:, :4])),
    "stack_features": ("fast", lambda h, d: d(tf.reshape(tf.stack([h, -h], axis=1), [-1, 8])[:, ::2])),
    "reshape_keeps_batch": ("fast", lambda h, d: d(tf.reshape(tf.reshape(h, [-1, 2, 2]) * 2.0, [-1, 4]))),
    "tile_features": ("fast", lambda h, d: d(tf.tile(h, [1, 2])[:, 1:5])),
    "transpose_twice": ("fast", lambda h, d: d(tf.transpose(tf.transpose(h) * 2.0))),
    "reverse_features": ("fast", lambda h, d: d(tf.reverse(h, axis=[1]))),
    "softmax_features": ("fast", lambda h, d: d(tf.nn.softmax(h, axis=-1))),
    "slice_all_rows": ("fast", lambda h, d: d(h[:, :]) + d(h[..., ::-1])),
    # A random crop of the features (Keras 3's RandomCrop): bounds unknown at trace time off the batch axis.
    "random_feature_slice": ("fast", lambda h, d: d(_random_crop(h))),
    "feature_reduce": ("fast", lambda h, d: d(h - tf.reduce_mean(h, axis=1, keepdims=True))),
    # Sorting each example's features (TopKV2 along the last axis) keeps the rows.
    "sort_features": ("fast", lambda h, d: d(tf.sort(h, axis=-1))),
    # Not in the allowlist (UnsortedSegmentSum): refused whether or not it mixes, since the
    # analysis cannot tell (pairs of rows summed mixed examples and trained before the refusal).
    "unknown_op_per_example": ("raise", lambda h, d: d(_segment_sum(h, tf.range(tf.shape(h)[0])))),
    "unknown_op_pairs": ("raise", lambda h, d: d(_segment_sum(h, tf.range(tf.shape(h)[0]) // 2))),
    # Rows regrouped across examples (hole 1: the fast path took them as batch-major).
    "pack_batch": ("raise", lambda h, d: _halves(d(tf.reshape(tf.stack([h, 2.0 * h]), [-1, 4])), tf.shape(h)[0])),
    "tile_batch": ("raise", lambda h, d: _halves(d(tf.tile(h, [2, 1])), tf.shape(h)[0])),
    "reverse_batch": ("raise", lambda h, d: d(h[::-1])),
    "reverse_batch_added": ("raise", lambda h, d: d(h + h[::-1])),
    "shift_batch": ("raise", lambda h, d: d(tf.concat([h[1:], h[:1]], axis=0))),
    "gather_batch": ("raise", lambda h, d: d(tf.gather(h, tf.range(tf.shape(h)[0])[::-1]))),
    "roll_batch": ("raise", lambda h, d: d(tf.roll(h, 1, axis=0))),
    "transpose_batch": ("raise", lambda h, d: d(tf.transpose(tf.nn.softmax(tf.transpose(h), axis=-1)))),
    "fold_batch": ("raise", lambda h, d: d(tf.reshape(tf.nn.softmax(tf.reshape(h, [-1, 8])), [-1, 4]))),
    "batch_mean": ("raise", lambda h, d: d(h - tf.reduce_mean(h, axis=0, keepdims=True))),
    "batch_max": ("raise", lambda h, d: d(h) * tf.reduce_max(h)),
    "batch_softmax": ("raise", lambda h, d: d(h) * tf.nn.softmax(h[:, 0])[:, None]),
    "batch_gram": ("raise", lambda h, d: d(tf.matmul(h, tf.matmul(h, h, transpose_a=True)) / 8.0)),
}


class PatternModel(keras.Model):
    def __init__(self, pattern):
        super().__init__()
        self.first = L.Dense(4, activation="tanh")
        self.second = L.Dense(3)
        self.pattern = pattern

    def call(self, x):
        return self.pattern(self.first(x), self.second)


def _data(seed=0):
    gen = np.random.default_rng(seed)
    return gen.normal(size=(B, 5)).astype("float32"), gen.normal(size=(B, 3)).astype("float32")


def _distance(a, b):
    return float(np.sqrt(sum(np.sum(np.square(u - v)) for u, v in zip(a, b))))


def _outcome(backend, model, x, y):
    """("raise", None), or the sensitivity of the clipped sum to removing example 3 (σ = 0)
    and the clipped sum of the whole batch (one trace, batch size None)."""

    # autograph=False: the step is straight-line code; converting the library's code at each trace cost ~20% of
    # this module's CPU. The refusals are the same (the same ValueError messages with and without autograph).
    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None, 3])], autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_loss(model, x, y)
        return backend.clipped_sum(loss, model.trainable_variables, tape, flat_factors(CLIP))

    keep = [i for i in range(B) if i != 3]
    try:
        full, sq = step(x, y)
        fewer, _ = step(x[keep], y[keep])
    except (ValueError, tf.errors.InvalidArgumentError):
        return "raise", None
    return _distance(full, fewer), ([s.numpy() for s in full], sq.numpy())


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_sensitivity_to_one_example_is_at_most_clip_or_the_step_raises(name):
    expected, pattern = PATTERNS[name]
    x, y = _data()
    model = PatternModel(pattern)
    model(x)
    fast = FastBackend()
    (fast_got, fast_sums), (ref_got, ref_sums) = _outcome(fast, model, x, y), _outcome(ReferenceBackend(), model, x, y)
    outcomes = {"fast": fast_got, "reference": ref_got}
    for backend, got in outcomes.items():
        assert got == "raise" or got <= CLIP * (1 + 1e-5), (name, backend, got)
    if expected == "raise":
        assert outcomes == {"fast": "raise", "reference": "raise"}
        return
    assert "raise" not in outcomes.values(), outcomes
    want_fallback = [] if expected == "fast" else [v.name for v in model.trainable_variables]
    assert fast.last_fallback == want_fallback
    assert_same(fast_sums, ref_sums)


def test_mixing_message_names_the_layer_and_the_op():
    x, y = _data(1)
    model = PatternModel(PATTERNS["batch_mean"][1])
    model(x)
    for backend in (FastBackend(), ReferenceBackend()):
        with pytest.raises(ValueError, match=r"pattern_model.*Mean.*reduces over the batch axis"):
            run_traced(backend, model, x, y, flat_factors(CLIP))


# ------------------------------------------------------------------ through the optimizer
def _xy(n=8, seed=2):
    gen = np.random.default_rng(seed)
    return gen.normal(size=(n, 5)).astype("float32"), gen.integers(0, 3, size=(n,))


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_lambda_subtracting_the_batch_mean_is_refused_in_fit(backend):
    model = keras.Sequential(
        [
            keras.Input((5,)),
            L.Dense(4),
            L.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True), name="center"),
            L.Dense(3),
        ]
    )
    model.compile(optimizer=DPSGDOptimizer(1.0, 0.0, per_example_backend=backend), loss=_loss())
    x, y = _xy()
    with pytest.raises(ValueError, match="center.*reduces over the batch axis"):
        model.fit(x, y, batch_size=8, verbose=0)


class KeepdimsLossModel(keras.Model):
    """A custom train_step that reduces the loss over the batch to shape [1]."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.compiled_loss_fn(y, self(x, training=True)), keepdims=True)
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return {}


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_loss_reduced_to_one_entry_is_refused(backend):
    inp = keras.Input((5,))
    model = KeepdimsLossModel(inp, L.Dense(3)(L.Dense(4)(inp)))
    model.compiled_loss_fn = _loss()
    model.compile(optimizer=DPSGDOptimizer(1.0, 0.0, per_example_backend=backend))
    x, y = _xy()
    with pytest.raises(ValueError, match="reduces over the batch axis.*one loss value per example"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_loss_with_fewer_entries_than_examples_is_refused_at_run_time():
    opt = DPSGDOptimizer(1.0, 0.0)
    model = keras.Sequential([keras.Input((5,)), L.Dense(3)])
    x, y = _xy()

    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None], tf.int64)])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss()(y, model(x))[:2]  # Two "examples" out of eight.
        opt.minimize(loss, model.trainable_variables, tape=tape)

    with pytest.raises(tf.errors.InvalidArgumentError, match="one entry per example"):
        step(x, y)


def test_loss_static_size_other_than_the_batch_is_refused():
    opt = DPSGDOptimizer(1.0, 0.0, per_example_backend="reference")
    model = keras.Sequential([keras.Input((5,)), L.Dense(3)])
    x, y = _xy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss()(y, model(x))[:2]
        opt.minimize(loss, model.trainable_variables, tape=tape)

    with pytest.raises(ValueError, match="one entry per example of the batch"):
        step(tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_batch_normalization_named_bn_is_refused_in_a_custom_loop(backend):
    model = keras.Sequential([keras.Input((5,)), L.Dense(4), L.BatchNormalization(name="bn"), L.Dense(3)])
    opt = DPSGDOptimizer(1.0, 0.0, per_example_backend=backend)
    x, y = _xy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss()(y, model(x, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)

    with pytest.raises(ValueError, match="'[^']*bn/[^']*'.*(reduces over the batch axis|batch statistics)"):
        step(x, y)


def test_layer_normalization_and_inference_mode_statistics_still_train():
    # Per-example statistics (LayerNorm's fused kernel) and a frozen normalization are fine.
    model = keras.Sequential([keras.Input((5,)), L.Dense(4), L.LayerNormalization(), L.Dense(3)])
    opt = DPSGDOptimizer(1.0, 0.0)
    model.compile(optimizer=opt, loss=_loss())
    x, y = _xy()
    model.fit(x, y, batch_size=4, verbose=0)
    assert opt._backend.last_fallback == []
