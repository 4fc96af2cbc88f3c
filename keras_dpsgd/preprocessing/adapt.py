"""What DPPCA and DPNormalization share, on both Keras front ends: one DP release per ``adapt``.

Both layers stream the data through exact sums that are never saved (:class:`Accumulator`),
release them once through a Gaussian mechanism at the end of ``adapt``, zero the sums, and record
the release as a privacy event in their weights (:class:`DPReleaseMixin`), where
:func:`keras_dpsgd.ledger.model_privacy_ledger` finds it through the ``privacy_events``
property. The Keras glue differs only in how the batches reach ``update_state``: tf_keras's
``PreprocessingLayer.adapt`` (:class:`TfKerasAdaptGlue`), or :func:`stream_batches` for Keras 3
(which has no generic adapt loop).

Nothing here imports a Keras: the layers are ``(glue, mechanism, Layer)`` classes, the mechanism
(``keras_dpsgd.preprocessing.pca.PCAMechanism``, ``keras_dpsgd.preprocessing.normalization.MomentsMechanism``) a subclass of
:class:`DPReleaseMixin`.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, PrivacyLedger
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.preprocessing.seam import TfOps, outward

DEFAULT_ADAPT_BATCH_SIZE = 1024

__all__ = [
    "DEFAULT_ADAPT_BATCH_SIZE",
    "Accumulator",
    "DPReleaseMixin",
    "TfKerasAdaptGlue",
    "as_adapt_data",
    "batch_shape",
    "check_features",
    "feature_dim",
    "flatten",
    "release_event",
    "stream_batches",
]


# ----------------------------------------------------------------- adapt's data
def as_adapt_data(data: Any, owner: str) -> Any:
    """Checks adapt's `data` (features only) and converts lists to arrays; `owner` names the layer."""
    if isinstance(data, tf.data.Dataset):
        if not isinstance(data.element_spec, tf.TensorSpec):
            raise refuse(
                "dp-layer-adapt",
                f"{owner}.adapt data must hold features only, got dataset elements "
                f"{data.element_spec}; e.g. pass dataset.map(lambda x, y: x)",
                TypeError,
            )
        return data
    if isinstance(data, (tuple, dict)):
        raise refuse(
            "dp-layer-adapt", f"{owner}.adapt data must hold features only, got a {type(data).__name__}", TypeError
        )
    if isinstance(data, list):
        data = np.asarray(data)
    if not hasattr(data, "shape"):
        raise TypeError(
            f"{owner}.adapt data must be an array, a tensor or a tf.data.Dataset, got "
            f"{type(data).__name__} (wrap generators with tf.data.Dataset.from_generator)"
        )
    return data


def batch_shape(data: Any, owner: str) -> Any:
    """(None, d1, ...) of a dataset of batches or of an array of examples (a TensorShape if the rank is unknown)."""
    if isinstance(data, tf.data.Dataset):
        shape = tf.TensorShape(data.element_spec.shape)
        if shape.rank is not None and shape.rank < 2:
            raise ValueError(
                f"{owner}.adapt dataset elements must be batches (batch, d1, ...), got {shape}: use dataset.batch(...)"
            )
    else:
        shape = tf.TensorShape(data.shape)
        if shape.rank is not None and shape.rank < 2:
            raise ValueError(f"{owner}.adapt data must have shape (num_examples, d1, ...), got {shape}")
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return shape if shape.rank is None else tuple(shape.as_list())


def feature_dim(input_shape: Any, owner: str) -> tuple[int, tuple]:
    """(d, (d1, ...)): the flattened size and the feature shape of inputs of shape (batch, d1, ...)."""
    shape = tf.TensorShape(input_shape)
    if shape.rank is None or shape.rank < 2 or not shape[1:].is_fully_defined():
        raise ValueError(f"{owner} inputs must have shape (batch, d1, ...) with known d1, ..., got {shape}")
    features = tuple(shape[1:].as_list())
    return int(np.prod(features)), features


def flatten(inputs: Any, dim: int, compute_dtype: Any, owner: str, ops: Any = TfOps) -> Any:
    """Inputs (batch, d1, ...) as (batch, d); non-float inputs cast to `compute_dtype` (`ops`: TfOps or keras.ops)."""
    x = ops.convert_to_tensor(inputs)
    if not ops.is_floating(x):
        x = ops.cast(x, compute_dtype)
    check_features(x.shape, dim, owner)
    return ops.reshape(x, (-1, dim))


