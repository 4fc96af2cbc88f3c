"""Differentially private PCA as a Keras preprocessing layer ("Analyze Gauss").

Abadi et al. 2016 (Sec. 4) project MNIST onto 60 private principal directions
before the network, following the "Analyze Gauss" mechanism of Dwork, Talwar,
Thakurta and Zhang 2014 (Algorithm 1): normalize every example to unit ℓ2 norm,
form the second-moment matrix AᵀA, add symmetric Gaussian noise and keep the
top-k eigenvectors of the noisy matrix. The projection is the only thing the
layer keeps; the exact AᵀA is accumulated in memory that is never saved and
is zeroed once the noisy release has been made.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import scipy.linalg
import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, PrivacyLedger

__all__ = ["DPPCA", "symmetric_gaussian_noise", "top_k_eigenvectors"]

_PreprocessingLayer = keras.layers.experimental.preprocessing.PreprocessingLayer

PCA_LABEL = "dp-pca"
DEFAULT_ADAPT_BATCH_SIZE = 1024


def symmetric_gaussian_noise(dim: int, noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """Symmetric matrix E with E_ij = E_ji ~ N(0, σ²) independent for i <= j.

    The upper triangle (diagonal included) is drawn and mirrored (Dwork et al.
    2014, Algorithm 1). Hence E‖E‖_F² = σ² d² and ‖E‖_2 ≈ 2σ√d (semicircle law).

    Args:
      dim: d, the matrix size.
      noise_multiplier: σ >= 0.
      rng: the generator the noise is drawn from.

    Returns:
      A (d, d) float64 array.
    """
    upper = np.triu(rng.normal(0.0, noise_multiplier, size=(dim, dim)))
    return upper + np.triu(upper, 1).T


def top_k_eigenvectors(matrix: np.ndarray, k: int) -> np.ndarray:
    """Eigenvectors of the k largest eigenvalues of a symmetric matrix.

    Columns are ordered by decreasing eigenvalue; each column's sign is fixed so
    that its entry of largest magnitude is positive (post-processing, so it costs
    no privacy and makes results comparable).

    Returns:
      A (d, k) float64 array with orthonormal columns.
    """
    d = matrix.shape[0]
    _, vectors = scipy.linalg.eigh(matrix, subset_by_index=[d - k, d - 1], driver="evr")
    vectors = vectors[:, ::-1]
    pivot = np.argmax(np.abs(vectors), axis=0)
    signs = np.sign(vectors[pivot, np.arange(k)])
    signs[signs == 0] = 1.0
    return vectors * signs


def _release(gram: np.ndarray, k: int, noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """Analyze Gauss: top-k eigenvectors of AᵀA + E (the only data-dependent output)."""
    if not np.all(np.isfinite(gram)):
        raise ValueError("DPPCA.adapt data must be finite, got NaN or infinite values")
    gram = 0.5 * (gram + gram.T)  # float32 matmul rounding is not exactly symmetric
    noisy = gram + symmetric_gaussian_noise(gram.shape[0], noise_multiplier, rng)
    return top_k_eigenvectors(noisy, k)


def _normalize_rows(x: tf.Tensor) -> tf.Tensor:
    """Scales every row to unit ℓ2 norm; zero rows stay zero (overflow-safe)."""
    scale = tf.reduce_max(tf.abs(x), axis=1, keepdims=True)
    x = tf.math.divide_no_nan(x, scale)
    return tf.math.divide_no_nan(x, tf.norm(x, axis=1, keepdims=True))


def _as_adapt_data(data):
    """Checks adapt's `data` (features only) and converts lists to arrays."""
    if isinstance(data, tf.data.Dataset):
        if not isinstance(data.element_spec, tf.TensorSpec):
            raise TypeError(
                "DPPCA.adapt data must hold features only, got dataset elements "
                f"{data.element_spec}; e.g. pass dataset.map(lambda x, y: x)")
        return data
    if isinstance(data, (tuple, dict)):
        raise TypeError(f"DPPCA.adapt data must hold features only, got a {type(data).__name__}")
    if isinstance(data, list):
        data = np.asarray(data)
    if not hasattr(data, "shape"):
        raise TypeError(
            "DPPCA.adapt data must be an array, a tensor or a tf.data.Dataset, got "
            f"{type(data).__name__} (wrap generators with tf.data.Dataset.from_generator)")
    return data


