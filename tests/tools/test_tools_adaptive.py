"""Adaptive per-layer clipping (Three Tools Sec. 3): bound update, noise, accounting, calibration."""

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats
import tf_keras as keras

from keras_dpsgd import accounting
from keras_dpsgd.tools import adaptive_clipping as ac
from keras_dpsgd.tf_keras._adaptive import (
    AdaptiveDPSGDOptimizer,
    ClipBoundsLogger,
    initial_clip_bounds,
    make_adaptive_optimizer,
)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.layers.InputLayer(input_shape=(4,)),
            keras.layers.Dense(3, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )


def _per_example_norms(model, x, y):
    """One example at a time: ‖g_i^v‖ for each example i and variable v."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i : i + 1], model(x[i : i + 1], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        rows.append([float(tf.norm(g)) for g in grads])
    return np.array(rows)


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32") * 3, (np.arange(n) % 2).astype("int64")


@pytest.mark.parametrize("accumulation, backend", [(1, "reference"), (2, "reference"), (1, "fast"), (2, "fast")])
def test_bound_follows_alpha_times_clipped_mean_norm_without_noise(accumulation, backend):
    if backend == "fast":
        pytest.importorskip("keras_dpsgd.backends.tensorflow")
    x, y = _data(8)
    model = _model()
    bounds = np.array([0.3, 0.05, 0.2, 0.08])  # small: the β·C clip is active for some examples
    alpha, beta = 1.3, 2.0
    opt = AdaptiveDPSGDOptimizer(
        list(bounds),
        0.0,
        0.0,
        alpha=alpha,
        beta=beta,
        learning_rate=0.1,
        gradient_accumulation_steps=accumulation,
        per_example_backend=backend,
        seed=3,
    )
    model.compile(optimizer=opt, loss=LOSS)
    for _ in range(3):
        norms = _per_example_norms(model, x, y)
        expected = alpha * np.minimum(norms, beta * bounds[None, :]).sum(axis=0) / len(x)
        model.fit(x, y, batch_size=len(x) // accumulation, epochs=1, shuffle=False, verbose=0)
        got = opt.clip_bounds.numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-4)
        assert np.any(norms > beta * bounds[None, :])  # the norm-query clip mattered
        bounds = expected
    assert int(opt.noised_steps.numpy()) == 3


def test_bound_divides_by_expected_lot_size():
    x, y = _data(8)
    model = _model()
    bounds = np.array([1.0, 1.0, 1.0, 1.0])
    opt = AdaptiveDPSGDOptimizer(list(bounds), 0.0, 0.0, learning_rate=0.0, expected_lot_size=5.0, seed=1)
    model.compile(optimizer=opt, loss=LOSS)
    norms = _per_example_norms(model, x, y)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_allclose(opt.clip_bounds.numpy(), np.minimum(norms, 2.0).sum(axis=0) / 5.0, rtol=1e-4)


def test_norm_query_noise_is_gaussian_with_scale_sigma_l2_beta_c():
    """z = (L·C_new/α − Σ min(‖g‖, βC)) / (σ_l2 β C) must be N(0, 1) (lr = 0: gradients fixed)."""
    x, y = _data(16)
    model = _model()
    # Noise std on the new bound: σ_l2 β C / L = C / 8, so the floor is never reached.
    sigma_l2, beta, alpha = 1.0, 2.0, 1.0
    opt = AdaptiveDPSGDOptimizer(
        [1.0] * 4, 1.0, sigma_l2, alpha=alpha, beta=beta, learning_rate=0.0, min_clip_bound=1e-9, seed=7
    )
    norms = _per_example_norms(model, x, y)

    @tf.function  # the batch as the step's arguments (a captured constant is not a known input)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)

    zs = []
    prev = np.ones(4)
    for _ in range(60):
        step(x, y)
        new = opt.clip_bounds.numpy()
        signal = np.minimum(norms, beta * prev[None, :]).sum(axis=0)
        z = (len(x) * new / alpha - signal) / (sigma_l2 * beta * prev)
        assert np.all(new > 1e-9)
        zs.extend(z)
        prev = new
    zs = np.array(zs)
    n = len(zs)
    assert n == 240
    assert abs(zs.mean()) < 4 / math.sqrt(n)
    assert 0.85 < zs.std() < 1.15
    assert stats.kstest(zs, "norm").pvalue > 1e-4


def test_effective_noise_multiplier_composes_gradient_and_norm_queries():
    opt = AdaptiveDPSGDOptimizer([1.0, 2.0, 3.0], [1.0, 2.0, 0.5], 2.5)
    expected = (1 / 1.0**2 + 1 / 2.0**2 + 1 / 0.5**2 + 3 / 2.5**2) ** -0.5
    assert opt.effective_noise_multiplier == pytest.approx(expected, rel=1e-12)
    assert ac.composed_noise_multiplier([0.7225] * 4, [2.5] * 4) == pytest.approx((4 / 0.7225**2 + 4 / 2.5**2) ** -0.5)
    assert AdaptiveDPSGDOptimizer([1.0], 1.0, 0.0).effective_noise_multiplier == 0.0
    # σ_l2 → ∞: back to per-layer clipping's σ/√V.
    assert ac.composed_noise_multiplier([1.2] * 4, [1e12] * 4) == pytest.approx(0.6, rel=1e-9)


def test_epsilon_of_composed_step_matches_dp_accounting():
    dp_accounting = pytest.importorskip("dp_accounting")
    q, steps, delta = 0.01, 500, 1e-5
    event = ac.adaptive_clipping_event(
        noise_multiplier=1.1, norm_noise_multiplier=5.0, num_layers=6, sampling_rate=q, steps=steps
    )
    sigma_eff = (6 / 1.1**2 + 6 / 5.0**2) ** -0.5
    assert event.noise_multiplier == pytest.approx(sigma_eff)
    ours = accounting.compute_epsilon([event], delta)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_eff)), steps)
    oracle = acc.get_epsilon(delta)
    assert ours <= oracle * (1 + 1e-6)  # ours may be tighter (conversion), never looser than ~oracle
    assert ours == pytest.approx(oracle, rel=0.05)
    # Charging only the gradient releases would under-report ε.
    assert (
        accounting.compute_epsilon([accounting.PoissonSampledGaussianEvent(q, 1.1 / math.sqrt(6), steps)], delta) < ours
    )


def test_calibration_helper_meets_target_and_matches_closed_form():
    kw = dict(
        num_layers=8,
        norm_noise_multiplier=2.5,
        target_epsilon=3.0,
        target_delta=1e-5,
        sampling_rate=128 / 50000,
        steps=2000,
    )
    sigma = ac.calibrate_adaptive_noise_multiplier(**kw)
    eps = lambda s: accounting.compute_epsilon(  # noqa: E731
        [
            ac.adaptive_clipping_event(
                noise_multiplier=s,
                norm_noise_multiplier=2.5,
                num_layers=8,
                sampling_rate=kw["sampling_rate"],
                steps=2000,
            )
        ],
        1e-5,
    )
    assert eps(sigma) <= 3.0
    assert eps(sigma * 0.999) > 3.0
    needed = accounting.compute_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sampling_rate=kw["sampling_rate"], steps=2000
    )
    closed = math.sqrt(8 / (1 / needed**2 - 8 / 2.5**2))
    assert sigma == pytest.approx(closed, rel=1e-4)


def test_calibration_refuses_when_norm_queries_spend_the_budget():
    with pytest.raises(ValueError, match="norm_noise_multiplier must be >"):
        ac.calibrate_adaptive_noise_multiplier(
            num_layers=50,
            norm_noise_multiplier=0.5,
            target_epsilon=1.0,
            target_delta=1e-5,
            sampling_rate=0.01,
            steps=1000,
        )


def test_initial_clip_bounds_are_mean_norms_on_noise():
    model = _model()
    bounds = initial_clip_bounds(model, batch_size=6, seed=11)
    rng = np.random.default_rng(11)
    x = rng.random((6, 4), dtype=np.float32)
    y = rng.integers(0, 2, size=6)
    np.testing.assert_allclose(bounds, _per_example_norms(model, x, y).mean(axis=0), rtol=1e-5)


def test_validation_and_serialization():
    flat = AdaptiveDPSGDOptimizer(1.0, 1.0, 2.0)  # one flat bound: one gradient release, one query
    assert flat.effective_noise_multiplier == pytest.approx((1 + 1 / 4) ** -0.5)
    with pytest.raises(ValueError, match="clipping='normalize' has no bound"):
        AdaptiveDPSGDOptimizer(None, 1.0, 1.0, clipping="normalize")
    with pytest.raises(ValueError, match="norm_noise_multiplier must have one entry"):
        AdaptiveDPSGDOptimizer([1.0, 1.0], 1.0, [1.0])
    with pytest.raises(ValueError, match="alpha must be"):
        AdaptiveDPSGDOptimizer([1.0], 1.0, 1.0, alpha=0.0)
    opt = AdaptiveDPSGDOptimizer([1.0, 2.0], 1.0, 2.5, alpha=1.1, beta=3.0, learning_rate=0.05)
    clone = AdaptiveDPSGDOptimizer.from_config(opt.get_config())
    assert (clone.alpha, clone.beta, clone.norm_noise_multiplier) == (1.1, 3.0, 2.5)
    assert clone.effective_noise_multiplier == opt.effective_noise_multiplier
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, AdaptiveDPSGDOptimizer)
    settings = dict(
        norm_noise_multiplier=[2.0, 3.0],
        alpha=1.0,
        beta=2.0,
        min_clip_bound=1e-3,
        rule="quantile",
        target_quantile=0.3,
        quantile_learning_rate=0.4,
        divide_by_bound=True,
    )
    quantile = AdaptiveDPSGDOptimizer([1.0, 2.0], 1.0, **settings)
    assert {k: getattr(quantile, k) for k in settings} == settings  # read back as given, and in the config
    assert {k: quantile.get_config()[k] for k in settings} == settings
    with pytest.raises(AttributeError):
        quantile.alpha = 2.0  # read-only
    adam_cls = make_adaptive_optimizer(__import__("keras_dpsgd").tf_keras.DPAdamOptimizer)
    adam = adam_cls([1.0, 1.0], 1.0, 2.0, learning_rate=0.01)
    assert adam.effective_noise_multiplier == pytest.approx((2 + 2 / 4) ** -0.5)


def test_clip_bounds_logger_writes_logs_and_tensorboard(tmp_path):
    x, y = _data(8)
    model = _model()
    opt = AdaptiveDPSGDOptimizer([1.0] * 4, 1.0, 5.0, learning_rate=0.1)
    model.compile(optimizer=opt, loss=LOSS)
    cb = ClipBoundsLogger(log_dir=str(tmp_path), update_freq=1)
    hist = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb])
    key = "clip_bound/" + model.trainable_variables[0].name[:-2]
    assert len(hist.history[key]) == 2
    assert hist.history[key][-1] == pytest.approx(float(opt.clip_bounds.numpy()[0]))
    assert len(cb.history) == 2 and len(cb.history[0]) == 4
    # The ledger charges the composed σ_eff (gradient releases and norm queries).
    from keras_dpsgd.ledger import model_privacy_ledger

    opt.sampling_rate = 0.5
    (event,) = model_privacy_ledger(model).events
    assert event.noise_multiplier == pytest.approx((4 / 1.0 + 4 / 25.0) ** -0.5)
    assert event.count == 4 and event.sampling_rate == 0.5
    files = list(tmp_path.glob("events.out.tfevents*"))
    assert files
    tags = {v.tag for e in tf.compat.v1.train.summary_iterator(str(files[0])) for v in e.summary.value}
    assert key in tags


def test_cli_adaptive_clipping_noise(capsys):
    import json

    from keras_dpsgd.cli import main

    args = [
        "adaptive-clipping-noise",
        "--num-layers",
        "8",
        "--norm-noise-multiplier",
        "2.5",
        "--target-epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sampling-rate",
        "0.00256",
        "--steps",
        "2000",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(
        ac.calibrate_adaptive_noise_multiplier(
            num_layers=8,
            norm_noise_multiplier=2.5,
            target_epsilon=3.0,
            target_delta=1e-5,
            sampling_rate=0.00256,
            steps=2000,
        )
    )
    assert out["effective_noise_multiplier"] == pytest.approx((8 / out["noise_multiplier"] ** 2 + 8 / 6.25) ** -0.5)
    assert main(args[:4] + ["0.1"] + args[5:]) == 2
    assert "norm_noise_multiplier must be >" in capsys.readouterr().err


def test_model_save_load_keeps_adaptive_optimizer_and_bounds(tmp_path):
    x, y = _data(8)
    model = _model()
    opt = AdaptiveDPSGDOptimizer([1.0] * 4, 1.0, 4.0, alpha=1.1, learning_rate=0.1, expected_lot_size=8.0)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, AdaptiveDPSGDOptimizer)
    assert loaded.optimizer.alpha == 1.1 and loaded.optimizer.norm_noise_multiplier == 4.0
    np.testing.assert_allclose(loaded.optimizer.clip_bounds.numpy(), opt.clip_bounds.numpy())
    assert int(loaded.optimizer.noised_steps.numpy()) == 2


def test_every_public_tools_name_resolves():
    import keras_dpsgd
    import keras_dpsgd.tools as tools

    for name in tools.__all__:
        assert getattr(tools, name) is not None
    for name, module in keras_dpsgd._NEUTRAL.items():
        if module == "keras_dpsgd.tools":
            assert getattr(keras_dpsgd, name) is getattr(tools, name)
    assert keras_dpsgd.tf_keras.AdaptiveDPSGDOptimizer is AdaptiveDPSGDOptimizer
    assert issubclass(AdaptiveDPSGDOptimizer, keras_dpsgd.tf_keras.DPSGDOptimizer)


def test_a_discarded_partial_lot_leaves_no_norm_sums_in_the_next_lot():
    """tf_keras, 2 batches per lot, 3 batches per epoch: the third is discarded at the next epoch's start.
    The next lot's norm query must sum its own examples only (an example of the discarded batch would
    otherwise count in a lot it was never sampled into: twice the norm query's sensitivity)."""
    x, y = _data(12)
    model = _model()
    opt = AdaptiveDPSGDOptimizer(
        [0.3, 0.05, 0.2, 0.08], 0.0, 0.0, learning_rate=0.0, gradient_accumulation_steps=2, seed=1
    )
    model.compile(optimizer=opt, loss=LOSS)
    norms = _per_example_norms(model, x, y)  # lr = 0: fixed
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    first = opt.clip_bounds.numpy()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # starts by discarding batch 3
    assert opt.discarded_lots >= 1
    expected = np.minimum(norms[:8], 2.0 * first[None, :]).sum(axis=0) / 8
    np.testing.assert_allclose(opt.clip_bounds.numpy(), expected, rtol=1e-4)
