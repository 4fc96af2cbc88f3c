"""Fast per-example clipping (ghost norms and book-keeping) for DP-SGD on TensorFlow (Keras 3 and tf_keras).

``FastBackend`` implements the per-example backend protocol of ``keras_dpsgd.backends.tensorflow._per_example``:
``clipped_sum(loss, var_list, tape, clip_factors) -> (summed, sq_norms)``. It gives the same
numbers as the per-example jacobian (reference) path, without materializing per-example
gradients for the layers that carry most parameters. See ``_backend`` for the algorithm.
``ReferenceBackend`` (``_reference``) is the always-exact per-example jacobian path it falls back
to for a variable without a rule (announced: ``_report``). How a new op gets a per-example
rule: ``_handlers.register_rule``.
"""

from keras_dpsgd.backends.tensorflow._backend import FastBackend
from keras_dpsgd.backends.tensorflow._reference import ReferenceBackend

__all__ = ["FastBackend", "ReferenceBackend"]
