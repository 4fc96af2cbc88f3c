"""Fail closed on state the train step writes from the batch, and on eager steps (issue 25, items 1-3).

1. A statistic of the batch kept in a variable and read back on the way to the loss
   (``self.v.assign(reduce_mean(x, 0))`` then ``x - self.v``, or the previous batch's read before)
   mixes the examples through an ordering edge the row analysis took for a weight: it trained.
2. A variable written from the batch and never read back held the exact statistic of the last batch,
   un-noised, outside the ledger, and was saved with the model: it trained silently.
3. ``run_eagerly=True`` only warned; with a layer that mixes the batch, one example moved the update
   by 1.96·C (tf.roll) and 1.45·C (tf.nn.moments).

All refused now, before any weight changes, on both Kerases and both per-example backends; the
controls (a layer counting its calls in a variable, a per-example layer of the same shape) train,
with one example moving the update by at most C (σ = 0).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_dpsgd.keras3
import keras_dpsgd.tf_keras
from _fast_helpers import data, flat_factors, run_traced
from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow._backend import _reference_backend

CLIP = 1.0
LOT = 8.0


def _front(name):
    if name == "tf_keras":
        return tf_keras, keras_dpsgd.tf_keras, {"reduction": "none"}
    import keras

    return keras, keras_dpsgd.keras3, {}


def _layer(K, kind):
    """A layer of the given kind, for Keras ``K`` (tf_keras or Keras 3)."""

    class Stateful(K.layers.Layer):
        def build(self, shape):
            self.v = self.add_weight(name="v", shape=(int(shape[-1]),), initializer="ones", trainable=False)

        def call(self, x, training=None):
            if kind == "mean_read_back":  # item 1: batch mean through a variable
                self.v.assign(tf.reduce_mean(x, axis=0))
                return x - self.v
            if kind == "max_read_back":  # item 1: batch max through a variable, added to
                self.v.assign_add(tf.reduce_max(tf.abs(x), axis=0))
                return x / self.v
            if kind == "mean_read_before":  # item 1: the mean of the previous batch, then this one's kept
                out = x - self.v
                self.v.assign(tf.reduce_mean(x, axis=0))
                return out
            if kind == "stores_mean":  # item 2: the batch mean kept, never read back
                self.v.assign(tf.reduce_mean(x, axis=0))
                return x
            if kind == "counts_calls":  # control: written, not from the batch; read as a weight
                self.v.assign_add(tf.ones_like(self.v))
                return x * tf.tanh(x) / self.v
            if kind == "roll":  # item 3: mixes the batch (refused in a traced step)
                return x + tf.roll(x, shift=1, axis=0)
            if kind == "moments":
                mean, var = tf.nn.moments(x, axes=[0])
                return (x - mean) / tf.sqrt(var + 1e-3)
            return x * tf.tanh(x)  # "per_example": the control of item 3

    return Stateful(name="stateful")


def _model(front, kind, backend):
    K, kd, loss = _front(front)
    model = K.Sequential([K.Input((4,)), K.layers.Dense(3), _layer(K, kind), K.layers.Dense(2)])
    if front == "keras3":
        kd.make_private(model)
    return model, kd, K.losses.SparseCategoricalCrossentropy(from_logits=True, **loss)


def _data():
    rng = np.random.default_rng(25)
    x = (3.0 * rng.normal(size=(8, 4))).astype("float32")
    return x, rng.integers(0, 2, size=8)


def _compiled(front, kind, backend, run_eagerly=False):
    """The model from its fixed initial weights, compiled for one DP step (σ = 0, lr = 1, lot size L)."""
    model, kd, loss = _model(front, kind, backend)
    model.set_weights(_initial(front, kind))
    opt = kd.DPSGDOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=1.0, expected_lot_size=LOT, per_example_backend=backend
    )
    model.compile(optimizer=opt, loss=loss, run_eagerly=run_eagerly)
    return model


def _floats(model):
    return [w for w in model.get_weights() if np.asarray(w).dtype.kind == "f"]


def _stepped(model, x, y, initial):
    """The weights after one DP step on (x, y) from ``initial``."""
    model.set_weights(initial)
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return _floats(model)


_INITIAL = {}


def _initial(front, kind):
    if (front, kind) not in _INITIAL:
        model, _, _ = _model(front, kind, "auto")
        _INITIAL[front, kind] = model.get_weights()
    return _INITIAL[front, kind]


def _sensitivity(front, kind, backend):
    """max over examples j of ‖L·(update on the lot) − L·(update without example j)‖ (σ = 0, lr = 1)."""
    x, y = _data()
    model = _compiled(front, kind, backend)  # One model: a step of 8 and one of 7 examples are traced.
    initial = model.get_weights()
    full = _stepped(model, x, y, initial)
    worst = 0.0
    for j in range(len(x)):
        keep = np.arange(len(x)) != j
        without = _stepped(model, x[keep], y[keep], initial)
        sq = sum(np.sum((LOT * (a.astype(np.float64) - b)) ** 2) for a, b in zip(full, without))
        worst = max(worst, float(np.sqrt(sq)))
    return worst


def _assert_refused_unchanged(model, x, y, match):
    before = _floats(model)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = _floats(model)
    assert len(after) == len(before)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


_VARIABLE = r"(a )?variable (of layer )?'[^']*stateful[^']*'"
_REFUSED = {
    "mean_read_back": rf"reads {_VARIABLE}, and op .*AssignVariableOp.*LayerNormalization",
    "mean_read_before": rf"reads {_VARIABLE}, and op .*AssignVariableOp",
    "max_read_back": rf"reads {_VARIABLE}, and op .*Assign(Add)?VariableOp",
    "stores_mean": rf"writes a value computed from the batch into {_VARIABLE}.*freeze it",
}
BACKENDS = ["fast", "reference"]
FRONTS = ["tf_keras", "keras3"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", sorted(_REFUSED))
def test_batch_written_into_a_variable_is_refused_before_any_weight_changes(kind, front, backend):
    _assert_refused_unchanged(_compiled(front, kind, backend), *_data(), _REFUSED[kind])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("front", FRONTS)
def test_a_variable_written_from_no_example_still_trains_within_the_bound(front, backend):
    """Control: a layer counting its calls in a variable it reads back (the same shape of model)."""
    assert _sensitivity(front, "counts_calls", backend) <= CLIP * (1 + 1e-4)


@pytest.mark.parametrize("kind", ["roll", "moments"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("front", FRONTS)
def test_run_eagerly_is_refused_before_any_weight_changes(front, backend, kind):
    model = _compiled(front, kind, backend, run_eagerly=True)
    _assert_refused_unchanged(model, *_data(), r"refuses to run a DP-SGD step eagerly.*Remove run_eagerly=True")


@pytest.mark.parametrize("front", FRONTS)
def test_the_same_per_example_model_trains_traced_within_the_bound(front):
    """Control of run_eagerly: the model without it (the default, traced step) trains."""
    assert _sensitivity(front, "per_example", "fast") <= CLIP * (1 + 1e-4)


@pytest.mark.parametrize("backend", [FastBackend, _reference_backend], ids=BACKENDS)
def test_custom_loop_reading_back_a_batch_statistic_is_refused(backend):
    """Straight through the backends (a custom tf.function loop): the read-back is refused by both."""
    x, y = data((4, 5), (4, 3))
    model = tf_keras.Sequential([tf_keras.Input((5,)), tf_keras.layers.Dense(3), _layer(tf_keras, "mean_read_back")])
    with pytest.raises(ValueError, match=f"loss reads {_VARIABLE}.* writes a value computed"):
        run_traced(backend(), model, x, y, flat_factors(CLIP))


@pytest.mark.parametrize("front", FRONTS)
def test_batch_normalization_writes_in_training_and_not_frozen(front):
    """BatchNormalization's moving statistics are writes of the batch in training mode; frozen
    (trainable = False: inference mode) it writes nothing, so this check lets it through."""
    from keras_dpsgd.backends.tensorflow import state as _state

    K, _, _ = _front(front)
    x = tf.constant(_data()[0])

    def writes(trainable):
        layer = K.layers.BatchNormalization(name="bn")
        layer(x[:1])
        layer.trainable = trainable
        graph = (
            tf.function(lambda x: layer(x, training=True))
            .get_concrete_function(tf.TensorSpec([None, 4], tf.float32))
            .graph
        )
        return _state.scan(graph)[0]

    assert writes(True) and not writes(False)


def test_a_keras3_models_own_eager_step_is_refused():
    """A model's own train_step (sanitized_gradients) run eagerly: refused like fit's."""
    from tests.keras3.test_keras3_step import OwnStep, _sanitize_then_apply

    model = OwnStep(_sanitize_then_apply)
    x, y = _data()
    model(x[:1])
    opt = keras_dpsgd.keras3.DPSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=1.0)
    model.compile(optimizer=opt, run_eagerly=True)
    _assert_refused_unchanged(model, x, y, "Remove run_eagerly=True")
