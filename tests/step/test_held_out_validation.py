"""Issue 37.5: a `val_` decision is allowed on held-out validation data only, checked by content.

The guard compared object identity with fit's `x`: `fit(lots.dataset(), validation_data=(x_train, y_train))`,
a copy of `x_train`, rows of it in `validation_split`, and an EarlyStopping inside a CallbackList all trained,
deciding on the private training set without noise. Now each is refused before any weight changes, as is a
training set whose rows cannot be read (fail closed); held-out validation data (arrays, a finite dataset)
still trains. Keras 3 TF and tf_keras here, Keras 3 JAX in tests/backends/jax/test_jax_held_out_validation.py.
Every refusal here failed on the code before the fix (the fits trained).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests._behaviour import process_fronts

FRONTS = process_fronts()  # Keras 3 and tf_keras; Keras 3 alone in the JAX and torch suites
N, B = 16, 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 3)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
X_HELD = RNG.normal(size=(8, 3)).astype("float32")
Y_HELD = (X_HELD[:, 0] > 0).astype("int32")


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _model(front):
    model = front.keras.Sequential([front.keras.Input((3,)), front.keras.layers.Dense(2)])
    return front.compiled(model, l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.5)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _lots(model):
    from keras_dpsgd import PoissonLots

    lots = PoissonLots(X, Y, expected_lot_size=B, seed=3)
    lots.configure(model.optimizer)
    return lots


def _refused_fits(front, model):
    """(name, fit call) of every fit that decides on training rows, or on rows it cannot read."""
    cb = front.keras.callbacks
    lots = _lots(model)

    def stop():
        return cb.EarlyStopping(monitor="val_loss", restore_best_weights=True, patience=5)

    def fit(x, y=None, **kwargs):
        kwargs.setdefault("batch_size", None if y is None else B)
        return lambda: model.fit(x, y, epochs=2, verbose=0, **kwargs)

    class Fanout(cb.Callback):  # a container of the user's: passes Keras's calls on to the callbacks it holds
        def __init__(self, callbacks):
            super().__init__()
            self.callbacks = callbacks

    doubled_x, doubled_y = np.concatenate([X, X]), np.concatenate([Y, Y])
    unread = tf.data.Dataset.from_tensor_slices((X, Y)).batch(B)
    fits = [
        (
            "lots, x_train",
            fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, validation_data=(X, Y), callbacks=[stop()]),
        ),
        ("copy", fit(X, Y, validation_data=(X.copy(), Y), callbacks=[cb.ReduceLROnPlateau(monitor="val_loss")])),
        ("float64 slice", fit(X, Y, validation_data=(X[3:7].astype("float64"), Y[3:7]), callbacks=[stop()])),
        ("split", fit(doubled_x, doubled_y, validation_split=0.5, callbacks=[stop()])),
        ("container", fit(X, Y, callbacks=[Fanout([cb.CallbackList([cb.EarlyStopping(monitor="loss")])])])),
        ("container, val", fit(X, Y, validation_data=(X, Y), callbacks=[Fanout([stop()])])),
        ("unread training data", fit(unread, validation_data=(X_HELD, Y_HELD), callbacks=[stop()])),
    ]
    if front.name == "keras3":  # Keras 3 runs a CallbackList inside fit's list (tf_keras needs a Callback there)
        fits.append(("CallbackList", fit(X, Y, callbacks=[cb.CallbackList([cb.EarlyStopping(monitor="loss")])])))
    return fits


def test_decisions_on_training_rows_are_refused_before_any_step(front):
    model = _model(front)
    for name, fit in _refused_fits(front, model):
        before = _weights(model)
        with pytest.raises(ValueError, match=r"is refused in a DP fit.*(held-out|val_)"):
            fit()
        assert all(np.array_equal(a, b) for a, b in zip(before, _weights(model))), name
        assert int(model.optimizer.noised_steps.numpy()) == 0, name


def test_held_out_validation_data_still_trains(front):
    model = _model(front)
    cb = front.keras.callbacks
    deciders = [cb.EarlyStopping(monitor="val_loss", restore_best_weights=True, patience=5), cb.ReduceLROnPlateau()]
    before = _weights(model)
    model.fit(X, Y, batch_size=B, epochs=1, verbose=0, validation_data=(X_HELD, Y_HELD), callbacks=deciders)
    assert int(model.optimizer.noised_steps.numpy()) == N // B
    lots = _lots(model)
    held = tf.data.Dataset.from_tensor_slices((X_HELD, Y_HELD)).batch(B)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, verbose=0, validation_data=held, callbacks=deciders)
    assert int(model.optimizer.noised_steps.numpy()) == N // B + lots.steps_per_epoch
    assert not all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))


def test_the_fingerprints_see_through_dtypes_and_read_finite_datasets_only():
    from keras_dpsgd.step._held_out import validation_overlap

    def overlap(validation, x=X, **kwargs):
        return validation_overlap(dict(x=x, validation_data=validation, **kwargs))

    ints = np.arange(12, dtype="int32").reshape(4, 3)
    assert overlap((ints[1:2].astype("float64"), Y[:1]), x=ints).startswith("1 of the 1 validation rows")
    zeros = np.zeros((2, 3), "float32")
    assert overlap((-zeros, Y[:2]), x=zeros).startswith("2 of the 2")  # -0.0 is 0.0 to the model
    assert overlap((X_HELD, Y_HELD)) is None and overlap(None) is None
    assert overlap(({"a": X[:2]}, Y[:2]), x={"a": X}).startswith("2 of the 2")  # nested inputs
    endless = tf.data.Dataset.from_tensor_slices((X, Y)).batch(B).repeat()
    assert "unknown or infinite length" in overlap(endless)
    assert overlap(endless, validation_steps=1).startswith("4 of the 4")  # one batch read
    assert "cannot read" in overlap(iter([(X, Y)]))
