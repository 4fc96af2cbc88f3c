"""Grouped convolutions (Conv1D/Conv2D with groups > 1) on the fast backend, both Kerases.

Keras runs them as an XLA-compiled call; the fast backend reads the call's body
(``keras_dpsgd.backends.tensorflow._grouped``) and computes each example's kernel gradient per group of channels.
TensorFlow's pfor jacobian is wrong for grouped convolutions (tests/backends/tensorflow/test_fast_conv.py), so the oracle
is the one-example-at-a-time loop, and every other path refuses them.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from _fast_helpers import assert_same, data, flat_factors, loop_oracle, per_example_loss, per_layer_factors
from _keras3_helpers import loop_clipped_mean, one_sgd_step

import keras_dpsgd.keras3 as k3
import keras_dpsgd.tf_keras as kt
from keras_dpsgd.backends.tensorflow import FastBackend, ReferenceBackend, _grouped

FRONT_ENDS = {"tf_keras": tf_keras, "keras3": keras}
LR = 0.5


def _conv2d_model(front_end):
    """A plain Conv2D below two grouped ones (the first layer's δ flows through their calls):
    groups 4 then 2, 'valid' with a stride then 'same' dilated, 1 then 32 input channels per group
    (both layouts of ``_conv.per_example_kernel_grads``)."""
    layers = front_end.layers
    return front_end.Sequential(
        [
            front_end.Input((7, 7, 3)),
            layers.Conv2D(4, 1),
            layers.Conv2D(64, 3, groups=4, strides=2, activation="tanh"),
            layers.Conv2D(4, 2, groups=2, dilation_rate=2, padding="same"),
            layers.Flatten(),
            layers.Dense(2),
        ]
    )


def _conv1d_model(front_end):
    """Conv1D runs as Conv2D on ExpandDims, here dilated: on SpaceToBatchND blocks, inside the call."""
    layers = front_end.layers
    return front_end.Sequential(
        [
            front_end.Input((9, 4)),
            layers.Conv1D(8, 3, groups=4, padding="causal", dilation_rate=2, activation="tanh"),
            layers.Flatten(),
            layers.Dense(2),
        ]
    )


def _backend_view(model):
    """The model as the optimizer hands it to the backend: tf.Variables (a Keras 3 variable's ``value``)."""
    if isinstance(model, tf_keras.Model):
        return model

    def view(x):
        return model(x)

    view.trainable_variables = [v.value for v in model.trainable_variables]
    return view


def _traced_view(view):
    """``view`` called through one tf.function: the loop's examples reuse one trace (and one XLA
    compilation of the grouped convolution) instead of one per example."""
    call = tf.function(view)

    def traced(x):
        return call(x)

    traced.trainable_variables = view.trainable_variables
    return traced


def _traced_step(backend, view, factors, x_shape, y_shape):
    """``backend.clipped_sum`` of the per-example loss in one tf.function for every batch size
    (without autograph, which is slow to convert the backend)."""

    @tf.function(
        autograph=False,
        input_signature=[tf.TensorSpec((None,) + tuple(x_shape)), tf.TensorSpec((None,) + tuple(y_shape))],
    )
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_loss(view, x, y)
        return backend.clipped_sum(loss, view.trainable_variables, tape, factors)

    return step


def _check(model, x, y, factors, batches):
    """The fast backend == the one-example loop, at each batch size, with no jacobian fallback."""
    model(x[:1])
    view = _backend_view(model)
    backend = FastBackend()
    step = _traced_step(backend, view, factors, x.shape[1:], y.shape[1:])
    for batch in batches:
        summed, sq_norms = step(x[:batch], y[:batch])
        assert backend.last_fallback == []
        got = ([s.numpy() for s in summed], sq_norms.numpy())
        assert_same(got, loop_oracle(_traced_view(view), x[:batch], y[:batch], factors))


@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
def test_fast_backend_equals_the_one_example_loop(front):
    """Flat clipping (B = 3 and B = 1), per-layer clipping (B = 2): the fast backend == the loop of
    each example's own gradient, no variable on the jacobian fallback."""
    front_end = FRONT_ENDS[front]
    x, y = data((3, 7, 7, 3), (3, 2), seed=4)
    _check(_conv2d_model(front_end), x, y, flat_factors(1.0), batches=(3, 1))
    x, y = data((2, 9, 4), (2, 2), seed=5)
    _check(_conv1d_model(front_end), x, y, per_layer_factors([0.1, 0.02, 0.3, 0.05]), batches=(2,))


def test_the_rule_reads_only_kerass_convolution_calls():
    """A jit-compiled grouped convolution of one's own (tests/backends/tensorflow/test_reference_guard.py) is not
    recognized: its kernel is not on the fast path, and the jacobian fallback's check guards it."""

    @tf.function(jit_compile=True)
    def own_conv(x, k):
        return tf.nn.conv2d(x, k, 1, "VALID")

    @tf.function
    def step(x, k):
        return own_conv(x, k)

    graph = step.get_concrete_function(tf.TensorSpec((None, 5, 5, 4)), tf.TensorSpec((3, 3, 2, 4))).graph
    calls = [op for op in graph.get_operations() if op.type in _grouped.CALL_OPS]
    assert calls and all(_grouped.recognize(op) is None for op in calls)


def _fit_model(front_end):
    layers = front_end.layers
    return front_end.Sequential(
        [
            front_end.Input((6, 6, 4)),
            layers.Conv2D(8, 3, groups=4, strides=2, activation="relu"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(3),
        ]
    )


def _compiled(front, clip, backend="auto", run_eagerly=False):
    front_end = FRONT_ENDS[front]
    model = _fit_model(front_end)
    dp = kt if front == "tf_keras" else k3
    opt = dp.DPSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR, per_example_backend=backend, seed=1
    )
    if front == "keras3":
        k3.make_private(model)
    loss = front_end.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    model.compile(optimizer=opt, loss=loss, run_eagerly=run_eagerly)
    return model, opt


@pytest.mark.parametrize("front, clip, per_layer", [("tf_keras", 0.2, False), ("keras3", [0.1, 0.02, 0.3, 0.04], True)])
def test_fit_update_is_the_clipped_mean_of_the_one_example_loop(front, clip, per_layer):
    """σ = 0: one fit step moves the weights by LR times the loop's clipped mean, on the fast path
    (before the fast rule, fit refused the model)."""
    gen = np.random.default_rng(3)
    x = gen.normal(size=(4, 6, 6, 4)).astype("float32")
    y = gen.integers(0, 3, size=4)
    model, opt = _compiled(front, clip)
    loss_fn = FRONT_ENDS[front].losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    expected = loop_clipped_mean(model, x, y, loss_fn, clip, per_layer=per_layer)
    before, after = one_sgd_step(model, x, y, LR)
    assert opt._backend.last_fallback == []
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert all(np.any(b != a) for b, a in zip(before, after))


@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
@pytest.mark.parametrize("how", ["reference", "eager"])
def test_other_paths_still_refuse(front, how):
    """The reference backend and an eager step would take pfor jacobians through the layer: refused."""
    model, _ = _compiled(front, 1.0, backend="reference" if how == "reference" else "auto", run_eagerly=how == "eager")
    x = np.zeros((2, 6, 6, 4), "float32")
    with pytest.raises(ValueError, match=r"groups=4\).*grouped convolution"):
        model.fit(x, np.zeros(2, "int32"), batch_size=2, epochs=1, verbose=0)


@pytest.mark.parametrize("front", sorted(FRONT_ENDS))
def test_in_the_trace_a_grouped_convolution_off_the_fast_path_is_refused(front):
    """Unknown spatial sizes: the rule declines, and the trace refuses (never pfor) on either
    backend; the traced reference backend refuses Keras's grouped-convolution call too."""
    front_end = FRONT_ENDS[front]
    layers = front_end.layers
    model = front_end.Sequential([front_end.Input((None, None, 4)), layers.Conv2D(4, 3, groups=2), layers.Dense(2)])
    x, y = data((2, 5, 5, 4), (2, 3, 3, 2), seed=1)
    model(x[:1])
    view = _backend_view(model)
    for backend in (FastBackend(), ReferenceBackend()):
        with pytest.raises(ValueError, match=r"PartitionedCall' is a grouped convolution"):
            _traced_step(backend, view, flat_factors(1.0), (None, None, 4), y.shape[1:])(x, y)


class _OwnStep(keras.Model):
    """A Keras 3 model with its own train_step (``keras_dpsgd.keras3.private_update``)."""

    def __init__(self):
        super().__init__()
        self.conv, self.flat, self.dense = (
            keras.layers.Conv2D(4, 3, groups=2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        )

    def call(self, x):
        return self.dense(self.flat(self.conv(x)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(self(x, training=True) - y), axis=1)
        k3.private_update(self.optimizer, loss, self.trainable_variables, tape)
        return {"loss": tf.reduce_mean(loss)}


def test_keras3_own_eager_step_refuses_a_grouped_convolution():
    """A model's own step run eagerly has no graph to read or check: it trained on pfor's wrong
    per-example gradients before (private_update did not look at the model's layers)."""
    x, y = data((2, 5, 5, 4), (2, 2), seed=2)
    model = _OwnStep()
    model(x[:1])
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1), run_eagerly=True
    )
    with pytest.raises(ValueError, match=r"groups=2\).*grouped convolution.*runs eagerly"):
        model.fit(x, y, batch_size=2, epochs=1, verbose=0)
