"""Fail closed (issue 12): lots, the model's ledger, validation_split, the saved diagnostics.

Each test here failed on the code before its fix.
"""

import logging
import zipfile

import h5py
import numpy as np
import pytest
import tf_keras as keras

from keras_dpsgd import PoissonLots, PrivacyLogger, model_epsilon
from keras_dpsgd.tf_keras import DPSGDOptimizer
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

N, B, SIGMA, DELTA = 24, 4, 1.1, 1e-3


def _data(n=N, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
    return x, (x[:, :1] > 0).astype(np.float32)


def _model(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    return model


def _opt(k=1, **kwargs):
    return DPSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, gradient_accumulation_steps=k, **kwargs
    )


def _pending(opt):
    """(batches, examples, largest |accumulator|) of the lot being accumulated."""
    return (
        int(opt._accum_batches.numpy()),
        float(opt._accum_examples.numpy()),
        max(float(np.abs(a.numpy()).max()) for a in opt._accumulators),
    )


def _epsilon(steps, q=B / N):
    return compute_epsilon(PoissonSampledGaussianEvent(q, SIGMA, steps), DELTA)


# ------------------------------------------------------------------ hole 2: lots
def test_lots_do_not_cross_epochs_and_partial_lots_are_discarded(caplog):
    # 6 batches per epoch... here 24 / 4 = 6; use 20 examples: 5 batches, k = 2 -> 2 lots + 1 batch per epoch.
    x, y = _data(20)
    opt = _opt(k=2)
    model = _model(opt)
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        model.fit(x, y, batch_size=B, epochs=3, verbose=0)
    # 2 lots per epoch; before the fix the odd batch of an epoch joined the next epoch's first
    # batch (another shuffle) in one release: 7 releases, the last lot of each epoch straddling.
    assert int(opt.noised_steps.numpy()) == 6
    assert opt.discarded_batches == 3 and opt.discarded_lots == 3
    assert _pending(opt) == (0, 0.0, 0.0)
    assert "incomplete lot" in caplog.text


def test_partial_lot_of_one_fit_is_not_carried_into_the_next():
    x, y = _data(12)  # 3 batches, k = 2
    opt = _opt(k=2)
    model = _model(opt)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False)
    assert _pending(opt) == (0, 0.0, 0.0)  # discarded at the end of the fit
    model.fit(x[:8], y[:8], batch_size=B, epochs=1, verbose=0, shuffle=False)
    assert int(opt.noised_steps.numpy()) == 2


class _Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            raise KeyboardInterrupt


def test_interrupted_lot_is_discarded_before_the_next_batch():
    x, y = _data(16)
    opt = _opt(k=2)
    model = _model(opt)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[_Interrupt()])
    assert _pending(opt)[0] == 1  # one batch of a lot left by the interrupted fit
    model.fit(x[:8], y[:8], batch_size=B, epochs=1, verbose=0, shuffle=False)
    # The released lot holds the 8 examples of this fit only, none of the interrupted one.
    assert int(opt.noised_steps.numpy()) == 1
    assert opt.discarded_batches == 1
    assert _pending(opt) == (0, 0.0, 0.0)


@pytest.mark.parametrize("filename", ["m.keras", "m.h5"])
def test_a_file_saved_mid_lot_loads_no_partial_lot(tmp_path, filename):
    x, y = _data(8)
    opt = _opt(k=2)
    model = _model(opt)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[_Interrupt()])
    assert _pending(opt)[0] == 1
    path = str(tmp_path / filename)
    model.save(path)
    loaded = keras.models.load_model(path)
    assert _pending(loaded.optimizer) == (0, 0.0, 0.0)


def test_poisson_lots_with_steps_per_epoch_not_a_multiple_of_the_lot_are_refused():
    x, y = _data(64)
    lots = PoissonLots(x, y, expected_lot_size=8, physical_batch_size=4)
    k = lots.gradient_accumulation_steps
    assert k > 1
    opt = lots.configure(_opt(k=k))
    model = _model(opt)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(lots.dataset(), steps_per_epoch=k + 1, epochs=1, verbose=0)


