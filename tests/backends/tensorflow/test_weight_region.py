"""Variables used through ops on weights alone that have no factorized pullback (``_weight_region``), and weights
repeated over the batch along a new axis (``keras.ops.repeat``, the Tile rule): DeBERTa-v3's pattern, small.

Each case: the fast backend, with no variable on per-example jacobians, == the one-example loop (flat and per-layer
clipping, B = 1 and B = 3 through one trace), and removing one example moves the clipped sum by at most C.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _fast_helpers import (
    TfVariables,
    assert_same,
    flat_factors,
    loop_oracle,
    per_example_loss,
    per_layer_factors,
    traced_step,
)

from keras_dpsgd.backends.tensorflow import FastBackend, graph as _graph

L = keras.layers
STEPS, WIDTH, TABLE = 3, 4, 5


class _Disentangled(L.Layer):
    """A relative-position table, layer-normalized (ops on weights alone: mean, rsqrt, ...), repeated over the batch
    (``keras.ops.repeat``: ExpandDims, Tile along the new axis, Reshape), projected by the same Dense as the tokens
    and scored against them per example (DeBERTa-v3's content-to-position scores)."""

    def build(self, shape):
        self.table = self.add_weight(shape=(TABLE, WIDTH), initializer="random_normal", name="table")
        self.norm = L.LayerNormalization(gamma_initializer="random_uniform", beta_initializer="random_normal")
        self.norm.build((1, TABLE, WIDTH))
        self.proj = L.Dense(WIDTH)
        self.proj.build((None, None, WIDTH))

    def call(self, x):
        rel = self.norm(keras.ops.expand_dims(self.table, 0))
        rel = keras.ops.repeat(rel, keras.ops.shape(x)[0], axis=0)  # [B, TABLE, WIDTH], a copy per example
        scores = keras.ops.einsum("btd,brd->btr", self.proj(x), self.proj(rel))
        return keras.ops.concatenate([x, keras.ops.tanh(scores)], axis=-1)


class _SquashedKernel(L.Layer):
    """``x @ (tanh(w) * s)`` with a non-scalar weight ``s``: no factorized pullback, a weight region."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 3), initializer="random_normal")
        self.s = self.add_weight(shape=(shape[-1], 3), initializer="random_normal")

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.tanh(self.w) * self.s)


def _disentangled():
    inp = keras.Input((STEPS, WIDTH))
    h = _Disentangled()(L.Dense(WIDTH)(inp))
    return keras.Model(inp, L.Dense(2)(L.Flatten()(h)))


def _squashed():
    return keras.Sequential([keras.Input((WIDTH,)), _SquashedKernel(), L.Dense(2)])


_CASES = {"disentangled": (_disentangled, (STEPS, WIDTH)), "squashed-kernel": (_squashed, (WIDTH,))}


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_weight_regions_match_the_loop(name, per_layer):
    make, shape = _CASES[name]
    keras.utils.set_random_seed(0)
    gen = np.random.default_rng(0)
    x, y = gen.normal(size=(3, *shape)).astype("float32"), gen.normal(size=(3, 2)).astype("float32")
    model = make()
    model(x[:1])
    view = TfVariables(model)
    count = len(view.trainable_variables)
    factors = per_layer_factors([0.05 + 0.01 * v for v in range(count)]) if per_layer else flat_factors(0.5)
    backend = FastBackend()
    step = traced_step(backend, view, x, y, factors)
    for batch in (1, 3):
        got = step(x[:batch], y[:batch])
        assert backend.last_fallback == []
        assert_same(got, loop_oracle(view, x[:batch], y[:batch], factors), rtol=5e-4, atol=5e-5)


def test_removing_one_example_moves_the_sum_by_at_most_c():
    """σ = 0, flat clipping at C = 0.5, every example clipped (large errors): the bound is reached, not passed."""
    keras.utils.set_random_seed(1)
    gen = np.random.default_rng(1)
    x, y = gen.normal(size=(4, STEPS, WIDTH)).astype("float32"), 50 * gen.normal(size=(4, 2)).astype("float32")
    model = _disentangled()
    model(x[:1])
    view = TfVariables(model)
    backend = FastBackend()
    step = traced_step(backend, view, x, y, flat_factors(0.5))
    full = step(x, y)[0]
    assert backend.last_fallback == []
    for drop in range(len(x)):
        keep = [i for i in range(len(x)) if i != drop]
        part = step(x[keep], y[keep])[0]
        move = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(full, part)))
        assert 0.5 * 0.9 < move <= 0.5 * (1 + 1e-4)


def test_an_op_outside_the_region_ops_keeps_the_jacobians():
    """``x @ cumsum(w)``: a cumulative sum is not among the region's ops; the variable takes the exact jacobians."""

    class Cumulative(L.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 3))

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.cumsum(self.w, axis=0))

    model = keras.Sequential([keras.Input((WIDTH,)), Cumulative(), L.Dense(2)])
    gen = np.random.default_rng(2)
    x, y = gen.normal(size=(3, WIDTH)).astype("float32"), gen.normal(size=(3, 2)).astype("float32")
    view = TfVariables(model)
    backend = FastBackend()
    got = traced_step(backend, view, x, y, flat_factors(0.5))(x, y)
    assert backend.last_fallback == [view.trainable_variables[0].name]
    assert_same(got, loop_oracle(view, x, y, flat_factors(0.5)))


def test_copies_of_a_normalized_table_mixed_over_the_batch_are_refused():
    """The repeated copies of a table computed from weights are the examples' rows: an op averaging them over the
    batch is seen by the row analysis and refused (never given to the Tile rule as per-example copies)."""
    table = tf.Variable(tf.ones([1, 2, 4]))

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 4], tf.float32)], autograph=False)
    def step(x):
        rel = tf.repeat(tf.tanh(table), tf.shape(x)[0], axis=0)  # [B, 2, 4]
        mixed = rel * tf.reduce_mean(rel, axis=0, keepdims=True)
        _graph.analyze(tf.reduce_sum(x, axis=[1, 2]) + tf.reduce_sum(mixed, axis=[1, 2]))
        return x

    with pytest.raises(ValueError, match="Mean"):
        step.get_concrete_function()


def test_a_static_batch_repeats_the_table_by_a_constant():
    """With the batch size known at trace time (``fit`` on arrays), ``keras.ops.repeat`` repeats by a reshaped
    constant: the copies are still the examples' rows (before, every variable of the table and of the shared
    projection took the per-example jacobians)."""
    keras.utils.set_random_seed(3)
    gen = np.random.default_rng(3)
    x, y = gen.normal(size=(3, STEPS, WIDTH)).astype("float32"), gen.normal(size=(3, 2)).astype("float32")
    model = _disentangled()
    model(x[:1])
    view = TfVariables(model)
    backend = FastBackend()

    @tf.function(input_signature=[tf.TensorSpec(x.shape), tf.TensorSpec(y.shape)], autograph=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_loss(view, x, y)
        return backend.clipped_sum(loss, view.trainable_variables, tape, flat_factors(0.5))

    summed, sq = step(x, y)
    got = [t.numpy() for t in summed], sq.numpy()
    assert backend.last_fallback == []
    assert_same(got, loop_oracle(view, x, y, flat_factors(0.5)), rtol=5e-4, atol=5e-5)
