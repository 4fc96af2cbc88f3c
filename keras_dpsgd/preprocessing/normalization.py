"""Feature normalization without leaking the data: DPNormalization, and a refusal.

A Keras ``Normalization`` layer adapted on the training data stores the exact
per-feature mean and variance of that data in the model; so do
``Discretization`` (bin boundaries), ``StringLookup``, ``IntegerLookup`` and
``TextVectorization`` (vocabularies, document frequencies). Whoever gets the
model gets those statistics, with no noise and outside the privacy ledger.

* :func:`refuse_adapted_preprocessing` (called at the first DP step of a model)
  refuses such a layer unless it is marked as fitted on public data
  (:func:`mark_public`) or its state was given at construction
  (``Normalization(mean=..., variance=...)``, ``StringLookup(vocabulary=...)``,
  ``Discretization(bin_boundaries=...)``: public by construction, and saved
  with the model). Layers that account for their own releases (a
  ``privacy_events`` property: :class:`DPNormalization`, ``DPPCA``) pass.
* :class:`DPNormalization` releases the per-feature mean and variance by the
  Gaussian mechanism on clipped sums and records the release, like ``DPPCA``.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_dpsgd.preprocessing import adapt as _adapt
from keras_dpsgd import _validate
from keras_dpsgd.accounting import PrivacyLedger
from keras_dpsgd.dp.refusals import refuse

if TYPE_CHECKING:
    import tf_keras as keras  # imported where used: the Keras 3 front end must not load tf_keras

__all__ = [
    "DPNormalization",  # noqa: F822 (defined at first access, by __getattr__)
    "fitted_state_message",
    "is_marked_public",
    "mark_public",
    "refuse_adapted_preprocessing",
]

NORMALIZATION_LABEL = "dp-normalization"
PUBLIC_ATTR = "_keras_dpsgd_fitted_on_public_data"
# The three released blocks (count, sum, sum of squares): each, divided by its
# sensitivity, moves by at most 1 in ℓ2 norm, so the whole vector by sqrt(3).
_NUM_BLOCKS = 3

_EPSILON = 1e-7  # min_std=None: the floor of the std in call (Keras's backend.epsilon(), the same in both Kerases)
# min_std="auto" (the default): the floor is this fraction of each feature's public range (upper - lower), or of
# 2C/√d in ℓ2-norm mode (the range a feature has when the norm bound C is shared evenly by the d features).
MIN_STD_FRACTION = 0.05

Bound = Union[float, Sequence[float]]


# ----------------------------------------------------------------- the refusal
def mark_public(layer: keras.layers.Layer) -> keras.layers.Layer:
    """Declares that `layer`'s adapted state was fitted on public data; returns the layer.

    A DP optimizer then trains a model holding the layer (see
    :func:`refuse_adapted_preprocessing`). The claim is yours to make: the
    statistics are published with the model and are not in the privacy ledger.

    The mark is an attribute of the layer object. It is not saved: Keras's
    built-in layers have no config entry that could carry it, so mark the
    layer again after loading a model (the refusal reminds you). To make the
    public origin part of the saved model, build the layer from the public
    statistics instead: ``Normalization(mean=..., variance=...)``,
    ``StringLookup(vocabulary=...)``, ``Discretization(bin_boundaries=...)``.
    """
    if not _is_keras_layer(layer):
        raise TypeError(f"mark_public needs a Keras layer (tf_keras or Keras 3), got {type(layer).__name__}")
    setattr(layer, PUBLIC_ATTR, True)
    inner = getattr(layer, "_lookup_layer", None)  # TextVectorization's vocabulary
    if _is_keras_layer(inner):
        setattr(inner, PUBLIC_ATTR, True)
    return layer


def _is_tf_keras_layer(obj) -> bool:
    """Whether `obj` is a tf_keras layer; tf_keras is not imported for it (no tf_keras layer exists before)."""
    tf_keras = sys.modules.get("tf_keras")
    return tf_keras is not None and isinstance(obj, tf_keras.layers.Layer)


def _is_keras_layer(obj) -> bool:
    """Whether `obj` is a Keras 3 or a tf_keras layer."""
    import keras

    return isinstance(obj, keras.layers.Layer) or _is_tf_keras_layer(obj)


def _eager(value) -> np.ndarray:
    with tf.init_scope():  # the check may run while Keras traces train_step
        return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def _normalization_state(layer) -> Optional[str]:
    if layer.input_mean is not None or not layer.built:
        return None  # built from given mean/variance (or nothing yet)
    fitted = (
        layer.is_adapted
        or int(_eager(layer.count)) != 0
        or np.any(_eager(layer.adapt_mean) != 0)
        or np.any(_eager(layer.adapt_variance) != 1)
    )
    return "a mean and variance" if fitted else None


def _lookup_state(layer) -> Optional[str]:
    if getattr(layer, "_has_input_vocabulary", False):
        return None  # vocabulary given at construction
    with tf.init_scope():
        fitted = layer.is_adapted or len(layer.get_vocabulary(include_special_tokens=False)) > 0
    return "a vocabulary" if fitted else None


def _discretization_state(layer) -> Optional[str]:
    if layer.input_bin_boundaries is not None:
        return None  # boundaries given at construction
    fitted = layer.is_adapted or len(layer.bin_boundaries) > 0
    return "bin boundaries" if fitted else None


def _data_fitted_state(layer) -> Optional[str]:
    """What state fitted on data `layer` holds ("a vocabulary", ...), or None."""
    from tf_keras.src.layers.preprocessing import discretization, index_lookup, normalization, text_vectorization

    if isinstance(layer, normalization.Normalization):
        return _normalization_state(layer)
    if isinstance(layer, index_lookup.IndexLookup):
        return _lookup_state(layer)
    if isinstance(layer, text_vectorization.TextVectorization):
        return _lookup_state(layer._lookup_layer)
    if isinstance(layer, discretization.Discretization):
        return _discretization_state(layer)
    if isinstance(layer, _adapt.tf_keras_preprocessing_layer()) and layer.is_adapted:
        return "adapted state"
    return None


def _declares_privacy_events(layer) -> bool:
    """Whether `layer` accounts for its releases (without reading the property: it may run in a trace)."""
    return hasattr(type(layer), "privacy_events") or "privacy_events" in vars(layer)


def refuse_adapted_preprocessing(model: Optional[keras.Model]) -> None:
    """Raises ValueError if `model` holds a preprocessing layer fitted on data outside the ledger.

    Checked: Normalization (mean, variance), StringLookup / IntegerLookup /
    TextVectorization (vocabulary), Discretization (bin boundaries) and any
    other adapted ``PreprocessingLayer``. A layer passes if its state was
    given at construction, if it is marked with :func:`mark_public`, or if it
    declares ``privacy_events`` (its releases are in the model's ledger).
    Without a model (a custom loop outside a Model method) nothing is checked.
    """
    if model is None:
        return
    refuse_fitted_layers([layer for layer in model.submodules if _is_tf_keras_layer(layer)], _data_fitted_state)


def refuse_fitted_layers(layers: Iterable[Any], fitted_state: Callable[[Any], Optional[str]]) -> None:
    """Raises ValueError for the first of `layers` that holds state fitted on data and is not marked
    public (both Kerases; `fitted_state(layer)` says what state, or None)."""
    for layer in layers:
        if is_marked_public(layer):
            continue
        state = fitted_state(layer)
        if state is not None:
            raise refuse("adapted-preprocessing", fitted_state_message(layer, state))


def fitted_state_message(layer, state: str) -> str:
    """The refusal of a layer holding `state` fitted on data (shared by the tf_keras and Keras 3 checks).

    It names the DPNormalization of the layer's own Keras.
    """
    front_end = "tf_keras" if _is_tf_keras_layer(layer) else "keras3"
    if state == "a vocabulary":
        public = "StringLookup(vocabulary=...)"
        private = (
            "build the vocabulary with keras_dpsgd.dp_vocabulary(texts, noise_multiplier=..., "
            "max_tokens_per_example=..., threshold_delta=...) and its apply_to(layer), whose release is "
            "noised, thresholded and accounted"
        )
    else:
        public = "Normalization(mean=..., variance=...)"
        private = f"use keras_dpsgd.{front_end}.DPNormalization, whose release is noised and accounted"
    return (
        f"layer {layer.name!r} ({type(layer).__name__}) holds {state} fitted on data (adapt, "
        "set_vocabulary or loaded weights): the model would publish these exact statistics, outside "
        "the privacy ledger. If they come from public data, call keras_dpsgd.mark_public(layer) (or "
        f"build the layer from them, e.g. {public}); for private data, {private}."
    )


def is_marked_public(layer) -> bool:
    """Whether :func:`mark_public` marked `layer`, or it accounts for its own releases."""
    return bool(getattr(layer, PUBLIC_ATTR, False)) or _declares_privacy_events(layer)


# ----------------------------------------------------------------- DPNormalization
def _check_bound(name: str, value) -> Union[float, list]:
    array = np.asarray(value, dtype=np.float64) if not isinstance(value, (str, bool)) else None
    if array is None or array.ndim > 1 or array.size == 0 or not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be a finite number or a 1-D sequence of them, got {value!r}")
    return float(array) if array.ndim == 0 else array.tolist()


def _plain(bound):
    """A bound as get_config saves it: a float, or a plain list (Keras wraps lists it tracks)."""
    return list(bound) if isinstance(bound, (list, tuple)) or hasattr(bound, "__len__") else bound


def _check_clipping(lower, upper, l2_norm_clip):
    if l2_norm_clip is not None:
        if lower is not None or upper is not None:
            raise ValueError("give either lower and upper, or l2_norm_clip, not both")
        return None, None, _validate.positive(l2_norm_clip=l2_norm_clip)
    if lower is None or upper is None:
        raise ValueError(
            "DPNormalization needs public clipping bounds: lower and upper (per feature or scalars), "
            f"or l2_norm_clip; got lower={lower!r}, upper={upper!r}"
        )
    lower, upper = _check_bound("lower", lower), _check_bound("upper", upper)
    if np.size(lower) > 1 and np.size(upper) > 1 and np.size(lower) != np.size(upper):
        raise ValueError(f"lower and upper must have the same length, got {np.size(lower)} and {np.size(upper)}")
    if not np.all(np.asarray(lower) < np.asarray(upper)):
        raise ValueError(f"lower must be < upper for every feature, got lower={lower}, upper={upper}")
    return lower, upper, None


def release_moments(
    count: float,
    total: np.ndarray,
    squares: np.ndarray,
    *,
    stddevs: dict,
    limit: np.ndarray,
    center: np.ndarray,
    rng: np.random.Generator,
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Steps 3 and 4 of :class:`DPNormalization`: the noisy (n, S, Q), then the post-processed moments.

    Args:
      count, total, squares: the exact n, S = Σ y and Q = Σ y² of the clipped, centred rows y.
      stddevs: noise std per block ({"count", "sum", "sum_of_squares"}: σ·√3·Δ).
      limit: (d,) bound on |y_j| (r, or C in norm mode): the clamp of the post-processing.
      center: (d,) c, added back to the mean.
      rng: the generator of the noise.

    Returns:
      ({"count": n̂, "sum": Ŝ, "sum_of_squares": Q̂}, mean, variance).
    """

    def noisy(value, std):
        return value + rng.normal(0.0, std, np.shape(value)) if std > 0 else value

    noisy_n = float(noisy(count, stddevs["count"]))
    noisy_s = noisy(total, stddevs["sum"])
    noisy_q = noisy(squares, stddevs["sum_of_squares"])
    n = max(noisy_n, 1.0)
    mean_y = np.clip(noisy_s / n, -limit, limit)
    variance = np.clip(noisy_q / n - mean_y**2, 0.0, limit**2)
    return {"count": noisy_n, "sum": noisy_s, "sum_of_squares": noisy_q}, mean_y + center, variance


class MomentsMechanism(_adapt.DPReleaseMixin):
    """DP mean and variance for any Keras front end (the docstring of :class:`DPNormalization` says what it does)."""

    _LABEL = NORMALIZATION_LABEL

    def __init__(
        self,
        noise_multiplier: float,
        *,
        lower: Optional[Bound] = None,
        upper: Optional[Bound] = None,
        l2_norm_clip: Optional[float] = None,
        sampling_rate: float = 1.0,
        seed: Optional[int] = None,
        min_std: Union[float, str, None] = "auto",
        **kwargs,
    ):
        lower, upper, l2_norm_clip = _check_clipping(lower, upper, l2_norm_clip)
        if min_std is not None and not (isinstance(min_std, str) and min_std == "auto"):
            min_std = _validate.positive(min_std=min_std)
        super().__init__(**kwargs)
        self.lower, self.upper, self.l2_norm_clip = lower, upper, l2_norm_clip
        self.min_std = min_std
        self._init_release(noise_multiplier, sampling_rate, seed)
        self.last_release: Optional[dict] = None

    # ---- the mechanism, in numpy (float64) -----------------------------------

    def _radius(self) -> np.ndarray:
        """r per feature (range mode) as a (d,) array."""
        lower, upper = (np.broadcast_to(np.asarray(b, np.float64), (self.input_dim,)) for b in (self.lower, self.upper))
        return (upper - lower) / 2.0

    def _center(self) -> np.ndarray:
        if self.l2_norm_clip is not None:
            return np.zeros(self.input_dim)
        lower, upper = (np.broadcast_to(np.asarray(b, np.float64), (self.input_dim,)) for b in (self.lower, self.upper))
        return (upper + lower) / 2.0

    @property
    def sensitivities(self) -> dict:
        """ℓ2 sensitivity of each released block: {"count": 1, "sum": Δ_S, "sum_of_squares": Δ_Q}."""
        if self.input_dim is None:
            raise ValueError("the sensitivities depend on d: build or adapt the layer first")
        if self.l2_norm_clip is not None:
            c = self.l2_norm_clip
            return {"count": 1.0, "sum": c, "sum_of_squares": c * c}
        r = self._radius()
        return {"count": 1.0, "sum": float(np.linalg.norm(r)), "sum_of_squares": float(np.linalg.norm(r * r))}

    @property
    def noise_stddevs(self) -> dict:
        """Noise standard deviation on each coordinate of each block: σ·√3·Δ."""
        scale = self.noise_multiplier * math.sqrt(_NUM_BLOCKS)
        return {block: scale * s for block, s in self.sensitivities.items()}

    def std_floor(self) -> np.ndarray:
        """(d,) the floor of the standard deviation `call` divides by (`min_std`, per feature)."""
        if self.input_dim is None:
            raise ValueError("the floor depends on d: build or adapt the layer first")
        if self.min_std is None:
            return np.full(self.input_dim, _EPSILON)
        if self.min_std != "auto":
            return np.full(self.input_dim, float(self.min_std))
        if self.l2_norm_clip is not None:
            return np.full(self.input_dim, MIN_STD_FRACTION * 2.0 * self.l2_norm_clip / math.sqrt(self.input_dim))
        return MIN_STD_FRACTION * 2.0 * self._radius()

    def _warn_floored(self, variance: np.ndarray) -> None:
        """Warns, naming them, about the features whose released std is below a floor the user did not choose."""
        if self.min_std is not None and self.min_std != "auto":
            return
        floor = self.std_floor()
        hit = np.flatnonzero(np.sqrt(variance.reshape(-1)) < floor)
        if hit.size == 0:
            return
        names = ", ".join(str(int(j)) for j in hit[:10]) + (f", ... ({hit.size} in all)" if hit.size > 10 else "")
        if self.min_std is None:
            effect = f"divided by {_EPSILON:g} (min_std=None): multiplied by up to {1 / _EPSILON:g}"
        else:
            of = "2C/√d" if self.l2_norm_clip is not None else "each feature's public range"
            effect = (
                f"divided by the default floor min_std='auto' ({MIN_STD_FRACTION:.0%} of {of}: "
                f"{float(floor[hit].min()):.4g} to {float(floor[hit].max()):.4g}) instead"
            )
        warnings.warn(
            f"DPNormalization {self.name!r}: {hit.size} of {floor.size} features have a released standard "
            f"deviation below the floor and are {effect}; features (flattened indices) [{names}]",
            UserWarning,
            stacklevel=5,
        )

    def _limit(self) -> np.ndarray:
        """The bound on |y_j| per feature: r, or C in norm mode."""
        return np.full(self.input_dim, self.l2_norm_clip) if self.l2_norm_clip is not None else self._radius()

    # ---- state -------------------------------------------------------------

    def build(self, input_shape):
        dim, feature_shape = _adapt.feature_dim(input_shape, "DPNormalization")
        for name in ("lower", "upper"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != dim:
                raise ValueError(f"{name} must have one bound per feature (d = {dim}), got {len(value)}")
        self.mean = self.add_weight(
            name="mean", shape=feature_shape, dtype="float32", initializer="zeros", trainable=False
        )
        self.variance = self.add_weight(
            name="variance", shape=feature_shape, dtype="float32", initializer="ones", trainable=False
        )
        self._build_release(dim)
        super().build(input_shape)
        self.reset_state()

    @staticmethod
    def _new_accumulator(dim: int) -> _adapt.Accumulator:
        return _adapt.Accumulator(
            count=((), tf.float64), total=((dim,), tf.float64), squares=((dim,), tf.float64), nonfinite=((), tf.int64)
        )

    # ---- adapt -------------------------------------------------------------

    def adapt(self, data, batch_size=None, steps=None, *, ledger: Optional[PrivacyLedger] = None):
        """Releases the private mean and variance of `data` (one Gaussian mechanism).

        Args:
          data: examples only (no labels): an array or tensor of shape
            (num_examples, d1, ...), or a finite `tf.data.Dataset` of batches.
            Every example must appear at most once.
          batch_size: rows per accumulation step for arrays (default 1024).
          steps: number of batches to read (Keras `adapt` semantics).
          ledger: optional `PrivacyLedger` that also receives the event (only
            if it is not also filled from `privacy_events`, or it counts twice).

        Raises:
          TypeError: if `ledger` is not a PrivacyLedger or data holds labels.
          ValueError: for data of the wrong shape, non-finite data, or a layer
            whose recorded adapts used another (q, σ).
        """
        self._adapt(data, batch_size, steps, ledger)

    def _release(self) -> tuple:
        """The noisy (n, S, Q) of the accumulated sums (kept in `last_release`), post-processed."""
        acc = self._acc
        if int(acc.nonfinite.numpy()) > 0:
            raise refuse("non-finite-data", "DPNormalization.adapt data must be finite, got NaN or infinite values")
        self.last_release, mean, variance = release_moments(
            float(acc.count.numpy()),
            acc.total.numpy(),
            acc.squares.numpy(),
            stddevs=self.noise_stddevs,
            limit=self._limit(),
            center=self._center(),
            rng=self._noise_rng,
        )
        return mean, variance

    def _store(self, released: tuple) -> None:
        mean, variance = released
        self._warn_floored(variance)
        self.mean.assign(mean.reshape(self.mean.shape).astype(np.float32))
        self.variance.assign(variance.reshape(self.variance.shape).astype(np.float32))

    def update_state(self, data):
        x = tf.cast(self._flatten(data), tf.float64)
        sums = self._acc
        x = sums.poisson_sample(x, self.sampling_rate)
        finite = tf.reduce_all(tf.math.is_finite(x), axis=1)
        sums.nonfinite.assign_add(tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int64)))
        y = self._clip(tf.where(finite[:, None], x, tf.zeros_like(x)))
        sums.count.assign_add(tf.cast(tf.shape(y)[0], tf.float64))
        sums.total.assign_add(tf.reduce_sum(y, axis=0))
        sums.squares.assign_add(tf.reduce_sum(tf.square(y), axis=0))

    def _clip(self, x: tf.Tensor) -> tf.Tensor:
        """Step 2: y = clip(x, lower, upper) − c, or x · min(1, C/‖x‖)."""
        if self.l2_norm_clip is not None:
            norms = tf.norm(x, axis=1, keepdims=True)
            scale = tf.math.divide_no_nan(tf.constant(self.l2_norm_clip, tf.float64), norms)
            return x * tf.minimum(tf.constant(1.0, tf.float64), scale)
        d = self.input_dim
        lower = tf.constant(np.broadcast_to(np.asarray(self.lower, np.float64), (d,)))
        upper = tf.constant(np.broadcast_to(np.asarray(self.upper, np.float64), (d,)))
        return tf.clip_by_value(x, lower, upper) - (lower + upper) / 2.0

    # ---- call --------------------------------------------------------------

    def _flatten(self, inputs) -> tf.Tensor:
        return _adapt.flatten(inputs, self.input_dim, self.compute_dtype, "DPNormalization")

    def call(self, inputs):
        ops = self._ops  # TensorFlow ops on tf_keras, keras.ops on Keras 3 (any backend)
        x = self._check_adapted(ops.cast(ops.convert_to_tensor(inputs), self.compute_dtype))
        mean = ops.cast(self.mean, x.dtype)
        floor = ops.cast(self.std_floor().reshape(tuple(self.mean.shape)), x.dtype)
        std = ops.maximum(ops.sqrt(ops.cast(self.variance, x.dtype)), floor)
        return (x - mean) / std

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "noise_multiplier": self.noise_multiplier,
                "lower": _plain(self.lower),
                "upper": _plain(self.upper),
                "l2_norm_clip": self.l2_norm_clip,
                "sampling_rate": self.sampling_rate,
                "min_std": self.min_std,
            }
        )  # not the seed: it determines the noise
        return config


