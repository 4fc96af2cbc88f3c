"""DP-SGD under ``tf.distribute``: one noise draw per lot, split across the replicas.

Shared by both front ends (tf_keras, Keras 3). A lot is spread over R replicas
(``strategy.num_replicas_in_sync``: all devices of all workers); replica r holds its share of the
examples and computes S_r = Σ_{i in share r} clip(g_i). The one-device mechanism releases
``ΣS_r + N(0, σ²C²)``. Here replica r adds its own noise

    n_r ~ N(0, σ²C²/R)          (stddev σC/√R: :func:`replica_noise_scale`)

with a key of its own (:func:`replica_key`: the replica id folded into the step's key), so the
n_r are independent, and the strategy's cross-replica SUM of the per-replica gradients gives

    Σ_r (S_r + n_r) = ΣS_r + N(0, R · σ²C²/R) = ΣS_r + N(0, σ²C²),

the sum of R independent Gaussians of variance σ²C²/R: exactly the one-device release, so the
accountant's ε is unchanged. Each replica divides by the GLOBAL expected lot size L = q·N before
the sum, so the update is (ΣS_r + N(0, σ²C²))/L. Per-layer clipping splits each group's noise the
same way (stddev σ_v C_v/√R). No single replica's n_r is a release: only the sum leaves the
all-reduce, so nothing may be done to a replica's gradient before it (per-replica clipnorm, for
instance) that is not linear.

Anything computed identically on every replica and added to its gradient (the weight-regularizer
gradient, data-independent) is summed R times by the same all-reduce: each replica adds its
:func:`replica_share` (1/R of it).

Outside a strategy, under the default strategy or ``OneDeviceStrategy``, R = 1, r = 0 and every
function here is the identity: the step is bit-identical to the one-device step.

Supported: ``tf.distribute.MirroredStrategy`` and ``tf.distribute.MultiWorkerMirroredStrategy``
(plus ``OneDeviceStrategy``); :func:`check_strategy` refuses every other strategy (TPUStrategy,
ParameterServerStrategy, CentralStorageStrategy, the TF1 ``tf.compat.v1`` strategies): their
gradient aggregation or variable placement is not the one derived above, and it is not tested.
"""

from __future__ import annotations

import math

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "SUPPORTED",
    "check_strategy",
    "current_strategy",
    "global_sum",
    "num_replicas",
    "replica_id",
    "replica_key",
    "replica_noise_scale",
    "replica_share",
]

SUPPORTED = "tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy or OneDeviceStrategy"


def current_strategy() -> tf.distribute.Strategy:
    """The strategy in scope (the default strategy outside any)."""
    return tf.distribute.get_strategy()


def _supported_classes() -> tuple[type, ...]:
    return (
        tf.distribute.MirroredStrategy,
        tf.distribute.MultiWorkerMirroredStrategy,
        tf.distribute.OneDeviceStrategy,
    )


def check_strategy(caller: str, strategy: tf.distribute.Strategy | None = None) -> None:
    """Raises ValueError unless `strategy` (default: the one in scope) is one the DP step supports.

    Args:
      caller: who asks (e.g. ``"DPSGDOptimizer"``), named in the message.
      strategy: the strategy to check; None: ``tf.distribute.get_strategy()``.

    Raises:
      ValueError: for any strategy other than the default one, MirroredStrategy,
        MultiWorkerMirroredStrategy and OneDeviceStrategy (TPUStrategy, ParameterServerStrategy,
        CentralStorageStrategy, tf.compat.v1 strategies, ...).
    """
    if strategy is None:
        strategy = current_strategy()
    if strategy is distribute_lib._get_default_strategy():  # pylint: disable=protected-access
        return  # The default strategy: one replica, no distribution.
    if isinstance(strategy, _supported_classes()):
        return
    raise refuse(
        "unsupported-strategy",
        f"{caller} does not support {type(strategy).__name__}: the DP step adds its noise split across "
        f"replicas and relies on a cross-replica SUM of the gradients, derived and tested for {SUPPORTED} "
        "only (TPUStrategy, ParameterServerStrategy and CentralStorageStrategy are not supported). "
        "Use MirroredStrategy (one machine) or MultiWorkerMirroredStrategy (several).",
    )


def num_replicas() -> int:
    """R: the replicas in sync across all workers (1 outside a strategy)."""
    return int(current_strategy().num_replicas_in_sync)


def replica_id() -> tf.Tensor:
    """r: this replica's global id in [0, R) as an int64 tensor (0 outside a replica context).

    Under MultiWorkerMirroredStrategy the id is global: worker offsets included.
    """
    context = tf.distribute.get_replica_context()
    if context is None:  # Cross-replica context: no replica of its own.
        return tf.constant(0, tf.int64)
    return tf.cast(context.replica_id_in_sync_group, tf.int64)


def replica_noise_scale() -> float:
    """1/√R: the factor on each replica's noise stddev (1.0 for one replica)."""
    replicas = num_replicas()
    return 1.0 if replicas == 1 else 1.0 / math.sqrt(replicas)


def replica_key(key: tf.Tensor) -> tf.Tensor:
    """`key` ([2] int64 Philox key of a draw) made this replica's own: r folded in when R > 1.

    Seeded runs are a function of (seed, noised step, tensor index, r): reproducible for a given R.
    Unseeded keys come from per-process OS entropy; folding r in still keeps replicas apart when
    they share a generator state. One replica: `key` itself (bit-identical to the one-device step).
    """
    if num_replicas() == 1:
        return key
    return tf.random.experimental.stateless_fold_in(tf.cast(key, tf.int64), replica_id())


def replica_share(value: tf.Tensor) -> tf.Tensor:
    """`value` / R: the part of a term every replica computes identically (the cross-replica SUM
    adds the R shares back to `value`). One replica: `value` itself."""
    replicas = num_replicas()
    if replicas == 1:
        return value
    return value / tf.cast(replicas, value.dtype)


def global_sum(value: tf.Tensor) -> tf.Tensor:
    """The SUM of `value` over all replicas (a realized count, ...), in replica context; `value`
    itself for one replica or in cross-replica context."""
    context = tf.distribute.get_replica_context()
    if num_replicas() == 1 or context is None:
        return value
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)
