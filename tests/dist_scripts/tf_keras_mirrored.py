"""Child of ``tests/test_tf_keras_distribute.py``: the tf_keras DP step under a MirroredStrategy on
two logical CPU devices, against the one-device step, the one-example-at-a-time oracle, the noise
std σC/L and the accountant's ε (``tf_keras_checks``)."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from _dist_helpers import child_setup, write_result  # noqa: E402

child_setup()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_keras_checks as checks  # noqa: E402

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
single = tf.distribute.get_strategy()
x, y = checks.data()
result = {"replicas": strategy.num_replicas_in_sync, "steps": {}}
x3, y3 = checks.data(3 * checks.GLOBAL_BATCH)
x3[-1] = np.nan  # in the discarded third batch, on replica 1: counted in nonfinite_examples only
for variant in ("flat", "per_layer", "make_private", "accumulation"):  # "realized": in the MWMS workers
    xv, yv = (x3, y3) if variant == "accumulation" else (x, y)
    mirrored = checks.one_step(strategy, variant, xv, yv)
    result["steps"][variant] = {
        "vs_oracle": checks.max_diff(mirrored, checks.oracle_step(variant, xv, yv)),
        "moved": checks.max_diff(mirrored, [w.numpy() for w in checks._model().trainable_variables]),
    }
    if variant in ("flat", "make_private"):  # the one-device step (the oracle checks the others)
        result["steps"][variant]["vs_one_device"] = checks.max_diff(mirrored, checks.one_step(single, variant, x, y))
# Seeded, 2 batches accumulated into one lot of L = 8: one draw per lot, with the keys of the
# workers' one-batch seeded step (same seed, same R, noised step 0).
seeded = checks.noise_std(strategy, seed=7, accumulation=2)
result["noise"] = {
    "expected_std": 1.0 * 1.0 / 8.0,
    "seeded_std": float(np.std(seeded)),
    "seeded_mean": float(np.mean(seeded)),
    "unseeded_std": float(np.std(checks.noise_std(strategy, seed=None))),
    "head": seeded[:50].tolist(),
    "count": int(seeded.size),
}
result["refusals"] = {kind: checks.refusal(strategy, kind) for kind in ("accumulation_weight_decay", "adaptive")}
with tempfile.TemporaryDirectory() as tmp:
    result["epsilon"] = checks.backup_check(strategy, tmp + "/backup")
write_result(result)
