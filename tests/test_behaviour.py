"""The behavioural suite (issues 14, 29), run for Keras 3 on TensorFlow, tf_keras and (in the JAX suite's
process, tests/backends/jax/test_jax_behaviour.py) Keras 3 on JAX, with the same checks.

Exact clipped steps (σ = 0) against a one-example-at-a-time loop, flat and per-layer, batch 1, a
CNN, an LSTM, a transformer block; the noise std σC/B (statistical bound); an empty lot; lots of k
batches (gradient accumulation); weight regularizers added un-clipped, data-dependent add_loss
refused; the ledger's ε against the accountant's, across a .keras save, load and resumed fit.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson
from tests._behaviour import built, process_fronts
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5
FRONTS = process_fronts()  # Keras 3 and tf_keras; Keras 3 alone in the JAX and torch suites


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _assert_step(front, model, x, y, clip, per_layer=False):
    expected = loop_clipped_mean(model, x, y, front.loss(), clip, per_layer)
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("name", ["dense", "conv2d", "embedding", "layer_norm", "lstm", "transformer", "subclassed"])
def test_flat_clipped_step_matches_loop(front, name):
    model, x, y = built(front, name)
    _assert_step(front, front.compiled(model, l2_norm_clip=0.3, learning_rate=LR), x, y, 0.3)


@pytest.mark.parametrize("name", ["conv2d", "subclassed"])
def test_per_layer_clipped_step_matches_loop(front, name):
    model, x, y = built(front, name)
    clip = [float(c) for c in np.random.default_rng(5).uniform(0.05, 0.5, size=len(model.trainable_variables))]
    _assert_step(front, front.compiled(model, l2_norm_clip=clip, learning_rate=LR), x, y, clip, per_layer=True)


def test_batch_size_one(front):
    model, x, y = built(front, "dense")
    _assert_step(front, front.compiled(model, l2_norm_clip=0.2, learning_rate=LR), x[:1], y[:1], 0.2)


def _wide(front):
    K = front.keras
    K.utils.set_random_seed(0)
    return K.Sequential([K.Input((40,)), K.layers.Dense(250, use_bias=False)])


def _noise_only(front, x, **dp_kwargs):
    """The update of one fit over `x` (one batch per lot) when every gradient is 0 (mse at y = f(x))."""
    model = _wide(front)
    y = model.predict(x, verbose=0) if len(x) else np.zeros((0, 250), "float32")
    model.compile(optimizer=front.optimizer_cls(learning_rate=1.0, seed=None, **dp_kwargs), loss=_mse(front))
    front.private(model)
    data = tf.data.Dataset.from_tensors((x, y))  # One batch of len(x) examples, possibly 0.
    before = model.trainable_variables[0].numpy().copy()
    model.fit(data, epochs=1, verbose=0)
    return (before - model.trainable_variables[0].numpy()).ravel(), model


def _mse(front):
    return front.keras.losses.MeanSquaredError(reduction="none")


def _assert_std(noise, expected):
    # 10,000 coordinates: the sample std is within 3% of the truth with probability > 0.9999 (chi-square).
    assert abs(noise.std() / expected - 1.0) < 0.03
    assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)


def test_noise_std_is_sigma_c_over_batch(front):
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    noise, model = _noise_only(front, x, l2_norm_clip=0.7, noise_multiplier=1.3)
    _assert_std(noise, 1.3 * 0.7 / 8)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_empty_lot_releases_noise_only(front):
    """B = 0 (an empty Poisson lot): no crash, the update is N(0, (σC/L)²), one noised step."""
    noise, model = _noise_only(
        front, np.zeros((0, 40), "float32"), l2_norm_clip=0.7, noise_multiplier=1.3, expected_lot_size=4.0
    )
    _assert_std(noise, 1.3 * 0.7 / 4.0)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def _accumulated(front, k, batch, **dp_kwargs):
    model, x, y = built(front, "dense")
    x = np.concatenate([x] * 2)[: k * batch]
    y = np.concatenate([y] * 2)[: k * batch]
    return front.compiled(model, learning_rate=LR, gradient_accumulation_steps=k, **dp_kwargs), x, y


def test_accumulated_lot_equals_one_big_batch(front):
    """k = 3 batches of 4: one release, the clipped mean of the 12 examples (σ = 0)."""
    model, x, y = _accumulated(front, 3, 4, l2_norm_clip=0.3)
    expected = loop_clipped_mean(model, x, y, front.loss(), 0.3)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert int(model.optimizer.noised_steps.numpy()) == 1
    assert model.optimizer.discarded_lots == 0


def test_accumulated_lot_noise_is_drawn_once(front):
    """k = 2 batches, L = 8: the released update is N(0, (σC/L)²), not k separately noised batches."""
    model = _wide(front)
    x = np.random.default_rng(1).normal(size=(8, 40)).astype("float32")
    y = model.predict(x, verbose=0)
    opt = front.optimizer_cls(
        l2_norm_clip=0.7, noise_multiplier=1.3, learning_rate=1.0, expected_lot_size=8.0, gradient_accumulation_steps=2
    )
    model.compile(optimizer=opt, loss=_mse(front))
    front.private(model)
    before = model.trainable_variables[0].numpy().copy()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_std((before - model.trainable_variables[0].numpy()).ravel(), 1.3 * 0.7 / 8.0)
    assert int(opt.noised_steps.numpy()) == 1


def test_partial_lots_are_discarded_and_the_ledger_counts_lots(front):
    """5 batches per epoch, k = 2: 2 lots per epoch, the odd batch discarded at each epoch's end."""
    model, x, y = _accumulated(front, 2, 4, l2_norm_clip=1.0, noise_multiplier=1.1)
    x, y = np.concatenate([x] * 3)[:20], np.concatenate([y] * 3)[:20]
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    opt = model.optimizer
    assert int(opt.noised_steps.numpy()) == 4
    assert (opt.discarded_lots, opt.discarded_batches) == (2, 2)
    assert int(opt._accum_batches.numpy()) == 0


