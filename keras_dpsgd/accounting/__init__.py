"""The privacy accountant: pure numpy/scipy, importable without TensorFlow."""

from keras_dpsgd.accounting.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyEvent,
    PrivacyLedger,
    event_from_dict,
    flatten_events,
)

__all__ = [
    "ComposedEvent",
    "GaussianEvent",
    "PoissonSampledGaussianEvent",
    "PrivacyEvent",
    "PrivacyLedger",
    "event_from_dict",
    "flatten_events",
]
