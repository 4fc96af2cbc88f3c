"""keras_dpsgd for tf_keras (Keras 2, ``import tf_keras``): the DP optimizers by explicit name.

Code that names its Keras imports from here (``keras_dpsgd.tf_keras``) or from
``keras_dpsgd.keras3``; the top-level ``keras_dpsgd.DPSGDOptimizer`` is the tf_keras class today.
"""

from keras_dpsgd._tf_keras_step import make_private
from keras_dpsgd.optimizer import DPAdamOptimizer, DPSGDOptimizer, make_dp_optimizer
from keras_dpsgd.tools._adaptive_tf import AdaptiveDPSGDOptimizer, ClipBoundsLogger, make_adaptive_optimizer

__all__ = [
    "AdaptiveDPSGDOptimizer",
    "ClipBoundsLogger",
    "DPAdamOptimizer",
    "DPSGDOptimizer",
    "make_adaptive_optimizer",
    "make_dp_optimizer",
    "make_private",
]
