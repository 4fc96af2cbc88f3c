"""The tf_keras DP step under tf.distribute (issue 15; the design in ``keras_dpsgd.step.distribute``).

Each strategy runs in fresh processes (``tests/_dist_helpers.py``: logical CPU devices must be set
before TensorFlow starts), launched once per session for both Kerases
(``tests/_dist_helpers.strategy_runs``), running every check of
``tests/dist_scripts/tf_keras_checks.py``:

* the σ = 0 step equals the one-example-at-a-time oracle (flat and per-layer clipping, the
  realized-count normalization, weight regularizers through ``make_private``) and the one-device
  step on the same global batch;
* the noise of one step has std σC/L, not √R·σC/L (nor σC/(√R·L), the noise of one replica):
  10 000 coordinates of a zero-gradient step, seeded (reproducible) and unseeded;
* after k steps ``noised_steps`` == k and the ledger's ε (and PrivacyLogger's) is the
  accountant's for k steps; BackupAndRestore and ModelCheckpoint (.keras) under the strategy keep it;
* MultiWorkerMirroredStrategy (2 workers on 127.0.0.1): the same, with Poisson lots sharded over
  the workers, whose summed sizes are Binomial(N, q) (statistical bounds at 5 standard errors);
  gradient accumulation (one lot's update equals the one-device update); a BackupAndRestore fit
  interrupted, the cluster relaunched and resumed (the chief writes): each global step counted once.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd.tf_keras as kt
from tests._dist_helpers import strategy_runs

EXACT = 1e-6


def _check_noise(noise: dict, count: int = 10_000) -> None:
    tolerance = 5 * noise["expected_std"] / math.sqrt(2 * count)  # 5 standard errors of the std
    for key in ("seeded_std", "unseeded_std"):
        assert abs(noise[key] - noise["expected_std"]) < tolerance, (key, noise)
    # The wrong scalings, √R·σC/L (no split, or one key for all replicas) and σC/(√R·L) (one
    # replica's noise only), are over 50 standard errors away.


@pytest.fixture(scope="module")
def mirrored():
    return strategy_runs()["mirrored"]["tf_keras"]


@pytest.fixture(scope="module")
def workers():
    return [w["tf_keras"] for w in strategy_runs()["workers"]]


def test_mirrored_sigma_zero_step_is_the_one_device_step(mirrored):
    assert mirrored["replicas"] == 2
    for variant, step in mirrored["steps"].items():
        assert step["vs_oracle"] < EXACT, (variant, step)
        assert step.get("vs_one_device", 0.0) < EXACT, (variant, step)
        assert step["moved"] > 1e-3, (variant, step)
    assert {"flat", "make_private"} <= {v for v, s in mirrored["steps"].items() if "vs_one_device" in s}
    assert "accumulation" in mirrored["steps"]  # one lot of 2 batches, the partial third discarded
    # The one NaN example of the discarded batch, on replica 1, is counted once: the count sums the replicas'.
    assert mirrored["steps"]["accumulation"]["nonfinite_examples"] == 1


def test_mirrored_noise_is_sigma_c_over_l(mirrored):
    noise = mirrored["noise"]
    assert noise["count"] == 10_000
    _check_noise(noise)
    assert abs(noise["seeded_mean"]) < 5 * noise["expected_std"] / math.sqrt(noise["count"])


def test_mirrored_epsilon_is_the_accountants_and_survives_backup_and_restore(mirrored):
    e = mirrored["epsilon"]
    assert e["first"]["noised_steps"] == 2  # once per global step, not once per replica
    assert e["first"]["epsilon"] == pytest.approx(e["first_truth"], rel=1e-9)
    assert e["epochs_run"] == 1  # resumed at the second epoch
    assert e["noised_steps"] == 4 and e["iterations"] == 4
    assert e["epsilon"] == pytest.approx(e["truth"], rel=1e-9)
    assert e["logged_epsilon"] == pytest.approx(e["truth"], rel=1e-9)
    assert e["loaded_steps"] == 4  # ModelCheckpoint's .keras file, loaded under the strategy
    assert e["loaded_epsilon"] == pytest.approx(e["truth"], rel=1e-9)


def test_mirrored_refusals(mirrored):
    accumulation, adaptive = mirrored["refusals"]["accumulation_weight_decay"], mirrored["refusals"]["adaptive"]
    assert (
        "gradient_accumulation_steps = 2, weight_decay=0.01 and use_ema=False is not supported with 2" in accumulation
    )
    assert "AdaptiveDPSGDOptimizer is not supported with 2 replicas: adaptive clipping" in adaptive


def test_workers_step_noise_and_epsilon(workers):
    assert [w["worker"] for w in workers] == [0, 1]
    for w in workers:
        assert w["replicas"] == 2
        for variant, step in w["steps"].items():
            assert step["vs_oracle"] < EXACT and step.get("vs_one_device", 0.0) < EXACT, (variant, step)
        _check_noise(w["noise"])
        p = w["poisson"]
        assert p["noised_steps"] == 3 and p["expected_lot_size"] == 8.0  # the global L = qN
        assert p["epsilon"] == pytest.approx(p["truth"], rel=1e-9)
        assert "fit would split each of its batches over 2 steps" in p["refused"]
    # The one-device step on the chief; every worker holds the same weights after each step.
    assert {"flat", "accumulation"} <= {v for v, s in workers[0]["steps"].items() if "vs_one_device" in s}
    # The one NaN example (worker 1's) is counted once on every worker, not its whole per-replica batch
    # of 4 (the jacobian fallback, taken before under MWMS: 0·NaN spread over the batch).
    assert [w["steps"]["accumulation"]["nonfinite_examples"] for w in workers] == [1, 1]
    assert workers[0]["weights"] == workers[1]["weights"]
    # One update, applied identically on every worker.
    assert workers[0]["noise"]["head"] == workers[1]["noise"]["head"]
    assert workers[0]["poisson"]["weights"] == workers[1]["poisson"]["weights"]


def test_workers_resume_a_relaunched_cluster_counting_each_global_step_once(workers):
    resumed = [w["tf_keras"]["resumed"] for w in strategy_runs()["resumed"]]
    for where, (w, r) in enumerate(zip(workers, resumed)):
        first = w["interrupted"]
        assert first["noised_steps"] == 2 and first["epsilon"] == pytest.approx(first["truth"], rel=1e-9), where
        assert r["epochs_run"] == 1, where  # the relaunch resumed at the second epoch
        assert r["noised_steps"] == 4 and r["iterations"] == 4, where
        assert r["epsilon"] == pytest.approx(r["truth"], rel=1e-9), where
        assert r["logged_epsilon"] == pytest.approx(r["truth"], rel=1e-9), where
        assert r["loaded_steps"] == 4, where  # the chief's ModelCheckpoint file, loaded under the strategy
        assert r["loaded_epsilon"] == pytest.approx(r["truth"], rel=1e-9), where


def test_seeded_noise_is_reproducible_for_a_given_number_of_replicas(mirrored, workers):
    # Same seed, same R = 2, same noised step: the same keys, whether the replicas are devices or
    # workers, and whether the lot is one batch (workers) or two accumulated (mirrored; its std
    # σC/L in test_mirrored_noise_is_sigma_c_over_l: one draw per lot, not one per batch).
    assert mirrored["noise"]["head"] == workers[0]["noise"]["head"]


def test_workers_lot_sizes_are_binomial(workers):
    n, q = 200, 0.1
    sizes = np.sum([w["lot_sizes"] for w in workers], axis=0)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / len(sizes))
    assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (len(sizes) - 1))
    for w in workers:  # each worker samples its half with the same q
        assert abs(np.mean(w["lot_sizes"]) - mean / 2) < 5 * math.sqrt(var / 2 / len(sizes))


def test_central_storage_strategy_is_refused():
    with tf.distribute.experimental.CentralStorageStrategy().scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        opt = kt.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, expected_lot_size=4.0)
        model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError(reduction="none"))
    with pytest.raises(ValueError, match="DPSGDOptimizer does not support CentralStorageStrategy"):
        model.fit(np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32), batch_size=4, verbose=0)


def test_fit_frame_is_found_from_a_replica_thread():
    # MirroredStrategy traces each replica's step in a thread of its own; the lot-alignment check
    # (steps_per_epoch a multiple of gradient_accumulation_steps with Poisson lots) reads fit's frame.
    import threading

    from keras_dpsgd import ledger

    model, other, found = keras.Sequential([keras.Input((1,))]), keras.Sequential([keras.Input((1,))]), []

    def fit(self):  # the frame fit_frame looks for: named fit, whose self is the model
        thread = threading.Thread(target=lambda: found.append(ledger.fit_frame(model)))
        thread.start()
        thread.join()

    fit(other)
    fit(model)
    assert found[0] is None and found[1].f_locals["self"] is model
    assert ledger.fit_frame(model) is None