def _batch_shape(data) -> tf.TensorShape:
    """(None, d1, ...) of a dataset of batches or of an array of examples."""
    if isinstance(data, tf.data.Dataset):
        shape = tf.TensorShape(data.element_spec.shape)
        if shape.rank is not None and shape.rank < 2:
            raise ValueError(
                f"DPPCA.adapt dataset elements must be batches (batch, d1, ...), got {shape}: "
                "use dataset.batch(...)")
        return shape
    shape = tf.TensorShape(data.shape)
    if shape.rank is not None and shape.rank < 2:
        raise ValueError(f"DPPCA.adapt data must have shape (num_examples, d1, ...), got {shape}")
    return tf.TensorShape([None]).concatenate(shape[1:])


class _Accumulator:
    """Adapt-time state that must never be saved (not tracked by Keras).

    `gram` holds the exact, un-noised AᵀA of the sampled rows; `num_sampled`
    their number (not private: diagnostics and tests only).
    """

    def __init__(self, dim: int):
        self.gram = tf.Variable(tf.zeros((dim, dim), tf.float64), trainable=False)
        self.num_sampled = tf.Variable(tf.constant(0, tf.int64), trainable=False)
        self.seed = tf.Variable(tf.constant(0, tf.int64), trainable=False)
        self.batch = tf.Variable(tf.constant(0, tf.int64), trainable=False)

    def reset(self, seed: int) -> None:
        self.gram.assign(tf.zeros(self.gram.shape, tf.float64))
        self.num_sampled.assign(0)
        self.seed.assign(seed)
        self.batch.assign(0)


def _check_args(n_components, noise_multiplier, sampling_rate, seed) -> None:
    if isinstance(n_components, bool) or not isinstance(n_components, (int, np.integer)):
        raise TypeError(f"n_components must be an integer >= 1, got {n_components!r}")
    if n_components < 1:
        raise ValueError(f"n_components must be an integer >= 1, got {n_components}")
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float, np.number)):
        raise TypeError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier}")
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float, np.number)):
        raise TypeError(f"sampling_rate must be a number in (0, 1], got {sampling_rate!r}")
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be None or an integer >= 0, got {seed!r}")
        if seed < 0:
            raise ValueError(f"seed must be None or an integer >= 0, got {seed}")


