"""A DP vocabulary's release survives saving: apply_to → DP fit → save → load → ε still composes it.

The release lives in the layer's config (a keras_dpsgd-registered DPStringLookup / DPTextVectorization),
so a loaded model declares it again; ε is checked against dp_accounting's RDP accountant.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd
from keras_dpsgd.accounting import DEFAULT_ORDERS

dp_accounting = pytest.importorskip("dp_accounting")

N, BATCH, SIGMA, VOCAB_SIGMA, DELTA = 16, 2, 1.1, 2.0, 1e-4
_WORDS = ["good", "bad", "movie", "plot", "great", "awful"]


def _texts():
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(_WORDS, 3)) for _ in range(N)]


def _vocab():
    return keras_dpsgd.dp_vocabulary(
        _texts() * 20, noise_multiplier=VOCAB_SIGMA, max_tokens_per_example=3, threshold_delta=1e-7, seed=0
    )


def _oracle_epsilon(vocab, steps):
    """dp_accounting: the vocabulary's Gaussian and `steps` Poisson-sampled Gaussian steps, at δ − δ_τ."""
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(VOCAB_SIGMA))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(BATCH / N, dp_accounting.GaussianDpEvent(SIGMA)), steps)
    return accountant.get_epsilon(DELTA - vocab.threshold_delta)


def _keras3_model(vocab):
    import keras

    layer = vocab.apply_to(keras.layers.TextVectorization(max_tokens=10, output_sequence_length=3))
    model = keras.Sequential(
        [
            keras.Input((), dtype="string"),
            layer,
            keras.layers.Embedding(10, 2),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    return keras_dpsgd.keras3.make_private(model)


def _tf_keras_model(vocab):
    import tf_keras

    layer = vocab.apply_to(tf_keras.layers.TextVectorization(max_tokens=10, output_sequence_length=3))
    return tf_keras.Sequential(
        [
            tf_keras.Input((), dtype="string"),
            layer,
            tf_keras.layers.Embedding(10, 2),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(1),
        ]
    )


def _fit(model, keras3, epochs=1):
    if keras3:
        import keras

        optimizer = keras_dpsgd.keras3.DPSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, per_example_backend="fast"
        )
        loss = keras.losses.BinaryCrossentropy(from_logits=True)
        x = tf.constant(_texts())
    else:
        import tf_keras

        optimizer = keras_dpsgd.tf_keras.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1)
        loss = tf_keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
        x = np.array(_texts(), dtype=object)
    if not getattr(model, "_is_compiled", False) or model.optimizer is None:
        model.compile(optimizer=optimizer, loss=loss)
    y = np.arange(N, dtype=np.float32)[:, None] % 2
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def _epsilon(model):
    return keras_dpsgd.model_epsilon(model, target_delta=DELTA, num_examples=N, batch_size=BATCH)[0]


def _load(model, keras3, path):
    if keras3:
        import keras

        model.save(str(path / "model.keras"))
        return keras_dpsgd.keras3.make_private(keras.models.load_model(str(path / "model.keras")))
    import tf_keras

    model.save(str(path / "saved_model"))  # a SavedModel: the format that keeps tf_keras's whole ledger
    return tf_keras.models.load_model(str(path / "saved_model"))


@pytest.mark.parametrize("keras3", [True, False], ids=["keras3-.keras", "tf_keras-SavedModel"])
def test_release_is_in_epsilon_after_fit_save_load_and_further_training(tmp_path, keras3):
    vocab = _vocab()
    model = _keras3_model(vocab) if keras3 else _tf_keras_model(vocab)
    _fit(model, keras3)  # N / BATCH = 8 steps
    assert _epsilon(model) == pytest.approx(_oracle_epsilon(vocab, 8), rel=1e-6)

    loaded = _load(model, keras3, tmp_path)
    assert keras_dpsgd.model_privacy_ledger(loaded, num_examples=N, batch_size=BATCH).events[0] == vocab.event
    assert _epsilon(loaded) == pytest.approx(_oracle_epsilon(vocab, 8), rel=1e-6)
    _fit(loaded, keras3)  # training on: the vocabulary passes the refusal and stays in ε, counted once
    assert _epsilon(loaded) == pytest.approx(_oracle_epsilon(vocab, 16), rel=1e-6)


@pytest.mark.parametrize("keras3", [True, False], ids=["keras3-.keras", "tf_keras-SavedModel"])
def test_model_saved_before_any_fit_keeps_the_release(tmp_path, keras3):
    vocab = _vocab()
    model = _keras3_model(vocab) if keras3 else _tf_keras_model(vocab)
    loaded = _load(model, keras3, tmp_path)
    _fit(loaded, keras3)
    assert _epsilon(loaded) == pytest.approx(_oracle_epsilon(vocab, 8), rel=1e-6)


def test_adapt_of_an_accounted_vocabulary_is_refused():
    import keras

    layer = _vocab().apply_to(keras.layers.StringLookup())
    with pytest.raises(ValueError, match="adapt would replace it by the exact vocabulary"):
        layer.adapt(["a b"])


def test_a_second_vocabulary_adds_its_release_and_the_config_carries_both():
    import tf_keras

    vocab = _vocab()
    layer = vocab.apply_to(vocab.apply_to(tf_keras.layers.StringLookup()))
    assert layer.privacy_events == (vocab.event, vocab.event)
    assert type(layer).from_config(layer.get_config()).privacy_events == (vocab.event, vocab.event)
    with pytest.raises(TypeError, match="layer must be a StringLookup or TextVectorization .* got .*Dense"):
        vocab.apply_to(tf_keras.layers.Dense(2))
