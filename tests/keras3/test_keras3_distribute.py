"""Keras 3 DP-SGD under tf.distribute (issue 15): MirroredStrategy on 2 logical CPU devices and
MultiWorkerMirroredStrategy with 2 worker processes on 127.0.0.1.

Each strategy runs once per session, in fresh processes shared with the tf_keras tests
(tests/_dist_helpers.strategy_runs; tests/dist_scripts/keras3_distributed.py and
keras3_checkpoints.py run every check and return JSON); the tests below assert on the numbers:

* σ = 0: the update equals the one-example-at-a-time oracle on the same global lot (flat
  clipping with a weight regularizer, per-layer clipping) and the one-device step;
* the noise of one step has stddev σC/L, not √R·σC/L (nor σC/(√R·L): the replicas' draws are
  independent), on 10 000 zero-gradient coordinates;
* noised_steps, ε, PrivacyLogger and WithinLimit count global steps once; the workers' Poisson
  lots summed are ~ Binomial(N, q);
* BackupAndRestore and a .keras file keep the ledger (MirroredStrategy); with 2 workers,
  keras_dpsgd.keras3.BackupAndRestore (the chief writes) resumes a relaunched cluster with each
  global step counted once, and refuses workers that restored different states;
* adaptive clipping: its norm queries split like the gradient's noise (σ = 0: the next bounds
  are the one-device ones; ε the accountant's for σ_eff);
* what the noise split does not cover is refused under R > 1;
* examples/multi_worker.py --smoke runs (in the mirrored process).
"""

import math
import re

import numpy as np
import pytest

from tests._dist_helpers import strategy_runs


@pytest.fixture(scope="module")
def mirrored():
    return strategy_runs()["mirrored"]["keras3"]


@pytest.fixture(scope="module")
def workers():
    return [w["keras3"] for w in strategy_runs()["workers"]]


def _both(mirrored, workers):
    return {"mirrored": mirrored, "worker 0": workers[0], "worker 1": workers[1]}


def test_two_replicas(mirrored, workers):
    assert mirrored["replicas"] == 2 and mirrored["workers"] == 1
    assert [w["replicas"] for w in workers] == [2, 2] and [w["worker"] for w in workers] == [0, 1]


@pytest.mark.parametrize("check", ["flat", "per_layer_realized"])
def test_noise_free_step_equals_the_one_example_oracle(mirrored, workers, check):
    runs = _both(mirrored, workers) if check == "flat" else {"mirrored": mirrored}
    for where, run in runs.items():
        out = run[check]
        assert out["max_error"] < 1e-6 * max(1.0, out["scale"]) and out["scale"] > 1e-3, where
        assert out["noised_steps"] == 1 and out["iterations"] == 1, where
        if "one_device_error" in out:
            assert out["one_device_error"] < 1e-6, where


@pytest.mark.parametrize("check", ["noise_seeded_per_layer", "noise_unseeded"])
def test_noise_stddev_is_sigma_c_over_l(mirrored, workers, check):
    runs = _both(mirrored, workers) if check == "noise_unseeded" else {"mirrored": mirrored}
    for where, run in runs.items():
        out = run[check]
        # 10 000 coordinates: the sample stddev is within 5 % (its own sd is ~0.7 %); the wrong
        # scalings sqrt(2)·σC/L (noise added per replica, unsplit) and σC/(sqrt(2)·L) (one replica's
        # noise, or the same draw twice cancelling nothing) are 41 % and 29 % away.
        assert out["n"] == 10_000
        assert abs(out["std"] / out["expected"] - 1) < 0.05, (where, out["std"], out["expected"])
        assert abs(out["mean"]) < 5 * out["expected"] / math.sqrt(out["n"]), where
        assert out["noised_steps"] == 1, where


