"""Issue 37, classes 2 and 3: the ledger records the rate of the lots that reached the step, and an epoch is
one number of steps everywhere (planning, the CLI, make_private_with_epsilon, PoissonLots, WithinLimit).

Run on Keras 3 with TensorFlow and on tf_keras here, on Keras 3 with JAX in the JAX suite
(tests/backends/jax/test_jax_fed_lots.py imports these checks). The oracle is the accountant for the
lots that ran; a refusal is checked to come before any weight changes.
"""

import json

import numpy as np
import pytest

from keras_dpsgd import PoissonLots, WithinLimit, make_private_with_epsilon, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon, steps_for_epochs
from tests._behaviour import process_fronts

N, SIGMA, DELTA = 16, 1.1, 1e-3
FRONTS = process_fronts()  # Keras 3 and tf_keras; Keras 3 alone in the JAX and torch suites


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _data(n=N):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, size=n)


def _model(front, **dp_kwargs):
    K = front.keras
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    dp_kwargs = {"l2_norm_clip": 1.0, "noise_multiplier": SIGMA, "learning_rate": 0.1, "seed": 1, **dp_kwargs}
    return front.compiled(model, **dp_kwargs)


def _eps(*segments):
    return compute_epsilon([PoissonSampledGaussianEvent(q, SIGMA, k) for q, k in segments], DELTA)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _unchanged(model, before):
    return all(np.array_equal(a, b) for a, b in zip(before, _weights(model)))


