"""Issue 37.4: a seed passed again never draws the noise of a release already in the model's ledger.

A seeded key was a function of (seed, the optimizer's own ``noised_steps``): a model compiled again
with a new optimizer of the same seed, or ``make_private_with_epsilon(seed=...)`` called twice, drew
exactly the first run's noise (correlation 1.0) while ε counted independent releases. The key is now
a function of (seed, the release's position in the model's ledger), and the one-call API derives the
lots' seed from (seed, that position) too.

The noise of a run is read from its weight change: σ = 1000 makes the clipped sum (norm <= L·C)
negligible next to the noise (norm ~ σC·sqrt(512)), so two runs with the same noise have weight
changes of correlation ~1, independent noises a correlation ~N(0, 1/512): |r| < 0.3 is a 6.8σ bound
(false alarm < 1e-10). Every check runs on Keras 3 TF and tf_keras here, on Keras 3 JAX in
tests/backends/jax/test_jax_noise_never_repeats.py. The repeat checks failed on the code before the
fix (correlation 1.0 on all three; the same lots twice; the tf_keras SavedModel resume); the
reproducibility control and the .keras resume guard pass on both.
"""

import copy

import numpy as np
import pytest

from tests._behaviour import process_fronts, tf_keras_front

# The checks of every Keras 3 backend, collected by the JAX and torch suites with `import *`
# (tests/backends/*/test_*_noise_never_repeats.py); the tf_keras file's check is tf_keras's alone.
__all__ = [
    "front",
    "test_a_fresh_model_with_the_same_seed_reproduces_the_run_bit_for_bit",
    "test_a_keras3_file_loaded_after_a_second_optimizer_continues_the_ledger_positions",
    "test_a_new_optimizer_with_the_same_seed_draws_fresh_noise",
    "test_make_private_with_epsilon_twice_with_one_seed_draws_fresh_lots_and_noise",
    "test_two_layers_adapted_with_one_seed_are_refused_before_any_step",
]
FRONTS = process_fronts()  # Keras 3 and tf_keras; Keras 3 alone in the JAX and torch suites
N, D, U = 16, 8, 64
X = np.random.default_rng(0).normal(size=(N, D)).astype("float32")
Y = np.zeros(N, "int32")
BOUND = 0.3


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _model(front, init_from=None):
    keras = front.keras
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(U, use_bias=False)])
    if init_from is not None:
        model.set_weights(init_from.get_weights())
    return front.private(model)


def _kernel(model):
    return np.array(model.get_weights()[0], np.float64).ravel()


def _fit_with(front, model, seed):
    """The weight change of one fit (N/B = 2 steps) with a new optimizer of this seed: its noise."""
    optimizer = front.optimizer_cls(l2_norm_clip=1.0, noise_multiplier=1000.0, learning_rate=1e-3, seed=seed)
    model.compile(optimizer=optimizer, loss=front.loss())
    before = _kernel(model)
    model.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0, shuffle=False)
    return _kernel(model) - before


def _corr(a, b):
    return float(np.corrcoef(a, b)[0, 1])


def test_a_new_optimizer_with_the_same_seed_draws_fresh_noise(front):
    from keras_dpsgd.ledger import model_privacy_ledger

    model = _model(front)
    first = _fit_with(front, model, seed=7)
    second = _fit_with(front, model, seed=7)
    assert abs(_corr(first, second)) < BOUND, "the second fit drew the first fit's noise"
    third = _fit_with(front, model, seed=7)  # a third counter continues after both
    assert max(abs(_corr(first, third)), abs(_corr(second, third))) < BOUND
    assert sum(e.count for e in model_privacy_ledger(model).events) == 6  # 3 fits of 2 releases each
    # Controls: another seed, no seed (OS entropy): fresh noise as before.
    assert abs(_corr(first, _fit_with(front, model, seed=8))) < BOUND
    assert abs(_corr(first, _fit_with(front, model, seed=None))) < BOUND


def test_a_fresh_model_with_the_same_seed_reproduces_the_run_bit_for_bit(front):
    model = _model(front)
    again = _model(front, init_from=model)
    first, second = _fit_with(front, model, seed=7), _fit_with(front, model, seed=7)
    assert np.array_equal(_fit_with(front, again, seed=7), first)
    assert np.array_equal(_fit_with(front, again, seed=7), second)


def _one_call(front, model, target_epsilon):
    import keras_dpsgd

    return keras_dpsgd.make_private_with_epsilon(
        model,
        X,
        Y,
        target_epsilon=target_epsilon,
        epochs=1,
        expected_lot_size=N / 2,
        l2_norm_clip=1.0,
        seed=7,
        verbose=0,
    )


def _draws(lots, n=8):
    lots = copy.deepcopy(lots)
    return [tuple(lots.sample_indices()) for _ in range(n)]