def test_seeded_noise_is_the_sum_of_two_independent_replica_draws(mirrored):
    """The seeded update, recomputed here: -(n_0 + n_1)/L with n_r ~ N(0, σ²C²/2) under the key
    noise_key(seed, step 0, variable 0) with r folded in (the release's first key) (reproducible for a given R)."""
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow import ops as _noise
    from keras_dpsgd.dp import release

    out = mirrored["noise_seeded_per_layer"]
    lot, std = 16, out["expected"] * 16 / math.sqrt(2)  # σC/√R per replica
    draws = []
    for r in range(2):
        key = tf.random.experimental.stateless_fold_in(
            _noise.seeded_key(4, tf.constant(0, tf.int64), 0), tf.constant(r, tf.int64)
        )
        kernels = [tf.zeros([100, 100]), tf.zeros([100, 1])]  # the release: both kernels, one draw under the key
        draws.append(release.add_gaussians(_noise.TF_OPS, kernels, [std, std], key)[0].numpy().ravel()[:8])
    assert not np.allclose(draws[0], draws[1])  # independent keys
    np.testing.assert_allclose(out["first"], -(draws[0] + draws[1]) / lot, rtol=1e-5, atol=1e-7)


def test_unseeded_noise_differs_between_runs_and_keeps_the_workers_in_sync(mirrored, workers):
    unseeded = [run["noise_unseeded"]["first"] for run in _both(mirrored, workers).values()]
    assert unseeded[0] != unseeded[1] and unseeded[1] == unseeded[2]


