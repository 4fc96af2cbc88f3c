"""No silent slow path: a variable that takes per-example jacobians is reported, warned about once
per traced step, readable as ``optimizer.per_example_report``, and refused with
``jacobian_fallback="refuse"`` (both Kerases)."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_dpsgd.keras3 as k3
import keras_dpsgd.tf_keras as tk

KERASES = {"keras3": (keras, k3), "tf_keras": (tf_keras, tk)}


def _cumsum_scale(lib):
    """``x * cumsum(w)``: no fast rule reads ``w`` through Cumsum (nor may a weight region hold it), so it takes
    per-example jacobians."""

    class CumsumScale(lib.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(name="w", shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * tf.math.cumsum(self.w)

    return CumsumScale(name="cumsum_scale")


def _fit(name, jacobian_fallback="warn", epochs=1, backend="auto"):
    lib, front = KERASES[name]
    lib.utils.set_random_seed(0)
    model = lib.Sequential([lib.Input((5,)), _cumsum_scale(lib), lib.layers.Dense(3, name="head")])
    opt = front.DPSGDOptimizer(
        1.0, 0.0, learning_rate=0.1, jacobian_fallback=jacobian_fallback, per_example_backend=backend
    )
    model.compile(opt, loss=lib.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
    if name == "keras3":
        front.make_private(model)
    gen = np.random.default_rng(0)
    x, y = gen.normal(size=(12, 5)).astype("float32"), gen.integers(0, 3, 12)
    return model, opt, (x, y, epochs)


def _run(model, data):
    x, y, epochs = data
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.parametrize("name", sorted(KERASES))
def test_fallback_warns_once_per_traced_step_and_is_reported(name, caplog):
    model, opt, data = _fit(name, epochs=2)
    assert opt.per_example_report is None and opt.jacobian_fallback == "warn"
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        _run(model, data)  # 6 steps (Keras 3 traces the step twice): one warning.
    warnings = [r.getMessage() for r in caplog.records if "per-example jacobians" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "cumsum_scale" in warnings[0] and "(Cumsum)" in warnings[0] and "B times" in warnings[0]
    report = opt.per_example_report
    (fallback,) = report.fallback
    assert fallback.op_type == "Cumsum" and "cumsum_scale" in fallback.op and "w" in fallback.variable
    assert report.fallback_variables == [fallback.variable] == opt._backend.last_fallback
    assert len(report.fast) == 2 and all("head" in v for v in report.fast)
    assert report.backend == "fast" and str(report) in warnings[0]


@pytest.mark.parametrize("name", sorted(KERASES))
def test_refuse_raises_before_any_weight_changes(name):
    model, opt, data = _fit(name, jacobian_fallback="refuse")
    before = [v.numpy() for v in model.weights]
    with pytest.raises(ValueError, match=r"cumsum_scale.*\(Cumsum\).*jacobian_fallback='refuse'"):
        _run(model, data)
    for b, v in zip(before, model.weights):
        np.testing.assert_array_equal(b, v.numpy())
    assert int(opt.noised_steps.numpy()) == 0


@pytest.mark.parametrize("name", sorted(KERASES))
def test_a_model_without_fallback_reports_none_and_passes_refuse(name, caplog):
    lib, front = KERASES[name]
    model = lib.Sequential([lib.Input((5,)), lib.layers.Dense(3)])
    opt = front.DPSGDOptimizer(1.0, 0.0, jacobian_fallback="refuse")
    model.compile(opt, loss=lib.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
    if name == "keras3":
        front.make_private(model)
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        model.fit(np.ones((4, 5), "float32"), np.zeros(4), batch_size=4, verbose=0)
    assert opt.per_example_report.fallback == () and len(opt.per_example_report.fast) == 2
    assert not [r for r in caplog.records if "per-example jacobians" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(KERASES))
def test_reference_backend_reports_every_variable_without_warning(name, caplog):
    model, opt, data = _fit(name, jacobian_fallback="refuse", backend="reference")
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        _run(model, data)  # The reference backend's jacobians are a choice, not a fallback.
    assert opt.per_example_report.backend == "reference"
    assert len(opt.per_example_report.fallback) == 3 and opt.per_example_report.fast == ()
    assert not [r for r in caplog.records if "per-example jacobians" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(KERASES))
def test_jacobian_fallback_config_round_trip_and_validation(name):
    front = KERASES[name][1]
    opt = front.DPSGDOptimizer(1.0, 1.0, jacobian_fallback="refuse")
    config = opt.get_config()
    assert config["jacobian_fallback"] == "refuse"
    again = type(opt).from_config(config)
    assert again.jacobian_fallback == "refuse" and again._backend.jacobian_fallback == "refuse"
    assert front.DPSGDOptimizer(1.0, 1.0).get_config()["jacobian_fallback"] == "warn"
    for bad in ("silent", True, None):
        with pytest.raises(ValueError, match=r"jacobian_fallback must be one of \('warn', 'refuse'\)"):
            front.DPSGDOptimizer(1.0, 1.0, jacobian_fallback=bad)


def test_a_variable_never_read_is_certified_by_the_graph_and_the_tape():
    """An unread variable (keras_hub's untied output table in a backbone without its head) has a zero gradient without
    per-example jacobians only where both the step's graph and the loss's tape show no read of it; a variable read,
    or watched by the tape, or a step without a tape, stays on the jacobians (fail closed)."""
    from keras_dpsgd.backends.tensorflow.state import never_read

    read, watched, unread = tf.Variable([1.0]), tf.Variable([2.0]), tf.Variable([3.0])
    found = {}

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(watched)  # watched, never read
            loss = x * read
        for name, var in (("read", read), ("watched", watched), ("unread", unread)):
            found[name] = never_read(loss.graph, var, tape)
        found["no tape"] = never_read(loss.graph, unread, None)
        return loss

    step(tf.ones([4]))
    assert found == {"read": False, "watched": False, "unread": True, "no tape": False}
