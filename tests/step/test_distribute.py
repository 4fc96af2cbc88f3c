"""keras_dpsgd.step.distribute: replica helpers and strategy refusals (both front ends use them)."""

import math

import pytest
import tensorflow as tf

from keras_dpsgd.step import distribute as _distribute
from tests._dist_helpers import strategy_runs


def test_one_replica_is_the_identity():
    key = tf.constant([3, 4], tf.int64)
    assert _distribute.num_replicas() == 1
    assert _distribute.replica_noise_scale() == 1.0
    assert int(_distribute.replica_id()) == 0
    assert _distribute.replica_key(key) is key
    value = tf.constant(5.0)
    assert _distribute.replica_share(value) is value
    assert _distribute.global_sum(value) is value
    _distribute.check_strategy("test")  # the default strategy


def test_one_device_strategies_are_the_identity():
    for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"), tf.distribute.MirroredStrategy(["/cpu:0"])):
        with strategy.scope():
            _distribute.check_strategy("test")
            assert _distribute.num_replicas() == 1
            key = tf.constant([3, 4], tf.int64)
            assert _distribute.replica_key(key) is key


@pytest.mark.parametrize(
    "name", ["TPUStrategy", "ParameterServerStrategy", "CentralStorageStrategy", "MirroredStrategyV1"]
)
def test_other_strategies_are_refused_by_name(name):
    fake = type(name, (), {})()
    with pytest.raises(ValueError, match=f"DPSGDOptimizer does not support {name}.*MirroredStrategy"):
        _distribute.check_strategy("DPSGDOptimizer", fake)


def test_central_storage_is_refused_in_its_scope():
    with tf.distribute.experimental.CentralStorageStrategy().scope():
        with pytest.raises(ValueError, match="does not support CentralStorageStrategy"):
            _distribute.check_strategy("DPSGDOptimizer")


def test_two_mirrored_replicas():
    result = strategy_runs()["mirrored"]["replicas"]  # tests/dist_scripts/distribute_replicas.py
    assert result["num_replicas"] == 2 and result["outside"] == 1
    assert result["scale"] == pytest.approx(1 / math.sqrt(2))
    assert result["ids"] == [0, 1]
    keys = [tuple(k) for k in result["keys"]]
    assert len(set(keys)) == 2 and (7, 11) not in keys  # each replica its own key
    expected = [
        tuple(
            tf.random.experimental.stateless_fold_in(tf.constant([7, 11], tf.int64), tf.constant(r, tf.int64)).numpy()
        )
        for r in (0, 1)
    ]
    assert keys == expected  # seeded: a function of (key, r), reproducible
    assert result["sums"] == [3.0, 3.0]  # (0 + 1) + (1 + 1) on both replicas
    assert result["shares"] == [3.0, 3.0]  # 6 / R
