"""DPPCA and DPNormalization as Keras 3 layers (``import keras``, TensorFlow and JAX backends).

The mechanisms are the tf_keras layers' (:class:`keras_dpsgd.preprocessing.pca.PCAMechanism`,
:class:`keras_dpsgd.preprocessing.normalization.MomentsMechanism`: same arguments, validation, sums, release
and events); only the glue differs. Keras 3 has no generic adapt loop, so the batches reach
``update_state`` through :func:`keras_dpsgd.preprocessing.adapt.stream_batches` (consecutive batches of the
array, or the dataset's own, in order: the same batches and hence, for a given seed, the same
release as tf_keras's ``adapt``). The released state and the events are weights, saved in
``.keras`` files; loading restores them and releases nothing.

The exact sums of ``adapt`` are TensorFlow variables and ops on every backend (TensorFlow comes with
the library); ``call`` is ``keras.ops`` (:data:`_OPS`), so it runs inside a jitted JAX train step.
On JAX without x64 the float64 records of the events are float32: q is recorded rounded up and σ
rounded down (``keras_dpsgd.preprocessing.seam.outward``), also when a file saved on TensorFlow is
loaded.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_dpsgd.preprocessing import normalization as _normalization
from keras_dpsgd.preprocessing import pca as _pca
from keras_dpsgd.preprocessing.adapt import stream_batches
from keras_dpsgd.preprocessing.seam import TfOps
from keras_dpsgd.preprocessing.feature_map import PublicFeatureMapMixin
from keras_dpsgd.preprocessing.vocabulary import accounted_layer_classes

__all__ = ["DPNormalization", "DPPCA", "PublicFeatureMap"]

# The layers' call: keras.ops (the names of TfOps), and whether a tensor is floating.
_OPS = types.SimpleNamespace(
    **{name: getattr(keras.ops, name) for name in vars(TfOps) if not name.startswith("_") and name != "is_floating"},
    is_floating=lambda x: keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype)),
)


class _Keras3AdaptGlue:
    """Keras 3 front end of a DP release layer; put first (before the mechanism and ``keras.layers.Layer``)."""

    _ops = _OPS

    @property
    def is_adapted(self) -> bool:
        """Whether the layer's weights record at least one adapt."""
        return bool(getattr(self, "_is_adapted", False))

    def _stream(self, data: Any, batch_size: Optional[int], steps: Optional[int]) -> None:
        self.reset_state()
        acc = self._acc
        if acc.update_function is None:  # traced once per accumulator (it captures its variables)
            acc.update_function = tf.function(self.update_state, reduce_retracing=True)
        stream_batches(data, batch_size, steps, acc.update_function)

    def load_own_variables(self, store) -> None:
        super().load_own_variables(store)
        # Keras rounds a float64 file's values to nearest in float32 weights (JAX): record them outward.
        variables = self._trainable_variables + self._non_trainable_variables  # Keras's order of `store`
        index = {id(v): str(i) for i, v in enumerate(variables)}
        saved = (
            float(np.asarray(store[index[id(v)]])) for v in (self.adapt_sampling_rate, self.adapt_noise_multiplier)
        )
        self._write_records(*saved)

    def compute_output_shape(self, input_shape):
        return tuple(super().compute_output_shape(input_shape).as_list())


def _keras3_doc(doc: str) -> str:
    first, rest = doc.split("\n", 1)
    return f"{first.rstrip('.')} (Keras 3 layer).\n{rest}"


@keras.saving.register_keras_serializable(package="keras_dpsgd", name="DPPCA")
class DPPCA(_Keras3AdaptGlue, _pca.PCAMechanism, keras.layers.Layer):
    __doc__ = _keras3_doc(_pca.DPPCA_DOC)


@keras.saving.register_keras_serializable(package="keras_dpsgd", name="DPNormalization")
class DPNormalization(_Keras3AdaptGlue, _normalization.MomentsMechanism, keras.layers.Layer):
    __doc__ = _keras3_doc(_normalization.DP_NORMALIZATION_DOC)


@keras.saving.register_keras_serializable(package="keras_dpsgd", name="PublicFeatureMap")
class PublicFeatureMap(PublicFeatureMapMixin, keras.layers.Layer):
    __doc__ = _keras3_doc(PublicFeatureMapMixin.__doc__)
    _ops = keras.ops


# Registered for loading; made by keras_dpsgd.DPVocabulary.apply_to, not public names.
_DPStringLookup, _DPTextVectorization = accounted_layer_classes(keras)
