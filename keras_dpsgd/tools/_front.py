"""Which Keras a tool trains with: Keras 3 unless ``TF_USE_LEGACY_KERAS=1`` (the rule of ``tf.keras``),
or the Keras of a model the user built. The memorization test and the audit build, compile and
train models through this one seam, so the same statistics run on both front ends."""

from __future__ import annotations

import dataclasses
import os
from typing import Any


def legacy_keras_requested() -> bool:
    """True when ``TF_USE_LEGACY_KERAS`` asks for tf_keras (the values TensorFlow's ``tf.keras`` honours)."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """The glue of one Keras: its module, its DP-SGD class and how a model gets the private step."""

    name: str  # "keras3" or "tf_keras" (the "keras" key of the CLIs' --json)

    @property
    def keras(self) -> Any:
        if self.name == "keras3":
            import keras
        else:
            import tf_keras as keras
        return keras

    @property
    def dp_sgd(self) -> type:
        if self.name == "keras3":
            from keras_dpsgd.keras3 import DPSGDOptimizer
        else:
            from keras_dpsgd.optimizer import DPSGDOptimizer
        return DPSGDOptimizer

    def private(self, model: Any) -> Any:
        """The model with the private train step (Keras 3: ``make_private``; tf_keras: the optimizer's)."""
        if self.name == "keras3":
            from keras_dpsgd.keras3 import make_private

            return make_private(model)
        return model

    def cross_entropy(self, per_example: bool) -> Any:
        """Sparse categorical cross-entropy on logits; unreduced for a DP run."""
        reduction = "none" if per_example else "sum_over_batch_size"
        if self.name == "tf_keras" and not per_example:
            reduction = "auto"
        return self.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def active() -> FrontEnd:
    """Keras 3 unless ``TF_USE_LEGACY_KERAS=1``."""
    return FrontEnd("tf_keras" if legacy_keras_requested() else "keras3")


def of_model(model: Any) -> FrontEnd:
    """The front end of a built model (a Keras 3 ``keras.Model`` or a tf_keras one)."""
    import keras

    return FrontEnd("keras3" if isinstance(model, keras.Model) else "tf_keras")


def _keras3_accumulates() -> bool:
    """Whether this version's Keras 3 DP optimizers take ``gradient_accumulation_steps`` (DP lots)."""
    import inspect

    from keras_dpsgd.keras3._optimizer import DPKeras3Mixin

    return "gradient_accumulation_steps" in inspect.signature(DPKeras3Mixin._init_dp).parameters


def dp_optimizer_kwargs(front: FrontEnd, accumulation_steps: int) -> dict:
    """``gradient_accumulation_steps`` for a DP optimizer of `front`; refused (with the fix) where
    that Keras's DP optimizers cannot accumulate a lot over batches."""
    if front.name == "keras3" and not _keras3_accumulates():
        if accumulation_steps != 1:
            raise ValueError(
                "physical_batch_size (gradient accumulation) is not supported on Keras 3 yet, got "
                f"{accumulation_steps} physical batches per lot: leave it None, or use tf_keras "
                "(TF_USE_LEGACY_KERAS=1)"
            )
        return {}  # Keras 3's own optimizers take no gradient_accumulation_steps=1
    return {"gradient_accumulation_steps": accumulation_steps}

def set_random_seed(seed: int) -> None:
    """Seeds Python, NumPy, TensorFlow and both Kerases' initializers (tf_keras where installed)."""
    import keras

    keras.utils.set_random_seed(seed)
    try:
        import tf_keras
    except ImportError:  # a Keras 3-only install
        return
    tf_keras.utils.set_random_seed(seed)
