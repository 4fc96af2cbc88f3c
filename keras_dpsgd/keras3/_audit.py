"""The audit's Keras callback on Keras 3 (the audit itself takes models of either Keras)."""

from __future__ import annotations

import keras

from keras_dpsgd.audit._callback import MembershipInferenceCallbackCore

__all__ = ["MembershipInferenceCallback"]


class MembershipInferenceCallback(MembershipInferenceCallbackCore, keras.callbacks.Callback):
    __doc__ = MembershipInferenceCallbackCore.__doc__

    def __init__(self, *args, **kwargs):
        from keras_dpsgd.keras3._train_step import _refuse_jax

        _refuse_jax("the audit (keras_dpsgd.keras3.MembershipInferenceCallback)")
        super().__init__(*args, **kwargs)
