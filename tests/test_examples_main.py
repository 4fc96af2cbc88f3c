"""The examples' --smoke runs (subprocesses, offline: tfds mock data), so the examples never rot.

The Keras 3 smokes of this module (mnist, cifar10, finetune_lora) run one after another in ONE fresh process
(``tests/_one_process.py``: TensorFlow and Keras imported once); their random draws may differ from a run in a
process of its own, and no assertion here reads them beyond chance level (the mock data's labels are random).
"""

import importlib.util
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests._one_process import run_scripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
_RESULT = re.compile(r"test accuracy ([0-9.]+) at ε = ([0-9.e+-]+) \(δ = ([0-9.e+-]+)\), (\d+) DP-SGD steps")


def _run(script, *argv, timeout=240, **env_vars):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env_vars)
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--smoke", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    match = _RESULT.search(proc.stdout)
    assert match, proc.stdout[-2000:]
    acc, eps, delta, steps = float(match[1]), float(match[2]), float(match[3]), int(match[4])
    return proc.stdout, acc, eps, delta, steps


def _parsed(run):
    """(stdout, accuracy, ε, δ, DP-SGD steps) of one script's run from :func:`run_scripts`."""
    assert run["code"] == 0, run["stdout"][-2000:] + run["error"][-3000:]
    match = _RESULT.search(run["stdout"])
    assert match, run["stdout"][-2000:]
    return run["stdout"], float(match[1]), float(match[2]), float(match[3]), int(match[4])


@pytest.fixture(scope="module")
def keras3_smokes(tmp_path_factory):
    """This module's Keras 3 smokes in one process: name -> run; cifar10 starts from a saved public model."""
    directory = tmp_path_factory.mktemp("smokes")
    public = _load_example("cifar10_alexnet").small_alexnet()
    public.save(str(directory / "public.keras"))
    jobs = {
        "mnist": ["mnist_dpsgd.py", "--preset", "medium"],
        "cifar10": ["cifar10_alexnet.py", "--public-model", directory / "public.keras"]
        + ["--save-model", directory / "trained.keras"],
    }
    if importlib.util.find_spec("keras_hub") is not None:
        jobs["finetune_lora"] = ["finetune_lora.py"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="0")
    runs = run_scripts(
        [[os.path.join(EXAMPLES, name), "--smoke", *argv] for name, *argv in jobs.values()], timeout=600, env=env
    )
    return dict(zip(jobs, runs)), directory, public


def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("legacy, front_end, paper", [("0", "Keras 3", False), ("1", "tf_keras", True)])
def test_mnist_smoke_counts_pca_and_steps(legacy, front_end, paper, request):
    from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, compute_epsilon

    # Keras 3 by default (in this module's Keras 3 process), tf_keras with TF_USE_LEGACY_KERAS=1 (the Keras that
    # tf.keras is) in a process of its own.
    if legacy == "0":
        assert not paper  # the module's Keras 3 process runs mnist without --paper
        out, acc, eps, delta, steps = _parsed(request.getfixturevalue("keras3_smokes")[0]["mnist"])
    else:
        out, acc, eps, delta, steps = _run(
            "mnist_dpsgd.py", "--preset", "medium", *(["--paper"] if paper else []), TF_USE_LEGACY_KERAS=legacy
        )
    assert out.startswith(f"{front_end}; preset medium")
    assert "epsilon:" in out  # ε printed as it trains
    # 2 epochs of ceil(256 / 64) = 4 lots; ε composes the DP-PCA release (all data; the paper's or the
    # tuned σ_p) and the DP-SGD steps at q = 64/256 and σ_eff: the paper's 4, else calibrated to ε = 2.
    assert steps == 8 and delta == 1e-3
    sigma = float(re.search(r"σ_eff = ([0-9.]+) \((fixed|calibrated to 2 epochs)\)", out)[1])
    if paper:
        assert sigma == 4.0
    else:
        assert eps == pytest.approx(2.0, rel=1e-2) and eps <= 2.0
    example = _load_example("mnist_dpsgd")
    medium = example.PRESETS["medium"]
    pca_noise = medium.paper_pca_noise if paper else medium.pca_noise
    expected = compute_epsilon([GaussianEvent(pca_noise), PoissonSampledGaussianEvent(0.25, sigma, steps)], delta)
    sgd_only = compute_epsilon(PoissonSampledGaussianEvent(0.25, sigma, steps), delta)
    assert eps == pytest.approx(expected, rel=1e-3) and eps > sgd_only
    _assert_chance_accuracy(acc, num_test=256)  # mock data: 256 test examples, random labels


