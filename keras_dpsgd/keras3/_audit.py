"""The audit's Keras callback on Keras 3, TensorFlow or JAX backend (the attack reads the model's logits only)."""

from __future__ import annotations

import keras

from keras_dpsgd.audit.membership import MembershipInferenceCallbackCore

__all__ = ["MembershipInferenceCallback"]


class MembershipInferenceCallback(MembershipInferenceCallbackCore, keras.callbacks.Callback):
    __doc__ = MembershipInferenceCallbackCore.__doc__
