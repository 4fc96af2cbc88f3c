"""What a newcomer does first (issue 27), on both Kerases: plain fit, the progress display, TensorBoard,
messages. Each check compares with a closed form or the accountant."""

import logging

import numpy as np
import pytest
import tensorflow as tf
from _behaviour import keras3_front, tf_keras_front

import keras_dpsgd
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

FRONTS = [keras3_front, tf_keras_front]
N, SIGMA, DELTA = 200, 1.1, 1e-5
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 4)).astype("float32")
Y = RNG.integers(0, 2, size=N)


def _model(front, **dp_kwargs):
    K = front.keras
    model = K.Sequential([K.Input((4,)), K.layers.Dense(2)])
    dp_kwargs.setdefault("noise_multiplier", SIGMA)
    return front.compiled(model, l2_norm_clip=1.0, learning_rate=0.1, **dp_kwargs)


def _eps(*segments):
    return compute_epsilon([PoissonSampledGaussianEvent(q, SIGMA, steps) for q, steps in segments], DELTA)


# ------------------------------------------------------------------ item 1: plain fit
@pytest.mark.parametrize("make_front", FRONTS)
def test_plain_fit_reports_epsilon_at_b_over_n_and_says_it_assumes_poisson(make_front, caplog, monkeypatch):
    """fit(x, y, batch_size=B) then model_epsilon(model, δ), as in docs/keras3.md: q = B/N of fit's own
    training set (after validation_split), announced as an assumption; a later fit adds its own q."""
    monkeypatch.setattr(keras_dpsgd.ledger.sampling, "_WARNED", set())  # said once per process and q
    model = _model(make_front())
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        model.fit(X, Y, batch_size=40, epochs=2, validation_split=0.2, verbose=0)  # N = 160, 4 steps/epoch
    warned = [r.getMessage() for r in caplog.records if "ASSUMES POISSON" in r.getMessage()]
    assert warned and "40 * 1 / 160" in warned[0]
    eps, delta = keras_dpsgd.model_epsilon(model, target_delta=DELTA)
    assert delta == DELTA and eps == pytest.approx(_eps((40 / 160, 8)), rel=1e-12)
    model.fit(X[:100], Y[:100], batch_size=50, epochs=1, verbose=0)  # q = 1/2, 2 steps
    eps, _ = keras_dpsgd.model_epsilon(model, target_delta=DELTA)
    assert eps == pytest.approx(_eps((40 / 160, 8), (0.5, 2)), rel=1e-12)


@pytest.mark.parametrize("make_front", FRONTS)
def test_privacy_logger_on_plain_fit_and_refusal_before_the_first_step(make_front):
    """PrivacyLogger needs no num_examples/batch_size on arrays; on data of unknown size it refuses at
    the start of fit, before any step (it used to fail after a whole epoch of training)."""
    model = _model(make_front())
    hist = model.fit(X, Y, batch_size=50, epochs=2, verbose=0, callbacks=[keras_dpsgd.PrivacyLogger(DELTA)])
    np.testing.assert_allclose(hist.history["epsilon"], [_eps((0.25, 4)), _eps((0.25, 8))], rtol=1e-12)
    model = _model(make_front())
    before = [w.copy() for w in model.get_weights()]
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(50)
    with pytest.raises(ValueError, match="sampling_rate is unknown"):
        model.fit(data, epochs=1, verbose=0, callbacks=[keras_dpsgd.PrivacyLogger(DELTA)])
    assert int(model.optimizer.noised_steps.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ item 3: the progress display
@pytest.mark.parametrize("make_front", FRONTS)
def test_logged_loss_and_metrics_are_means_over_the_real_examples_of_poisson_lots(make_front):
    """Every real example has the same loss softplus(-2) and is classified right (lr = 0: the weights
    never move); the padding rows of the lots (sample_weight 0, label 0) must change neither the logged
    loss nor metrics=["accuracy"] nor weighted_metrics (they pulled them to about 0.6 of the truth)."""
    front = make_front()
    K = front.keras
    model = K.Sequential(
        [
            K.Input((4,)),
            K.layers.Dense(2, kernel_initializer="zeros", bias_initializer=K.initializers.Constant([0.0, 2.0])),
        ]
    )
    model = front.private(model)
    lots = keras_dpsgd.PoissonLots(X, np.ones(N, dtype="int64"), expected_lot_size=40, seed=0)
    optimizer = lots.configure(front.optimizer_cls(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.0, seed=1))
    model.compile(optimizer=optimizer, loss=front.loss(), metrics=["accuracy"], weighted_metrics=["accuracy"])
    hist = model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=2, verbose=0)
    logs = hist.history
    np.testing.assert_allclose(logs["loss"], [np.log1p(np.exp(-2.0))] * 2, rtol=1e-5)
    accuracies = [v for k, v in logs.items() if "acc" in k]
    assert len(accuracies) == 2 and all(a == [1.0, 1.0] for a in accuracies), logs


