"""The per-example step's mode, checked without TensorFlow (the CLI reads it before importing it).

"clip" (default): each example's gradient is scaled by ``min(1, C/||g_i||)``, C from ``l2_norm_clip``
(flat or per layer). "normalize": per-example normalization, ``g_i / (||g_i|| + γ)`` (automatic
clipping, Bu et al., NeurIPS 2023; De et al. 2022's rescaling to unit norm): every example has norm
< 1, so the sensitivity of the sum is 1, the noise is N(0, σ²) and the ledger charges the same (q, σ)
as clipping at C = 1. The step math is ``keras_dpsgd.dp.clip.clip_factors``.
"""

from __future__ import annotations

from typing import Any

from keras_dpsgd import _validate as V

__all__ = ["CLIPPING_CHOICES", "DEFAULT_STABILITY", "check_clipping"]

CLIPPING_CHOICES = ("clip", "normalize")
DEFAULT_STABILITY = 0.01


def check_clipping(clipping: Any, stability: Any, l2_norm_clip: Any) -> tuple[str, float]:
    """Validates the per-example step's mode and γ; returns (clipping, stability).

    "clip" (default): ``min(1, C/||g_i||)`` with the bound(s) of `l2_norm_clip`. "normalize": per-example
    normalization ``g_i / (||g_i|| + γ)`` (Bu et al. 2023; De et al. 2022), sensitivity 1: there is no C,
    so `l2_norm_clip` must be None; γ = `stability` > 0 applies to this mode only.
    """
    clipping = V.one_of(CLIPPING_CHOICES, clipping=clipping)
    stability = V.positive(stability=stability)
    if clipping == "normalize" and l2_norm_clip is not None:
        raise ValueError(
            "l2_norm_clip must be None with clipping='normalize': each example's gradient is rescaled to "
            f"g/(||g|| + stability), norm < 1, so the sensitivity is 1 and the learning rate absorbs the scale; "
            f"got l2_norm_clip={l2_norm_clip!r}"
        )
    if clipping == "clip" and stability != DEFAULT_STABILITY:
        raise ValueError(
            f"stability applies to clipping='normalize' only, got stability={stability!r} with clipping='clip'"
        )
    return clipping, stability
