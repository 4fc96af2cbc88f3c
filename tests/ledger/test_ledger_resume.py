"""Kill-and-resume: a run killed after a checkpoint continues ε in a new process, never from zero."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

N, LOT, SIGMA, DELTA = 64, 8, 1.1, 1e-4

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import tf_keras as keras
    from keras_dpsgd import PoissonLots, PrivacyLogger, model_privacy_ledger
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    mode, directory, epochs, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    N, LOT, SIGMA, DELTA = {N}, {LOT}, {SIGMA}, {DELTA}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    lots = PoissonLots(x, y, expected_lot_size=LOT)  # seed=None: fresh lots in every process
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    weights = os.path.join(directory, "weights")

    class KillAtEpoch(keras.callbacks.Callback):
        def __init__(self, epoch):
            super().__init__()
            self.epoch = epoch
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == self.epoch:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [
        PrivacyLogger(DELTA),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
        keras.callbacks.ModelCheckpoint(weights, save_weights_only=True),
    ]
    if mode == "first":  # killed (SIGKILL) at the start of epoch 1, after epoch 0 was saved
        callbacks.append(KillAtEpoch(1))
    hist = model.fit(lots.dataset(), steps_per_epoch=steps, epochs=epochs, callbacks=callbacks, verbose=0)
    print("RESULT " + json.dumps(dict(
        ledger=model_privacy_ledger(model).to_dict(),
        epsilon=hist.history["epsilon"],
        noised_steps=int(opt.noised_steps.numpy()),
    )))
    """
).format(N=N, LOT=LOT, SIGMA=SIGMA, DELTA=DELTA)


def _run(mode, directory, epochs, steps, killed=False):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(directory), str(epochs), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    if killed:
        assert proc.returncode == -9, proc.stderr[-3000:]
        return None
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _expected_epsilon(steps):
    return compute_epsilon(PoissonSampledGaussianEvent(LOT / N, SIGMA, steps), DELTA)


def test_kill_and_resume_continues_the_ledger(tmp_path):
    steps, epochs = 3, 3
    # Process 1: epoch 0 (k = 3 steps) is trained and checkpointed, then the process is killed.
    _run("first", tmp_path, epochs, steps, killed=True)
    # Process 2: the same fit call; BackupAndRestore resumes at epoch 1 and trains m = 6 more steps.
    result = _run("resume", tmp_path, epochs, steps)
    total = epochs * steps
    assert len(result["epsilon"]) == epochs - 1
    assert result["noised_steps"] == total
    assert result["ledger"]["events"] == [PoissonSampledGaussianEvent(LOT / N, SIGMA, total, "dp-sgd").to_dict()]
    assert result["epsilon"][-1] == pytest.approx(_expected_epsilon(total), rel=1e-12)
    assert result["epsilon"][0] == pytest.approx(_expected_epsilon(2 * steps), rel=1e-12)  # not from zero

    # This process: a fresh model restores ModelCheckpoint's weights (with the optimizer) and trains on.
    import numpy as np
    import tf_keras as keras

    from keras_dpsgd import PoissonLots, model_privacy_ledger
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    lots = PoissonLots(x, (x[:, :1] > 0).astype(np.float32), expected_lot_size=LOT)
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    model.load_weights(os.path.join(tmp_path, "weights"))
    model.fit(lots.dataset(), steps_per_epoch=2, epochs=1, verbose=0)
    events = model_privacy_ledger(model).events
    assert events == (PoissonSampledGaussianEvent(LOT / N, SIGMA, total + 2, "dp-sgd"),)


def _dp_model():
    import numpy as np
    import tf_keras as keras

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    x = np.random.default_rng(2).normal(size=(N, 3)).astype(np.float32)
    lots = PoissonLots(x, (x[:, :1] > 0).astype(np.float32), expected_lot_size=LOT)
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    return model, lots


@pytest.mark.parametrize("filename", ["model.keras", "saved_model"])
def test_full_model_save_and_load_continues_the_ledger(tmp_path, filename):
    """.keras restores the optimizer's noised_steps; a SavedModel loses the optimizer's
    variables, and the ledger copy kept on the model carries the count instead."""
    import tf_keras as keras

    from keras_dpsgd import PrivacyLogger, model_privacy_ledger

    model, lots = _dp_model()
    model.fit(lots.dataset(), steps_per_epoch=5, verbose=0, callbacks=[PrivacyLogger(DELTA)])
    path = str(tmp_path / filename)
    model.save(path)
    loaded = keras.models.load_model(path)
    # As many new steps as before: a counter that restarted at 0 catches up with the recorded one.
    hist = loaded.fit(lots.dataset(), steps_per_epoch=5, verbose=0, callbacks=[PrivacyLogger(DELTA)])
    events = model_privacy_ledger(loaded).events
    assert sum(e.count for e in events) == 10
    assert {(e.sampling_rate, e.noise_multiplier, e.label) for e in events} == {(LOT / N, SIGMA, "dp-sgd")}
    assert hist.history["epsilon"][-1] == pytest.approx(_expected_epsilon(10), rel=1e-12)
