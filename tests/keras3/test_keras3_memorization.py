"""The memorization test (Three Tools Sec. 2) on Keras 3 models: same statistics, same accounting."""

import keras

from keras_dpsgd.tools.memorization import DPSettings, memorization_test, mlp_builder

SHAPE, CLASSES = (8, 8, 1), 4


# Non-private vs DP and the DP run's ε on Keras 3: tests/tools/test_tools_memorization.py (parametrized by Keras).


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
