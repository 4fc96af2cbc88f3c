"""The privacy accountant: pure numpy/scipy, importable without TensorFlow.

Events (:mod:`events`) record every access to the data; accountants
(:mod:`accountants`) compose them and convert to (ε, δ); :mod:`planning` turns
a budget into a noise multiplier, a number of steps or a lot-size table; :mod:`tuning` bounds a
hyperparameter search that releases its best trial (:class:`TuningEvent`, Papernot & Steinke 2022).

Accountants are registered by name (``@register_accountant("rdp")``); every
``accountant=`` argument takes a registered name or an accountant object.
"""

from keras_dpsgd.accounting.accountants import (
    ACCOUNTANTS,
    MomentsAccountant,
    PldAccountant,
    PrivacyAccountant,
    RdpAccountant,
    accountant_names,
    make_accountant,
    register_accountant,
)
from keras_dpsgd.accounting.bandmf import BandMFEvent
from keras_dpsgd.accounting.conversions import delta_from_rdp, epsilon_from_rdp
from keras_dpsgd.accounting.events import (
    ComposedEvent,
    GaussianEvent,
    GaussianThresholdingEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyEvent,
    PrivacyLedger,
    TuningEvent,
    composed_noise_multiplier,
    event_from_dict,
    flatten_events,
)
from keras_dpsgd.accounting.planning import (
    batch_table,
    calibrate_noise_multiplier,
    check_delta,
    compute_epsilon,
    compute_epsilon_and_order,
    compute_noise_multiplier,
    default_delta,
    effective_noise_multiplier,
    lots_per_epoch,
    max_epochs_from_steps,
    max_epochs_within_budget,
    max_steps_within_budget,
    steps_for_epochs,
)
from keras_dpsgd.accounting.tuning import expected_trials, rdp_tuning, sample_trials
from keras_dpsgd.accounting.rdp import (
    DEFAULT_ORDERS,
    MOMENTS_ORDERS,
    TF_PRIVACY_LEGACY_ORDERS,
    rdp_gaussian,
    rdp_poisson_subsampled_gaussian,
)

__all__ = [
    "ACCOUNTANTS",
    "BandMFEvent",
    "ComposedEvent",
    "DEFAULT_ORDERS",
    "GaussianEvent",
    "GaussianThresholdingEvent",
    "MOMENTS_ORDERS",
    "MomentsAccountant",
    "PldAccountant",
    "PoissonSampledComposedGaussianEvent",
    "PoissonSampledGaussianEvent",
    "PrivacyAccountant",
    "PrivacyEvent",
    "PrivacyLedger",
    "RdpAccountant",
    "TF_PRIVACY_LEGACY_ORDERS",
    "TuningEvent",
    "accountant_names",
    "batch_table",
    "calibrate_noise_multiplier",
    "check_delta",
    "compute_epsilon",
    "compute_epsilon_and_order",
    "composed_noise_multiplier",
    "compute_noise_multiplier",
    "default_delta",
    "delta_from_rdp",
    "effective_noise_multiplier",
    "epsilon_from_rdp",
    "event_from_dict",
    "expected_trials",
    "flatten_events",
    "lots_per_epoch",
    "make_accountant",
    "max_epochs_from_steps",
    "max_epochs_within_budget",
    "max_steps_within_budget",
    "rdp_gaussian",
    "rdp_poisson_subsampled_gaussian",
    "rdp_tuning",
    "register_accountant",
    "sample_trials",
    "steps_for_epochs",
]
