"""The DP optimizer built before ``fit`` traces the train step: the step is traced once (both TensorFlow fronts).

Keras builds an optimizer's variables inside the first trace of the train function (tf_keras in
``apply_gradients``, Keras 3 in its first ``apply``), and the DP step attaches the ledger there: the DP
optimizer's ``clip_bounds``, a lot's accumulators, the slots, the model's copy of the ledger. A variable made
in a trace makes ``tf.function`` trace the whole step a second time (its variable-creation protocol), so a
DP ``fit`` paid twice the graph analysis and building of its first step. :func:`build_before_the_trace`
makes the same variables before the trace, in the same order, from the model's trainable variables: the
step then makes none and is traced once.

Left to Keras (the step traced twice, as before) where the variables the step will train are not known
before it runs: an unbuilt layer, a ``train_step`` of the model's own class (it may train other
variables), or a distribution strategy (Keras builds under the strategy itself).
"""

from __future__ import annotations

from typing import Any

from keras_dpsgd import ledger

__all__ = ["build_before_the_trace"]


def _built(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "built", False) or getattr(optimizer, "_built", False))


def build_before_the_trace(model: Any, *, strategy: Any, own_train_steps: tuple | None = None) -> None:
    """Builds `model`'s DP optimizer and the model's copy of the ledger now, before ``fit`` traces the step.

    Args:
      model: the model about to ``fit``.
      strategy: the model's distribution strategy, or None (under a strategy nothing is done here).
      own_train_steps: the ``train_step`` functions that train the model's trainable variables (the Keras
        class's own, the library's): a model whose step is another is left to Keras. None: no check (Keras 3,
        whose ``make_private`` gives the model its step).
    """
    optimizer = getattr(model, "optimizer", None)
    if not ledger.is_dp_optimizer(optimizer) or strategy is not None:
        return
    if own_train_steps is not None:
        if getattr(getattr(model, "train_step", None), "__func__", None) not in own_train_steps:
            return
    ledger.ledger_state_holders(model, optimizer)  # the model's copy of the ledger (a variable), made once
    if not _built(optimizer) and all(layer.built for layer in model._flatten_layers()):
        optimizer.build(model.trainable_variables)
