"""The ledger is the model's but no model weight (issue 27.8); h5 weights that lose it are refused (25.6).

tf_keras counted the ledger's string variable (`segments:0`) among a functional model's weights:
`get_weights()` returned an extra bytes array, `w, b = model.get_weights()` and `set_weights` from a
plain model broke, and h5 weights saved it as a layer weight yet lost it on load (ε back to 0 after
a resume). Now the ledger is a checkpoint dependency only, and tf_keras h5 weights are refused.

Each tf_keras test here failed on the code before the fix; the Keras 3 check passed before too.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from keras_dpsgd import PrivacyLogger, model_epsilon
from keras_dpsgd.tf_keras import DPSGDOptimizer

N, B, SIGMA, DELTA = 16, 4, 1.1, 1e-3
X = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
Y = (X[:, :1] > 0).astype(np.float32)


def _functional(keras, optimizer=None):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    return model


def _dp():
    return DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1)


def _epsilon(model):
    return model_epsilon(model, target_delta=DELTA, num_examples=N, batch_size=B)[0]


def _trained():
    model = _functional(tf_keras, _dp())
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0)
    return model


def _assert_plain_weights(model):
    assert [w.name.split("/")[-1] for w in model.weights] == ["kernel:0", "bias:0"]
    kernel, bias = model.get_weights()
    assert kernel.shape == (3, 1) and bias.shape == (1,) and kernel.dtype == np.float32


def test_tf_keras_ledger_is_no_weight_and_weights_move_between_plain_and_private_models(tmp_path):
    model = _trained()
    _epsilon(model)  # a reader attaches the ledger too
    _assert_plain_weights(model)
    plain = _functional(tf_keras)
    plain.set_weights(model.get_weights())
    model.set_weights(plain.get_weights())
    # Still checkpointed (the model's copy restores into a fresh model and optimizer).
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = _functional(tf_keras, _dp())
    tf.train.Checkpoint(model=fresh).restore(path)  # deferred: applied when the ledger attaches
    assert _epsilon(fresh) == pytest.approx(_epsilon(model), rel=1e-12)
    assert _epsilon(fresh) > 0.0
    _assert_plain_weights(fresh)


def test_tf_keras_savedmodel_keeps_the_ledger_out_of_the_weights(tmp_path):
    model = _trained()
    eps = _epsilon(model)
    model.save(str(tmp_path / "saved"))
    loaded = tf_keras.models.load_model(str(tmp_path / "saved"))
    assert _epsilon(loaded) == pytest.approx(eps, rel=1e-12)
    _assert_plain_weights(loaded)


def test_keras3_ledger_is_no_weight():
    import keras

    import keras_dpsgd.keras3 as k3

    inputs = keras.Input((3,))
    model = k3.make_private(keras.Model(inputs, keras.layers.Dense(1)(inputs)))
    optimizer = k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1)
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0)
    assert _epsilon(model) > 0.0
    assert len(model.weights) == 2
    kernel, bias = model.get_weights()
    assert kernel.shape == (3, 1) and bias.shape == (1,)


def test_tf_keras_h5_weights_are_refused_before_training_and_after(tmp_path):
    model = _functional(tf_keras, _dp())
    before = model.get_weights()
    checkpoint = tf_keras.callbacks.ModelCheckpoint(str(tmp_path / "weights.h5"), save_weights_only=True)
    logger = PrivacyLogger(num_examples=N, batch_size=B, target_delta=DELTA)
    with pytest.raises(ValueError, match=r"ModelCheckpoint\('.*weights\.h5', save_weights_only=True\) is refused"):
        model.fit(X, Y, batch_size=B, epochs=2, verbose=0, callbacks=[logger, checkpoint])
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert int(model.optimizer.noised_steps.numpy()) == 0
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0, callbacks=[logger])
    for path, kwargs in ((tmp_path / "w.h5", {}), (tmp_path / "w", {"save_format": "h5"})):
        with pytest.raises(ValueError, match="keep the whole ledger"):
            model.save_weights(str(path), **kwargs)
        assert not os.path.exists(path)
    model.save_weights(str(tmp_path / "tf_weights"))  # the TF format keeps the ledger: allowed
