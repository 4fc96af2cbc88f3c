"""End to end: DPPCA(k) → Dense → softmax trained with DP-SGD on scikit-learn's digits."""

import numpy as np
import tf_keras as keras
from sklearn.datasets import load_digits

from keras_dpsgd.tf_keras import DPPCA, DPSGDOptimizer
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import model_privacy_ledger


def test_dppca_then_dense_trains_with_dpsgd_on_digits():
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)  # (1797, 8, 8)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    pca = DPPCA(20, noise_multiplier=4.0, seed=0)
    pca.adapt(x_train)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8)), pca, keras.layers.Dense(10, activation="softmax")])
    batch_size, epochs, clip, sigma = 50, 8, 1.0, 0.8
    model.compile(
        optimizer=DPSGDOptimizer(clip, sigma, learning_rate=1.5, seed=1),  # q = B/N from fit (a Poisson assumption)
        loss=keras.losses.SparseCategoricalCrossentropy(reduction="none"),
        metrics=["accuracy"],
    )
    before = model.evaluate(x_test, y_test, verbose=0)[1]
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0)
    after = model.evaluate(x_test, y_test, verbose=0)[1]
    assert before < 0.4 and after > 0.75  # ≈ 0.9 on this split; chance is 0.1

    # the projection is frozen during training; the ε of the run includes the PCA release
    assert pca.trainable_weights == [] and len(pca.privacy_events) == 1
    steps = epochs * len(x_train) // batch_size
    sgd = PoissonSampledGaussianEvent(batch_size / len(x_train), sigma, count=steps, label="dp-sgd")
    ledger = model_privacy_ledger(model)
    assert ledger.events == (*pca.privacy_events, sgd)
    eps = compute_epsilon(ledger, 1e-5)
    assert eps == compute_epsilon([*pca.privacy_events, sgd], 1e-5)
    assert eps > compute_epsilon(sgd, 1e-5)
