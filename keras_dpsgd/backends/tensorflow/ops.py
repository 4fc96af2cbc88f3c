"""The TensorFlow backend's table of array operations (:class:`keras_dpsgd.dp.ops.ArrayOps`) for the DP core,
the noise source over it (the core's sampler, :mod:`keras_dpsgd.dp.noise`) and the optimizer's local state.

Why not ``tf.random.normal``: it clamps its uniform and has no sample past 5.68 (``keras_dpsgd.dp.noise``).

Random words: ``tf.random.stateless_uniform`` (Philox) under a stateless [2] int64 key; stream 0 is the key
itself, stream 1 the key folded with 1 (the layout of the sampler since 0.1: a one-tensor draw reproduces 0.2.0's;
after 0.2.0 a release's tensors are one draw). A seeded key is the pair (seed mod 2⁶³, the release's position in
the model's ledger).
"""

from __future__ import annotations

import tensorflow as tf

from keras_dpsgd.dp import release
from keras_dpsgd.dp.noise import circle_by_trig, noise_key, scaled_normal
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["TF_OPS", "add_gaussian", "make_local_state", "seeded_key", "standard_normal"]


def _random_words(key, shape, stream: int):
    """uint32 words of `shape` (every value of 2³²), a function of (key, stream)."""
    seed = key if stream == 0 else tf.random.experimental.stateless_fold_in(key, stream)
    static = all(isinstance(d, int) for d in shape)  # a constant shape: no op to build it in a traced step
    return tf.random.stateless_uniform(
        list(shape) if static else tf.stack(shape), seed=seed, minval=None, maxval=None, dtype=tf.uint32
    )


def _seed_key(seed: int, position):
    """[2] int64: (seed mod 2⁶³, position)."""
    return tf.stack([tf.constant(int(seed) % (2**63), tf.int64), tf.cast(position, tf.int64)])


def _group_sum(x, groups, num_groups):
    return tf.transpose(tf.math.unsorted_segment_sum(tf.transpose(x), list(groups), num_groups))


TF_OPS = ArrayOps(
    name="tensorflow",
    minimum=tf.minimum,
    maximum=tf.maximum,
    exp=tf.exp,
    where=tf.where,
    zeros_like=tf.zeros_like,
    ones_like=tf.ones_like,
    log=tf.math.log,
    sqrt=tf.sqrt,
    is_finite=tf.math.is_finite,
    cast=tf.cast,
    reshape=tf.reshape,
    reduce_all=lambda x, axis=None, keepdims=False: tf.reduce_all(x, axis=axis, keepdims=keepdims),
    group_sum=_group_sum,
    gather_columns=lambda x, index: tf.gather(x, list(index), axis=1),
    cond=tf.cond,
    random_words=_random_words,
    fold_in=tf.random.experimental.stateless_fold_in,
    seed_key=_seed_key,
    unit_circle=circle_by_trig(tf.math.cos, tf.math.sin, tf.stack),
    rows=tf.unstack,
    concat=lambda xs: tf.concat(xs, 0),
    split=lambda x, sizes, axis: tf.split(x, list(sizes), axis),
)


# The backend's noise source (``keras_dpsgd.backends.INTERFACE``): the core's sampler over this table.
def seeded_key(seed: int, position, index: int) -> tf.Tensor:
    """The [2] int64 key of tensor `index` of the release at ledger position `position` under `seed`."""
    return noise_key(TF_OPS, seed, position, index)


def standard_normal(shape, seed, dtype=tf.float32) -> tf.Tensor:
    """N(0, 1) samples of `shape` (a static or traced shape), a stateless function of ``seed`` ([2] int64)."""
    shape = tf.convert_to_tensor(shape, tf.int32)
    return tf.cast(tf.reshape(scaled_normal(TF_OPS, tf.reduce_prod(shape), seed, 1.0), shape), dtype)


def add_gaussian(x: tf.Tensor, stddev, seed) -> tf.Tensor:
    """``x + N(0, stddev² I)`` (``keras_dpsgd.dp.release.add_gaussian``)."""
    return release.add_gaussian(TF_OPS, x, stddev, seed)


def make_local_state(state) -> None:
    """The optimizer's local state on TensorFlow (``DPState``: never saved): ``tf.Variable``s made outside
    any trace, and an OS-entropy generator when there is no seed."""
    with tf.init_scope():
        lot = 0.0 if state.expected_lot_size is None else state.expected_lot_size
        state.lot = tf.Variable(lot, dtype=tf.float32, trainable=False, name="expected_lot_size")
        # An un-noised count over the private data: a local diagnostic outside the ledger. Under a
        # strategy each replica counts its own examples and a read sums them (ON_READ, SUM).
        state.nonfinite = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            name="nonfinite_examples",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        state.ledger_offset = tf.Variable(0, dtype=tf.int64, trainable=False, name="ledger_offset")
        if state.seed is None:
            # Fresh OS entropy per process: restoring a checkpoint twice never replays noise.
            state.generator = tf.random.Generator.from_non_deterministic_state()