def _assert_chance_accuracy(accuracy, num_test, decimals=4):
    """tfds mock data has random labels over 10 classes: the printed accuracy (to `decimals`) is a
    count over the `num_test` test examples, below 0.1 + 8 sd of Binomial(num_test, 0.1). A count exactly halfway
    between two printed values (2/64 = 0.03125 printed 0.0312) sits on the rounding bound: float slack 1e-9."""
    correct = accuracy * num_test
    assert abs(correct - round(correct)) <= 0.5 * 10.0**-decimals * num_test + 1e-9, accuracy
    assert accuracy < 0.1 + 8 * math.sqrt(0.09 / num_test), accuracy


def test_cifar10_smoke_with_frozen_public_layers(keras3_smokes):
    example = _load_example("cifar10_alexnet")
    runs, directory, public = keras3_smokes
    trained_path = str(directory / "trained.keras")
    out, acc, eps, delta, steps = _parsed(runs["cifar10"])
    assert "frozen public conv layers, 6 DP-trained variables" in out
    assert steps == 4 and 0 < eps <= 8.0
    _assert_chance_accuracy(acc, num_test=64)  # mock data: 64 test examples, random labels
    keras = example.keras  # the example's Keras: Keras 3 unless TF_USE_LEGACY_KERAS=1

    trained = keras.models.load_model(trained_path, compile=False)
    for name in example.CONV_LAYERS:  # frozen: exactly the public weights
        for got, want in zip(trained.get_layer(name).get_weights(), public.get_layer(name).get_weights()):
            np.testing.assert_array_equal(got, want)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(trained.get_layer("dense1").get_weights(), public.get_layer("dense1").get_weights())
    ]
    assert all(changed)  # trained with DP-SGD


def test_small_alexnet_architecture():
    example = _load_example("cifar10_alexnet")
    keras = example.keras
    model = example.small_alexnet()
    kinds = [type(layer).__name__ for layer in model.layers[1:]]
    assert kinds == [
        "Conv2D",
        "MaxPooling2D",
        "LocalResponseNormalization",
        "Conv2D",
        "LocalResponseNormalization",
        "MaxPooling2D",
        "Flatten",
        "Dense",
        "Dense",
        "Dense",
    ]
    assert [model.get_layer(n).units for n in ("dense1", "dense2", "logits")] == [384, 192, 10]
    assert all(
        model.get_layer(n).filters == 64 and model.get_layer(n).kernel_size == (5, 5) for n in ("conv1", "conv2")
    )
    # LRN mixes channels of one example, never examples: example 0's output ignores example 1.
    x = np.random.default_rng(0).random((2, 32, 32, 3)).astype(np.float32)
    y = x.copy()
    y[1] = 0.0
    np.testing.assert_allclose(model(x)[0], model(y)[0], rtol=1e-5, atol=1e-6)
    assert isinstance(model, keras.Model)


def test_finetune_lora_smoke(keras3_smokes):
    """keras_hub BERT (random, tiny) with LoRA, DP-SGD on generated text: only the LoRA factors and
    the head train, and the run spends the calibrated ε."""
    pytest.importorskip("keras_hub")
    out, acc, eps, delta, steps = _parsed(keras3_smokes[0]["finetune_lora"])
    trained, total = (int(v) for v in re.search(r"LoRA rank 4: (\d+) trainable parameters of (\d+)", out).groups())
    assert 0 < trained < total / 20
    assert steps >= 3 and 2.5 < eps <= 3.0 + 1e-6 and 0 < delta < 1e-2
