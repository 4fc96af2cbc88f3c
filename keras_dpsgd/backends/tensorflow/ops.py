"""The TensorFlow backend's table of array operations (:class:`keras_dpsgd.dp.ops.ArrayOps`) for the DP core.

Random words: ``tf.random.stateless_uniform`` (Philox) under a stateless [2] int64 key; stream 0 is the key
itself, stream 1 the key folded with 1 (the layout of the sampler since 0.1: seeded runs reproduce). A
seeded key is the pair (seed mod 2⁶³, the release's position in the model's ledger).
"""

from __future__ import annotations

import tensorflow as tf

from keras_dpsgd.dp.noise import circle_by_trig
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["TF_OPS"]


def _random_words(key, shape, stream: int):
    """uint32 words of `shape` (every value of 2³²), a function of (key, stream)."""
    seed = key if stream == 0 else tf.random.experimental.stateless_fold_in(key, stream)
    return tf.random.stateless_uniform(tf.stack(shape), seed=seed, minval=None, maxval=None, dtype=tf.uint32)


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
)
