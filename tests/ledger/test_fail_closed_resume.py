"""Fail closed (issue 12, hole 6), in fresh processes: loading saved DP models, kill -9 and resume.

Each test here failed on the code before its fix. Every subprocess is bounded in time.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._parallel import run_jobs

N, LOT, SIGMA, DELTA = 64, 8, 1.1, 1e-4
FORMATS = ("model.keras", "saved_model", "model.h5")


def _python(code, *args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _save_formats(directory):
    """A tf_keras DP model after 3 steps, saved in every format (in this process: the loads are fresh)."""
    import numpy as np
    import tf_keras as keras

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    x = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
    lots = PoissonLots(x, (x[:, :1] > 0).astype(np.float32), expected_lot_size=LOT)
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    model.fit(lots.dataset(), steps_per_epoch=3, verbose=0)
    for name in FORMATS:
        model.save(os.path.join(directory, name))


LOAD = textwrap.dedent(
    """
    import json, sys
    import keras_dpsgd  # the user's import: nothing else of keras_dpsgd
    import tf_keras as keras

    # Registered by the imports alone, before any load: no load below can owe its success to another.
    registered = keras.saving.get_registered_object("keras_dpsgd>DPSGDOptimizer") is not None
    results = {}
    for path in sys.argv[1:]:
        model = keras.models.load_model(path)
        results[path] = dict(optimizer=type(model.optimizer).__name__,
                             epsilon=keras_dpsgd.model_epsilon(model, target_delta=1e-4)[0])
    print("RESULT " + json.dumps(dict(registered=registered, results=results)))
    """
)


def test_import_keras_dpsgd_then_load_model_in_a_fresh_process(tmp_path):
    _save_formats(tmp_path)
    expected = compute_epsilon(PoissonSampledGaussianEvent(LOT / N, SIGMA, 3), DELTA)
    paths = [str(tmp_path / name) for name in FORMATS]
    result = _result(_python(LOAD, *paths))  # one fresh process loads every format
    assert result["registered"] is True
    for name, path in zip(FORMATS, paths):
        assert result["results"][path]["optimizer"] == "DPSGDOptimizer", name
        assert result["results"][path]["epsilon"] == pytest.approx(expected, rel=1e-12), name


WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import tf_keras as keras
    from keras_dpsgd import PoissonLots, PrivacyLogger, model_privacy_ledger
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    mode, order, directory = sys.argv[1], sys.argv[2], sys.argv[3]
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    lots = PoissonLots(x, (x[:, :1] > 0).astype(np.float32), expected_lot_size=8)
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))

    class KillAtEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    logger, backup = PrivacyLogger(1e-4), keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"))
    callbacks = [logger, backup] if order == "logger-first" else [backup, logger]
    if mode == "first":
        callbacks.append(KillAtEpoch())
    hist = model.fit(lots.dataset(), steps_per_epoch=3, epochs=4, callbacks=callbacks, verbose=0)
    print("RESULT " + json.dumps(dict(epsilon=hist.history["epsilon"], noised_steps=int(opt.noised_steps.numpy()),
                                      ledger=model_privacy_ledger(model).to_dict())))
    """
)


ORDERS = ("logger-first", "backup-first")


@pytest.fixture(scope="module")
def kill_and_resume(tmp_path_factory):
    """For each callback order (two at a time): the run killed at the start of epoch 2, then its resume."""

    def job(order):
        directory = tmp_path_factory.mktemp(order)
        first = _python(WORKER, "first", order, directory)  # epochs 0 and 1 saved, killed at epoch 2
        return first, _python(WORKER, "resume", order, directory)  # resumes at epoch 2: 6 more steps

    return run_jobs({order: (lambda order=order: job(order)) for order in ORDERS})


@pytest.mark.parametrize("order", ORDERS)
def test_kill_and_resume_for_both_callback_orders(kill_and_resume, order):
    first, resumed = kill_and_resume[order].result()
    assert first.returncode == -9, first.stderr[-3000:]
    result = _result(resumed)
    assert result["noised_steps"] == 12
    assert result["ledger"]["events"] == [PoissonSampledGaussianEvent(LOT / N, SIGMA, 12, "dp-sgd").to_dict()]
    expected = [compute_epsilon(PoissonSampledGaussianEvent(LOT / N, SIGMA, s), DELTA) for s in (9, 12)]
    assert result["epsilon"] == pytest.approx(expected, rel=1e-12)