def test_make_private_with_epsilon_twice_with_one_seed_draws_fresh_lots_and_noise(front):
    from keras_dpsgd import PoissonLots

    model = _model(front)
    deltas, draws = [], []
    for target in (0.02, 0.2):  # the second run's budget includes the first run's steps
        run = _one_call(front, model, target)
        draws.append(_draws(run.lots))
        run.model.compile(optimizer=run.optimizer, loss=front.loss())
        before = _kernel(model)
        run.fit(verbose=0)
        deltas.append(_kernel(model) - before)
    assert draws[0] == _draws(PoissonLots(X, Y, expected_lot_size=N / 2, seed=7))  # a fresh model: the seed's lots
    assert draws[1] != draws[0], "the second call drew the first call's lots"
    assert abs(_corr(*deltas)) < BOUND, "the second call drew the first call's noise"


def test_a_tf_keras_saved_model_resumed_with_a_new_counter_draws_fresh_noise(tmp_path):
    """tf_keras restores no optimizer variable from a SavedModel: ``noised_steps`` restarts at 0 while the
    model's ledger keeps the steps; the resumed run's keys continue after them (before: the same noise)."""
    front = tf_keras_front()
    model = _model(front)
    model.compile(
        optimizer=front.optimizer_cls(l2_norm_clip=1.0, noise_multiplier=1000.0, learning_rate=1e-3, seed=7),
        loss=front.loss(),
    )
    before = _kernel(model)
    model.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0, shuffle=False)
    first = _kernel(model) - before
    model.save(str(tmp_path / "saved"))
    loaded = front.keras.models.load_model(str(tmp_path / "saved"))
    assert int(loaded.optimizer.noised_steps.numpy()) == 0 and loaded.optimizer.seed == 7
    before = _kernel(loaded)
    loaded.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0, shuffle=False)
    assert abs(_corr(first, _kernel(loaded) - before)) < BOUND, "the resumed run drew the first run's noise"


def test_a_keras3_file_loaded_after_a_second_optimizer_continues_the_ledger_positions(front, tmp_path):
    """A .keras file of the second optimizer's run: its counter (2) restored with the ledger (4 steps); the
    resumed keys take positions 4 and 5, not the second run's 2 and 3 (an offset lost in the file would). A
    guard of the new offset, not a bug of the code before (its second run repeated the first's positions 0, 1)."""
    if front.name != "keras3":
        pytest.skip("tf_keras: tests/step/test_noise_never_repeats.py's SavedModel test")
    model = _model(front)
    first, second = _fit_with(front, model, seed=7), _fit_with(front, model, seed=7)
    path = str(tmp_path / "run.keras")
    model.save(path)
    loaded = front.private(front.keras.models.load_model(path))
    assert int(loaded.optimizer.noised_steps.numpy()) == 2
    before = _kernel(loaded)
    loaded.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0, shuffle=False)
    resumed = _kernel(loaded) - before
    assert max(abs(_corr(first, resumed)), abs(_corr(second, resumed))) < BOUND, "the resumed run repeated noise"


def _dp_normalization(front):
    if front.name == "keras3":
        from keras_dpsgd.keras3 import DPNormalization
    else:
        from keras_dpsgd.tf_keras import DPNormalization
    return DPNormalization


def test_two_layers_adapted_with_one_seed_are_refused_before_any_step(front):
    """Two DP layers with one seed draw the same noise for their first adapts (the k-th adapt's noise is a
    function of (seed, k)): a model holding both is refused at fit and at every read of its ε."""
    from keras_dpsgd import model_epsilon

    layers = {}
    for seeds in ((7, 7), (7, 8)):
        norms = [_dp_normalization(front)(1.0, lower=-3.0, upper=3.0, seed=s) for s in seeds]
        for layer in norms:
            layer.adapt(X)
        keras = front.keras
        model = front.private(keras.Sequential([keras.Input((D,)), *norms, keras.layers.Dense(U)]))
        model.compile(
            optimizer=front.optimizer_cls(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3, seed=7),
            loss=front.loss(),
        )
        layers[seeds] = norms, model
    (same_a, same_b), shared = layers[(7, 7)]
    assert np.array_equal(same_a.mean.numpy(), same_b.mean.numpy())  # the same noise on the same data
    before = _kernel(shared)
    with pytest.raises(ValueError, match=r"adapted with the same seed \(7\)"):
        shared.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0)
    assert np.array_equal(_kernel(shared), before) and int(shared.optimizer.noised_steps.numpy()) == 0
    with pytest.raises(ValueError, match=r"adapted with the same seed \(7\)"):
        model_epsilon(shared, target_delta=1e-5)
    (own_a, own_b), control = layers[(7, 8)]  # control: a seed each
    assert not np.array_equal(own_a.mean.numpy(), own_b.mean.numpy())
    control.fit(X, Y, batch_size=N // 2, epochs=1, verbose=0)
    assert int(control.optimizer.noised_steps.numpy()) == 2 and model_epsilon(control, target_delta=1e-5)[0] > 0
