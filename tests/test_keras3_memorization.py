"""The memorization test (Three Tools Sec. 2) on Keras 3 models: same statistics, same accounting."""

import keras
import pytest

from keras_dpsgd import accounting
from keras_dpsgd.tools.memorization import DPSettings, memorization_test, mlp_builder

SHAPE, CLASSES = (8, 8, 1), 4


def test_keras3_memorization_distinguishes_nonprivate_from_dp_and_accounts_the_dp_run():
    dp = DPSettings(l2_norm_clip=1.0, noise_multiplier=8.0, batch_size=50, learning_rate=0.05)
    report = memorization_test(
        mlp_builder(SHAPE, CLASSES, width=256, keras_module=keras),
        input_shape=SHAPE,
        num_classes=CLASSES,
        dp=dp,
        num_examples=200,
        epochs=8,
        nonprivate_learning_rate=0.01,
        seed=5,
        confidence=0.999,
    )
    assert report.nonprivate_memorizes, report.summary()
    assert not report.dp_memorizes, report.summary()
    assert report.verdict.startswith("PASS") and report.chance == pytest.approx(0.25)
    steps = 8 * 4  # 4 Poisson lots of expected size 50 per epoch of 200
    assert report.dp.noised_steps == steps
    assert report.dp.epsilon == pytest.approx(
        accounting.compute_epsilon(
            [accounting.PoissonSampledGaussianEvent(0.25, 8.0, steps)], accounting.default_delta(200)
        ),
        rel=1e-9,
    )


def test_keras3_builders_follow_tf_use_legacy_keras(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "")
    assert isinstance(mlp_builder(SHAPE, CLASSES, width=4)(), keras.Model)
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert not isinstance(mlp_builder(SHAPE, CLASSES, width=4)(), keras.Model)


def test_keras3_physical_batches_accumulate_and_the_ledger_counts_lots():
    dp = DPSettings(batch_size=50, physical_batch_size=25)
    run = lambda: memorization_test(
        mlp_builder(SHAPE, CLASSES, width=4, keras_module=keras),  # noqa: E731
        input_shape=SHAPE,
        num_classes=CLASSES,
        dp=dp,
        num_examples=100,
        epochs=1,
        seed=0,
    )
    assert run().dp.noised_steps == 2  # two lots (of two physical batches each), not four batches
