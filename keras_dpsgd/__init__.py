"""keras_dpsgd: differentially private training (DP-SGD) for Keras 3 and tf_keras.

Which Keras: the names that exist once per Keras (``DPSGDOptimizer``,
``DPAdamOptimizer``, ``make_dp_optimizer``, ``DPPCA``, ...) follow ``tf.keras``:
Keras 3 unless ``TF_USE_LEGACY_KERAS`` is "1", "true" or "True" (TensorFlow's
rule), then tf_keras. Code that names its Keras imports from
``keras_dpsgd.keras3`` or ``keras_dpsgd.tf_keras``; the top level re-exports
from their ``__all__`` (:mod:`keras_dpsgd._which_keras`). The other names
(accounting, ``PoissonLots``, callbacks, the ledger, the Keras-neutral tools)
are the same for both.

Public names are imported lazily so that ``import keras_dpsgd.accounting``
works without TensorFlow installed (the accountant is pure numpy/scipy).
"""

from keras_dpsgd import _lazy, _which_keras

__version__ = "0.2.0"

# Keras-neutral public name -> module that defines it. TensorFlow-dependent
# modules are only imported when one of their names is first used.
_NEUTRAL = {
    # accounting (pure numpy/scipy)
    "PoissonSampledGaussianEvent": "keras_dpsgd.accounting",
    "GaussianEvent": "keras_dpsgd.accounting",
    "GaussianThresholdingEvent": "keras_dpsgd.accounting",
    "ComposedEvent": "keras_dpsgd.accounting",
    "BandMFEvent": "keras_dpsgd.accounting",
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
    # data sampling, callbacks and the ledger
    "PoissonLots": "keras_dpsgd.step.lots",
    "StreamingPoissonLots": "keras_dpsgd.step.streaming",
    "UserPoissonLots": "keras_dpsgd.step.user_lots",
    "UserMeanLoss": "keras_dpsgd.step.user_lots",
    "CyclicPoissonLots": "keras_dpsgd.step.cyclic_lots",
    "PrivacyLogger": "keras_dpsgd.callbacks",
    "WithinLimit": "keras_dpsgd.callbacks",
    "model_privacy_ledger": "keras_dpsgd.ledger",
    "model_epsilon": "keras_dpsgd.ledger",
    "steps_remaining": "keras_dpsgd.ledger",
    # one call: private step, Poisson lots, calibrated σ, private optimizer (either Keras, by the model's)
    "make_private_with_epsilon": "keras_dpsgd._one_call",
    "PrivateTraining": "keras_dpsgd._one_call",
    # preprocessing fitted on public data (marks a layer of either Keras)
    "mark_public": "keras_dpsgd.preprocessing.normalization",
    # a vocabulary released with DP (Gaussian thresholding), for StringLookup / TextVectorization
    "dp_vocabulary": "keras_dpsgd.preprocessing.vocabulary",
    "DPVocabulary": "keras_dpsgd.preprocessing.vocabulary",
    # tools (Three Tools for Practical Differential Privacy): the privacy arithmetic
    "memorization_test": "keras_dpsgd.tools",
    "real_task_test": "keras_dpsgd.tools",
    "calibrate_adaptive_noise_multiplier": "keras_dpsgd.tools",
    "scale_learning_rate": "keras_dpsgd.tools",
    "large_lot_table": "keras_dpsgd.tools",
}

_SUBMODULES = ("accounting", "audit", "keras3", "tf_keras", "tools")


def _public_names() -> list:
    """The neutral names, the submodules and the active Keras's front-end names (imports TensorFlow)."""
    front_end = _which_keras.front_end_names(_which_keras.active_front_end())
    return sorted(set(_NEUTRAL) | set(_SUBMODULES) | set(front_end))


def _front_end_or_all(name: str):
    return _public_names() if name == "__all__" else _which_keras.front_end_attribute(name)


# `__all__` is computed on first use: it holds the names of the Keras that tf.keras is.
__getattr__, __dir__ = _lazy.attach(__name__, _NEUTRAL, submodules=_SUBMODULES, fallback=_front_end_or_all)


# Serializable classes (issue 12, hole 6a): registered as soon as tf_keras (or Keras 3) is imported,
# so that loading a saved model works after `import keras_dpsgd` alone; importing
# keras_dpsgd.accounting still does not import TensorFlow.
from keras_dpsgd import _registration  # noqa: E402

_registration.register_when_keras_is_imported()
