"""``keras-dpsgd train --dp-normalize SIGMA``: standardize the features by a DP estimate, charged to the ledger.

Scaling features with the data's own mean and variance is a release about the data. With
``--dp-normalize SIGMA`` the mean and variance come from :class:`DPNormalization` (the Gaussian
mechanism on clipped sums, noise multiplier SIGMA, on every training example), clipped to the public
range ``--dp-normalize-bounds LO,HI`` (default 0,1: the range of the bundled and IDX images and of
``--feature-range`` data as loaded). The layer is the model's first layer, so its release is an event
of the model's ledger: the calibration of σ, ``WithinLimit``, the printed ε and the saved report all
count it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["register", "check", "adapted_layer", "prepend", "summary"]

DEFAULT_BOUNDS = "0,1"
MIN_STD_FRACTION = 0.05


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
            raise ValueError("--dp-normalize-bounds applies to --dp-normalize SIGMA only")
        return
    if not (math.isfinite(sigma) and sigma > 0):
        # σ = 0 would publish the exact statistics (ε = ∞): refused here, where nobody means it.
        raise ValueError(f"dp_normalize must be a finite noise multiplier > 0, got {sigma}")
    _bounds(args.dp_normalize_bounds or DEFAULT_BOUNDS)


def adapted_layer(args, x_train: Any, keras: Any, seed: Optional[int] = None) -> Optional[Any]:
    """The DPNormalization of `keras`'s front end, adapted on `x_train` (one release), or None without the flag."""
    if args.dp_normalize is None:
        return None
    if keras.__name__.startswith("tf_keras"):
        from keras_dpsgd.normalization import DPNormalization
    else:
        from keras_dpsgd.keras3 import DPNormalization
    lo, hi = _bounds(args.dp_normalize_bounds or DEFAULT_BOUNDS)
    # The std floor (5% of the range) keeps near-constant features (border pixels) from exploding.
    layer = DPNormalization(
        args.dp_normalize, lower=lo, upper=hi, seed=seed, min_std=MIN_STD_FRACTION * (hi - lo), name="dp_normalization"
    )
    layer.adapt(x_train)
    return layer


def prepend(keras: Any, layer: Optional[Any], model: Any) -> Any:
    """`model` behind `layer` (the layer's release then belongs to the model's ledger); `model` if None."""
    if layer is None:
        return model
    inputs = keras.Input(shape=model.input_shape[1:])
    return keras.Model(inputs, model(layer(inputs)), name=f"{model.name}_dp_normalized")


def summary(layer: Optional[Any]) -> Optional[dict]:
    """The JSON entry of the release (its settings and event), or None."""
    if layer is None:
        return None
    (event,) = layer.privacy_events
    return {
        "noise_multiplier": layer.noise_multiplier,
        "lower": layer.lower,
        "upper": layer.upper,
        "event": event.to_dict(),
    }
