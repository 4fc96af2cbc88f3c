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
    # optimizer
    "DPSGDOptimizer": "keras_dpsgd.optimizer",
    "DPAdamOptimizer": "keras_dpsgd.optimizer",
    "make_dp_optimizer": "keras_dpsgd.optimizer",
    # data sampling and callbacks
    "PoissonLots": "keras_dpsgd.sampling",
    # pca
    # tools
}

__all__ = sorted(_LAZY) + ["accounting"]


def __getattr__(name):
    if name == "accounting":
        return importlib.import_module("keras_dpsgd.accounting")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_dpsgd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
