"""Per-example normalization (clipping="normalize"; Bu et al. 2023, De et al. 2022) on both Kerases.

Each example's gradient is scaled by 1/(||g_i|| + γ): the update against a one-example-at-a-time
loop (σ = 0, fast and reference backends, B = 1 and B > 1), the sensitivity of the sum (< 1), the
noise std σ·1/B (statistical), the ledger's ε against the accountant's, get_config, bad values.
"""

import numpy as np
import pytest

from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson
from tests._behaviour import built, keras3_front, tf_keras_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5
GAMMA = 0.05
FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _normalized(front, model, **kwargs):
    kwargs.setdefault("learning_rate", LR)
    return front.compiled(model, l2_norm_clip=None, clipping="normalize", **kwargs)


@pytest.mark.parametrize("backend", ["fast", "reference"])
@pytest.mark.parametrize("batch", [1, 7])
def test_step_matches_loop(front, backend, batch):
    """σ = 0: the update is Σ_i g_i / (||g_i|| + γ) / B."""
    model, x, y = built(front, "dense")
    x, y = x[:batch], y[:batch]
    _normalized(front, model, stability=GAMMA, per_example_backend=backend)
    expected = loop_clipped_mean(model, x, y, front.loss(), 1.0, stability=GAMMA)
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def _summed(front, x, y, lot):
    """Σ_i g_i/(||g_i|| + γ) of one step (σ = 0, the noised sum divided by expected_lot_size `lot`)."""
    model, _, _ = built(front, "dense")
    _normalized(front, model, stability=GAMMA, expected_lot_size=lot)
    before, after = one_sgd_step(model, x, y, LR)
    return np.concatenate([((b - a) / LR * lot).ravel() for b, a in zip(before, after)])


def test_sensitivity_is_below_one(front):
    """Removing one example (a huge gradient: normalized to norm just under 1) moves the sum by < 1."""
    _, x, y = built(front, "dense")
    x = x.copy()
    x[0] *= 1e3
    moved = np.linalg.norm(_summed(front, x, y, 7.0) - _summed(front, x[1:], y[1:], 7.0))
    assert 0.9 < moved < 1.0


def test_noise_std_is_sigma_over_lot_size(front):
    """Zero gradients (zero kernel, MSE at its minimum): the update is N(0, σ²·1²)/B, no C."""
    K, sigma, batch = front.keras, 1.3, 8
    model = K.Sequential([K.Input((2000,)), K.layers.Dense(1, kernel_initializer="zeros", use_bias=False)])
    opt = front.optimizer_cls(None, sigma, clipping="normalize", learning_rate=LR, seed=3)
    front.private(model)
    model.compile(optimizer=opt, loss=K.losses.MeanSquaredError(reduction="none"))
    x = np.random.default_rng(0).normal(size=(batch, 2000)).astype("float32")
    before, after = one_sgd_step(model, x, np.zeros((batch, 1), "float32"), LR)
    noise = ((before[0] - after[0]) / LR).ravel()
    assert np.std(noise) == pytest.approx(sigma / batch, rel=0.08)
    assert abs(np.mean(noise)) < 4 * sigma / batch / np.sqrt(noise.size)


def test_ledger_epsilon_equals_the_accountant(front):
    q, sigma, delta, steps = 0.25, 1.1, 1e-3, 3
    model, x, y = built(front, "dense")
    _normalized(front, model, noise_multiplier=sigma, sampling_rate=q)
    assume_poisson(model.optimizer)  # the fixed batches stand for Poisson lots at q
    assert model.optimizer.effective_noise_multiplier == sigma
    model.fit(np.concatenate([x] * 2)[:6], np.concatenate([y] * 2)[:6], batch_size=2, epochs=1, verbose=0)
    eps, _ = model_epsilon(model, target_delta=delta)
    assert eps == pytest.approx(compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), delta), rel=1e-9)


def test_config_round_trip(front):
    opt = front.optimizer_cls(None, 1.1, clipping="normalize", stability=0.2, learning_rate=0.1)
    config = opt.get_config()
    assert (config["clipping"], config["stability"], config["l2_norm_clip"]) == ("normalize", 0.2, None)
    restored = type(opt).from_config(config)
    assert (restored.clipping, restored.stability, restored.l2_norm_clip) == ("normalize", 0.2, None)
    assert not restored.per_layer_clipping
    default = front.optimizer_cls(1.0, 1.1).get_config()
    assert (default["clipping"], default["stability"]) == ("clip", 0.01)


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        (dict(stability=0.0), ValueError, "stability must be a finite number > 0, got 0.0"),
        (dict(stability=-1.0), ValueError, "stability must be a finite number > 0"),
        (dict(stability="0.1"), TypeError, "stability must be a finite number > 0, got '0.1' (str)"),
        (dict(stability=True), TypeError, "stability"),
        (dict(clipping="auto"), ValueError, "clipping must be one of ('clip', 'normalize'), got 'auto'"),
        (dict(l2_norm_clip=1.0), ValueError, "l2_norm_clip must be None with clipping='normalize'"),
        (dict(clipping="clip", l2_norm_clip=1.0, stability=0.1), ValueError, "stability applies to"),
        (dict(clipping="clip"), TypeError, "l2_norm_clip must be a finite number > 0, got None"),
        (dict(noise_multiplier=[1.0, 1.0]), ValueError, "noise_multiplier may be a list only"),
    ],
)
def test_bad_values_are_refused(front, kwargs, error, named):
    args = dict(l2_norm_clip=None, noise_multiplier=1.0, clipping="normalize")
    args.update(kwargs)
    with pytest.raises(error) as info:
        front.optimizer_cls(**args)
    assert named in str(info.value)


# ------------------------------------------------------------------ keras-dpsgd train --clipping normalize
def test_cli_train_normalize(capsys):
    import json

    from keras_dpsgd.cli import main

    code = main(["train", "--json", "--clipping", "normalize", "--stability", "0.05", "--epochs", "2", "--seed", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    result = json.loads(out)
    assert (result["clipping"], result["stability"], result["l2_norm_clip"]) == ("normalize", 0.05, None)
    assert "per-example normalization (γ = 0.05)" in err
    q, sigma, steps = result["sampling_rate"], result["noise_multiplier"], result["steps"]
    assert steps == 12
    assert result["epsilon"] == pytest.approx(
        compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), result["delta"]), rel=1e-9
    )
    assert result["test_accuracy"] > 0.5  # it learned (chance is 0.1)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "--clipping", "normalize", "--l2-norm-clip", "1"], "--l2-norm-clip does not apply to --clipping"),
        (["train", "--stability", "0.1"], "--stability applies to --clipping normalize only"),
        (["audit", "--clipping", "normalize"], "--clipping normalize is not supported by audit"),
    ],
)
def test_cli_bad_clipping_exit_2(capsys, argv, fragment):
    from keras_dpsgd.cli import main

    code = main([*argv, "--epochs", "1"])
    _, err = capsys.readouterr()
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_cli_nonpositive_stability_is_an_argparse_error(capsys):
    from keras_dpsgd.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--clipping", "normalize", "--stability", "0"])
    assert info.value.code == 2
    assert "argument --stability: must be a finite number > 0, got 0" in capsys.readouterr().err