DP_NORMALIZATION_DOC = """Normalizes features with a differentially private mean and variance.

    `adapt(data)` is one Gaussian mechanism:

    1. Poisson-sample the examples: each is used independently with
       probability q = `sampling_rate` (q = 1 uses all of them).
    2. Flatten each example to x ∈ R^d (every non-batch position is a feature)
       and clip it with public bounds, either per feature to
       [`lower`, `upper`], centred: y = clip(x, lower, upper) − c with
       c = (lower + upper)/2, so |y_j| <= r_j = (upper_j − lower_j)/2; or in ℓ2
       norm: y = x · min(1, C/‖x‖₂) with C = `l2_norm_clip` (c = 0).
    3. Release the count n = Σ 1, the sum S = Σ y and the sum of squares
       Q = Σ y² (elementwise), each plus Gaussian noise of standard deviation
       σ·√3·Δ, with the sensitivities (add/remove one example)
       Δ_n = 1, Δ_S = ‖r‖₂ (C) and Δ_Q = ‖r²‖₂ (C²).
    4. Post-process: mean = c + S/n̂ and variance = Q/n̂ − (S/n̂)² with
       n̂ = max(n, 1), clamped to the clipped range ([−r, r] for S/n̂,
       [0, r²] for the variance; C and C² in norm mode).

    Privacy: one example moves (n, S/Δ_S, Q/Δ_Q) by at most √3 in ℓ2 norm
    (each block by at most 1), and that vector gets noise σ·√3 per
    coordinate: the Gaussian mechanism with noise multiplier σ. Each `adapt`
    is one ``PoissonSampledGaussianEvent(q, σ, label="dp-normalization")``
    (``GaussianEvent(σ)`` when q = 1), listed by `privacy_events` (collected by
    ``keras_dpsgd.model_privacy_ledger``, so ``PrivacyLogger`` and
    ``WithinLimit`` count it) and stored as weights, so a saved and reloaded
    model still declares it. The bounds must not depend on the data (choose
    them from domain knowledge: pixel range, plausible ages...): clipping to
    data-dependent bounds leaks outside the mechanism. σ = 0 is allowed and
    means no privacy (ε = ∞). Every example must appear at most once in
    `data`; examples with a non-finite value make `adapt` fail. After an
    adapt, `last_release` holds the noisy (n, S, Q) it released (as private
    as the mean and variance; not saved).

    Args:
      noise_multiplier: σ >= 0.
      lower, upper: public per-feature clipping range (scalars, or 1-D
        sequences of length d); give both, or `l2_norm_clip`.
      l2_norm_clip: C > 0, clip each example's flattened features to ℓ2 norm C.
      sampling_rate: q in (0, 1], the Poisson sampling probability of adapt.
      seed: None (default: OS entropy at each adapt) or an integer for
        reproducible adapts (kept secret, never saved, as for ``DPPCA``).
      min_std: the public floor of the standard deviation `call` divides
        by (post-processing: no privacy cost). The noisy variance of a
        feature that barely varies (a border pixel), or whose variance the
        noise hides, can come out near 0. "auto" (default): 5% of each
        feature's range, upper − lower (in ℓ2-norm mode 5% of 2C/√d), so
        that no feature is scaled up by more than 20/range; `adapt` warns,
        naming them, about the features whose std falls below it. A number
        > 0: that floor for every feature (no warning). None: Keras's
        epsilon, 1e-7 (the default of 0.2.0, which can scale a feature up
        by 1e7; it warns too).
      **kwargs: Keras layer arguments (`name`, `dtype`, ...).

    Raises:
      ValueError/TypeError: for arguments out of range, inputs of the wrong
        size, non-finite data, or calling the layer before `adapt`.
    """


def __getattr__(name: str):
    return _adapt.tf_keras_layer(globals(), name, {"DPNormalization": (MomentsMechanism, DP_NORMALIZATION_DOC)})
