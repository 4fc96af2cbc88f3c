"""The private step on torch beyond the behaviour suite (test_torch_behaviour.py): the checks JAX and torch share
(tests/_step_checks.py: non-finite examples, per-example normalization, a Dropout mask per example), DP Adam and
make_dp_optimizer, seeded and unseeded noise across a load, Poisson lots with the privacy callbacks and the
one-call API (ε = the accountant's).

The oracle is the behaviour suite's one-example loop (tests/_keras3_helpers.py: torch.autograd.grad on a batch
of one, no vmap, clipped in numpy); σ = 0 makes the step exact.
"""

import os

import keras
import numpy as np
import pytest
import torch

import keras_dpsgd
import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import built
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step
from tests._step_checks import *  # noqa: F403 (the checks JAX and torch share, collected here)
from tests._step_checks import FRONT, compiled, noise_only, update


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


def test_seeded_noise_is_reproducible_and_unseeded_noise_is_fresh_after_a_load(tmp_path):
    a = update(*noise_only(seed=7))
    b = update(*noise_only(seed=7))
    np.testing.assert_array_equal(a, b)
    model, x, y = noise_only()
    first = update(model, x, y)
    assert abs(np.corrcoef(first, a)[0, 1]) < 0.05
    path = str(tmp_path / "m.keras")
    model.save(path)
    draws = []
    for _ in range(2):  # the same file loaded twice: two fresh keys (OS entropy), never the same noise
        loaded = keras.saving.load_model(path)
        k3.make_private(loaded)
        draws.append(update(loaded, x, y))
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


def test_dp_optimizers_take_kerass_fused_torch_update():
    """On torch Keras builds ``SGD(...)`` (Adam, RMSprop) as its torch subclass, one ``torch._foreach`` update of
    every variable; the DP classes derive from it (the steps above check its values), a class of one's own keeps
    its own update."""
    from keras.src.backend.torch.optimizers.torch_parallel_optimizer import TorchParallelOptimizer

    for cls in (k3.DPSGDOptimizer, k3.DPAdamOptimizer, k3.make_dp_optimizer(keras.optimizers.RMSprop)):
        assert issubclass(cls, TorchParallelOptimizer), cls
    own = type("OwnSGD", (keras.optimizers.SGD,), {"update_step": keras.optimizers.SGD.update_step})
    dp_own = k3.make_dp_optimizer(own)
    assert issubclass(dp_own, own) and not issubclass(dp_own, TorchParallelOptimizer)


def test_noise_drawn_ahead_releases_the_same_values(monkeypatch):
    """A lot of one batch draws its noise on a second thread during the step (``TorchFront.draw_ahead``) where
    torch's intra-op threads leave a core free (``spare_core``): a seeded run gives the weights of the same run
    drawing at the release (no spare core, or a release too large to draw ahead), bit for bit."""
    from keras_dpsgd.backends import torch as torch_backend
    from keras_dpsgd.backends.torch import NoiseAhead
    from keras_dpsgd.keras3 import _torch_front

    taken, take = [], NoiseAhead.take
    monkeypatch.setattr(NoiseAhead, "take", lambda self, *args: taken.append(take(self, *args)) or taken[-1])
    runs = []
    # (spare core, AHEAD_MAX): drawn ahead; no core free: at the release; 0: every draw at the release
    for spare, limit in ((True, _torch_front.AHEAD_MAX), (False, _torch_front.AHEAD_MAX), (True, 0)):
        monkeypatch.setattr(torch_backend, "spare_core", lambda device, spare=spare: spare)
        monkeypatch.setattr(_torch_front, "AHEAD_MAX", limit)
        model, x, y = noise_only(seed=5)
        runs.append(np.concatenate([update(model, x, y), update(model, x, y)]))
    assert len(taken) == 2 and all(t is not None for t in taken)  # the first run's two releases took their draws
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])
    assert np.std(runs[0]) > 0.01  # noise was added


def test_noise_is_drawn_ahead_only_beside_a_free_core():
    """``spare_core``: a draw ahead only where torch's intra-op threads are fewer than the usable cores, or the step
    computes on an accelerator."""
    from keras_dpsgd.backends.torch import spare_core

    threads = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(cores)
        assert not spare_core()
        torch.set_num_threads(1)
        assert spare_core() == (cores > 1)
        torch.set_num_threads(cores)
        assert spare_core("cuda")  # the step computes on the accelerator
    finally:
        torch.set_num_threads(threads)
