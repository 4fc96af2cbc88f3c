"""keras_dpsgd.step.distribute under a 2-replica MirroredStrategy (tests/step/test_distribute.py)."""

import tensorflow as tf

from keras_dpsgd.step import distribute as _distribute


def run(strategy: tf.distribute.MirroredStrategy) -> dict:
    """The replica helpers in replica context: ids, keys, sums, shares; R in and outside the scope."""
    key = tf.constant([7, 11], tf.int64)

    @tf.function
    def step():
        def replica_fn():
            return (
                _distribute.replica_id(),
                _distribute.replica_key(key),
                _distribute.global_sum(tf.cast(_distribute.replica_id(), tf.float32) + 1.0),
                _distribute.replica_share(tf.constant(6.0)),
            )

        return strategy.run(replica_fn)

    with strategy.scope():
        _distribute.check_strategy("test")
        in_scope = {"num_replicas": _distribute.num_replicas(), "scale": _distribute.replica_noise_scale()}
    ids, keys, sums, shares = (strategy.experimental_local_results(t) for t in step())
    return dict(
        in_scope,
        ids=[int(i) for i in ids],
        keys=[k.numpy().tolist() for k in keys],
        sums=[float(s) for s in sums],
        shares=[float(s) for s in shares],
        outside=_distribute.num_replicas(),
    )
