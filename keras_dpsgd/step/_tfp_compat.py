"""TF Privacy migration: arguments of TF Privacy's optimizers that keras_dpsgd accepts or refuses."""

from __future__ import annotations

from typing import Any

from keras_dpsgd.dp.refusals import refuse

__all__ = ["check_num_microbatches"]


def check_num_microbatches(num_microbatches: Any) -> None:
    """Accepts TF Privacy's default ``num_microbatches=None`` (per-example clipping); refuses any other.

    Raises:
      ValueError: for any value but None.
    """
    if num_microbatches is None:
        return
    raise refuse(
        "num-microbatches",
        f"num_microbatches must be None (per-example clipping, TF Privacy's default), got {num_microbatches!r}: "
        "keras_dpsgd does not offer microbatch clipping. It clips each example's gradient, which gives the "
        "tightest sensitivity for the same noise; clipping microbatch means instead bounds a whole microbatch "
        "by C, so each example's noise is larger by the microbatch size. Remove num_microbatches.",
    )