def test_ledger_and_callbacks_count_global_steps_once(mirrored, workers):
    for where, run in _both(mirrored, workers).items():
        out = run["ledger"]
        assert out["noised_steps"] == 10 and out["iterations"] == 10, where  # WithinLimit stopped after 10
        assert out["stopped"], where
        np.testing.assert_allclose(out["logged"], out["expected_logged"], rtol=1e-12, err_msg=where)
        assert out["epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12), where
        assert out["loaded_steps"] == 10, where  # a .keras file saved and loaded under the strategy
        assert out["loaded_epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12), where
    assert workers[0]["ledger"]["unsharded_refused"] and workers[1]["ledger"]["unsharded_refused"]


def test_poisson_lots_summed_over_the_workers_are_binomial(workers):
    sizes = np.array(workers[0]["ledger"]["lot_sizes"]) + np.array(workers[1]["ledger"]["lot_sizes"])
    n, q = workers[0]["ledger"]["n"], workers[0]["ledger"]["q"]
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / len(sizes))
    assert abs(sizes.var(ddof=1) / var - 1) < 5 * math.sqrt(2 / len(sizes))
    assert workers[0]["ledger"]["lot_sizes"] != workers[1]["ledger"]["lot_sizes"]  # independent streams
    assert workers[0]["ledger"]["physical"] == workers[1]["ledger"]["physical"]  # one padded size


def test_backup_and_restore_and_keras_files_keep_the_ledger(mirrored):
    out = mirrored["checkpoints"]
    assert out["resumed_steps"] == 9  # 2 epochs before the interruption + 1 after, 3 lots each
    assert out["resumed_epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12)
    assert out["loaded_epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12)


def test_adaptive_clipping_splits_its_norm_queries_across_replicas(mirrored, workers):
    for where, run in _both(mirrored, workers).items():
        out = run["adaptive"]
        # σ = σ_l2 = 0: the next bounds and the weights are the one-device step's (computed by the chief).
        if where != "worker 1":
            assert out["bounds_error"] < 1e-6 and out["weights_error"] < 1e-6, (where, out)
        assert out["bounds_moved"] > 1e-3, (where, out)
        assert out["bounds"] == pytest.approx(workers[0]["adaptive"]["bounds"], rel=1e-6), where
        # Noised: 2 lots counted once each, at σ_eff of the gradient and the norm queries composed.
        assert out["noised_steps"] == 2, where
        assert out["epsilon"] == pytest.approx(out["expected_epsilon"], rel=1e-12), where
        assert all(b == out["noised_bounds"] for b in out["replica_bounds"]), where  # one bound per replica alike
    # One noised release, summed once: every worker sets the same next bounds.
    assert workers[0]["adaptive"]["noised_bounds"] == workers[1]["adaptive"]["noised_bounds"]


def test_two_workers_back_up_once_and_resume_a_relaunched_cluster():
    runs = strategy_runs()
    main = [w["keras3_checkpoints"] for w in runs["workers"]]
    resumed = [w["keras3_checkpoints"] for w in runs["resumed"]]
    for where, (first, second) in enumerate(zip(main, resumed)):
        assert first["interrupted_steps"] == 6, where  # 2 epochs of 3 lots before the interruption
        # The chief's files only (Keras's own callback: every worker writes them, an HDF5 lock error).
        assert first["backup_files"] == ["latest.weights.h5", "training_metadata.json"], where
        assert "the workers restored different training states" in second["mismatch"], where
        assert "(epoch, iterations, noised_steps) = " in second["mismatch"], where
        assert second["resumed_steps"] == 9 and second["iterations"] == 9, where  # the third epoch only
        assert second["resumed_epsilon"] == pytest.approx(second["expected_epsilon"], rel=1e-12), where
        assert second["backup_removed"], where
    assert "= (2, 6, 6)" in resumed[0]["mismatch"] and "= (0, 0, 0)" in resumed[1]["mismatch"]


@pytest.mark.parametrize(
    "what, match",
    [
        ("hook", "_Hooked overrides on_per_example_sq_norms .* not split across the 2 replicas"),
        ("adaptive_hook", "_HookedAdaptive overrides on_noised_step .* not split across the 2 replicas"),
        ("clipnorm", r"clipnorm=1.0\) under 2 replicas"),
        ("adaptive_accumulation", r"gradient_accumulation_steps=2\) under 2 replicas: adaptive clipping"),
        ("accumulation", r"gradient_accumulation_steps=2\) under 2 replicas"),
    ],
)
def test_refused_under_several_replicas(mirrored, what, match):
    assert re.search(match, mirrored["refusals"][what]), mirrored["refusals"][what]


def test_the_example_runs_on_two_mirrored_devices(mirrored):
    out = mirrored["example"]  # examples/multi_worker.py --smoke, run in the mirrored process
    assert out["strategy"] == "MirroredStrategy" and out["replicas"] == 2 and out["noised_steps"] == 3
    assert 0 < out["epsilon"] < math.inf


def test_backup_and_restore_with_one_worker_is_keras_own(tmp_path):
    """No strategy: keras_dpsgd.keras3.BackupAndRestore writes and restores like Keras's callback
    (the backup dir itself, resumed at the interrupted epoch, every step counted once, removed at the end)."""
    import keras

    import keras_dpsgd.keras3 as k3
    from keras_dpsgd import model_epsilon
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
    from keras_dpsgd.ledger import assume_poisson

    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = x[:, :1]
    backup = str(tmp_path / "backup")

    def fit(callbacks):
        keras.utils.set_random_seed(1)
        model = k3.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        optimizer = k3.DPSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, expected_lot_size=8, sampling_rate=0.25
        )
        assume_poisson(optimizer)  # the fixed batches stand for Poisson lots at q
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(
            x, y, batch_size=8, epochs=2, verbose=0, callbacks=[k3.BackupAndRestore(backup), *callbacks]
        )
        return model, history

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        fit([Interrupt()])
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == ["latest.weights.h5", "training_metadata.json"]
    model, history = fit([])
    assert len(history.history["loss"]) == 1  # the second epoch only
    assert int(model.optimizer.noised_steps.numpy()) == 8
    truth = compute_epsilon([PoissonSampledGaussianEvent(0.25, 1.1, 8)], 1e-5)
    assert model_epsilon(model, target_delta=1e-5)[0] == pytest.approx(truth, rel=1e-12)
    assert not (tmp_path / "backup").exists()
