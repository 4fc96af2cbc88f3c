"""The one child process of the tf.distribute tests (``tests/_dist_helpers.strategy_runs``).

``python strategy_child.py mirrored DIR`` (2 logical CPU devices, one MirroredStrategy) or
``python strategy_child.py mwms DIR PHASE`` (one worker of a MultiWorkerMirroredStrategy cluster;
PHASE "main" or "resume", a relaunch of the cluster on the same DIR). One strategy per process
(collective keys), shared by the checks of both Kerases: ``_distribute``'s helpers
(distribute_replicas), Keras 3 (keras3_distributed, keras3_checkpoints, keras3_accumulate) and
tf_keras (tf_keras_checks). Writes one JSON result with a part per module.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dist_helpers  # noqa: E402

_dist_helpers.child_setup()

import tensorflow as tf  # noqa: E402

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
PHASE = sys.argv[3] if len(sys.argv) > 3 else "main"
ONLY = os.environ.get("KERAS_DPSGD_DIST_ONLY", "")  # debugging: "keras3", "tf_keras", "replicas", ...
CHECKS = [c for c in os.environ.get("KERAS_DPSGD_DIST_CHECKS", "").split(",") if c]  # debugging: keras3 checks


def main() -> dict:
    import keras3_checkpoints
    import keras3_distributed
    import tf_keras_checks

    result = {}
    if MODE == "mirrored":
        import distribute_replicas
        import keras3_accumulate

        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
        parts = {
            "replicas": lambda: distribute_replicas.run(strategy),
            "tf_keras": lambda: tf_keras_checks.mirrored_checks(strategy, DIRECTORY),
            "keras3": lambda: keras3_distributed.run(strategy, MODE, CHECKS),
            "keras3_accumulate": lambda: keras3_accumulate.run(strategy),
        }
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        parts = {
            "tf_keras": lambda: tf_keras_checks.worker_checks(strategy, DIRECTORY, PHASE),
            "keras3": lambda: keras3_distributed.run(strategy, MODE, CHECKS) if PHASE == "main" else {},
            "keras3_checkpoints": lambda: keras3_checkpoints.run(strategy, DIRECTORY, PHASE),
        }
    result["cpu_seconds"] = {"start": time.process_time()}  # where the time goes (not asserted)
    for name, part in parts.items():
        if not ONLY or name.startswith(ONLY):
            result[name] = part()
            result["cpu_seconds"][name] = time.process_time()
    return result


_dist_helpers.write_result(main())
