"""The DP vocabulary (Gaussian thresholding) and its accounting: closed forms, composition, the ledger, layers."""

import math

import keras
import numpy as np
import pytest
import tf_keras
from scipy.stats import norm

import keras_dpsgd
from keras_dpsgd.accounting import (
    GaussianEvent,
    GaussianThresholdingEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    compute_epsilon,
    make_accountant,
)
from keras_dpsgd.preprocessing.vocabulary import threshold_for_delta, thresholding_delta

dp_accounting = pytest.importorskip("dp_accounting")


def _exact_gaussian_delta(sigma, epsilon):
    """Balle & Wang 2018, Thm 8: the exact δ(ε) of the Gaussian mechanism with noise multiplier σ."""
    return norm.cdf(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * norm.cdf(-0.5 / sigma - epsilon * sigma)


def test_threshold_closed_form():
    """τ = 1 + s·Φ⁻¹((1 − δ)^(1/k)), and one of k count-1 tokens passes it with probability δ."""
    s, k, delta = 3.0, 5, 1e-6
    tau = threshold_for_delta(delta, s, k)
    assert tau == pytest.approx(1 + s * norm.ppf((1 - delta) ** (1 / k)), rel=1e-9)
    assert 1 - norm.cdf((tau - 1) / s) ** k == pytest.approx(delta, rel=1e-6)
    assert thresholding_delta(tau, s, k) == pytest.approx(delta, rel=1e-6)
    # Monte Carlo: a lone example's k tokens (count 1) pass a lower threshold at the predicted rate.
    rng = np.random.default_rng(0)
    tau_half = threshold_for_delta(0.05, s, k)
    passed = np.mean(np.any(1 + rng.normal(0, s, (200_000, k)) > tau_half, axis=1))
    assert passed == pytest.approx(0.05, abs=0.003)


@pytest.mark.parametrize("accountant", ["rdp", "moments", "pld"])
def test_thresholding_composes_as_gaussian_plus_delta(accountant):
    """ε at δ of the event = ε of GaussianEvent(σ) at δ − δ_τ; composed with DP-SGD the δ_τ adds once per event."""
    sigma, d_tau, delta = 2.0, 1e-6, 1e-5
    event = GaussianThresholdingEvent(sigma, d_tau, label="dp-vocabulary")
    assert compute_epsilon([event], delta, accountant=accountant) == pytest.approx(
        compute_epsilon([GaussianEvent(sigma)], delta - d_tau, accountant=accountant), rel=1e-12
    )
    steps = PoissonSampledGaussianEvent(0.01, 1.1, 1000)
    both = compute_epsilon([event, event, steps], delta, accountant=accountant)
    gaussian = GaussianEvent(sigma)
    gaussian_only = compute_epsilon([gaussian, gaussian, steps], delta - 2 * d_tau, accountant=accountant)
    assert both == pytest.approx(gaussian_only, rel=1e-12)
    assert compute_epsilon([event], d_tau, accountant=accountant) == math.inf  # nothing left for the Gaussian part


def test_thresholding_epsilon_against_the_exact_gaussian_and_dp_accounting():
    """PLD ε of one release matches the exact Gaussian mechanism at δ − δ_τ (Balle & Wang), and RDP bounds it."""
    sigma, d_tau, delta = 2.0, 1e-7, 1e-5
    event = GaussianThresholdingEvent(sigma, d_tau)
    eps_pld = compute_epsilon([event], delta, accountant="pld")
    assert _exact_gaussian_delta(sigma, eps_pld) == pytest.approx(delta - d_tau, rel=2e-2)
    oracle = dp_accounting.rdp.RdpAccountant()
    oracle.compose(dp_accounting.GaussianDpEvent(sigma))
    assert compute_epsilon([event], delta) == pytest.approx(oracle.get_epsilon(delta - d_tau), rel=1e-6)
    assert compute_epsilon([event], delta) >= eps_pld
    assert make_accountant("rdp").compose(event).get_delta(compute_epsilon([event], delta)) == pytest.approx(delta)


def test_the_event_round_trips_through_the_ledger():
    ledger = PrivacyLedger([GaussianThresholdingEvent(3.0, 1e-7, label="dp-vocabulary")])
    assert PrivacyLedger.from_dict(ledger.to_dict()) == ledger
    with pytest.raises(ValueError, match="threshold_delta must be in"):
        GaussianThresholdingEvent(3.0, 1.0)


def _texts(n=400, seed=0):
    rng = np.random.default_rng(seed)
    common = ["the", "movie", "good", "bad", "great", "plot"]
    texts = [" ".join(rng.choice(common, 4)) + f" Name{i}!" for i in range(n)]  # one unique name per text
    return texts


def test_dp_vocabulary_keeps_shared_tokens_and_drops_unique_ones():
    vocab = keras_dpsgd.dp_vocabulary(
        _texts(), noise_multiplier=2.0, max_tokens_per_example=5, threshold_delta=1e-6, seed=0
    )
    assert set(vocab.tokens) <= {"the", "movie", "good", "bad", "great", "plot"}
    assert len(vocab.tokens) == 6  # counts of about 200+ against τ ≈ 1 + 4.5·5.5
    assert not any(t.startswith("name") for t in vocab.tokens)  # each has count 1
    assert vocab.threshold == pytest.approx(threshold_for_delta(1e-6, 2.0 * math.sqrt(5), 5))
    assert vocab.privacy_events == (GaussianThresholdingEvent(2.0, vocab.threshold_delta, label="dp-vocabulary"),)
    assert vocab.threshold_delta == pytest.approx(1e-6, rel=1e-6) and vocab.threshold_delta >= 1e-6


def test_one_example_contributes_at_most_k_tokens():
    """An example repeating many distinct tokens adds 1 to each of its first k only (sensitivity √k)."""
    many = " ".join(f"tok{i}" for i in range(50))
    vocab = keras_dpsgd.dp_vocabulary(
        [many] * 300, noise_multiplier=1.0, max_tokens_per_example=3, threshold_delta=1e-6, seed=0
    )
    assert set(vocab.tokens) == {"tok0", "tok1", "tok2"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"noise_multiplier": 0.0}, r"noise_multiplier must be a finite number > 0, got 0.0"),
        ({"max_tokens_per_example": 0}, r"max_tokens_per_example must be an integer >= 1, got 0"),
        ({"threshold_delta": 1.0}, r"threshold_delta must be in \(0, 1\), got 1.0"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, got 0"),
        ({"standardize": "upper"}, r"standardize must be one of"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    args = dict(noise_multiplier=1.0, max_tokens_per_example=2, threshold_delta=1e-6)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        keras_dpsgd.dp_vocabulary(["a b"], **args)


@pytest.mark.parametrize("kmod", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_applied_vocabulary_is_in_the_model_ledger_and_passes_the_refusal(kmod):
    vocab = keras_dpsgd.dp_vocabulary(
        _texts(), noise_multiplier=2.0, max_tokens_per_example=5, threshold_delta=1e-7, seed=0
    )
    layer = vocab.apply_to(kmod.layers.StringLookup())
    assert layer.get_vocabulary()[1:] == list(vocab.tokens)
    model = kmod.Sequential([kmod.Input((1,), dtype="string"), layer, kmod.layers.Dense(2)])
    ledger = keras_dpsgd.model_privacy_ledger(model, untrained=True)  # a new model: stated
    assert ledger.events == vocab.privacy_events
    refuse = keras_dpsgd.keras3.refuse_adapted_preprocessing if kmod is keras else _tf_keras_refusal()
    refuse(model)  # accounted: no refusal


def _tf_keras_refusal():
    from keras_dpsgd.preprocessing.normalization import refuse_adapted_preprocessing

    return refuse_adapted_preprocessing


@pytest.mark.parametrize("kmod", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_adapted_vocabulary_refusal_points_to_the_dp_vocabulary(kmod):
    layer = kmod.layers.StringLookup()
    layer.adapt(["a b", "b c"])
    model = kmod.Sequential([kmod.Input((1,), dtype="string"), layer])
    refuse = keras_dpsgd.keras3.refuse_adapted_preprocessing if kmod is keras else _tf_keras_refusal()
    with pytest.raises(ValueError, match=r"holds a vocabulary .* keras_dpsgd\.dp_vocabulary\(texts") as err:
        refuse(model)
    assert "DPNormalization" not in str(err.value)


# ------------------------------------------------------------------ TextVectorization before an LSTM


def _text_model(output_sequence_length, vocabulary=("good", "great", "fun", "bad", "awful", "plot", "movie")):
    layer = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=output_sequence_length)
    layer.adapt([" ".join(vocabulary)])  # public strings
    keras_dpsgd.mark_public(layer)
    return keras.Sequential(
        [
            keras.Input((), dtype="string"),
            layer,
            keras.layers.Embedding(20, 4),
            keras.layers.LSTM(3),
            keras.layers.Dense(2),
        ]
    )


_TEXTS = ["good movie great fun", "bad plot", "awful", "great great acting and a good story too", "movie"]


def test_text_vectorization_with_static_length_trains_exactly_on_the_fast_backend():
    """TextVectorization(output_sequence_length=4) → Embedding → LSTM: accepted (was refused as a
    non-static length), and one σ = 0 step equals the one-example-at-a-time clipped mean."""
    import tensorflow as tf

    from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

    keras.utils.set_random_seed(0)
    model = keras_dpsgd.keras3.make_private(_text_model(4))
    optimizer = keras_dpsgd.keras3.DPSGDOptimizer(
        l2_norm_clip=0.05, noise_multiplier=0.0, learning_rate=1.0, per_example_backend="fast"
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss)
    x, y = tf.constant(_TEXTS), np.array([1, 0, 0, 1, 1])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = loop_clipped_mean(model, x, y, loss_fn, 0.05)
    before, after = one_sgd_step(model, x, y, 1.0)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose(b - a, g, rtol=2e-4, atol=2e-6)


def test_text_vectorization_padding_to_the_batch_is_refused():
    """Without output_sequence_length each example is padded to the longest of its batch: refused."""
    import tensorflow as tf

    model = keras_dpsgd.keras3.make_private(_text_model(None))
    optimizer = keras_dpsgd.keras3.DPSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=1.0, per_example_backend="fast"
    )
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="longest one of the batch"):
        model.fit(tf.constant(_TEXTS), np.array([1, 0, 0, 1, 1]), batch_size=5, verbose=0)
