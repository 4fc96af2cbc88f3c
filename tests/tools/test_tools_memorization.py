"""Memorization test (Three Tools Sec. 2): statistics, verdicts, accounting of the real-task mode, CLI."""

import json

import numpy as np
import pytest
import tf_keras as keras
from scipy import stats

from keras_dpsgd import accounting
from keras_dpsgd.cli import main
from keras_dpsgd.tools import data as _data, _stats
from keras_dpsgd.tools.memorization import DPSettings, memorization_test, mlp_builder, real_task_test


# ------------------------------------------------------------------ statistics
def test_clopper_pearson_closed_forms():
    # All successes: P(Bin(n, p) = n) = p^n = 1 - confidence.
    for n in (1, 10, 250):
        assert _stats.clopper_pearson_lower(n, n, 0.95) == pytest.approx(0.05 ** (1 / n))
    assert _stats.clopper_pearson_lower(0, 50) == 0.0
    # One success: 1 - (1 - p)^n = 1 - confidence.
    assert _stats.clopper_pearson_lower(1, 20, 0.9) == pytest.approx(1 - 0.9 ** (1 / 20))


@pytest.mark.parametrize("n, chance", [(100, 0.1), (500, 0.5), (1000, 0.1)])
def test_lower_bound_above_chance_iff_binomial_test_rejects(n, chance):
    for correct in range(0, n + 1, max(1, n // 200)):
        p = _stats.binomial_p_value(correct, n, chance)
        assert p == pytest.approx(stats.binomtest(correct, n, chance, alternative="greater").pvalue, rel=1e-9)
        if abs(p - 0.05) > 1e-9:
            assert _stats.significantly_above_chance(correct, n, chance, 0.95) == (p < 0.05)


def test_lower_bound_coverage_by_simulation():
    rng = np.random.default_rng(0)
    p, n = 0.13, 300
    draws = rng.binomial(n, p, size=2000)
    covered = np.mean([_stats.clopper_pearson_lower(int(k), n, 0.9) <= p for k in draws])
    assert covered >= 0.9 - 3 * np.sqrt(0.09 / 2000)


def test_stats_validation():
    with pytest.raises(ValueError, match="correct"):
        _stats.clopper_pearson_lower(11, 10)
    with pytest.raises(ValueError, match="confidence"):
        _stats.clopper_pearson_lower(1, 10, 1.0)
    with pytest.raises(ValueError, match="chance"):
        _stats.binomial_p_value(1, 10, 0.0)


def test_noise_labels_are_balanced_so_a_constant_guess_is_at_chance():
    x, y = _data.random_noise_data(1000, (8, 8, 1), 10, np.random.default_rng(1))
    assert x.shape == (1000, 8, 8, 1) and x.dtype == np.float32 and 0 <= x.min() and x.max() < 1
    assert np.all(np.bincount(y, minlength=10) == 100)
    with pytest.raises(ValueError, match="num_classes"):
        _data.random_noise_data(10, (2,), 1, np.random.default_rng(0))


# ------------------------------------------------------------------ the test itself (small, fast)
SHAPE, CLASSES = (8, 8, 1), 4
BUILD = mlp_builder(SHAPE, CLASSES, width=256, keras_module=keras)  # tf_keras


def _noise_test(build=BUILD, **options):
    """The memorization test (noise mode) of `build`'s model on SHAPE inputs and CLASSES classes."""
    return memorization_test(build, input_shape=SHAPE, num_classes=CLASSES, **options)


@pytest.mark.parametrize("front, epochs", [("tf_keras", 12), ("keras3", 8)])
def test_distinguishes_memorizing_nonprivate_from_dp(front, epochs):
    import keras as keras3

    build = BUILD if front == "tf_keras" else mlp_builder(SHAPE, CLASSES, width=256, keras_module=keras3)
    dp = DPSettings(l2_norm_clip=1.0, noise_multiplier=8.0, batch_size=50, learning_rate=0.05)
    # 99.9% bounds: at 95% a fixed seed fails whenever a change to any random stream lands it among
    # the 5% of draws the test rejects by design (and DP at this ε still allows train accuracy a
    # little above chance: 0.25-0.27 on average over seeds here).
    report = _noise_test(
        build, dp=dp, num_examples=200, epochs=epochs, nonprivate_learning_rate=0.01, seed=5, confidence=0.999
    )
    assert report.nonprivate_memorizes, report.summary()
    assert report.nonprivate.train_accuracy[-1] > 0.45
    assert not report.dp_memorizes, report.summary()
    assert report.conclusive and report.verdict.startswith("PASS")
    assert report.chance == pytest.approx(0.25)
    # Accounting of the (nominal) DP run: the optimizer's own counter, q = L/N.
    steps = epochs * 4  # 4 Poisson lots of expected size 50 per epoch of 200
    assert report.dp.noised_steps == steps
    assert report.dp.epsilon == pytest.approx(
        accounting.compute_epsilon(
            [accounting.PoissonSampledGaussianEvent(0.25, 8.0, steps)], accounting.default_delta(200)
        ),
        rel=1e-9,
    )
    d = json.loads(json.dumps(report.to_dict()))
    assert d["touches_real_data"] is False and "no real data" in d["privacy_note"]
    assert len(d["dp"]["train_accuracy"]) == epochs


def test_fail_verdict_when_the_private_run_memorizes():
    # A "DP" optimizer without noise (plain Adam) memorizes: the verdict must say the parameters are too weak.
    report = _noise_test(
        num_examples=200,
        epochs=12,
        nonprivate_learning_rate=0.01,
        seed=5,
        dp_optimizer_factory=lambda lots: keras.optimizers.Adam(0.01),
        loss=lambda reduction: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert report.dp_memorizes
    assert report.verdict.startswith("FAIL") and "privacy parameters too weak" in report.verdict
    # With its context (issue 27): where the run stands and how to reach a PASS.
    assert "at epsilon = not accounted (delta = " in report.verdict and "--noise-multiplier" in report.verdict
    assert report.dp.epsilon is None  # an optimizer that reports no σ is not accounted


def test_inconclusive_when_the_nonprivate_run_does_not_memorize():
    dp = DPSettings(noise_multiplier=8.0, batch_size=50)
    # The untrained model's accuracy on random labels exceeds the 95% bound with probability 5%: fix
    # the initialization (unseeded, it failed about once in 20 runs).
    keras.utils.set_random_seed(0)
    report = _noise_test(
        dp=dp,
        num_examples=200,
        epochs=2,
        nonprivate_optimizer_factory=lambda: keras.optimizers.SGD(1e-7),
        seed=3,
    )
    assert not report.nonprivate_memorizes and not report.conclusive
    assert report.verdict.startswith("INCONCLUSIVE")


def test_real_task_mode_accounts_the_dp_run():
    (xtr, ytr), (xte, yte) = _data.load_digits()
    train, test = (xtr[:400], ytr[:400]), (xte[:200], yte[:200])
    dp = DPSettings(l2_norm_clip=1.0, noise_multiplier=1.1, batch_size=100, learning_rate=0.1, physical_batch_size=64)
    report = real_task_test(
        mlp_builder(SHAPE, 10, width=32, keras_module=keras), train, test, num_classes=10, dp=dp, epochs=1, seed=2
    )
    assert report.mode == "real" and report.dp.test_accuracy is not None
    gap = report.train_test_gap
    assert gap["dp"] == pytest.approx(report.dp.train_accuracy[-1] - report.dp.test_accuracy[-1])
    assert report.dp.noised_steps == 4
    assert report.dp.epsilon == pytest.approx(
        accounting.compute_epsilon(
            [accounting.PoissonSampledGaussianEvent(0.25, 1.1, 4)], accounting.default_delta(400)
        )
    )
    d = report.to_dict()
    assert d["touches_real_data"] is True and d["nonprivate"]["epsilon"] == "inf"
    assert "cost privacy" in d["privacy_note"]
    nonprivate_runs = []  # An optimizer that cannot be accounted is refused before any training on the real data.
    with pytest.raises(ValueError, match="accounted"):
        real_task_test(
            mlp_builder(SHAPE, 10, width=8, keras_module=keras),
            train,
            test,
            num_classes=10,
            epochs=1,
            dp_optimizer_factory=lambda lots: keras.optimizers.SGD(0.1),
            nonprivate_optimizer_factory=lambda: nonprivate_runs.append(1) or keras.optimizers.SGD(0.1),
            loss=lambda r: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    assert nonprivate_runs == []


def test_validation():
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPSettings(noise_multiplier=-1)
    with pytest.raises(ValueError, match="delta must be < 1/num_examples"):
        _noise_test(num_examples=100, delta=0.05)
    with pytest.raises(ValueError, match="batch_size must be <="):
        _noise_test(num_examples=20, dp=DPSettings(batch_size=64))


def test_cli_memorization_json(capsys):
    code = main(
        [
            "memorization-test",
            "--num-examples",
            "120",
            "--epochs",
            "1",
            "--width",
            "16",
            "--lot-size",
            "40",
            "--seed",
            "1",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "noise" and out["num_examples"] == 120 and out["verdict"]
    assert len(out["dp"]["train_accuracy"]) == 1


def test_cli_memorization_real_mode_text(capsys):
    code = main(
        ["memorization-test", "--mode", "real", "--epochs", "1", "--width", "8", "--lot-size", "256", "--seed", "1"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "train-test gap" in out and "epsilon" in out and "Hyperparameter probes on real data cost privacy" in out