def check_features(shape: Any, dim: int, owner: str) -> None:
    """Raises ValueError if inputs of `shape` (batch, d1, ...) do not flatten to `dim` features (as far as known)."""
    shape = tf.TensorShape(shape)
    if shape.rank is not None and shape.rank < 2:
        raise ValueError(f"{owner} inputs must have shape (batch, d1, ...), got {shape}")
    if shape.rank is not None and shape[1:].is_fully_defined():
        got = int(np.prod(shape[1:].as_list()))
        if got != dim:
            raise ValueError(f"{owner} inputs must flatten to d = {dim} features, got shape {shape} ({got} features)")


def stream_batches(data: Any, batch_size: Optional[int], steps: Optional[int], update: Callable) -> None:
    """Calls `update(batch)` on the batches of `data` in order, as tf_keras's adapt does (Keras 3's loop).

    Arrays and tensors are cut into consecutive batches of `batch_size` rows (no shuffling); a
    dataset is read as it is. `steps` (None: all) bounds the number of batches.
    """
    if steps is not None:
        _validate.integer_at_least(1, steps=steps)
    if isinstance(data, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError(
                f"batch_size must be None for a tf.data.Dataset (it is batched already), got {batch_size!r}"
            )
        batches = iter(data)
    else:
        batch_size = _validate.integer_at_least(1, batch_size=batch_size)
        num = int(data.shape[0])
        batches = (data[start : start + batch_size] for start in range(0, num, batch_size))
    for index, batch in enumerate(batches):
        if steps is not None and index >= steps:
            break
        update(batch)


# ----------------------------------------------------------------- the exact sums
class Accumulator:
    """Adapt-time exact sums, never saved (a plain object: no Keras or TF tracking) and zeroed after a release.

    `specs` maps a name to (shape, dtype); each becomes a tf.Variable attribute. Those named in
    `kept` are diagnostics about the run (not private-release inputs: e.g. a sample count for
    tests) that :meth:`wipe` leaves in place. `seed` and `batch` drive the Poisson sampling of
    the batches (:meth:`poisson_sample`).
    """

    def __init__(self, kept: tuple = (), **specs: tuple):
        with tf.init_scope():
            self._names = tuple(specs)
            self._kept = tuple(kept)
            for name, (shape, dtype) in specs.items():
                setattr(self, name, tf.Variable(tf.zeros(shape, dtype), trainable=False))
            self.seed = tf.Variable(tf.constant(0, tf.int64), trainable=False)
            self.batch = tf.Variable(tf.constant(0, tf.int64), trainable=False)
        self.update_function = None  # Keras 3's traced update_state (captures these variables)

    def reset(self, seed: int) -> None:
        for name in self._names:
            variable = getattr(self, name)
            variable.assign(tf.zeros_like(variable))
        self.seed.assign(seed)
        self.batch.assign(0)

    def wipe(self) -> None:
        """Zeroes the exact sums (after a release, or an abandoned adapt)."""
        for name in self._names:
            if name not in self._kept:
                variable = getattr(self, name)
                variable.assign(tf.zeros_like(variable))

    def poisson_sample(self, x: tf.Tensor, sampling_rate: float) -> tf.Tensor:
        """Keeps each row of `x` independently with probability q (all rows when q = 1)."""
        if sampling_rate >= 1.0:
            return x
        u = tf.random.stateless_uniform(tf.shape(x)[:1], seed=tf.stack([self.seed, self.batch]), dtype=tf.float64)
        self.batch.assign_add(1)
        return tf.boolean_mask(x, u < sampling_rate)


def release_event(sampling_rate: float, noise_multiplier: float, label: str):
    """The event of one release: GaussianEvent(σ) on all the data, else Poisson-sampled at rate q."""
    if sampling_rate == 1.0:
        return GaussianEvent(noise_multiplier, count=1, label=label)
    return PoissonSampledGaussianEvent(sampling_rate, noise_multiplier, count=1, label=label)


# ----------------------------------------------------------------- the layers' common part
class DPReleaseMixin:
    """One accounted DP release per ``adapt``; put before the Keras layer class.

    A mechanism subclass sets ``_LABEL`` (the event label), defines ``_new_accumulator(dim)``,
    ``update_state(batch)``, ``_release()`` (returns the released values, reading ``self._acc``
    and ``self._noise_rng``) and ``_store(released)`` (assigns them to its weights), and calls
    ``_init_release`` in ``__init__`` and ``_build_release(dim)`` at the end of its weights in
    ``build``. The glue class defines ``_stream(data, batch_size, steps)``.

    The weights ``adapt_count``, ``adapt_sampling_rate`` and ``adapt_noise_multiplier`` record
    the releases, so a saved and reloaded layer still declares them (and never releases again by
    loading: only ``adapt`` releases). Where the weights hold float32 (Keras on JAX without x64)
    q is recorded rounded up and σ rounded down (:func:`outward`): the events never understate ε.
    """

    _LABEL = ""

    def _init_release(self, noise_multiplier: float, sampling_rate: float, seed: Optional[int]) -> None:
        self.noise_multiplier = _validate.nonnegative(noise_multiplier=noise_multiplier)
        self.sampling_rate = _validate.in_range(0, 1, "(]", sampling_rate=sampling_rate)
        self.seed = None if seed is None else _validate.integer_at_least(0, seed=seed)
        self.input_dim: Optional[int] = None
        self._acc: Optional[Accumulator] = None
        self._noise_rng: Optional[np.random.Generator] = None
        self._is_adapted = False

    def _build_release(self, dim: int) -> None:
        self.input_dim = dim
        self.adapt_count = self.add_weight(
            name="adapt_count", shape=(), dtype="int64", initializer="zeros", trainable=False
        )
        self.adapt_sampling_rate = self.add_weight(
            name="adapt_sampling_rate", shape=(), dtype="float64", initializer="zeros", trainable=False
        )
        self.adapt_noise_multiplier = self.add_weight(
            name="adapt_noise_multiplier", shape=(), dtype="float64", initializer="zeros", trainable=False
        )
        with tf.init_scope():
            self._write_records(self.sampling_rate, self.noise_multiplier)
        self._acc = self._new_accumulator(dim)

    # ---- state -------------------------------------------------------------

    def reset_state(self) -> None:
        """Starts a new adapt: zero sums and fresh sampling/noise seeds."""
        if not self.built:
            return
        with tf.init_scope():
            if self.seed is None:
                seq = np.random.SeedSequence()
            else:  # the adapt index keeps later adapts (also after reloading) fresh
                seq = np.random.SeedSequence(self.seed, spawn_key=(int(self.adapt_count.numpy()),))
            sample_seq, noise_seq = seq.spawn(2)
            self._acc.reset(int(sample_seq.generate_state(1, np.uint32)[0]))
            self._noise_rng = np.random.default_rng(noise_seq)

    def finalize_state(self) -> None:
        """Marks the layer adapted iff its weights record at least one adapt."""
        if self.built:
            self._is_adapted = int(self.adapt_count.numpy()) > 0

    def load_own_variables(self, store) -> None:
        super().load_own_variables(store)
        self.finalize_state()

    @property
    def privacy_events(self) -> tuple:
        """One event per completed `adapt` (empty before the first one)."""
        if not self.built:
            return ()
        count = int(self.adapt_count.numpy())
        return (release_event(*self._recorded(), self._LABEL),) * count

    def _recorded(self) -> tuple[float, float]:
        """(q, σ) as the weights hold them."""
        return float(self.adapt_sampling_rate.numpy()), float(self.adapt_noise_multiplier.numpy())

    def _as_recorded(self, sampling_rate: float, noise_multiplier: float) -> tuple[float, float]:
        """(q, σ) as the weights would record them: q rounded up, σ down, to the dtype they hold.

        TensorFlow holds the float64 weights as float64 (the values themselves); Keras on JAX
        without x64 holds them as float32, where rounding to nearest could lower q or raise σ, and
        so ε (see :func:`outward`).
        """
        return (
            outward(sampling_rate, np.asarray(self.adapt_sampling_rate.numpy()).dtype, up=True),
            outward(noise_multiplier, np.asarray(self.adapt_noise_multiplier.numpy()).dtype, up=False),
        )

    def _write_records(self, sampling_rate: float, noise_multiplier: float) -> None:
        """Records (q, σ) rounded outward (:meth:`_as_recorded`); fails if the weights do not read it back."""
        target = self._as_recorded(sampling_rate, noise_multiplier)
        self.adapt_sampling_rate.assign(target[0])
        self.adapt_noise_multiplier.assign(target[1])
        if self._recorded() != target:  # never expected: the outward values are representable
            raise RuntimeError(f"{type(self).__name__} recorded {self._recorded()} for (q, σ) = {target}")

    def _record_mechanism(self) -> None:
        """Stores (q, σ) in the weights the events are read from (and saved with), rounded as they record it."""
        recorded = self._recorded()
        if int(self.adapt_count.numpy()) > 0 and recorded != self._as_recorded(
            self.sampling_rate, self.noise_multiplier
        ):
            raise refuse(
                "dp-layer-adapt",
                f"this {type(self).__name__} layer's earlier adapts used (sampling_rate, noise_multiplier) = "
                f"{recorded}, got {(self.sampling_rate, self.noise_multiplier)}: use a new layer",
            )
        self._write_records(self.sampling_rate, self.noise_multiplier)

    # ---- adapt -------------------------------------------------------------

    def _adapt(
        self, data: Any, batch_size: Optional[int], steps: Optional[int], ledger: Optional[PrivacyLedger]
    ) -> None:
        """The whole adapt: check, build, stream the sums, release once, zero the sums, record the event."""
        owner = type(self).__name__
        if ledger is not None and not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a PrivacyLedger or None, got {type(ledger).__name__}")
        data = as_adapt_data(data, owner)
        if batch_size is None and not isinstance(data, tf.data.Dataset):
            batch_size = DEFAULT_ADAPT_BATCH_SIZE
        shape = batch_shape(data, owner)
        if not self.built:
            self.build(shape)
        check_features(shape, self.input_dim, owner)  # before any batch is read
        self._record_mechanism()
        try:
            self._stream(data, batch_size, steps)
            released = self._release()
        finally:
            if self.built:  # the exact sums are not kept once released (or abandoned)
                self._acc.wipe()
                self.finalize_state()
        self._store(released)
        self.adapt_count.assign_add(1)
        self.finalize_state()
        if ledger is not None:
            ledger.record(self.privacy_events[-1])

    def _check_adapted(self, x: tf.Tensor) -> tf.Tensor:
        """`x`, or an error if the layer was never adapted (in a graph: checked when it runs)."""
        if self._is_adapted:
            return x
        message = f"{type(self).__name__} must be adapted before it is called: call layer.adapt(data) first"
        if tf.executing_eagerly():
            raise ValueError(message)
        check = tf.debugging.assert_positive(self.adapt_count, message=message)
        with tf.control_dependencies([check]):
            return tf.identity(x)


def tf_keras_preprocessing_layer() -> type:
    """tf_keras's ``PreprocessingLayer`` (imported here, when a tf_keras layer class is defined)."""
    from keras_dpsgd._which_keras import import_tf_keras

    return import_tf_keras().layers.experimental.preprocessing.PreprocessingLayer


_DEFINE_LOCK = threading.Lock()


def tf_keras_layer(module_globals: dict, name: str, layers: dict[str, tuple[type, str]]) -> type:
    """A module's ``__getattr__`` (PEP 562) for its tf_keras DP release layers.

    `layers` maps a class name to its mechanism and docstring; class `name` is
    ``(TfKerasAdaptGlue, mechanism, tf_keras PreprocessingLayer)``, defined, registered with
    tf_keras's serialization and kept in the module at its first access (``keras_dpsgd.tf_keras``
    reaches it at import). So the module, whose mechanisms the Keras 3 front end uses, imports
    without tf_keras.
    """
    if name not in layers:
        raise AttributeError(f"module {module_globals['__name__']!r} has no attribute {name!r}")
    from keras_dpsgd._which_keras import import_tf_keras

    # Before the lock: tf_keras's first import registers keras_dpsgd.tf_keras, which reaches these
    # layers (this function again, in this thread); under the lock that waited on itself for ever.
    tf_keras = import_tf_keras()
    with _DEFINE_LOCK:
        if name not in module_globals:
            mechanism, doc = layers[name]
            bases = (TfKerasAdaptGlue, mechanism, tf_keras_preprocessing_layer())
            namespace = {"__doc__": doc, "__module__": module_globals["__name__"], "__qualname__": name}
            cls = types.new_class(name, bases, exec_body=lambda ns: ns.update(namespace))
            module_globals[name] = tf_keras.saving.register_keras_serializable(package="keras_dpsgd")(cls)
    return module_globals[name]


class TfKerasAdaptGlue:
    """tf_keras front end: the batches go through ``PreprocessingLayer.adapt``; put first."""

    _ops = TfOps  # the layers' call: TensorFlow ops

    def _stream(self, data: Any, batch_size: Optional[int], steps: Optional[int]) -> None:
        # The tf_keras layer's own adapt loop (reset_state, update_state per batch, finalize_state).
        super(DPReleaseMixin, self).adapt(data, batch_size=batch_size, steps=steps)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # The cached adapt tf.function captures the accumulators, which are
        # deliberately not saved: keep it out of SavedModel too.
        children = super()._trackable_children(save_type, **kwargs)
        children.pop("_adapt_function", None)
        return children