# ------------------------------------------------------------------ item 4: TensorBoard
def _scalars(log_dir):
    tags = {}
    for path in sorted(log_dir.rglob("*tfevents*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):  # scalars (the graph and the model's config are not)
                    number = tf.make_ndarray(value.tensor) if value.HasField("tensor") else value.simple_value
                    tags.setdefault(value.tag, []).append(float(number))
    return tags


@pytest.mark.parametrize("make_front", FRONTS)
def test_epsilon_reaches_tensorboard_history_and_progress_bar_whatever_the_order(make_front, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    front = make_front()
    model = _model(front)
    board = front.keras.callbacks.TensorBoard(log_dir=str(tmp_path), write_graph=False)
    hist = model.fit(X, Y, batch_size=50, epochs=2, verbose=2, callbacks=[board, keras_dpsgd.PrivacyLogger(DELTA)])
    expected = [_eps((0.25, 4)), _eps((0.25, 8))]
    np.testing.assert_allclose(hist.history["epsilon"], expected, rtol=1e-12)
    np.testing.assert_allclose(_scalars(tmp_path)["epoch_epsilon"], expected, rtol=1e-6)
    assert capsys.readouterr().out.count("epsilon:") == 2


# ------------------------------------------------------------------ item 9: messages
def test_make_private_refuses_a_backend_other_than_tensorflow_jax_or_torch(monkeypatch):
    """KERAS_BACKEND=torch failed with a TypeError inside the train step; make_private names the backend
    and the supported ones (the backend's name is what the check reads). JAX is supported since issue 29
    (tests/backends/jax), torch since issue 39 (tests/backends/torch): numpy stands for the refused ones."""
    import keras

    import keras_dpsgd.keras3 as k3

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    with pytest.raises(
        ValueError,
        match=r"TensorFlow, JAX and torch backends, got the 'numpy' backend.*KERAS_BACKEND=tensorflow",
    ):
        k3.make_private(model)
    monkeypatch.undo()
    assert k3.make_private(model) is model


@pytest.mark.parametrize("make_front", FRONTS)
def test_within_limit_is_silent_when_the_budget_ends_with_the_planned_fit(make_front, capsys):
    """A budget that allows exactly the planned 8 steps: fit ends as planned, nothing was stopped."""
    model = _model(make_front())
    target = _eps((0.25, 8)) * (1 + 1e-9)
    limit = keras_dpsgd.WithinLimit(target, DELTA, num_examples=N, batch_size=50)
    model.fit(X, Y, batch_size=50, epochs=2, verbose=0, callbacks=[limit])
    assert int(model.optimizer.noised_steps.numpy()) == 8
    assert not limit.stopped and limit.remaining == 0
    assert "stopping training" not in capsys.readouterr().out
    model.fit(X, Y, batch_size=50, epochs=1, verbose=0, callbacks=[limit])  # no step fits: a real stop
    assert int(model.optimizer.noised_steps.numpy()) == 8 and limit.stopped
    assert "WithinLimit: stopping training" in capsys.readouterr().out


def test_fit_on_poisson_lots_has_no_shuffle_warning():
    """Keras 3 warned on every fit(lots.dataset()) that it ignores shuffle=True (lots need no shuffling)."""
    import warnings

    front = keras3_front()
    model = _model(front)
    lots = keras_dpsgd.PoissonLots(X, Y, expected_lot_size=50, seed=0)
    lots.configure(model.optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
        model.fit(lots.as_py_dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)  # endless
    assert not [w for w in caught if "shuffle" in str(w.message)], [str(w.message) for w in caught]
    assert int(model.optimizer.noised_steps.numpy()) == 2 * lots.steps_per_epoch


def test_tf_keras_does_not_call_our_callbacks_slow(caplog):
    """tf_keras times batch hooks against the batch and warned "Callback method `on_train_batch_begin` is
    slow" because WithinLimit asked the accountant there; it now does at the epoch start."""
    model = _model(tf_keras_front())
    known = dict(num_examples=N, batch_size=10)
    callbacks = [keras_dpsgd.WithinLimit(1e3, DELTA, **known), keras_dpsgd.PrivacyLogger(DELTA, **known)]
    with caplog.at_level(logging.WARNING):
        model.fit(X, Y, batch_size=10, epochs=2, verbose=0, callbacks=callbacks)
    assert int(model.optimizer.noised_steps.numpy()) == 40
    assert not [r for r in caplog.records if "is slow compared to the batch time" in r.getMessage()]