def test_fit_records_the_rate_of_the_lots_it_is_fed(front):
    """Configured for L = 2, fed lots of L = 8: ε is the accountant's for q = 8/N (it was q = 2/N)."""
    x, y = _data()
    model = _model(front)
    PoissonLots(x, y, expected_lot_size=2, seed=0).configure(model.optimizer)
    fed = PoissonLots(x, y, expected_lot_size=8, seed=1)
    model.fit(fed.dataset(2), epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 2
    assert model.optimizer.sampling_rate == fed.sampling_rate and model.optimizer.expected_lot_size == 8
    assert model_epsilon(model, target_delta=DELTA)[0] == pytest.approx(_eps((8 / N, 2)), rel=1e-9)


def test_a_second_fit_on_other_lots_keeps_each_fits_rate(front, caplog):
    """1 lot at q = 2/N, then 2 lots at q = 8/N: the ledger holds both segments (the accountant's ε), and a
    warning names the change."""
    x, y = _data()
    model = _model(front)
    first = PoissonLots(x, y, expected_lot_size=2, seed=0)
    first.configure(model.optimizer)
    model.fit(first.dataset(1), epochs=1, verbose=0)
    model.fit(PoissonLots(x, y, expected_lot_size=8, seed=1).dataset(2), epochs=1, verbose=0)
    assert model_epsilon(model, target_delta=DELTA)[0] == pytest.approx(_eps((2 / N, 1), (8 / N, 2)), rel=1e-9)
    assert "the optimizer was told q = 0.125" in caplog.text


def test_a_loaded_model_fed_other_lots_is_charged_their_rate(front, tmp_path):
    """Saved after a step at q = 2/N, loaded, fed lots of q = 8/N: never less than the steps that ran."""
    x, y = _data()
    model = _model(front)
    first = PoissonLots(x, y, expected_lot_size=2, seed=0)
    first.configure(model.optimizer)
    model.fit(first.dataset(1), epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = front.private(front.keras.models.load_model(path))  # Keras 3: the private step again
    loaded.fit(PoissonLots(x, y, expected_lot_size=8, seed=1).dataset(2), epochs=1, verbose=0)
    eps = model_epsilon(loaded, target_delta=DELTA)[0]
    exact = _eps((2 / N, 1), (8 / N, 2))
    assert eps >= exact * (1 - 1e-9)
    if front.name == "keras3":  # a .keras file of Keras 3 keeps the segments: exact
        assert eps == pytest.approx(exact, rel=1e-9)
    else:  # tf_keras's .keras keeps the worst case (max q) for the steps before the load
        assert eps <= _eps((8 / N, 3)) * (1 + 1e-9)


@pytest.mark.parametrize("data", ["arrays", "dataset", "mapped lots"])
def test_fixed_batches_are_refused_before_any_weight_changes(front, data):
    """After make_private_with_epsilon, fit on anything but the lots is refused; the weights stay."""
    x, y = _data()
    K = front.keras
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    run = make_private_with_epsilon(
        model, x, y, target_epsilon=3.0, epochs=1, expected_lot_size=4, l2_norm_clip=1.0, seed=0, verbose=0
    )
    run.model.compile(optimizer=run.optimizer, loss=front.loss())
    before = _weights(run.model)
    if data == "arrays":
        fed = {"x": x, "y": y, "batch_size": 4}
    elif data == "dataset":
        import tensorflow as tf

        fed = {"x": tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(4)}
    else:
        fed = {"x": run.lots.dataset(2).map(lambda a, b, w: (a, b, w)), "steps_per_epoch": 2}
    with pytest.raises(ValueError, match=r"is refused: the optimizer holds the Poisson sampling rate q = 0\.25"):
        run.model.fit(**fed, epochs=1, verbose=0)
    assert int(run.optimizer.noised_steps.numpy()) == 0 and _unchanged(run.model, before)
    history = run.fit(verbose=0)  # control: the lots of the plan train (after the refusal, same model)
    assert int(run.optimizer.noised_steps.numpy()) == run.planned_steps == 4
    assert not _unchanged(run.model, before)
    planned = compute_epsilon(PoissonSampledGaussianEvent(0.25, run.noise_multiplier, 4), run.delta)
    assert history.history["epsilon"][-1] == pytest.approx(planned, rel=1e-9)


def test_train_on_batch_with_a_poisson_rate_is_refused(front):
    """Outside fit nothing shows which data reach the step: refused before any weight changes."""
    x, y = _data()
    model = _model(front, sampling_rate=0.25, expected_lot_size=4)
    before = _weights(model)
    with pytest.raises(ValueError, match=r"train_on_batch .* is refused"):
        model.train_on_batch(x[:4], y[:4])
    assert int(model.optimizer.noised_steps.numpy()) == 0 and _unchanged(model, before)


def test_an_unconfigured_optimizer_on_arrays_still_trains(front, caplog, monkeypatch):
    """Control: no rate known, arrays: the documented q = B/N with its warning (unchanged)."""
    import keras_dpsgd.ledger

    monkeypatch.setattr(keras_dpsgd.ledger.sampling, "_WARNED", set())  # the warning is said once per process
    x, y = _data()
    model = _model(front)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.noised_steps.numpy()) == 4
    assert model_epsilon(model, target_delta=DELTA)[0] == pytest.approx(_eps((4 / N, 4)), rel=1e-9)
    assert "ASSUMES POISSON SAMPLING" in caplog.text


def test_the_planned_epochs_are_the_steps_that_train(front, capsys):
    """One epoch = ceil(N/L) lots: the CLI's plan, make_private_with_epsilon and fit agree; WithinLimit does
    not stop early (N = 25, L = 4, 2 epochs: 14 steps; ceil(2·25/4) = 13 was planned before)."""
    from keras_dpsgd.cli import main

    x, y = _data(25)
    args = ["noise", "--num-examples", "25", "--lot-size", "4", "--epochs", "2", "--target-epsilon", "4", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 14 == steps_for_epochs(25, 4, 2)
    K = front.keras
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    run = make_private_with_epsilon(
        model, x, y, target_epsilon=4.0, epochs=2, expected_lot_size=4, l2_norm_clip=1.0, seed=0, verbose=0
    )
    run.model.compile(optimizer=run.optimizer, loss=front.loss())
    assert run.planned_steps == 2 * run.lots.lots_per_epoch == steps_for_epochs(25, 4, 2)
    stop = WithinLimit(run.target_epsilon, run.delta)
    run.fit(callbacks=[stop], verbose=0)
    assert int(run.optimizer.noised_steps.numpy()) == 14 and not run.model.stop_training
