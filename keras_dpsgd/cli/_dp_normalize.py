"""``keras-dpsgd train --dp-normalize SIGMA``: standardize the features by a DP estimate, charged to the ledger.

Scaling features with the data's own mean and variance is a release about the data. With
``--dp-normalize SIGMA`` the mean and variance come from :class:`DPNormalization` (the Gaussian
mechanism on clipped sums, noise multiplier SIGMA, on every training example), clipped to the public
range ``--dp-normalize-bounds LO,HI`` (default 0,1: the range of the bundled and IDX images and of
``--feature-range`` data as loaded). The layer is the model's first layer, so its release is an event
of the model's ledger: the calibration of σ, ``WithinLimit``, the printed ε and the saved report all
count it.

Without ``--dp-normalize``, features that have no public range (a CSV or a float npz given without
``--feature-range``) are scaled privately by default, so that small real tables train with the
defaults: each value is first mapped by ``asinh`` (a fixed per-example map, no privacy cost, that turns
magnitudes spanning decades into a few units, like a signed log), then centred by a
:class:`DPNormalization` in ℓ2-norm mode (each example's mapped features clipped to norm
``AUTO_CLIP_PER_FEATURE·√F``, F the public number of features; noise multiplier ``AUTO_NOISE_MULTIPLIER``)
whose release is an event of the model's ledger, in ε like the explicit flag's. The standard deviation
it divides by is floored at ``AUTO_MIN_STD`` (post-processing): at the sizes of such tables the noisy
variance is too rough to enlarge features, so it only shrinks them. Tuned on scikit-learn's breast
cancer (N = 455) and wine (N = 142) tables at the default ε = 3: about 0.93 and 0.91 test accuracy.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from keras_dpsgd.dp.refusals import refuse


__all__ = ["register", "check", "adapted_layer", "describe", "prepend", "public_transform", "summary"]

DEFAULT_BOUNDS = "0,1"
MIN_STD_FRACTION = 0.05
AUTO_NOISE_MULTIPLIER = 3.0
AUTO_CLIP_PER_FEATURE = 4.0
AUTO_MIN_STD = 1.0


def register(p) -> None:
    """Adds the flags to the ``train`` parser."""
    p.add_argument(
        "--dp-normalize",
        type=float,
        default=None,
        metavar="SIGMA",
        help="standardize the features with a DP mean and variance (DPNormalization, noise multiplier "
        "SIGMA > 0 on all training examples); the release is charged to the ledger and shown in ε",
    )
    p.add_argument(
        "--dp-normalize-bounds",
        default=None,
        metavar="LO,HI",
        help=f"public clipping range of every feature for --dp-normalize (default {DEFAULT_BOUNDS}: "
        "features as loaded); never computed from the data",
    )


def _bounds(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"dp_normalize_bounds must be LO,HI with finite LO < HI, got {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"dp_normalize_bounds must be LO,HI with finite LO < HI, got {text!r}")
    return lo, hi


def check(args) -> None:
    """Validates the flags (ValueError naming the flag: exit 2 before anything is trained or written)."""
    sigma = args.dp_normalize
    if sigma is None:
        if args.dp_normalize_bounds is not None:
            raise refuse("dp-normalize-sigma", "--dp-normalize-bounds applies to --dp-normalize SIGMA only")
        return
    if not (math.isfinite(sigma) and sigma > 0):
        # σ = 0 would publish the exact statistics (ε = ∞): refused here, where nobody means it.
        raise refuse("dp-normalize-sigma", f"dp_normalize must be a finite noise multiplier > 0, got {sigma}")
    _bounds(args.dp_normalize_bounds or DEFAULT_BOUNDS)


def public_transform(x: Any) -> Any:
    """``asinh(x)`` elementwise (float32): the fixed per-example map before the default private scaling."""
    return np.arcsinh(np.asarray(x, np.float64)).astype(np.float32)


def adapted_layer(args, x_train: Any, keras: Any, seed: Optional[int] = None, *, auto: bool = False) -> Optional[Any]:
    """The DPNormalization of `keras`'s front end, adapted on `x_train` (one release), or None.

    With ``--dp-normalize`` the flag's σ and range; else, if `auto` (features without a public range), the
    default private scaling of the module docstring (`x_train` already mapped by asinh: the model's PublicFeatureMap).
    """
    if args.dp_normalize is None and not auto:
        return None
    if keras.__name__.startswith("tf_keras"):
        from keras_dpsgd.preprocessing.normalization import DPNormalization
    else:
        from keras_dpsgd.keras3 import DPNormalization
    if args.dp_normalize is None:
        features = int(np.prod(np.shape(x_train)[1:]))
        clip = AUTO_CLIP_PER_FEATURE * math.sqrt(features)
        layer = DPNormalization(
            AUTO_NOISE_MULTIPLIER, l2_norm_clip=clip, seed=seed, min_std=AUTO_MIN_STD, name="dp_normalization"
        )
    else:
        lo, hi = _bounds(args.dp_normalize_bounds or DEFAULT_BOUNDS)
        # The std floor (5% of the range) keeps near-constant features (border pixels) from exploding.
        layer = DPNormalization(
            args.dp_normalize,
            lower=lo,
            upper=hi,
            seed=seed,
            min_std=MIN_STD_FRACTION * (hi - lo),
            name="dp_normalization",
        )
    layer.adapt(x_train)
    return layer


def describe(layer: Any) -> str:
    """One line for the user: how the features were standardized, and that ε counts it."""
    if layer.l2_norm_clip is not None:
        how = (
            f"mapped by asinh (fixed, no privacy cost), then centred by a DP mean (DPNormalization, "
            f"σ = {layer.noise_multiplier:g}, each example clipped to ℓ2 norm {layer.l2_norm_clip:.3g}; "
            f"std floored at {layer.min_std:g})"
        )
    else:
        how = (
            f"standardized by a DP estimate (DPNormalization, σ = {layer.noise_multiplier:g}, clipped to "
            f"[{layer.lower:g}, {layer.upper:g}])"
        )
    return f"features {how}: its release is in the ledger and in ε"


def prepend(
    keras: Any, layer: Optional[Any], model: Any, feature_map: Optional[Any] = None, input_shape: Any = None
) -> Any:
    """`model` behind `layer` (the layer's release then belongs to the model's ledger), itself behind `feature_map`.

    `feature_map` (a PublicFeatureMap, no release) takes rows of `input_shape`; `model` itself if both are None.
    """
    if layer is None and feature_map is None:
        return model
    inputs = keras.Input(shape=tuple(input_shape) if feature_map is not None else model.input_shape[1:])
    x = inputs if feature_map is None else feature_map(inputs)
    x = x if layer is None else layer(x)
    suffix = "_dp_normalized" if layer is not None else "_raw_input"
    return keras.Model(inputs, model(x), name=f"{model.name}{suffix}")


def summary(layer: Optional[Any]) -> Optional[dict]:
    """The JSON entry of the release (its settings and event), or None."""
    if layer is None:
        return None
    (event,) = layer.privacy_events
    if layer.l2_norm_clip is not None:  # the default private scaling (module docstring)
        clipping = {"public_transform": "asinh", "l2_norm_clip": layer.l2_norm_clip, "min_std": layer.min_std}
    else:
        clipping = {"lower": layer.lower, "upper": layer.upper}
    return {"noise_multiplier": layer.noise_multiplier, **clipping, "event": event.to_dict()}
