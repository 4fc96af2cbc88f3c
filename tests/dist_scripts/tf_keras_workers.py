"""Worker of ``tests/test_tf_keras_distribute.py``: the tf_keras DP step under a
MultiWorkerMirroredStrategy (one CPU device per worker, TF_CONFIG from ``_dist_helpers``), against
the one-device step and the oracle, the noise std σC/L, the accountant's ε with sharded Poisson
lots, and this worker's lot sizes (``tf_keras_checks``)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from _dist_helpers import child_setup, worker_index, write_result  # noqa: E402

child_setup()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_keras_checks as checks  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
single = tf.distribute.get_strategy()
worker = worker_index()
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
x, y = checks.data()
result = {"replicas": strategy.num_replicas_in_sync, "worker": worker, "steps": {}}
for variant in ("flat", "realized"):
    distributed = checks.one_step(strategy, variant, x, y)
    result["steps"][variant] = {"vs_oracle": checks.max_diff(distributed, checks.oracle_step(variant, x, y))}
    if variant == "flat":
        result["steps"][variant]["vs_one_device"] = checks.max_diff(distributed, checks.one_step(single, variant, x, y))
noise = checks.noise_std(strategy, seed=7)
result["noise"] = {
    "expected_std": 1.0 / 8.0,
    "seeded_std": float(np.std(noise)),
    "unseeded_std": float(np.std(checks.noise_std(strategy, seed=None))),
    "head": noise[:50].tolist(),  # the same on every worker: one update, applied everywhere
}
result["poisson"] = checks.poisson_fit(strategy, worker, workers)
result["lot_sizes"] = checks.lot_sizes(worker, workers)
write_result(result)
