"""keras_dpsgd: differentially private training (DP-SGD) for tf_keras.

Public names are imported lazily so that ``import keras_dpsgd.accounting``
works without TensorFlow installed (the accountant is pure numpy/scipy).
"""

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it. TensorFlow-dependent modules are only
# imported when one of their names is first used.
_LAZY = {
    # accounting (pure numpy/scipy)
    "PoissonSampledGaussianEvent": "keras_dpsgd.accounting",
    "GaussianEvent": "keras_dpsgd.accounting",
    "ComposedEvent": "keras_dpsgd.accounting",
    "PrivacyLedger": "keras_dpsgd.accounting",
    "RdpAccountant": "keras_dpsgd.accounting",
    "MomentsAccountant": "keras_dpsgd.accounting",
    "PldAccountant": "keras_dpsgd.accounting",
    "compute_epsilon": "keras_dpsgd.accounting",
    "compute_epsilon_and_order": "keras_dpsgd.accounting",
    "compute_noise_multiplier": "keras_dpsgd.accounting",
    "calibrate_noise_multiplier": "keras_dpsgd.accounting",
    "max_steps_within_budget": "keras_dpsgd.accounting",
    "batch_table": "keras_dpsgd.accounting",
    "default_delta": "keras_dpsgd.accounting",
    "check_delta": "keras_dpsgd.accounting",
    "effective_noise_multiplier": "keras_dpsgd.accounting",
    # optimizer
    "DPSGDOptimizer": "keras_dpsgd.optimizer",
    "DPAdamOptimizer": "keras_dpsgd.optimizer",
    "make_dp_optimizer": "keras_dpsgd.optimizer",
    # data sampling and callbacks
    "PoissonLots": "keras_dpsgd.sampling",
    "PrivacyLogger": "keras_dpsgd.callbacks",
    "WithinLimit": "keras_dpsgd.callbacks",
    "model_privacy_ledger": "keras_dpsgd.ledger",
    "model_epsilon": "keras_dpsgd.ledger",
    "steps_remaining": "keras_dpsgd.ledger",
    # pca
    "DPPCA": "keras_dpsgd.pca",
    # normalization (DP moments; preprocessing fitted on data is refused unless marked public)
    "DPNormalization": "keras_dpsgd.normalization",
    "mark_public": "keras_dpsgd.normalization",
    # tools (Three Tools for Practical Differential Privacy)
    "memorization_test": "keras_dpsgd.tools",
    "real_task_test": "keras_dpsgd.tools",
    "AdaptiveDPSGDOptimizer": "keras_dpsgd.tools",
    "make_adaptive_optimizer": "keras_dpsgd.tools",
    "initial_clip_bounds": "keras_dpsgd.tools",
    "ClipBoundsLogger": "keras_dpsgd.tools",
    "calibrate_adaptive_noise_multiplier": "keras_dpsgd.tools",
    "scale_learning_rate": "keras_dpsgd.tools",
    "large_lot_table": "keras_dpsgd.tools",
}

_SUBMODULES = ("accounting", "keras3", "tf_keras")

__all__ = sorted(_LAZY) + list(_SUBMODULES)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_dpsgd.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_dpsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# Serializable tf_keras classes (issue 12, hole 6a): registered as soon as tf_keras is
# imported, so that load_model works after `import keras_dpsgd` alone; importing
# keras_dpsgd.accounting still does not import TensorFlow.
from keras_dpsgd import _registration  # noqa: E402

_registration.register_when_tf_keras_is_imported()