# ------------------------------------------------- hole 3: the ledger is the model's
def test_recompiling_with_a_new_optimizer_keeps_the_first_fit():
    x, y = _data()
    model = _model(_opt())
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)  # 6 steps, no ledger read
    model.compile(optimizer=_opt(), loss=model.loss)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)  # 6 more
    eps, _ = model_epsilon(model, target_delta=DELTA, num_examples=N, batch_size=B)
    assert eps == pytest.approx(_epsilon(12), rel=1e-12)


def test_saved_model_without_a_ledger_read_resumes_its_epsilon(tmp_path):
    x, y = _data()
    model = _model(_opt())
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    model.save(str(tmp_path / "sm"))
    loaded = keras.models.load_model(str(tmp_path / "sm"))
    eps, _ = model_epsilon(loaded, target_delta=DELTA, num_examples=N, batch_size=B)
    assert eps == pytest.approx(_epsilon(6), rel=1e-12)


def test_checkpoint_before_the_logger_saves_the_current_ledger(tmp_path):
    x, y = _data()
    model = _model(_opt())
    path = str(tmp_path / "sm")
    callbacks = [keras.callbacks.ModelCheckpoint(path), PrivacyLogger(DELTA, num_examples=N, batch_size=B)]
    model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=callbacks)
    loaded = keras.models.load_model(path)  # saved at the end of epoch 1: 12 steps
    eps, _ = model_epsilon(loaded, target_delta=DELTA, num_examples=N, batch_size=B)
    assert eps == pytest.approx(_epsilon(12), rel=1e-12)


def test_h5_weights_only_is_refused_at_fit(tmp_path):
    # Was a warning at every save; a resumed run then restarted epsilon at 0 (issue 25.6).
    x, y = _data()
    model = _model(_opt())
    with pytest.raises(ValueError, match="h5 weights hold the layers' weights only"):
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=1,
            verbose=0,
            callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "w.h5"), save_weights_only=True)],
        )
    assert not (tmp_path / "w.h5").exists()


# ------------------------------------------------------------ 5(b): validation_split
def test_validation_split_with_the_full_num_examples_is_refused():
    x, y = _data()
    model = _model(_opt())
    with pytest.raises(ValueError, match="validation_split"):
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=1,
            verbose=0,
            validation_split=0.25,
            callbacks=[PrivacyLogger(DELTA, num_examples=N, batch_size=B)],
        )


def test_validation_split_with_the_training_size_is_accepted():
    x, y = _data()
    model = _model(_opt())
    hist = model.fit(
        x,
        y,
        batch_size=B,
        epochs=1,
        verbose=0,
        validation_split=0.25,
        callbacks=[PrivacyLogger(DELTA, num_examples=18, batch_size=B)],
    )
    assert hist.history["epsilon"][-1] == pytest.approx(_epsilon(5, q=B / 18), rel=1e-12)


# ------------------------------------------------- 5(c): nonfinite_examples not saved
def test_nonfinite_examples_is_not_saved(tmp_path):
    x, y = _data()
    x[0] = np.nan
    opt = _opt()
    model = _model(opt)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert int(opt.nonfinite_examples.numpy()) == 1  # a local diagnostic
    assert all(v is not opt.nonfinite_examples for v in opt.variables)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as f, h5py.File(f) as h5:
        saved = [h5["optimizer/vars"][k][()] for k in h5["optimizer/vars"]]
    assert len(saved) == len(opt.variables)
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.nonfinite_examples.numpy()) == 0
    assert int(loaded.optimizer.noised_steps.numpy()) == 6


@pytest.mark.parametrize("filename", ["m.keras", "m.h5"])
def test_a_file_that_keeps_only_the_counter_is_refused_after_a_recompile(tmp_path, filename):
    x, y = _data()
    model = _model(_opt())
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    model.compile(optimizer=_opt(), loss=model.loss)  # the new optimizer's counter is 0
    with pytest.raises(ValueError, match="earlier optimizer"):
        model.save(str(tmp_path / filename))
    model.save(str(tmp_path / "sm"))  # a SavedModel keeps the model's whole ledger
    loaded = keras.models.load_model(str(tmp_path / "sm"))
    eps, _ = model_epsilon(loaded, target_delta=DELTA, num_examples=N, batch_size=B)
    assert eps == pytest.approx(_epsilon(6), rel=1e-12)
