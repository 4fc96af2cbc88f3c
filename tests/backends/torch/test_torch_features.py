"""Features around the torch step: BackupAndRestore resumes a seeded run exactly (the ledger and the DP state
restored), and Keras's own checkpoint files carry the ledger."""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built, keras3_front

FRONT = keras3_front()
Q, SIGMA, DELTA = 0.5, 1.1, 1e-3


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise KeyboardInterrupt


class _Steps(keras.callbacks.Callback):
    taken = 0

    def on_train_batch_end(self, batch, logs=None):
        _Steps.taken += 1


def _run(callbacks):
    model, x, y = built(FRONT, "dense")
    x, y = x[:4], y[:4]
    FRONT.compiled(
        model,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        learning_rate=0.1,
        sampling_rate=Q,
        assume_poisson=True,
        gradient_accumulation_steps=1,
        seed=5,
    )
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def test_backup_and_restore_resumes_a_seeded_run_exactly(tmp_path):
    whole = _run([])
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _run([k3.BackupAndRestore(backup), _Interrupt()])  # the backup holds epoch 0
    _Steps.taken = 0
    resumed = _run([k3.BackupAndRestore(backup), _Steps()])
    assert _Steps.taken == 2  # epoch 1 only
    assert int(resumed.optimizer.noised_steps.numpy()) == 4
    for a, b in zip(whole.trainable_variables, resumed.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)
    eps, _ = model_epsilon(resumed, target_delta=DELTA)
    assert eps == pytest.approx(compute_epsilon(PoissonSampledGaussianEvent(Q, SIGMA, 4), DELTA), rel=1e-9)


def test_cli_trains_on_torch_in_this_process(capsys):
    """``KERAS_BACKEND=torch keras-dpsgd train --dp-normalize`` on the bundled digits: the planned lots run, ε is
    the accountant's over the normalization's release (recorded exactly: float64 on torch) and the steps."""
    import json

    from keras_dpsgd.accounting import PoissonSampledGaussianEvent, event_from_dict
    from keras_dpsgd.cli import main

    argv = ["train", "--epochs", "1", "--lot-size", "256", "--width", "8", "--seed", "0", "--json"]
    assert main(argv + ["--dp-normalize", "3.2"]) == 0, capsys.readouterr().err[-3000:]
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dataset"] == "digits" and result["backend"] == "torch"
    assert f"Keras {keras.__version__} on torch" in err  # the plan line
    assert result["steps"] == result["planned_steps"] == 6  # ceil(1347 / 256) lots
    release = event_from_dict(result["dp_normalize"]["event"])
    assert release.noise_multiplier == 3.2
    event = PoissonSampledGaussianEvent(result["sampling_rate"], result["noise_multiplier"], result["steps"])
    assert result["epsilon"] == pytest.approx(compute_epsilon([release, event], result["delta"]), rel=1e-9)
    assert result["epsilon"] <= result["target_epsilon"]
    assert result["test_accuracy"] > 0.2  # 10 classes: above chance after 6 noisy lots


def test_membership_callback_and_input_canary_audit_run_on_torch():
    """The membership-inference callback reads the model's losses (its AUC in [0, 1]); the one-run audit with input
    canaries: its ε is the accountant's for the lots it ran, its lower bound does not exceed it."""
    from keras_dpsgd.audit.one_run import canary_audit, mlp_builder

    model, x, y = built(FRONT, "dense")
    audit = k3.MembershipInferenceCallback((x[:3], y[:3]), (x[3:], y[3:]), methods=("loss",), verbose=0)
    FRONT.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1)
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, callbacks=[audit])
    ((epoch, reports),) = audit.history
    assert epoch == 1 and 0.0 <= reports["loss"].auc <= 1.0

    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    result = canary_audit(
        mlp_builder((6,), 2, width=8), (x, y), num_classes=2, canaries=16, kind="ood",
        noise_multiplier=1.0, lot_size=50, epochs=1, seed=0,
    )  # fmt: skip
    n = len(x) + 16 // 2  # the public size: N + m/2
    event = PoissonSampledGaussianEvent(50 / n, 1.0, result.steps)
    assert result.steps >= 1 and result.epsilon == pytest.approx(compute_epsilon([event], result.delta), rel=1e-9)
    assert 0.0 <= result.epsilon_lower_bound <= result.epsilon
