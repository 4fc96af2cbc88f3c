"""The DP core: Abadi et al. 2016, Algorithm 1, written once for every backend.

Nothing in this package imports TensorFlow, JAX, torch or Keras: the array math runs over the small table of
array operations each backend provides (:class:`keras_dpsgd.dp.ops.ArrayOps`). Backends (``keras_dpsgd.backends``)
supply the table and the per-example norms; the front ends (``keras_dpsgd.keras3``, ``keras_dpsgd.tf_keras``) own
the optimizer state and the train step. The import paths of this package are internal (not public API).
"""
