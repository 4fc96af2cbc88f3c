"""One validation module: every converted public function refuses bool, str, NaN, ∞ and out-of-range values alike.

Each row names a public callable, one numeric argument, valid values for the
others, and an out-of-range value. Every bad value must raise ValueError or
TypeError whose message names the argument and shows the value.
"""

import math

import numpy as np
import pytest

from keras_dpsgd import _validate as V
from keras_dpsgd import accounting as acc
from keras_dpsgd.accounting import conversions
from keras_dpsgd.audit import statistics as stats

_EVENT = acc.PoissonSampledGaussianEvent(0.01, 1.0, 10)
_PLAN = dict(target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.01)


def _dp_optimizer(**kwargs):
    from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer

    return DPSGDOptimizer(**{"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs})


def _canaries():
    from keras_dpsgd.audit import canaries

    return canaries


def _one_run():
    from keras_dpsgd.audit import one_run

    return one_run


def _membership():
    from keras_dpsgd.audit import membership

    return membership


_X, _Y = np.zeros((10, 1), np.float32), np.zeros(10, np.float32)


def _lots(**kwargs):
    from keras_dpsgd.step.lots import PoissonLots

    return PoissonLots(_X, _Y, **kwargs)


def _normalization(**kwargs):
    from keras_dpsgd.preprocessing.normalization import DPNormalization

    return DPNormalization(**{"noise_multiplier": 1.0, "l2_norm_clip": 1.0, **kwargs})


def _pca(**kwargs):
    from keras_dpsgd.preprocessing.pca import DPPCA

    return DPPCA(**{"n_components": 1, "noise_multiplier": 1.0, **kwargs})


def _keras3_optimizer(**kwargs):
    from keras_dpsgd.keras3 import DPSGDOptimizer

    return DPSGDOptimizer(**{"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs})


def _callbacks():
    from keras_dpsgd import callbacks

    return callbacks


def _tools():
    from keras_dpsgd.tf_keras import _adaptive as _adaptive_tf
    from keras_dpsgd.tools import data as _data, _stats, adaptive_clipping, large_lots

    return _adaptive_tf, _data, _stats, adaptive_clipping, large_lots


def _dp_settings(**kw):
    from keras_dpsgd.tools.memorization import DPSettings

    return DPSettings(**kw)


def _build_model(**kw):
    from keras_dpsgd.data.models import build_model

    return build_model("mlp", (2,), **{"num_classes": 2, **kw})


def _resolve_num_examples(num_examples):
    from keras_dpsgd.ledger import resolve_num_examples

    return resolve_num_examples(None, num_examples)


# (callable taking the argument by keyword, argument, an out-of-range value, valid specials: "inf", "none")
CASES = [
    (
        lambda **kw: acc.PoissonSampledGaussianEvent(**{"sampling_rate": 0.5, "noise_multiplier": 1.0, **kw}),
        "sampling_rate",
        1.5,
        "",
    ),
    (
        lambda **kw: acc.PoissonSampledGaussianEvent(**{"sampling_rate": 0.5, "noise_multiplier": 1.0, **kw}),
        "noise_multiplier",
        -1.0,
        "",
    ),
    (
        lambda **kw: acc.PoissonSampledGaussianEvent(**{"sampling_rate": 0.5, "noise_multiplier": 1.0, **kw}),
        "count",
        -1,
        "",
    ),
    (lambda **kw: acc.GaussianEvent(**{"noise_multiplier": 1.0, **kw}), "noise_multiplier", -0.5, ""),
    (lambda **kw: acc.GaussianEvent(**{"noise_multiplier": 1.0, **kw}), "count", -2, ""),
    (lambda count: acc.RdpAccountant().compose(_EVENT, count=count), "count", -1, ""),
    (lambda delta: acc.RdpAccountant().compose(_EVENT).get_epsilon(delta), "delta", 1.0, ""),
    (lambda delta: acc.MomentsAccountant().compose(_EVENT).get_epsilon(delta), "delta", 0.0, ""),
    (lambda orders: acc.RdpAccountant(orders=[orders]), "orders[0]", 1.0, ""),
    (
        lambda value_discretization_interval: acc.PldAccountant(value_discretization_interval),
        "value_discretization_interval",
        0.0,
        "",
    ),
    (lambda delta: acc.compute_epsilon(_EVENT, delta), "delta", 1.5, ""),
    (lambda delta: acc.compute_epsilon_and_order(_EVENT, delta), "delta", -1e-5, ""),
    (lambda **kw: acc.compute_noise_multiplier(**{**_PLAN, "steps": 10, **kw}), "target_epsilon", 0.0, ""),
    (lambda **kw: acc.compute_noise_multiplier(**{**_PLAN, "steps": 10, **kw}), "target_delta", 1.0, ""),
    (lambda **kw: acc.compute_noise_multiplier(**{**_PLAN, "steps": 10, **kw}), "sampling_rate", 0.0, ""),
    (lambda **kw: acc.compute_noise_multiplier(**{**_PLAN, "steps": 10, **kw}), "steps", 0, ""),
    (
        lambda **kw: acc.calibrate_noise_multiplier(
            lambda s: acc.GaussianEvent(s), **{"target_epsilon": 1.0, "target_delta": 1e-5, **kw}
        ),
        "target_epsilon",
        -1.0,
        "",
    ),
    (
        lambda **kw: acc.max_steps_within_budget(**{**_PLAN, "noise_multiplier": 1.0, **kw}),
        "noise_multiplier",
        -1.0,
        "",
    ),
    (lambda **kw: acc.max_steps_within_budget(**{**_PLAN, "noise_multiplier": 1.0, **kw}), "sampling_rate", 2.0, ""),
    (
        lambda **kw: acc.max_epochs_within_budget(
            **{
                "num_examples": 100,
                "batch_size": 10,
                "target_epsilon": 1.0,
                "target_delta": 1e-5,
                "noise_multiplier": 1.0,
                **kw,
            }
        ),
        "num_examples",
        0,
        "",
    ),
    (lambda batch_size: acc.max_epochs_from_steps(100, batch_size, 10), "batch_size", 0, ""),
    (lambda steps: acc.max_epochs_from_steps(100, 10, steps), "steps", -1, ""),
    (lambda epochs: acc.steps_for_epochs(100, 10, epochs), "epochs", 0.0, ""),
    (
        lambda **kw: acc.batch_table(
            **{"num_examples": 100, "epochs": 1.0, "target_epsilon": 1.0, "target_delta": 1e-5, "lot_sizes": [10], **kw}
        ),
        "epochs",
        -1.0,
        "",
    ),
    (
        lambda lot_size: acc.batch_table(
            num_examples=100, epochs=1.0, target_epsilon=1.0, target_delta=1e-5, lot_sizes=[lot_size]
        ),
        "lot_size",
        0,
        "",
    ),
    (lambda num_examples: acc.default_delta(num_examples), "num_examples", 0, ""),
    (lambda delta: acc.check_delta(delta, 100), "delta", 0.0, ""),
    (lambda s: acc.effective_noise_multiplier([1.0, s]), "noise_multipliers[1]", -1.0, ""),
    (lambda noise_multiplier: acc.rdp_gaussian(noise_multiplier), "noise_multiplier", -1.0, ""),
    (lambda sampling_rate: acc.rdp_poisson_subsampled_gaussian(sampling_rate, 1.0), "sampling_rate", 1.01, ""),
    (lambda delta: conversions.epsilon_from_rdp([2.0], [0.1], delta), "delta", 1.0, ""),
    (lambda epsilon: conversions.delta_from_rdp([2.0], [0.1], epsilon), "epsilon", -1.0, "inf"),
    (lambda conversion: conversions.check_conversion(conversion), "conversion", "loose", ""),
    (lambda trials: stats.clopper_pearson_lower(1, trials), "trials", 0, ""),
    (lambda successes: stats.clopper_pearson_upper(successes, 10), "successes", 11, ""),
    (lambda confidence: stats.clopper_pearson_interval(1, 10, confidence), "confidence", 1.0, ""),
    (lambda tpr: stats.epsilon_from_rates(tpr, 0.1), "tpr", 1.5, ""),
    (lambda delta: stats.epsilon_from_rates(0.5, 0.1, delta), "delta", 1.0, ""),
    (lambda epsilon: stats.one_run_p_value(10, 5, 3, epsilon), "epsilon", -0.1, "inf"),
    (
        lambda num_canaries: _canaries().make_input_canaries(
            "ood", num_canaries, input_shape=(2,), num_classes=2, rng=np.random.default_rng(0)
        ),
        "num_canaries",
        1,
        "",
    ),
    (
        lambda canaries: _one_run().canary_audit(
            lambda: None, (np.zeros((4, 2)), np.zeros(4)), num_classes=2, canaries=canaries, noise_multiplier=1.0
        ),
        "canaries",
        1,
        "",
    ),
    (lambda every: _membership().MembershipInferenceCallback((None, None), (None, None), every=every), "every", 0, ""),
    (lambda **kw: _dp_optimizer(**kw), "l2_norm_clip", 0.0, ""),
    (lambda **kw: _dp_optimizer(**kw), "noise_multiplier", -1.0, ""),
    (lambda **kw: _dp_optimizer(**kw), "gradient_accumulation_steps", 0, ""),
    (lambda **kw: _dp_optimizer(**kw), "expected_lot_size", -4.0, "none"),
    (lambda **kw: _dp_optimizer(**kw), "sampling_rate", 0.0, "none"),
    (lambda seed: _dp_optimizer(seed=seed), "seed", 2**64, "none"),
    (lambda c: _dp_optimizer(l2_norm_clip=[1.0, c]), "l2_norm_clip[1]", -1.0, ""),
    (lambda s: _dp_optimizer(l2_norm_clip=[1.0, 1.0], noise_multiplier=[s, 1.0]), "noise_multiplier[0]", -1.0, ""),
    (lambda **kw: _lots(**kw), "sampling_rate", 1.5, "none"),
    (lambda **kw: _lots(**kw), "expected_lot_size", 11.0, "none"),
    (lambda **kw: _lots(**{"sampling_rate": 0.5, **kw}), "overflow_probability", 1.0, ""),
    (lambda **kw: _lots(**{"sampling_rate": 0.5, **kw}), "max_lot_size", 11, "none"),
    (lambda **kw: _lots(**{"sampling_rate": 0.5, **kw}), "physical_batch_size", 0, "none"),
    (lambda **kw: _lots(**{"sampling_rate": 0.5, **kw}), "seed", -1, "none"),
    (lambda **kw: _normalization(**kw), "noise_multiplier", -1.0, ""),
    (lambda **kw: _normalization(**kw), "l2_norm_clip", 0.0, "none"),
    (lambda **kw: _normalization(**kw), "sampling_rate", 0.0, ""),
    (lambda **kw: _normalization(**kw), "seed", -1, "none"),
    (lambda **kw: _normalization(**kw), "min_std", 0.0, "none"),
    (lambda **kw: _pca(**kw), "n_components", 0, ""),
    (lambda **kw: _pca(**kw), "noise_multiplier", -1.0, ""),
    (lambda **kw: _pca(**kw), "sampling_rate", 1.5, ""),
    (lambda **kw: _pca(**kw), "seed", -3, "none"),
    (lambda **kw: _keras3_optimizer(**kw), "gradient_accumulation_steps", 0, ""),
    (lambda **kw: _keras3_optimizer(**kw), "sampling_rate", 0.0, "none"),
    (lambda **kw: _keras3_optimizer(**kw), "expected_lot_size", -4.0, "none"),
    (lambda **kw: _keras3_optimizer(**kw), "seed", 2**64, "none"),
    (lambda **kw: _callbacks().PrivacyLogger(1e-5, **kw), "num_examples", 0, "none"),
    (lambda **kw: _callbacks().PrivacyLogger(1e-5, **kw), "batch_size", 0, "none"),
    (lambda target_epsilon: _callbacks().WithinLimit(target_epsilon, 1e-5), "target_epsilon", 0.0, "inf"),
    (lambda num_examples: _resolve_num_examples(num_examples), "num_examples", 0, "none"),
    (lambda **kw: _build_model(**kw), "num_classes", 1, ""),
    (lambda **kw: _build_model(**kw), "width", 0, ""),
    (
        lambda num_examples: _tools()[1].random_noise_data(num_examples, (2,), 2, np.random.default_rng(0)),
        "num_examples",
        0,
        "",
    ),
    (
        lambda num_classes: _tools()[1].random_noise_data(4, (2,), num_classes, np.random.default_rng(0)),
        "num_classes",
        1,
        "",
    ),
    (lambda n: _tools()[2].clopper_pearson_lower(1, n), "n", 0, ""),
    (lambda correct: _tools()[2].clopper_pearson_lower(correct, 10), "correct", 11, ""),
    (lambda confidence: _tools()[2].clopper_pearson_lower(1, 10, confidence), "confidence", 1.0, ""),
    (lambda s: _tools()[3].composed_noise_multiplier([s], [1.0]), "noise_multipliers[0]", -1.0, ""),
    (
        lambda num_layers: _tools()[3].adaptive_clipping_event(
            noise_multiplier=1.0, norm_noise_multiplier=1.0, num_layers=num_layers, sampling_rate=0.1, steps=1
        ),
        "num_layers",
        0,
        "",
    ),
    (
        lambda norm_noise_multiplier: _tools()[3].calibrate_adaptive_noise_multiplier(
            num_layers=1,
            norm_noise_multiplier=norm_noise_multiplier,
            target_epsilon=1.0,
            target_delta=1e-5,
            sampling_rate=0.1,
            steps=10,
        ),
        "norm_noise_multiplier",
        0.0,
        "",
    ),
    (lambda update_freq: _tools()[0].ClipBoundsLogger(update_freq=update_freq), "update_freq", -1, ""),
    (lambda lot_size: _tools()[4].scale_learning_rate(lot_size), "lot_size", -1.0, ""),
    (lambda base_lot_size: _tools()[4].scale_learning_rate(256, base_lot_size=base_lot_size), "base_lot_size", 0.0, ""),
    (lambda lot_size: _tools()[4].plan_gradient_accumulation(lot_size, 32), "lot_size", 0, ""),
    (lambda max_batch_size: _tools()[4].plan_gradient_accumulation(256, max_batch_size), "max_batch_size", 0, ""),
    (lambda **kw: _dp_settings(**kw), "batch_size", 0, ""),
    (lambda **kw: _dp_settings(**kw), "momentum", 1.0, ""),
    (lambda **kw: _dp_settings(**kw), "l2_norm_clip", 0.0, ""),
    (lambda **kw: _dp_settings(**kw), "physical_batch_size", 0, "none"),
]


def _call(fn, name, value):
    if name.isidentifier():
        try:
            return fn(**{name: value})
        except TypeError as err:
            if "unexpected keyword" not in str(err) and "positional argument" not in str(err):
                raise
    return fn(value)


@pytest.mark.parametrize("fn,name,out_of_range,valid", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_refuses_bool_str_nan_inf_and_out_of_range(fn, name, out_of_range, valid):
    bad = [True, "0.5", out_of_range, np.bool_(False), math.nan]
    bad += [] if "inf" in valid else [math.inf]
    bad += [] if "none" in valid else [None]
    for value in bad:
        with pytest.raises((ValueError, TypeError)) as info:
            _call(fn, name, value)
        message = str(info.value)
        assert f"{name} must be" in message, (value, message)
        assert repr(value) in message, (value, message)


def test_accepts_numpy_scalars():
    assert V.in_range(0, 1, "(]", q=np.float32(0.5)) == 0.5
    assert type(V.integer_at_least(1, n=np.int64(3))) is int
    assert V.positive(x=np.float16(2.0)) == 2.0


def test_messages_name_argument_range_and_value():
    with pytest.raises(ValueError, match=r"^sampling_rate must be in \(0, 1\], got 1\.5$"):
        V.in_range(0, 1, "(]", sampling_rate=1.5)
    with pytest.raises(TypeError, match=r"^count must be an integer >= 0, got 3\.0 \(float\)$"):
        V.integer_at_least(0, count=3.0)
    with pytest.raises(ValueError, match=r"^trials must be an integer in \[1, 5\], got 6$"):
        V.integer_in_range(1, 5, trials=6)
    with pytest.raises(ValueError, match=r"^noise_multiplier must be a finite number >= 0, got inf$"):
        V.nonnegative(noise_multiplier=math.inf)
    # A type error is both a TypeError and a ValueError (callers catching either still see it).
    with pytest.raises(ValueError):
        V.positive(epsilon="1")
    with pytest.raises(TypeError, match="exactly one keyword"):
        V.positive(a=1.0, b=2.0)


def test_bounds_are_open_or_closed_as_written():
    assert V.in_range(0, 1, "[]", x=0) == 0.0 and V.in_range(0, 1, "[]", x=1) == 1.0
    for bounds, value in (("(]", 0), ("[)", 1), ("()", 0), ("()", 1)):
        with pytest.raises(ValueError, match=rf"x must be in \{bounds[0]}0, 1\{bounds[1]}"):
            V.in_range(0, 1, bounds, x=value)