@keras.saving.register_keras_serializable(package="keras_dpsgd")
class DPPCA(_PreprocessingLayer):
    """Projects inputs onto k differentially private principal directions.

    `adapt(data)` runs Analyze Gauss (Dwork et al. 2014, Algorithm 1; used by
    Abadi et al. 2016, Sec. 4):

    1. Poisson-sample the examples: each is used independently with
       probability q = `sampling_rate` (q = 1 uses all of them).
    2. Flatten each example to a row a ∈ R^d and scale it to ‖a‖₂ = 1 (zero
       rows stay zero).
    3. Accumulate AᵀA = Σ a aᵀ over batches (streaming: the N×d matrix is
       never formed; arrays, tensors and `tf.data` datasets all work).
    4. Release AᵀA + E with E symmetric, E_ij = E_ji ~ N(0, σ²) for i <= j.
    5. Keep the eigenvectors of the k largest eigenvalues as the (d, k)
       projection (a non-trainable weight).

    Privacy: under add/remove-one-example adjacency AᵀA changes by a aᵀ with
    ‖a aᵀ‖_F = ‖a‖² <= 1, and its upper triangle (diagonal included), which
    determines the symmetric matrix, changes by at most that in Frobenius norm.
    So step 4 is the Gaussian mechanism with ℓ2 sensitivity 1 and noise
    multiplier σ, on a Poisson sample at rate q; the mirror, the
    eigendecomposition and `call` are post-processing. Each `adapt` is one
    `PoissonSampledGaussianEvent(q, σ, count=1, label="dp-pca")`
    (`GaussianEvent(σ)` when q = 1), listed by `privacy_events` (collected by
    `keras_dpsgd.ledger.model_privacy_ledger`) and stored as weights, so a
    saved and reloaded model still declares it. σ = 0 is allowed and means no
    privacy (ε = ∞). The guarantee assumes every example appears at most once
    in `data` (do not pass a repeated dataset).

    Args:
      n_components: k, the number of principal directions, 1 <= k <= d.
      noise_multiplier: σ >= 0, noise std on each entry of AᵀA (its
        sensitivity is 1).
      sampling_rate: q in (0, 1], the Poisson sampling probability of adapt.
      normalize_inputs: whether `call` scales each input row to unit norm
        before projecting, as adapt does. Default False: like Abadi et al.
        2016, the raw (flattened) inputs are projected, which keeps their
        magnitude. `call` touches no private statistic either way.
      seed: None (default) draws fresh OS entropy at each adapt. An integer
        makes adapt reproducible: the k-th adapt of any layer with this seed
        samples and draws the same noise, so never reuse a seed for releases
        on overlapping data that are meant to compose independently, and keep
        it secret (whoever knows it knows the noise). For that reason the seed
        is not part of `get_config` and is never saved with a model: a
        reloaded layer adapts with OS entropy.
      **kwargs: Keras layer arguments (`name`, `dtype`, ...).

    Raises:
      ValueError/TypeError: for arguments out of range, inputs whose flattened
        size is not d, or calling the layer before `adapt`.
    """

    def __init__(
        self,
        n_components: int,
        noise_multiplier: float,
        sampling_rate: float = 1.0,
        normalize_inputs: bool = False,
        seed: Optional[int] = None,
        **kwargs,
    ):
        _check_args(n_components, noise_multiplier, sampling_rate, seed)
        super().__init__(**kwargs)
        self.n_components = int(n_components)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling_rate = float(sampling_rate)
        self.normalize_inputs = bool(normalize_inputs)
        self.seed = None if seed is None else int(seed)
        self.input_dim: Optional[int] = None
        self._acc: Optional[_Accumulator] = None
        self._noise_rng: Optional[np.random.Generator] = None

    # ---- state -------------------------------------------------------------

    def build(self, input_shape):
        shape = tf.TensorShape(input_shape)
        if shape.rank is None or shape.rank < 2 or not shape[1:].is_fully_defined():
            raise ValueError(
                f"DPPCA inputs must have shape (batch, d1, ...) with known d1, ..., got {shape}"
            )
        dim = int(np.prod(shape[1:].as_list()))
        if self.n_components > dim:
            raise ValueError(
                f"n_components must be in [1, d] = [1, {dim}] for inputs of shape {shape}, "
                f"got {self.n_components}"
            )
        self.input_dim = dim
        self.projection = self.add_weight(
            name="projection", shape=(dim, self.n_components), dtype=tf.float32,
            initializer="zeros", trainable=False)
        self.adapt_count = self.add_weight(
            name="adapt_count", shape=(), dtype=tf.int64, initializer="zeros", trainable=False)
        self.adapt_sampling_rate = self.add_weight(
            name="adapt_sampling_rate", shape=(), dtype=tf.float64,
            initializer=keras.initializers.Constant(self.sampling_rate), trainable=False)
        self.adapt_noise_multiplier = self.add_weight(
            name="adapt_noise_multiplier", shape=(), dtype=tf.float64,
            initializer=keras.initializers.Constant(self.noise_multiplier), trainable=False)
        self._acc = _Accumulator(dim)
        super().build(input_shape)
        self.reset_state()

    def reset_state(self):
        """Starts a new adapt: zero accumulators and fresh sampling/noise seeds."""
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

    def finalize_state(self):
        """Marks the layer adapted iff its weights record at least one adapt."""
        if self.built:
            self._is_adapted = int(self.adapt_count.numpy()) > 0

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # The cached adapt tf.function captures the accumulators, which are
        # deliberately not saved: keep it out of SavedModel too.
        children = super()._trackable_children(save_type, **kwargs)
        children.pop("_adapt_function", None)
        return children

    def load_own_variables(self, store):
        super().load_own_variables(store)
        self.finalize_state()

    def _record_mechanism(self) -> None:
        """Stores (q, σ) in the weights the events are read from (and saved with)."""
        recorded = (float(self.adapt_sampling_rate.numpy()), float(self.adapt_noise_multiplier.numpy()))
        if int(self.adapt_count.numpy()) > 0 and recorded != (self.sampling_rate, self.noise_multiplier):
            raise ValueError(
                f"this DPPCA layer's earlier adapts used (sampling_rate, noise_multiplier) = {recorded}, "
                f"got {(self.sampling_rate, self.noise_multiplier)}: use a new layer")
        self.adapt_sampling_rate.assign(self.sampling_rate)
        self.adapt_noise_multiplier.assign(self.noise_multiplier)

    @property
    def privacy_events(self) -> tuple:
        """One event per completed `adapt` (empty before the first one)."""
        if not self.built:
            return ()
        count = int(self.adapt_count.numpy())
        q = float(self.adapt_sampling_rate.numpy())
        sigma = float(self.adapt_noise_multiplier.numpy())
        if q == 1.0:
            event = GaussianEvent(sigma, count=1, label=PCA_LABEL)
        else:
            event = PoissonSampledGaussianEvent(q, sigma, count=1, label=PCA_LABEL)
        return (event,) * count

    # ---- adapt -------------------------------------------------------------

    def adapt(self, data, batch_size=None, steps=None, *, ledger: Optional[PrivacyLedger] = None):
        """Fits the private projection to `data` (one DP-PCA release).

        Args:
          data: examples only (no labels): a numpy array or tensor of shape
            (num_examples, d1, ...), or a finite `tf.data.Dataset` of batches
            of shape (batch, d1, ...). Every example must appear at most once.
          batch_size: rows per accumulation step for array inputs. Defaults
            to 1024, not Keras' usual 32: a d×d update per 32 rows is slow.
            Do not set it for datasets (they are already batched).
          steps: number of batches to read (Keras `adapt` semantics).
          ledger: optional `PrivacyLedger` that also receives this adapt's
            event. `privacy_events` lists it regardless; pass a ledger only if
            it is not also filled from `privacy_events`, or it counts twice.

        Raises:
          TypeError: if `ledger` is not a PrivacyLedger or data holds labels.
          ValueError: for data of the wrong shape or non-finite data, or if the
            layer's recorded adapts used another (q, σ) (weights loaded from a
            different layer): their events could not be told apart.
        """
        if ledger is not None and not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a PrivacyLedger or None, got {type(ledger).__name__}")
        data = _as_adapt_data(data)
        if batch_size is None and not isinstance(data, tf.data.Dataset):
            batch_size = DEFAULT_ADAPT_BATCH_SIZE
        if not self.built:
            self.build(_batch_shape(data))
        self._record_mechanism()
        try:
            super().adapt(data, batch_size=batch_size, steps=steps)
            projection = _release(
                self._acc.gram.numpy(), self.n_components,
                self.noise_multiplier, self._noise_rng)
        finally:
            if self.built:  # the exact AᵀA is not kept once released (or abandoned)
                self._acc.gram.assign(tf.zeros(self._acc.gram.shape, tf.float64))
                self.finalize_state()
        self.projection.assign(projection.astype(np.float32))
        self.adapt_count.assign_add(1)
        self.finalize_state()
        if ledger is not None:
            ledger.record(self.privacy_events[-1])

    def update_state(self, data):
        x = _normalize_rows(self._flatten(data))
        acc = self._acc
        if self.sampling_rate < 1.0:
            seed = tf.stack([acc.seed, acc.batch])
            u = tf.random.stateless_uniform(tf.shape(x)[:1], seed=seed, dtype=tf.float64)
            x = tf.boolean_mask(x, u < self.sampling_rate)
            acc.batch.assign_add(1)
        acc.num_sampled.assign_add(tf.cast(tf.shape(x)[0], tf.int64))
        acc.gram.assign_add(tf.cast(tf.matmul(x, x, transpose_a=True), tf.float64))

    # ---- call --------------------------------------------------------------

    def _flatten(self, inputs) -> tf.Tensor:
        x = tf.convert_to_tensor(inputs)
        if not x.dtype.is_floating:
            x = tf.cast(x, self.compute_dtype)
        shape = x.shape
        if shape.rank is not None and shape.rank < 2:
            raise ValueError(f"DPPCA inputs must have shape (batch, d1, ...), got {shape}")
        if shape.rank is not None and shape[1:].is_fully_defined():
            dim = int(np.prod(shape[1:].as_list()))
            if dim != self.input_dim:
                raise ValueError(
                    f"DPPCA inputs must flatten to d = {self.input_dim} features, "
                    f"got shape {shape} ({dim} features)")
        return tf.reshape(x, (-1, self.input_dim))

    def call(self, inputs):
        x = tf.cast(self._flatten(inputs), self.compute_dtype)
        if self.normalize_inputs:
            x = _normalize_rows(x)
        if not self._is_adapted:
            message = "DPPCA must be adapted before it is called: call layer.adapt(data) first"
            if tf.executing_eagerly():
                raise ValueError(message)
            check = tf.debugging.assert_positive(self.adapt_count, message=message)
            with tf.control_dependencies([check]):
                x = tf.identity(x)
        return tf.matmul(x, tf.cast(self.projection, x.dtype))

    def compute_output_shape(self, input_shape):
        return tf.TensorShape([tf.TensorShape(input_shape)[0], self.n_components])

    def get_config(self):
        config = super().get_config()
        config.update({
            "n_components": self.n_components,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "normalize_inputs": self.normalize_inputs,
        })  # not the seed: it determines the noise (see the class docstring)
        return config
