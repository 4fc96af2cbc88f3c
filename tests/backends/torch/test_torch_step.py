"""The private step on torch beyond the behaviour suite (test_torch_behaviour.py): non-finite examples, per-example
normalization, DP Adam and make_dp_optimizer, a Dropout mask per example, seeded and unseeded noise across a
load, Poisson lots with the privacy callbacks and the one-call API (ε = the accountant's).

The oracle is the behaviour suite's one-example loop (tests/_keras3_helpers.py: torch.autograd.grad on a batch
of one, no vmap, clipped in numpy); σ = 0 makes the step exact.
"""

import keras
import numpy as np
import pytest
import torch

import keras_dpsgd
import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built, keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5
FRONT = keras3_front()


def compiled(model, **dp_kwargs):
    return FRONT.compiled(model, learning_rate=LR, **dp_kwargs)


def assert_step(model, x, y, expected):
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def test_nonfinite_example_contributes_exactly_zero():
    """An example whose gradient is NaN is zeroed (factor 0, NaN not propagated) and counted."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=0.3)
    x = x.copy()
    x[2, 0] = np.nan
    keep = np.arange(len(x)) != 2
    expected = [g * (keep.sum() / len(x)) for g in loop_clipped_mean(model, x[keep], y[keep], FRONT.loss(), 0.3)]
    assert_step(model, x, y, expected)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_per_example_normalization():
    """clipping='normalize': each gradient scaled by 1/(||g|| + γ), sensitivity 1."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    assert_step(model, x, y, loop_clipped_mean(model, x, y, FRONT.loss(), 1.0, stability=0.05))


def test_dp_adam_and_make_dp_optimizer_take_the_clipped_mean():
    """Adam's first step moves each coordinate by lr·sign(g) (ε-hat aside): the sign of the clipped mean;
    a DP RMSprop from make_dp_optimizer takes Keras's RMSprop step from the same mean."""
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, k3.DPAdamOptimizer, l2_norm_clip=0.3, learning_rate=1e-3)
    expected = loop_clipped_mean(model, x, y, FRONT.loss(), 0.3)
    before, after = one_sgd_step(model, x, y, 1e-3)
    for b, a, g in zip(before, after, expected):
        moved = np.abs(g) > 1e-5
        np.testing.assert_array_equal(np.sign(b - a)[moved], np.sign(g)[moved])
    rms = k3.make_dp_optimizer(keras.optimizers.RMSprop)
    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, rms, l2_norm_clip=0.3, learning_rate=1e-3, rho=0.5)
    expected = loop_clipped_mean(model, x, y, FRONT.loss(), 0.3)
    before, after = one_sgd_step(model, x, y, 1e-3)
    plain = [keras.Variable(b.astype("float32")) for b in before]  # Keras's RMSprop on the loop's clipped mean
    keras.optimizers.RMSprop(learning_rate=1e-3, rho=0.5).apply(
        [keras.ops.convert_to_tensor(g, "float32") for g in expected], plain
    )
    for p, a in zip(plain, after):
        np.testing.assert_allclose(a, p.numpy(), rtol=1e-4, atol=1e-6)


def test_each_example_draws_its_own_dropout_mask():
    """8 copies of one example through Dropout(0.5): with one mask for the batch about half the kernel's
    update would be exactly 0; with a mask per example a coordinate is 0 only if all 8 dropped it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
        ]
    )
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=100.0, noise_multiplier=0.0, learning_rate=0.01),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(np.ones((8, 64), "float32"), np.zeros((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    update = before - np.asarray(model.trainable_variables[0].numpy())
    assert np.mean(update == 0) < 0.2


def _noise_only(**dp_kwargs):
    """A model whose every gradient is 0 (mse at y = f(x)), compiled: each step's update is the noise / L."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    y = np.asarray(model.predict(x, verbose=0))
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=1.0, **dp_kwargs),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    return model, x, y


def _update(model, x, y):
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return (before - np.asarray(model.trainable_variables[0].numpy())).ravel()


def test_seeded_noise_is_reproducible_and_unseeded_noise_is_fresh_after_a_load(tmp_path):
    a = _update(*_noise_only(seed=7))
    b = _update(*_noise_only(seed=7))
    np.testing.assert_array_equal(a, b)
    model, x, y = _noise_only()
    first = _update(model, x, y)
    assert abs(np.corrcoef(first, a)[0, 1]) < 0.05
    path = str(tmp_path / "m.keras")
    model.save(path)
    draws = []
    for _ in range(2):  # the same file loaded twice: two fresh keys (OS entropy), never the same noise
        loaded = keras.saving.load_model(path)
        k3.make_private(loaded)
        draws.append(_update(loaded, x, y))
    assert abs(np.corrcoef(*draws)[0, 1]) < 0.05
    assert abs(np.corrcoef(draws[0], first)[0, 1]) < 0.05


def test_poisson_lots_privacy_logger_within_limit_and_one_call_match_the_accountant():
    q_sigma = (32 / 96, 1.5)
    delta = 1e-5

    def eps(steps, q=q_sigma[0], sigma=q_sigma[1]):
        return compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), delta)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 5)).astype("float32"), rng.integers(0, 3, 96)
    model, _, _ = built(FRONT, "dense")
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=32, physical_batch_size=16, seed=1)
    k = lots.gradient_accumulation_steps
    opt = lots.configure(k3.DPSGDOptimizer(1.0, q_sigma[1], gradient_accumulation_steps=k, learning_rate=0.1))
    k3.make_private(model).compile(optimizer=opt, loss=FRONT.loss())
    target = (eps(4) + eps(5)) / 2  # 4 lots fit, the 5th would not
    limit = keras_dpsgd.WithinLimit(target, delta, verbose=0)
    history = model.fit(
        lots.dataset(),
        steps_per_epoch=lots.steps_per_epoch,
        epochs=3,
        verbose=0,
        callbacks=[keras_dpsgd.PrivacyLogger(delta), limit],
    )
    assert history.history["epsilon"][0] == pytest.approx(eps(lots.steps_per_epoch // k), rel=1e-9)
    assert limit.stopped and int(opt.noised_steps.numpy()) == 4
    assert keras_dpsgd.model_epsilon(model, target_delta=delta)[0] == pytest.approx(eps(4), rel=1e-9)

    model, _, _ = built(FRONT, "dense")
    run = keras_dpsgd.make_private_with_epsilon(
        model, x, y, target_epsilon=2.0, epochs=1, expected_lot_size=24, l2_norm_clip=1.0, target_delta=delta, verbose=0
    )
    run.model.compile(optimizer=run.optimizer, loss=FRONT.loss())
    run.fit(verbose=0)
    got = keras_dpsgd.model_epsilon(run.model, target_delta=delta)[0]
    steps = int(run.optimizer.noised_steps.numpy())
    assert steps == 4 and got <= 2.0
    assert got == pytest.approx(eps(steps, 24 / 96, run.optimizer.noise_multiplier), rel=1e-9)


def test_the_step_leaves_no_autograd_state_on_the_weights():
    """The weights' .grad stays None (the step differentiates detached copies) and the update is in place."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=1.0)
    params = [v.value for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert all(p.grad is None for p in params)
    assert all(isinstance(v.value, torch.nn.Parameter) for v in model.trainable_variables)
