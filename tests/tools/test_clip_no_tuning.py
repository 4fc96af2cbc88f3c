"""Clipping bounds that need no tuning, on both Kerases: flat adaptive clipping (the Three Tools rule
with one group, C_t = α · noisy mean total norm) and quantile-based adaptive clipping (Andrew et al.
2021, the bound follows a target quantile of the norms through a noisy count).

Oracles: a one-example-at-a-time loop (the update and the next bound, σ = 0), the sensitivity of a
step's releases to removing one example, the count query's noise (statistical), and the ledger's ε
against the accountant's composition of the gradient release and the query.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import compute_epsilon
from keras_dpsgd.tools import adaptive_clipping as ac
from keras_dpsgd.ledger import assume_poisson
from tests._behaviour import built, keras3_front, tf_keras_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5
FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _adaptive_cls(front):
    import keras_dpsgd.keras3 as k3
    import keras_dpsgd.tf_keras as tfk

    return (k3 if front.name == "keras3" else tfk).AdaptiveDPSGDOptimizer


def _compiled(front, model, bound, sigma=0.0, query_sigma=0.0, **kwargs):
    kwargs.setdefault("learning_rate", LR)
    kwargs.setdefault("seed", 1)
    opt = _adaptive_cls(front)(bound, sigma, query_sigma, **kwargs)
    front.private(model)
    model.compile(optimizer=opt, loss=front.loss())
    return opt


def _total_norms(front, model, x, y):
    """‖g_i‖ of the whole gradient, one example at a time."""
    loss_fn, out = front.loss(), []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y[i : i + 1], model(x[i : i + 1], training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        out.append(math.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in grads)))
    return np.array(out)


def _check_update(front, model, x, y, bound):
    """One step: the weights move by lr × the loop's flat-clipped mean at the bound in force."""
    expected = loop_clipped_mean(model, x, y, front.loss(), bound)
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_flat_mean_rule_matches_loop(front, backend):
    """σ = 0: C ← α Σ_i min(‖g_i‖, β C) / B on the whole gradient, the same C for every variable."""
    model, x, y = built(front, "dense")
    alpha, beta, bound = 1.3, 2.0, 0.05  # small: both the clip and the query's β·C clip are active
    opt = _compiled(front, model, bound, alpha=alpha, beta=beta, per_example_backend=backend)
    capped = False
    for _ in range(3):
        norms = _total_norms(front, model, x, y)
        new = alpha * np.minimum(norms, beta * bound).sum() / len(x)
        _check_update(front, model, x, y, bound)
        got = opt.clip_bounds.numpy()
        np.testing.assert_allclose(got, np.full(len(model.trainable_variables), new), rtol=1e-4)
        capped |= bool(np.any(norms > beta * bound))
        bound = new
    assert capped


