"""Keras 3 on JAX runs the user's model as Keras would, or refuses it by name (issue 37, class 6).

* A trainer hook through which Keras's JAX train step computes the loss (``compute_loss_and_updates``,
  ``stateless_compute_loss``, ``compute_loss``, ``_compute_loss``, ``train_step``) is refused at
  ``make_private``, with the way out that holds on every backend (never "switch to TensorFlow", which
  refuses ``compute_loss`` too).
* A compiled loss that reads the weights runs in the scope that maps them: its weight term is part of
  each example's loss, clipped with it (as on TensorFlow: ``tests/keras3/test_keras3_hooks.py``).
* A covered layer called inside a loop (an RNN cell's Dense, a Dense in ``keras.ops.fori_loop``) takes the
  exact ``jax.vmap`` path, announced; the step equals the one-example loop.

Every step is checked with σ = 0 against a one-example-at-a-time loop (``tests._keras3_helpers``).
"""

import logging

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd.backends.jax import ghost as _ghost
from keras_dpsgd.keras3._jax_loss import per_example_loss_at
from tests._behaviour import keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step, weight_reading_loss_case

FRONT = keras3_front()
LR = 0.5
HOOKS = ("compute_loss_and_updates", "stateless_compute_loss", "compute_loss", "_compute_loss", "train_step")


def _step_matches(model, x, y, expected):
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert max(np.abs(g).max() for g in expected) > 1e-3  # the step moved the weights


def _optimizer(clip, backend):
    return k3.DPSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR, seed=1, per_example_backend=backend
    )


@pytest.mark.parametrize("method", HOOKS)
def test_loss_hooks_are_refused_by_name_with_a_way_out_true_on_every_backend(method):
    class Hooked(keras.Sequential):
        pass

    setattr(Hooked, method, lambda self, *a, **k: None)  # never runs: refused before
    model = Hooked([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=f"overrides {method}, which Keras's train step on the jax backend") as err:
        k3.make_private(model)
    message = str(err.value)
    assert "KERAS_BACKEND=tensorflow" not in message and "compile(loss=...)" in message
    assert not hasattr(vars(model), "train_step") and not k3._train_step.is_private(model)


def test_a_model_overriding_only_call_and_compute_metrics_trains():
    """The control: hooks the private step runs as Keras does (call, compute_metrics) are not refused."""
    seen = []

    class Own(keras.Sequential):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            seen.append(True)
            return super().compute_metrics(x, y, y_pred, sample_weight)

    keras.utils.set_random_seed(0)
    model = k3.make_private(Own([keras.Input((5,)), keras.layers.Dense(3)]))
    x, y = np.random.default_rng(0).normal(size=(6, 5)).astype("float32"), np.arange(6) % 3
    model.compile(optimizer=_optimizer(0.5, "auto"), loss=FRONT.loss())
    _step_matches(model, x, y, loop_clipped_mean(model, x, y, FRONT.loss(), 0.5))
    assert seen


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_compiled_loss_reading_the_weights_is_exact(backend):
    """ℓ_i = ce_i + 0.1·Σ k² with k the first Dense's kernel: before, 'NoneType' object is not callable (the
    loss ran outside the scope that maps the variables). With 'auto' the kernel read by the loss leaves its
    layer to jax.vmap (a rule on the Dense's call would miss that use); the other Dense keeps its rule."""
    model, x, y, loss, clip, expected = weight_reading_loss_case(keras)
    k3.make_private(model)
    model.compile(optimizer=_optimizer(clip, backend), loss=loss)
    if backend == "auto":
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        plan = _ghost.plan(model, trainable, non_trainable, x, {}, y, None, loss_at=per_example_loss_at)
        assert plan.covered == [model.layers[1]]
    _step_matches(model, x, y, expected)


class _Cell(keras.layers.Layer):
    """An RNN cell holding a Dense: the Dense is called in the body of RNN's jax.lax.scan."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 4
        self.dense = keras.layers.Dense(4, activation="tanh")

    def build(self, input_shape):
        self.dense.build((None, input_shape[-1] + 4))

    def call(self, inputs, states):
        h = self.dense(keras.ops.concatenate([inputs, states[0]], axis=-1))
        return h, [h]


class _Looped(keras.layers.Layer):
    """A Dense applied three times in keras.ops.fori_loop, or in both branches of keras.ops.cond."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.dense = keras.layers.Dense(4, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, h):
        if self.kind == "cond":
            return keras.ops.cond(keras.ops.sum(h) > 0, lambda: self.dense(h), lambda: self.dense(-h))
        return keras.ops.fori_loop(0, 3, lambda _, h: self.dense(h), h)


def _loop_model(kind):
    rng = np.random.default_rng(4)
    keras.utils.set_random_seed(4)
    if kind == "rnn":
        inputs, x = keras.Input((3, 2)), rng.normal(size=(5, 3, 2)).astype("float32")
        h = keras.layers.RNN(_Cell())(inputs)
    else:
        inputs, x = keras.Input((4,)), rng.normal(size=(5, 4)).astype("float32")
        h = _Looped(kind)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    return model, x, rng.integers(0, 3, size=len(x))


@pytest.mark.parametrize("kind", ["rnn", "fori_loop", "cond"])
def test_a_dense_called_inside_a_loop_takes_the_exact_path_announced(kind, caplog):
    """Before: UnexpectedTracerError (the interception recorded the loop body's tracers; in cond's branches too,
    an example's sign picking its branch). The looped Dense now
    takes jax.vmap, named in a warning; the Dense after the loop keeps its rule; the step equals the loop."""
    model, x, y = _loop_model(kind)
    k3.make_private(model)
    model.compile(optimizer=_optimizer(0.3, "auto"), loss=FRONT.loss())
    trainable = [v.value for v in model.trainable_variables]
    plan = _ghost.plan(model, trainable, [], x, {}, y, None, loss_at=per_example_loss_at)
    looped = model.layers[1].cell.dense if kind == "rnn" else model.layers[1].dense
    assert plan.covered == [model.layers[2]]
    assert [model.trainable_variables[j] for j in plan.uncovered] == looped.trainable_variables
    _ghost._ANNOUNCED.clear()
    expected = loop_clipped_mean(model, x, y, FRONT.loss(), 0.3)
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        _step_matches(model, x, y, expected)
    assert f"layer(s) {looped.name} are called inside a JAX loop" in caplog.text
