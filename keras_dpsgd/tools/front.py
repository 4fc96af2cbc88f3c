"""Which Keras a tool trains with: Keras 3 unless ``TF_USE_LEGACY_KERAS=1`` (the rule of ``tf.keras``),
or the Keras of a model the user built. The memorization test and the audit build, compile and
train models through this one seam, so the same statistics run on both front ends."""

from __future__ import annotations

import dataclasses
from typing import Any

from keras_dpsgd.data import models as _models
from keras_dpsgd._which_keras import active_front_end


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """The glue of one Keras (by name, over :mod:`keras_dpsgd.data.models`): its module, its DP-SGD class
    and how a model gets the private step."""

    name: str  # "keras3" or "tf_keras"

    @property
    def keras(self) -> Any:
        return _models.keras_module(self.name)

    @property
    def label(self) -> str:
        """Which Keras, as the CLIs' and examples' ``--json`` key "keras" writes it: "3.15.1", "tf_keras 2.21.0"."""
        return _models.keras_label(self.name)

    @property
    def dp_sgd(self) -> type:
        return _models.dp_sgd_class(self.name)

    def private(self, model: Any) -> Any:
        """The model with the private train step (Keras 3: ``make_private``; tf_keras: the optimizer's)."""
        return _models.private(model, self.name)

    def cross_entropy(self, per_example: bool) -> Any:
        """Sparse categorical cross-entropy on logits; unreduced for a DP run."""
        reduction = "none" if per_example else "sum_over_batch_size"
        if self.name == "tf_keras" and not per_example:
            reduction = "auto"
        return self.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def active() -> FrontEnd:
    """Keras 3 unless ``TF_USE_LEGACY_KERAS=1``."""
    return FrontEnd(active_front_end())


def of_model(model: Any) -> FrontEnd:
    """The front end of a built model (a Keras 3 ``keras.Model`` or a tf_keras one)."""
    import keras

    return FrontEnd("keras3" if isinstance(model, keras.Model) else "tf_keras")


def dp_optimizer_kwargs(front: FrontEnd, accumulation_steps: int) -> dict:
    """``gradient_accumulation_steps`` for a DP optimizer of `front` (both front ends accumulate a lot)."""
    del front  # both Kerases' DP optimizers take it
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
