"""BackupAndRestore, the membership-inference callback and the CLI on JAX: a run interrupted and resumed from its
backup continues exactly (weights, adaptive bounds, noised_steps, ε), the callback's loss attack has the AUC of the
model's own losses, ``keras-dpsgd train`` runs in this process on the bundled digits, and the input-canary audit runs."""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import compute_epsilon
from keras_dpsgd.tools import adaptive_clipping as ac
from tests._behaviour import built, keras3_front

FRONT = keras3_front()

Q, SIGMA, SIGMA_Q, DELTA = 0.5, 1.1, 2.0, 1e-3


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt("killed at the start of epoch 1")


class _Steps(keras.callbacks.Callback):
    taken = 0

    def on_train_batch_end(self, batch, logs=None):
        _Steps.taken += 1


def _run(callbacks=(), moved=False):
    """A seeded adaptive run of 2 epochs x 2 lots (noise: a function of (seed, step, tensor)); `moved`: other
    initial weights (only a restore can bring the run back to the uninterrupted one)."""
    model, x, y = built(FRONT, "dense")
    if moved:
        for v in model.trainable_variables:
            v.assign(v + 0.5)
    FRONT.compiled(
        model,
        k3.AdaptiveDPSGDOptimizer,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        norm_noise_multiplier=SIGMA_Q,
        learning_rate=0.1,
        sampling_rate=Q,
        expected_lot_size=2.0,
        seed=5,
        assume_poisson=True,
    )
    model.fit(x[:4], y[:4], batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def _loss_attack_auc(model, members, non_members):
    """P(ℓ(member) < ℓ(non-member)) (ties 1/2) from the model's logits: the "loss" attack's AUC."""

    def losses(xs, ys):
        logits = np.asarray(model(xs), np.float64)
        log_p = logits - logits.max(axis=1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
        return -log_p[np.arange(len(ys)), ys]

    inside, outside = losses(*members), losses(*non_members)
    return np.mean((inside[:, None] < outside[None, :]) + 0.5 * (inside[:, None] == outside[None, :]))


def test_backup_and_restore_resumes_exactly_and_the_membership_callback_runs(tmp_path):
    """The uninterrupted run also carries the membership-inference callback: its loss attack's AUC is the model's."""
    _, x, y = built(FRONT, "dense")
    rng = np.random.default_rng(3)
    members, non_members = (x[:4], y[:4]), (rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, size=6))
    audit = k3.MembershipInferenceCallback(members, non_members, methods=("loss",), verbose=0)
    whole = _run([audit])
    ((epoch, reports),) = audit.history[-1:]
    assert (epoch, len(audit.history)) == (2, 2)
    assert reports["loss"].auc == pytest.approx(_loss_attack_auc(whole, members, non_members), abs=1e-9)

    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _run([k3.BackupAndRestore(backup), _Interrupt()])  # the backup holds epoch 0
    _Steps.taken = 0
    resumed = _run([k3.BackupAndRestore(backup), _Steps()], moved=True)
    assert _Steps.taken == 2  # epoch 1 only
    assert int(resumed.optimizer.noised_steps.numpy()) == 4
    for a, b in zip(whole.trainable_variables, resumed.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(resumed.optimizer.clip_bounds.numpy(), whole.optimizer.clip_bounds.numpy(), rtol=1e-6)
    event = ac.adaptive_clipping_event(
        noise_multiplier=SIGMA, norm_noise_multiplier=SIGMA_Q, num_layers=1, sampling_rate=Q, steps=4
    )
    eps, _ = model_epsilon(resumed, target_delta=DELTA)
    assert eps == pytest.approx(compute_epsilon([event], DELTA), rel=1e-9)
    assert eps == pytest.approx(model_epsilon(whole, target_delta=DELTA)[0], rel=1e-12)


def test_cli_trains_on_jax_in_this_process(capsys):
    """``KERAS_BACKEND=jax keras-dpsgd train --dp-normalize`` on the bundled digits: the planned lots run, ε is the
    accountant's over the normalization's release (σ recorded in float32, rounded down) and the steps."""
    import json

    from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, event_from_dict
    from keras_dpsgd.cli import main

    norm_sigma = 3.2  # float32 rounds it up (to less noise): recorded rounded down
    assert float(np.float32(norm_sigma)) > norm_sigma
    argv = ["train", "--epochs", "1", "--lot-size", "256", "--width", "8", "--seed", "0", "--json"]
    assert main(argv + ["--dp-normalize", str(norm_sigma)]) == 0, capsys.readouterr().err[-3000:]
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dataset"] == "digits" and result["keras"] == keras.__version__ and result["backend"] == "jax"
    assert f"Keras {keras.__version__} on jax" in err  # the plan line
    assert result["steps"] == result["planned_steps"] == 6  # ceil(1347 / 256) lots
    release = event_from_dict(result["dp_normalize"]["event"])
    assert release.noise_multiplier == float(np.nextafter(np.float32(norm_sigma), np.float32(0)))
    event = PoissonSampledGaussianEvent(result["sampling_rate"], result["noise_multiplier"], result["steps"])
    assert result["epsilon"] == pytest.approx(compute_epsilon([release, event], result["delta"]), rel=1e-9)
    assert result["epsilon"] > compute_epsilon([GaussianEvent(norm_sigma), event], result["delta"])
    assert result["epsilon"] <= result["target_epsilon"]
    assert result["test_accuracy"] > 0.2  # 10 classes: above chance after 6 noisy lots


def test_input_canary_audit_runs_on_jax():
    """The one-run audit with input canaries (black box: the final model's losses) on JAX: its ε is the accountant's
    for the lots it ran, and its lower bound does not exceed it (gradient canaries stay refused: an optimizer hook)."""
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent
    from keras_dpsgd.audit.one_run import canary_audit, mlp_builder

    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    result = canary_audit(
        mlp_builder((6,), 2, width=8), (x, y), num_classes=2, canaries=16, kind="ood",
        noise_multiplier=1.0, lot_size=50, epochs=1, seed=0,
    )  # fmt: skip
    n = len(x) + 16 // 2  # the public size: N + m/2
    assert result.steps >= 1 and result.method == "one-run-ood"
    event = PoissonSampledGaussianEvent(50 / n, 1.0, result.steps)
    assert result.epsilon == pytest.approx(compute_epsilon([event], result.delta), rel=1e-9)
    assert 0.0 <= result.epsilon_lower_bound <= result.epsilon
