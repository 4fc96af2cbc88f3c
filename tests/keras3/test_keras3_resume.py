"""Keras 3 kill-and-resume (issue 14): the ledger travels in .keras and .weights.h5 files.

A Keras 3 private model (keras_dpsgd.keras3) trains with BackupAndRestore (which writes .weights.h5)
and a ModelCheckpoint (a full .keras model), changes q after its first epoch, and is killed with
SIGKILL one step into its third epoch. A fresh process resumes from each file and must end with
every step counted exactly once: the killed step is not counted (it died with the process), the
segments saved before the kill are kept (not replaced by the worst case), and ε is the accountant's.
Both subprocesses are bounded in time.
"""

import textwrap

import pytest

from keras_dpsgd.dp.ledger_state import CHANGED_LABEL
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, PrivacyLedger, compute_epsilon
from tests.ledger.test_fail_closed_resume import _python, _result

SIGMA, DELTA = 1.1, 1e-4

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import keras
    from keras_dpsgd import PoissonLots, model_epsilon, model_privacy_ledger
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

    mode, directory = sys.argv[1], sys.argv[2]
    backup_dir, full = os.path.join(directory, "backup"), os.path.join(directory, "full.keras")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    lots = PoissonLots(x, (x[:, :1] > 0).astype(np.float32), expected_lot_size=8)


    def private_model(sampling_rate):
        opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1))
        opt.sampling_rate = sampling_rate
        model = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True))
        return model


    class Steps(keras.callbacks.Callback):
        taken = 0

        def on_train_batch_end(self, batch, logs=None):
            Steps.taken += 1
            if mode == "first" and int(self.model.optimizer.noised_steps.numpy()) == 7:
                os.kill(os.getpid(), signal.SIGKILL)  # one step into the third epoch

        def on_epoch_begin(self, epoch, logs=None):
            if mode == "first" and epoch == 1:
                self.model.optimizer.sampling_rate = 0.25


    fit = dict(steps_per_epoch=3, epochs=4, verbose=0)
    if mode == "first":
        model = private_model(0.125)
        model.fit(lots.dataset(), callbacks=[
            keras.callbacks.BackupAndRestore(backup_dir), keras.callbacks.ModelCheckpoint(full), Steps()], **fit)
        sys.exit(3)  # never reached: killed


    def report(model):
        taken, Steps.taken = Steps.taken, 0
        return dict(taken=taken, noised_steps=int(model.optimizer.noised_steps.numpy()),
                    ledger=model_privacy_ledger(model).to_dict(), epsilon=model_epsilon(model, target_delta=1e-4)[0])


    results = {}
    model = private_model(0.25)
    model.fit(lots.dataset(), callbacks=[keras.callbacks.BackupAndRestore(backup_dir), Steps()], **fit)
    results["BackupAndRestore"] = report(model)

    model = make_private(keras.models.load_model(full))
    model.fit(lots.dataset(), initial_epoch=2, callbacks=[Steps()], **fit)
    results["ModelCheckpoint .keras"] = report(model)

    print("RESULT " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keras3_resume")
    first = _python(WORKER, "first", directory, timeout=300)
    assert first.returncode == -9, first.stderr[-3000:]  # SIGKILL, mid-run
    return _result(_python(WORKER, "resume", directory, timeout=300))


@pytest.mark.parametrize("saver", ["BackupAndRestore", "ModelCheckpoint .keras"])
def test_keras3_kill_and_resume_counts_every_step_once(resumed, saver):
    result = resumed[saver]
    # Epochs 0-1 (6 steps) were saved before the kill; the resumed run takes epochs 2-3.
    assert result["taken"] == 6
    assert result["noised_steps"] == 12
    expected = [
        PoissonSampledGaussianEvent(0.125, SIGMA, 3, "dp-sgd"),
        # q changed before the next ledger read (the save at the end of epoch 1): worst case of both.
        PoissonSampledGaussianEvent(0.25, SIGMA, 3, CHANGED_LABEL),
        # The resumed fit's optimizer is told q = 0.25 but fed the lots of q = 0.125: the ledger records the
        # rate of the lots that ran (issue 37.2; it recorded 0.25 before).
        PoissonSampledGaussianEvent(0.125, SIGMA, 6, "dp-sgd"),
    ]
    assert result["ledger"]["events"] == [e.to_dict() for e in expected]  # not the worst case of lost segments
    assert PrivacyLedger.from_dict(result["ledger"]) == PrivacyLedger(expected)
    assert result["epsilon"] == pytest.approx(compute_epsilon(expected, DELTA), rel=1e-12)
