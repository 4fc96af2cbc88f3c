""".keras / .h5 saves keep the optimizer's variables but not the ledger's segments: after a load
every step is charged at the worst (q, σ) the run was charged, never lower than the true ε."""

import numpy as np
import pytest
import tf_keras as keras

from keras_dpsgd import PoissonLots, model_epsilon, model_privacy_ledger
from keras_dpsgd.tf_keras import DPSGDOptimizer
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

N, SIGMA, DELTA = 64, 1.1, 1e-4
LOT_1, LOT_2 = 16, 8  # q1 = 0.25, then q2 = 0.125 (smaller: the current q understates the first steps)
K, M = 3, 4
WORST_LABEL = "dp-sgd (segments not saved: worst case)"


def _data():
    x = np.random.default_rng(3).normal(size=(N, 3)).astype(np.float32)
    return x, (x[:, :1] > 0).astype(np.float32)


def _model(lots):
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, momentum=0.9))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    return model


def _event(lot, count, label="dp-sgd"):
    return PoissonSampledGaussianEvent(lot / N, SIGMA, count, label)


def _two_segment_run():
    """K steps at q1, then q2 < q1 set through the public sampling_rate, M steps; ledger read between."""
    x, y = _data()
    lots_1, lots_2 = PoissonLots(x, y, expected_lot_size=LOT_1), PoissonLots(x, y, expected_lot_size=LOT_2)
    model = _model(lots_1)
    model.fit(lots_1.dataset(), steps_per_epoch=K, verbose=0)
    model_privacy_ledger(model)
    lots_2.configure(model.optimizer)
    model_privacy_ledger(model)  # the change is seen before the next step: two exact segments
    model.fit(lots_2.dataset(), steps_per_epoch=M, verbose=0)
    assert model_privacy_ledger(model).events == (_event(LOT_1, K), _event(LOT_2, M))
    return model


@pytest.mark.parametrize("filename", ["model.keras", "model.h5"])
def test_changed_sampling_rate_is_never_under_reported_after_load(tmp_path, filename):
    model = _two_segment_run()
    opt = model.optimizer
    assert float(opt.ledger_max_sampling_rate.numpy()) == LOT_1 / N
    assert float(opt.ledger_min_noise_multiplier.numpy()) == SIGMA
    path = str(tmp_path / filename)
    model.save(path)

    loaded = keras.models.load_model(path)
    assert loaded.optimizer.sampling_rate == LOT_2 / N
    assert int(loaded.optimizer.noised_steps.numpy()) == K + M
    assert float(loaded.optimizer.ledger_max_sampling_rate.numpy()) == LOT_1 / N
    assert model_privacy_ledger(loaded).events == (_event(LOT_1, K + M, WORST_LABEL),)
    eps, _ = model_epsilon(loaded, target_delta=DELTA)
    true_eps = compute_epsilon([_event(LOT_1, K), _event(LOT_2, M)], DELTA)
    assert eps == compute_epsilon(_event(LOT_1, K + M), DELTA)
    assert eps >= true_eps
    assert compute_epsilon(_event(LOT_2, K + M), DELTA) < true_eps  # what the current q alone gave

    # Training on after the load: the new steps are charged at the current values.
    x, y = _data()
    lots_2 = PoissonLots(x, y, expected_lot_size=LOT_2)
    loaded.fit(lots_2.dataset(), steps_per_epoch=2, verbose=0)
    assert model_privacy_ledger(loaded).events == (_event(LOT_1, K + M, WORST_LABEL), _event(LOT_2, 2))


def test_unchanged_run_keeps_exactly_the_same_epsilon(tmp_path):
    x, y = _data()
    lots = PoissonLots(x, y, expected_lot_size=LOT_2)
    model = _model(lots)
    model.fit(lots.dataset(), steps_per_epoch=K, verbose=0)
    before, _ = model_epsilon(model, target_delta=DELTA)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert model_privacy_ledger(loaded).events == (_event(LOT_2, K),)
    after, _ = model_epsilon(loaded, target_delta=DELTA)
    assert after == before == compute_epsilon(_event(LOT_2, K), DELTA)


@pytest.mark.parametrize("filename", ["model.keras", "model.h5"])
def test_file_saved_without_the_bounds_still_loads_its_counter(tmp_path, filename, monkeypatch):
    """A file from before the worst-case variables existed: noised_steps and the slots load;
    the worst case is unknown, so the steps are charged at the current values (as then)."""
    model = _two_segment_run()
    opt = model.optimizer
    # The older layout: no bounds, and nonfinite_examples (no longer saved) after noised_steps.
    at = [v is opt.noised_steps for v in opt._variables].index(True) + 1
    older_file = [
        v
        for v in opt._variables[:at] + [opt.nonfinite_examples] + opt._variables[at:]
        if all(v is not b for b in opt._ledger_bounds)
    ]
    older_layout = [v for v in older_file if v is not opt.nonfinite_examples]
    with monkeypatch.context() as patch:  # saves the older variable layout
        patch.setattr(DPSGDOptimizer, "variables", property(lambda self: list(older_file)))
        path = str(tmp_path / filename)
        model.save(path)
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.noised_steps.numpy()) == K + M
    reloaded = [v for v in loaded.optimizer._variables if all(v is not b for b in loaded.optimizer._ledger_bounds)]
    assert len(reloaded) == len(older_layout) and np.any(older_layout[-2].numpy() != 0)  # a momentum slot
    for saved, restored in zip(older_layout, reloaded):
        np.testing.assert_array_equal(restored.numpy(), saved.numpy())
    assert float(loaded.optimizer.ledger_max_sampling_rate.numpy()) == 0.0
    assert model_privacy_ledger(loaded).events == (_event(LOT_2, K + M),)


def test_sampling_rate_changed_before_any_ledger_read_is_never_under_reported():
    """No callback, no ledger read: K steps at q1, then q2 < q1, M steps; ε >= the true two-segment ε."""
    x, y = _data()
    lots_1, lots_2 = PoissonLots(x, y, expected_lot_size=LOT_1), PoissonLots(x, y, expected_lot_size=LOT_2)
    model = _model(lots_1)
    model.fit(lots_1.dataset(), steps_per_epoch=K, verbose=0)
    lots_2.configure(model.optimizer)
    model.fit(lots_2.dataset(), steps_per_epoch=M, verbose=0)
    events = model_privacy_ledger(model).events
    true_eps = compute_epsilon([_event(LOT_1, K), _event(LOT_2, M)], DELTA)
    assert compute_epsilon(events, DELTA) >= true_eps
    assert sum(e.count for e in events) == K + M