def test_ledger_epsilon_equals_the_accountant_across_save_load_and_resume(front, tmp_path):
    """3 lots, a .keras file, loaded, 3 lots more: ε of 3 then of 6 lots, the accountant's."""
    q, sigma, delta = 0.25, 1.1, 1e-3

    def accountant(steps):
        return compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), delta)

    model, x, y = built(front, "dense")
    front.compiled(
        model, l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.1, sampling_rate=q, assume_poisson=True
    )
    x, y = np.concatenate([x] * 2)[:6], np.concatenate([y] * 2)[:6]
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    eps, got_delta = model_epsilon(model, target_delta=delta)
    assert got_delta == delta
    assert eps == pytest.approx(accountant(3), rel=1e-9)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = front.keras.models.load_model(path)
    assert int(loaded.optimizer.noised_steps.numpy()) == 3
    assert model_epsilon(loaded, target_delta=delta)[0] == pytest.approx(accountant(3), rel=1e-9)
    front.private(loaded)
    assume_poisson(loaded.optimizer)  # the statement is not saved with the model
    loaded.fit(x, y, batch_size=2, epochs=1, verbose=0)
    assert int(loaded.optimizer.noised_steps.numpy()) == 6
    assert model_epsilon(loaded, target_delta=delta)[0] == pytest.approx(accountant(6), rel=1e-9)


def _regularized(front, **layer_kwargs):
    K = front.keras
    model = K.Sequential([K.Input((5,)), K.layers.Dense(3, **layer_kwargs)])
    # Keras 3: a reduced compiled loss (the private step takes it per example): Keras 3's own build of an
    # unreduced loss plus model.losses fails on JAX (ops.sum of a [B] and a scalar), with or without DP.
    # tf_keras's DP optimizer needs the unreduced (vector) loss.
    keras3 = front.name == "keras3"
    loss = K.losses.SparseCategoricalCrossentropy(from_logits=True) if keras3 else front.loss()
    model.compile(optimizer=front.optimizer_cls(l2_norm_clip=0.1, noise_multiplier=0.0, learning_rate=LR), loss=loss)
    return front.make_private(model)


def test_weight_regularizer_gradient_is_added_unclipped(front):
    """The step is the DP step of the data loss plus the exact ∇ 0.5·||W||² (no clip, no noise).

    On tf_keras this failed before inside compile_utils ("Shapes must be equal rank").
    """
    model = _regularized(front, kernel_regularizer=front.keras.regularizers.L2(0.5))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, size=6)
    expected = loop_clipped_mean(model, x, y, front.loss(), 0.1)
    expected[0] = expected[0] + 2 * 0.5 * model.trainable_variables[0].numpy()
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def test_data_dependent_add_loss_is_refused(front):
    model = _regularized(front, activity_regularizer=front.keras.regularizers.L2(0.1))
    with pytest.raises(ValueError, match="add_loss"):
        model.fit(np.zeros((4, 5), "float32"), np.zeros(4), verbose=0)


def test_interrupted_lot_is_discarded_before_the_next_fit(front):
    class Interrupt(front.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                raise KeyboardInterrupt

    model, x, y = _accumulated(front, 2, 4, l2_norm_clip=1.0, noise_multiplier=1.1)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[Interrupt()])
    opt = model.optimizer
    # One batch of a lot left by the interrupted fit: pending (TensorFlow), or already discarded when JAX's fit
    # ended (Keras syncs the stateless step's values back in a `finally`, then the lot boundary is seen).
    assert int(opt._accum_batches.numpy()) + opt.discarded_batches == 1
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    # The released lot holds this fit's 2 batches only, none of the interrupted one.
    assert int(opt.noised_steps.numpy()) == 1
    assert (opt.discarded_lots, opt.discarded_batches) == (1, 1)


def test_poisson_lots_with_steps_per_epoch_not_a_multiple_of_the_lot_are_refused(front):
    from keras_dpsgd import PoissonLots

    model, x, y = built(front, "dense")
    x, y = np.concatenate([x] * 10), np.concatenate([y] * 10)
    lots = PoissonLots(x, y, expected_lot_size=8, physical_batch_size=4)
    k = lots.gradient_accumulation_steps
    assert k > 1
    opt = lots.configure(front.optimizer_cls(l2_norm_clip=1.0, noise_multiplier=1.1, gradient_accumulation_steps=k))
    front.private(model)
    model.compile(optimizer=opt, loss=front.loss())
    with pytest.raises(ValueError, match="steps_per_epoch"):
        model.fit(lots.dataset(), steps_per_epoch=k + 1, epochs=1, verbose=0)