@pytest.mark.parametrize("per_layer", [False, True])
def test_quantile_rule_matches_loop(front, per_layer):
    """σ = 0: C ← C exp(-η (#{‖g_i‖ <= C}/B - γ)) (per variable with per-layer bounds)."""
    model, x, y = built(front, "dense")
    eta, gamma = 0.3, 0.7
    variables = len(model.trainable_variables)
    bound = [0.05, 0.2, 0.3, 0.1] if per_layer else 0.5
    opt = _compiled(front, model, bound, rule="quantile", target_quantile=gamma, quantile_learning_rate=eta)
    for _ in range(3):
        if per_layer:
            loss_fn, rows = front.loss(), []
            for i in range(len(x)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(loss_fn(y[i : i + 1], model(x[i : i + 1], training=True)))
                rows.append([float(tf.norm(g)) for g in tape.gradient(loss, model.trainable_variables)])
            below = (np.array(rows) <= np.array(bound)[None, :]).mean(axis=0)
            expected = np.array(bound) * np.exp(-eta * (below - gamma))
            model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        else:
            below = np.mean(_total_norms(front, model, x, y) <= bound)
            expected = np.full(variables, bound * math.exp(-eta * (below - gamma)))
            _check_update(front, model, x, y, bound)
        np.testing.assert_allclose(opt.clip_bounds.numpy(), expected, rtol=1e-5)
        bound = list(expected) if per_layer else float(expected[0])


def _release(front, x, y, lot, bound, **kwargs):
    """(Σ clip(g_i) at the bound in force, the next bound) of one σ = 0 step normalized by `lot`."""
    model, _, _ = built(front, "dense")
    opt = _compiled(front, model, bound, expected_lot_size=lot, **kwargs)
    before, after = one_sgd_step(model, x, y, LR)
    summed = np.concatenate([((b - a) / LR * lot).ravel() for b, a in zip(before, after)])
    return summed, float(opt.clip_bounds.numpy()[0])


@pytest.mark.parametrize("rule", ["mean", "quantile"])
def test_sensitivity_of_a_step_to_removing_one_example(front, rule):
    """The gradient sum moves by <= C; the query by <= β C (mean) or by one count at most (quantile)."""
    _, x, y = built(front, "dense")
    kwargs = dict(rule=rule, alpha=1.0, beta=2.0, quantile_learning_rate=0.4)
    # A huge gradient under a small bound (every clip active, not counted), then a bound above every norm.
    for scale, bound, count_moves in ((1e3, 0.5, 0.0), (1.0, 1e3, 1.0)):
        x2 = x.copy()
        x2[0] *= scale
        s_in, c_in = _release(front, x2, y, 7.0, bound, **kwargs)
        s_out, c_out = _release(front, x2[1:], y[1:], 7.0, bound, **kwargs)
        assert np.linalg.norm(s_in - s_out) <= bound * (1 + 1e-5)
        if rule == "mean":  # the query is L C_new / α = Σ min(‖g_i‖, 2 C)
            moved = abs(c_in - c_out) * 7.0
            assert moved <= 2 * bound * (1 + 1e-5)
            if scale > 1:
                assert moved == pytest.approx(2 * bound, rel=1e-4)
        else:  # the count is 7 (γ - log(C_new/C)/η)
            moved = abs(math.log(c_in / c_out)) * 7.0 / 0.4
            assert moved == pytest.approx(count_moves, abs=1e-4)


def test_count_query_noise_is_gaussian_with_scale_sigma():
    """lr = 0: z = (L (γ - log(C_new/C)/η) - count) / σ_q must be N(0, 1)."""
    front = tf_keras_front()
    model, x, y = built(front, "dense")
    sigma_q, eta, gamma, bound = 1.5, 0.01, 0.5, 0.5
    opt = _compiled(
        front, model, bound, 1.0, sigma_q, rule="quantile", quantile_learning_rate=eta, learning_rate=0.0, seed=5
    )
    model.optimizer = opt

    @tf.function(autograph=False)  # straight-line code: autograph's conversion of the library took ~11 s of the trace
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = front.loss()(y, model(x, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)

    norms = _total_norms(front, model, x, y)
    zs = []
    for _ in range(200):
        step(x, y)
        new = float(opt.clip_bounds.numpy()[0])
        count = np.sum(norms <= bound)
        zs.append((len(x) * (gamma - math.log(new / bound) / eta) - count) / sigma_q)
        bound = new
    zs = np.array(zs)
    assert abs(zs.mean()) < 4 / math.sqrt(len(zs))
    assert 0.85 < zs.std() < 1.15
    assert stats.kstest(zs, "norm").pvalue > 1e-4


@pytest.mark.parametrize("rule", ["mean", "quantile"])
def test_ledger_epsilon_is_the_gradient_and_query_composed(front, rule):
    q, sigma, sigma_q, delta = 0.25, 1.1, 4.0, 1e-3
    model, x, y = built(front, "dense")
    opt = _compiled(front, model, 1.0, sigma, sigma_q, rule=rule, sampling_rate=q, learning_rate=0.1)
    assume_poisson(opt)  # the fixed batches stand for Poisson lots at q
    assert opt.effective_noise_multiplier == pytest.approx((1 / sigma**2 + 1 / sigma_q**2) ** -0.5, rel=1e-12)
    model.fit(np.concatenate([x] * 2)[:6], np.concatenate([y] * 2)[:6], batch_size=2, epochs=1, verbose=0)
    event = ac.adaptive_clipping_event(
        noise_multiplier=sigma, norm_noise_multiplier=sigma_q, num_layers=1, sampling_rate=q, steps=3
    )
    eps, _ = model_epsilon(model, target_delta=delta)
    assert eps == pytest.approx(compute_epsilon([event], delta), rel=1e-9)
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent

    assert compute_epsilon([PoissonSampledGaussianEvent(q, sigma, 3)], delta) < eps  # the query is charged


@pytest.mark.parametrize("rule", ["mean", "quantile"])
def test_divide_by_bound_steps_in_units_of_the_bound(front, rule):
    """divide_by_bound: the update is lr × the loop's clipped mean / C (C in force), σ = 0."""
    model, x, y = built(front, "dense")
    bound = 0.05
    _compiled(front, model, bound, rule=rule, divide_by_bound=True)
    expected = loop_clipped_mean(model, x, y, front.loss(), bound)
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g / bound, rtol=2e-4, atol=2e-5)


def test_config_round_trip_and_bad_values(front):
    cls = _adaptive_cls(front)
    opt = cls(0.7, 1.1, 20.0, rule="quantile", target_quantile=0.6, quantile_learning_rate=0.1, divide_by_bound=True)
    restored = cls.from_config(opt.get_config())
    assert (restored.rule, restored.target_quantile, restored.quantile_learning_rate) == ("quantile", 0.6, 0.1)
    assert restored.divide_by_bound
    assert not restored.per_layer_clipping and restored.l2_norm_clip == 0.7
    for kwargs, error, named in [
        (dict(rule="median"), ValueError, "rule must be one of ('mean', 'quantile'), got 'median'"),
        (dict(target_quantile=1.5), ValueError, "target_quantile must be in [0, 1], got 1.5"),
        (dict(quantile_learning_rate=0.0), ValueError, "quantile_learning_rate must be a finite number > 0"),
        (dict(divide_by_bound=1), TypeError, "divide_by_bound must be True or False, got 1 (int)"),
    ]:
        with pytest.raises(error) as info:
            cls(1.0, 1.0, 1.0, **kwargs)
        assert named in str(info.value)


def test_initial_flat_clip_bound_is_the_mean_total_norm_on_noise():
    import tf_keras as keras

    from keras_dpsgd.tf_keras import initial_flat_clip_bound

    front = tf_keras_front()
    model, _, _ = built(front, "dense")
    bound = initial_flat_clip_bound(model, batch_size=6, seed=11)
    rng = np.random.default_rng(11)
    x = rng.random((6, 5), dtype=np.float32)
    y = rng.integers(0, 3, size=6)
    assert isinstance(model, keras.Model)
    assert bound == pytest.approx(float(np.mean(_total_norms(front, model, x, y))), rel=1e-5)
