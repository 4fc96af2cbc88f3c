"""The tuner on tf_keras: the returned model's ledger is the search, and a .keras file (which keeps only the
optimizer's counter) is refused rather than losing it."""

import numpy as np
import pytest
import tf_keras as keras

import keras_dpsgd
from keras_dpsgd.accounting import TuningEvent, compute_epsilon
from keras_dpsgd.tools.tuning import tune

DELTA = 1e-5


def test_a_tf_keras_search_is_in_the_model_and_a_keras_file_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 8)).astype("float32")
    labels = rng.integers(3, size=600)
    x = centers[labels] + 0.5 * rng.normal(size=(600, 8)).astype("float32")
    result = tune(
        lambda: keras.Sequential([keras.layers.Dense(3, input_shape=(8,))]),
        x[:500],
        labels[:500],
        validation_data=(x[500:], labels[500:]),
        search_space={"learning_rate": [0.5], "l2_norm_clip": [1.0], "expected_lot_size": [100], "epochs": [1]},
        target_epsilon=2.0,
        target_delta=DELTA,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        eta=1.0,
        gamma=0.5,
        seed=1,  # for the test only
    )
    assert isinstance(result.model, keras.Model)
    assert [type(e) for e in keras_dpsgd.model_privacy_ledger(result.model).events] == [TuningEvent]
    epsilon = keras_dpsgd.model_epsilon(result.model, target_delta=DELTA)[0]
    assert epsilon == result.epsilon == compute_epsilon(result.event, DELTA) <= 2.0
    with pytest.raises(ValueError, match="also records the hyperparameter search"):
        result.model.save(str(tmp_path / "best.keras"))
