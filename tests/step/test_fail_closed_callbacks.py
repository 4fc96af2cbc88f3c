"""Fail closed (issue 25.4): callbacks that act on the un-noised training logs are refused at fit.

EarlyStopping, ReduceLROnPlateau, ModelCheckpoint(save_best_only=True), TerminateOnNaN and any
callback with a `monitor` on a training quantity decide on the private data without noise. Each
is refused before any weight changes, on both Kerases, at the first fit (the DP step's trace)
and at a later fit (no new trace). A `val_` monitor is refused too when fit's validation_data
holds its training inputs themselves (by content since issue 37.5: tests/step/test_held_out_validation.py). Controls: `val_` and ε monitors still train.

Every refusal test here failed on the code before the fix (the fits trained).
"""

import numpy as np
import pytest

from _behaviour import keras3_front, tf_keras_front

FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}
N, B = 16, 4
X = np.random.default_rng(0).normal(size=(N + 4, 3)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
X, Y, X_HELD, Y_HELD = X[:N], Y[:N], X[N:], Y[N:]  # held-out rows for the val_ controls


def _model(front):
    model = front.keras.Sequential([front.keras.Input((3,)), front.keras.layers.Dense(2)])
    return front.compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.5)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _refused(front, tmp_path):
    """(callback, its name, its monitor) for every callback the DP fit must refuse."""
    cb = front.keras.callbacks
    suffix = ".keras" if front.name == "keras3" else ""

    class Custom(cb.Callback):  # a third-party callback steering by a training metric
        monitor = "sparse_categorical_accuracy"

    return [
        (cb.EarlyStopping(monitor="loss", restore_best_weights=True), "EarlyStopping", "loss"),
        (cb.EarlyStopping(monitor="loss"), "EarlyStopping", "loss"),
        (cb.ReduceLROnPlateau(monitor="loss"), "ReduceLROnPlateau", "loss"),
        (
            cb.ModelCheckpoint(str(tmp_path / f"best{suffix}"), save_best_only=True, monitor="loss"),
            "ModelCheckpoint",
            "loss",
        ),
        (cb.TerminateOnNaN(), "TerminateOnNaN", "loss"),
        (Custom(), "Custom", "sparse_categorical_accuracy"),
    ]


def _fit(model, callbacks, **kwargs):
    return model.fit(X, Y, batch_size=B, epochs=2, verbose=0, callbacks=callbacks, **kwargs)


@pytest.mark.parametrize("keras_name", sorted(FRONTS))
def test_callbacks_acting_on_the_training_logs_are_refused_before_any_step(keras_name, tmp_path):
    front = FRONTS[keras_name]()
    model = _model(front)
    for callback, name, monitor in _refused(front, tmp_path):
        before = _weights(model)
        with pytest.raises(ValueError, match=rf"{name}\(monitor='{monitor}'\) is refused in a DP fit.*val_"):
            _fit(model, [callback])
        assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model))), name
        assert int(model.optimizer.noised_steps.numpy()) == 0, name
    with pytest.raises(
        ValueError, match=r"EarlyStopping\(monitor='val_loss'\).*16 of the 16 validation rows are training"
    ):
        _fit(model, [front.keras.callbacks.EarlyStopping(monitor="val_loss")], validation_data=(X, Y))
    _fit(model, [])  # the callback removed, the same model trains
    assert int(model.optimizer.noised_steps.numpy()) == 2 * N // B


@pytest.mark.parametrize("keras_name", sorted(FRONTS))
def test_validation_monitors_train_and_a_later_fit_is_checked_too(keras_name, tmp_path):
    front = FRONTS[keras_name]()
    model = _model(front)
    cb = front.keras.callbacks
    controls = [
        cb.EarlyStopping(monitor="val_loss", restore_best_weights=True, patience=5),
        cb.ReduceLROnPlateau(monitor="val_loss"),
        cb.ModelCheckpoint(str(tmp_path / ("every.keras" if keras_name == "keras3" else "every")), monitor="loss"),
        cb.EarlyStopping(monitor="epsilon", mode="max", patience=5),  # no un-noised function of the data
    ]
    before = _weights(model)
    _fit(model, controls, validation_data=(X_HELD, Y_HELD))
    assert int(model.optimizer.noised_steps.numpy()) == 2 * N // B
    assert not all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))
    # The step is traced already: the next fit is checked before its first step all the same.
    trained = _weights(model)
    with pytest.raises(ValueError, match=r"EarlyStopping\(monitor='loss'\)"):
        _fit(model, [cb.EarlyStopping(monitor="loss")])
    assert all(np.array_equal(a, b) for a, b in zip(trained, _weights(model)))
    assert int(model.optimizer.noised_steps.numpy()) == 2 * N // B
