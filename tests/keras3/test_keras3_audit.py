"""The audit on Keras 3 (cheap versions of tests/test_audit_*.py): the step audit, the gradient-canary hook in closed
form, bug detection (noise off while the ledger charges σ = 1), power (no noise: memorization seen),
membership inference with its Keras 3 callback, and the CLI's choice of Keras (soundness: the tf_keras
module, which shares the statistics and the canary code)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd.keras3 as k3
from keras_dpsgd.data.datasets import load_digits
from keras_dpsgd.audit import membership_inference, with_gradient_canaries
from tests._audit_helpers import gradient_audit, input_canary_audit, scaled_noise, step_audit_run, without_noise


@pytest.fixture(scope="module")
def digits():
    return load_digits()


NoNoiseDPSGD = without_noise(k3.DPSGDOptimizer)


def test_gradient_canaries_on_keras3_add_plus_minus_c_at_their_coordinates():
    """σ = 0, q = 1: add_noise's output is its input plus ±C at each included canary's coordinate."""
    variables = [keras.Variable(np.zeros([3, 4], "float32")), keras.Variable(np.zeros([5], "float32"))]
    opt = with_gradient_canaries(k3.DPSGDOptimizer)(l2_norm_clip=2.0, noise_multiplier=0.0)
    assert isinstance(opt, k3.DPSGDOptimizer)
    opt.build(variables)
    included = np.array([True, False, True, True, False, True])
    opt.install_gradient_canaries(variables, included, rng=np.random.default_rng(0), sampling_rate=1.0)
    summed = [tf.fill([3, 4], 0.5), tf.fill([5], -0.25)]
    out = opt.add_noise(summed)
    delta = np.concatenate([(out[0] - summed[0]).numpy().ravel(), (out[1] - summed[1]).numpy().ravel()])
    moved = np.flatnonzero(delta)
    assert len(moved) == included.sum()
    np.testing.assert_allclose(np.abs(delta[moved]), 2.0)
    np.testing.assert_array_equal(opt.canary_inclusions(), included.astype(int))
    with pytest.raises(ValueError, match="optimizer_cls"):
        with_gradient_canaries(keras.optimizers.SGD)


def test_bug_detection_on_keras3(digits):
    result = gradient_audit(keras, digits, 1.0, seed=1, optimizer_cls=NoNoiseDPSGD)
    assert result.noise_multiplier == 1.0 and np.isfinite(result.epsilon)  # what the ledger charges
    assert result.keras == keras.__version__  # the label of every --json "keras" key
    assert result.is_violation, result
    assert result.verdict().startswith("BUG")


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_step_audit_on_keras3(digits, factor):
    """The white-box step audit through the Keras 3 add_noise hook: a correct optimizer is not flagged, half
    the charged noise is (tests/audit/test_audit_step.py has the rest, on tf_keras)."""
    broken = None if factor == 1.0 else scaled_noise(k3.DPSGDOptimizer, factor)
    result = step_audit_run(keras, digits, seed=2, optimizer_cls=broken)
    assert result.keras == keras.__version__ and result.epsilon == pytest.approx(2.07, abs=0.01)
    assert result.noise_multiplier_estimate == pytest.approx(factor, rel=0.01)
    assert result.is_violation == (factor < 1.0), result


def test_power_input_canaries_without_noise_on_keras3(digits):
    result = input_canary_audit(keras, digits, canaries=100, epochs=20)
    assert result.epsilon == float("inf")
    assert result.epsilon_lower_bound > 1.0, result


def test_membership_inference_and_callback_on_keras3():
    rng = np.random.default_rng(0)
    x, y = rng.random((300, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 300)
    members, non_members = (x[:200], y[:200]), (x[200:], y[200:])
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = k3.MembershipInferenceCallback(members, non_members, every=15, verbose=0, methods=("loss",))
    model.fit(*members, epochs=30, batch_size=32, verbose=0, callbacks=[cb])
    assert [epoch for epoch, _ in cb.history] == [15, 30]
    report = membership_inference(model, members, non_members, methods=("loss",))["loss"]
    assert report.auc > 0.9
    assert report.auc == pytest.approx(cb.history[-1][1]["loss"].auc)


@pytest.mark.parametrize("legacy", ["1"])  # the default (Keras 3): tests/audit/test_audit_cli.py
def test_cli_audit_runs_on_tf_keras_with_the_legacy_switch_and_says_which(legacy, monkeypatch, capsys):
    import json

    from keras_dpsgd.cli import main

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    argv = [
        "audit",
        "--json",
        "--epochs",
        "1",
        "--lot-size",
        "256",
        "--width",
        "8",
        "--canaries",
        "100",
        "--seed",
        "3",
        "--noise-multiplier",
        "1",
    ]
    assert main(argv) == 0
    out = json.loads([line for line in capsys.readouterr().out.splitlines() if line.strip()][-1])
    import tf_keras

    assert out["keras"] == f"tf_keras {tf_keras.__version__}"  # the form of `keras-dpsgd train --json`
    assert 0.0 <= out["epsilon_lower_bound"] <= out["epsilon"]
