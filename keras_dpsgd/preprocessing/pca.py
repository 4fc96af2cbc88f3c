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

from typing import Any, Optional

import numpy as np
import scipy.linalg
import tensorflow as tf

from keras_dpsgd.preprocessing import adapt as _adapt
from keras_dpsgd.preprocessing.seam import TfOps
from keras_dpsgd import _validate
from keras_dpsgd.accounting import PrivacyLedger
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "DPPCA",  # noqa: F822 (defined at first access, by __getattr__)
    "symmetric_gaussian_noise",
    "top_k_eigenvectors",
]

PCA_LABEL = "dp-pca"


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


def analyze_gauss(gram: np.ndarray, k: int, noise_multiplier: float, rng: np.random.Generator) -> np.ndarray:
    """Analyze Gauss: top-k eigenvectors of AᵀA + E (the only data-dependent output).

    Args:
      gram: the exact AᵀA (d, d) of the sampled unit rows.
      k: the number of principal directions.
      noise_multiplier: σ, the std of each upper-triangle entry of E.
      rng: the generator E is drawn from.

    Returns:
      The (d, k) float64 projection.

    Raises:
      ValueError: if `gram` holds NaN or infinite values (non-finite data).
    """
    if not np.all(np.isfinite(gram)):
        raise refuse("non-finite-data", "DPPCA.adapt data must be finite, got NaN or infinite values")
    gram = 0.5 * (gram + gram.T)  # float32 matmul rounding is not exactly symmetric
    noisy = gram + symmetric_gaussian_noise(gram.shape[0], noise_multiplier, rng)
    return top_k_eigenvectors(noisy, k)


def _normalize_rows(x: Any, ops: Any = TfOps) -> Any:
    """Scales every row to unit ℓ2 norm; zero rows stay zero (overflow-safe) (`ops`: TfOps or keras.ops)."""
    scale = ops.max(ops.abs(x), axis=1, keepdims=True)
    x = ops.divide_no_nan(x, scale)
    return ops.divide_no_nan(x, ops.norm(x, axis=1, keepdims=True))


class PCAMechanism(_adapt.DPReleaseMixin):
    """DP-PCA for any Keras front end (the docstring of :class:`DPPCA` says what it does)."""

    _LABEL = PCA_LABEL

    def __init__(
        self,
        n_components: int,
        noise_multiplier: float,
        sampling_rate: float = 1.0,
        normalize_inputs: bool = False,
        seed: Optional[int] = None,
        **kwargs,
    ):
        n_components = _validate.integer_at_least(1, n_components=n_components)
        super().__init__(**kwargs)
        self.n_components = n_components
        self.normalize_inputs = bool(normalize_inputs)
        self._init_release(noise_multiplier, sampling_rate, seed)

    # ---- state -------------------------------------------------------------

    def build(self, input_shape):
        dim, _ = _adapt.feature_dim(input_shape, "DPPCA")
        if self.n_components > dim:
            raise ValueError(
                f"n_components must be in [1, d] = [1, {dim}] for inputs of shape {tf.TensorShape(input_shape)}, "
                f"got {self.n_components}"
            )
        self.projection = self.add_weight(
            name="projection", shape=(dim, self.n_components), dtype="float32", initializer="zeros", trainable=False
        )
        self._build_release(dim)
        super().build(input_shape)
        self.reset_state()

    @staticmethod
    def _new_accumulator(dim: int) -> _adapt.Accumulator:
        # gram: the exact, un-noised AᵀA of the sampled rows; num_sampled their number (not
        # private: diagnostics and tests only, kept after the release).
        return _adapt.Accumulator(kept=("num_sampled",), gram=((dim, dim), tf.float64), num_sampled=((), tf.int64))

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
        self._adapt(data, batch_size, steps, ledger)

    def update_state(self, data):
        x = _normalize_rows(self._flatten(data))
        acc = self._acc
        x = acc.poisson_sample(x, self.sampling_rate)
        acc.num_sampled.assign_add(tf.cast(tf.shape(x)[0], tf.int64))
        acc.gram.assign_add(tf.cast(tf.matmul(x, x, transpose_a=True), tf.float64))

    def _release(self) -> np.ndarray:
        return analyze_gauss(self._acc.gram.numpy(), self.n_components, self.noise_multiplier, self._noise_rng)

    def _store(self, projection: np.ndarray) -> None:
        self.projection.assign(projection.astype(np.float32))

    # ---- call --------------------------------------------------------------

    def _flatten(self, inputs, ops: Any = TfOps) -> Any:
        return _adapt.flatten(inputs, self.input_dim, self.compute_dtype, "DPPCA", ops)

    def call(self, inputs):
        ops = self._ops  # TensorFlow ops on tf_keras, keras.ops on Keras 3 (any backend)
        x = ops.cast(self._flatten(inputs, ops), self.compute_dtype)
        if self.normalize_inputs:
            x = _normalize_rows(x, ops)
        x = self._check_adapted(x)
        return ops.matmul(x, ops.cast(self.projection, x.dtype))

    def compute_output_shape(self, input_shape):
        return tf.TensorShape([tf.TensorShape(input_shape)[0], self.n_components])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "n_components": self.n_components,
                "noise_multiplier": self.noise_multiplier,
                "sampling_rate": self.sampling_rate,
                "normalize_inputs": self.normalize_inputs,
            }
        )  # not the seed: it determines the noise (see the class docstring)
        return config


DPPCA_DOC = """Projects inputs onto k differentially private principal directions.

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
        on overlapping data that are meant to compose independently (two
        layers of one model adapted with one seed are refused), and keep
        it secret (whoever knows it knows the noise). For that reason the seed
        is not part of `get_config` and is never saved with a model: a
        reloaded layer adapts with OS entropy.
      **kwargs: Keras layer arguments (`name`, `dtype`, ...).

    Raises:
      ValueError/TypeError: for arguments out of range, inputs whose flattened
        size is not d, or calling the layer before `adapt`.
    """


def __getattr__(name: str):
    return _adapt.tf_keras_layer(globals(), name, {"DPPCA": (PCAMechanism, DPPCA_DOC)})
