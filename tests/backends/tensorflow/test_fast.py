"""Fast per-example clipping vs the reference jacobian path vs a one-example-at-a-time loop."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _fast_helpers import (
    check,
    data,
    dense_mlp,
    per_layer_factors,
    rng,
)

L = keras.layers


class ValueGather(L.Layer):
    """tf.gather on the table's value (ReadVariableOp + GatherV2 instead of ResourceGather)."""

    def build(self, input_shape):
        self.table = self.add_weight("table", shape=(5, 3), initializer="random_normal")

    def call(self, ids):
        return tf.gather(tf.convert_to_tensor(self.table), ids)


class SeqMatMul(L.Layer):
    """x [B, T, D] @ W via BatchMatMulV2 (no tensordot reshape)."""

    def build(self, input_shape):
        self.k = self.add_weight("k", shape=(int(input_shape[-1]), 4), initializer="random_normal")

    def call(self, x):
        return tf.matmul(x, self.k)


@pytest.mark.parametrize("batch", [1, 5])
def test_dense_2d_flat_clipping(batch):
    x, y = data((batch, 7), (batch, 3))
    check(dense_mlp(), x, y)


def test_dense_2d_per_layer_clipping_and_tiny_bounds():
    x, y = data((6, 7), (6, 3), seed=1)
    got = check(dense_mlp(), x, y, factors=per_layer_factors([0.1, 0.05, 0.2, 0.01]))
    sq = got[1]
    assert sq.shape == (6, 4) and np.all(sq > 0)


@pytest.mark.parametrize("units,seq", [(4, 6), (24, 3)])  # direct per-example grads / ghost norm
def test_dense_on_sequences_and_layer_norm(units, seq):
    x, y = data((4, seq, 7), (4, seq, 3), seed=2)
    model = keras.Sequential([L.Dense(units, activation="tanh"), L.LayerNormalization(), L.Dense(3)])
    check(model, x, y, factors=per_layer_factors([0.3] * 6))


def test_sequence_length_unknown_at_trace_time():
    x, y = data((3, 5, 4), (3, 5, 2), seed=3)
    model = keras.Sequential([L.Dense(8, activation="relu"), L.Dense(2)])
    check(model, x, y, dynamic_dims=2, reference=False)


def test_layer_norm_on_2d_inputs_unfused_and_fused():
    x, y = data((5, 6), (5, 6), seed=4)
    model = keras.Sequential([L.Dense(6), L.LayerNormalization(epsilon=1e-6), L.LayerNormalization()])
    check(model, x, y)


def test_embedding_with_repeated_ids():
    gen = rng(7)
    x = gen.integers(0, 6, size=(5, 8)).astype("int32")  # vocab 6, 8 ids: repeats are certain
    y = gen.normal(size=(5, 2)).astype("float32")
    model = keras.Sequential([keras.Input((8,), dtype="int32"), L.Embedding(6, 3), L.Flatten(), L.Dense(2)])
    check(model, x, y)


def test_batch_matmul_on_sequences():
    x, y = data((3, 4, 5), (3, 4, 4), seed=11)
    check(keras.Sequential([SeqMatMul()]), x, y)


def test_gather_on_the_value_of_a_table():
    gen = rng(12)
    x = gen.integers(0, 5, size=(4, 3)).astype("int32")
    y = gen.normal(size=(4, 3, 3)).astype("float32")
    check(keras.Sequential([keras.Input((3,), dtype="int32"), ValueGather()]), x, y)


@pytest.mark.parametrize(
    "equation,output_shape,bias_axes",
    [
        ("abc,cd->abd", (None, 4), "d"),  # sequence dense as einsum
        ("abc,cde->abde", (None, 2, 3), "de"),  # attention-style projection to heads
        ("abc,bc->abc", (5, 3), None),  # weight indexed by a shared (non-batch) letter: materialized
    ],
)
def test_einsum_dense(equation, output_shape, bias_axes):
    x, y = data((4, 5, 3), (4, int(np.prod([5 if d is None else d for d in output_shape]))), seed=13)
    model = keras.Sequential(
        [
            keras.Input((5, 3)),
            keras.layers.EinsumDense(equation, output_shape=output_shape, bias_axes=bias_axes),
            L.Flatten(),
        ]
    )
    check(model, x, y)
