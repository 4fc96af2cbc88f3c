"""Layers that may mix the examples of a batch: the refusal shared by both front ends (read from the traced
TensorFlow graph of the step).

A BatchNormalization layer in training mode normalizes each example with the statistics of the
whole batch, so one example changes every other example's output and per-example clipping bounds
nothing. In inference mode it uses its moving statistics: an elementwise scale and shift of each
example, which mixes nothing. Keras 3 and tf_keras (TF 2.x) run a non-trainable BatchNormalization
in inference mode even when the model trains; a pretrained backbone is frozen that way.

A BatchNormalization layer is accepted only on proof from the traced step:

1. the step writes none of its non-trainable variables (the moving statistics): every op on
   their handles in the step's graph is a read (:func:`written_in_step`; anything else, a
   function call included, counts as a write);
2. no op upstream of the loss reduces over the batch axis: the per-example analysis
   (``keras_dpsgd.backends.tensorflow.graph.analyze``, run by both per-example backends) raises otherwise.

An eager step (no graph) proves nothing: its BatchNormalization layers are refused. A layer with a
true ``mixes_examples`` attribute declares that it mixes the examples and is always refused.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from keras_dpsgd.backends.tensorflow.state import internal_handles
from keras_dpsgd.dp.refusals import refuse

# Ops on a variable's handle that only read it.
_READS = frozenset({"ReadVariableOp", "VarIsInitializedOp", "VariableShape"})

FREEZE_HINT = (
    "Freeze it: `layer.trainable = False` (Keras 3 and tf_keras run a non-trainable BatchNormalization in "
    "inference mode, with its moving statistics; e.g. `backbone.trainable = False` for a pretrained "
    "backbone while the new layers train), or replace it with keras.layers.GroupNormalization or "
    "LayerNormalization."
)
_DECLARED = (
    "DP-SGD clips each example's gradient, which is meaningless when a layer mixes the examples of a "
    "batch. Layer {what} declares mixes_examples = True; replace it with a layer that treats each "
    "example alone (keras.layers.GroupNormalization or LayerNormalization instead of batch statistics)."
)
_TRAINING = (
    "Layer {what} runs in training mode in this DP step: it updates its moving statistics (op {op!r} on "
    "{var!r}) and normalizes each example with the statistics of the whole batch, so one example changes "
    "every other example's output and per-example clipping bounds nothing. " + FREEZE_HINT
)
_EAGER = (
    "Layer {what} is in a DP step that runs eagerly (run_eagerly=True or an eager custom loop): without "
    "the traced graph keras_dpsgd cannot prove that it runs in inference mode (no batch statistics, no "
    "update of its moving statistics). Train in a traced step (the default of fit) with the layer frozen "
    "(`layer.trainable = False`), or replace it with keras.layers.GroupNormalization or LayerNormalization."
)


def written_in_step(graph: Any, variables: Iterable[Any]) -> tuple[Any, Any] | None:
    """The first (op, variable) of ``variables`` whose handle an op of ``graph`` does more than read.

    Args:
      graph: the traced step's graph (the loss's).
      variables: variables (tf.Variable or Keras 3 variables).

    Returns:
      (op, variable), or None when every op on the variables' handles in ``graph`` reads them.
    """
    for var in variables:
        for handle in internal_handles(graph, var):
            for op in handle.consumers():
                if op.type not in _READS:
                    return op, var
    return None


def refuse_example_mixing(layers: Iterable[Any], loss: Any, is_batch_norm: Callable[[Any], bool]) -> None:
    """Raises ValueError for a layer of ``layers`` that mixes the examples of the batch in this step.

    Args:
      layers: every layer of the model (nested ones included).
      loss: the per-example loss of the step (its graph is read), or None (nothing traced).
      is_batch_norm: whether a layer is a BatchNormalization layer of the front end's Keras.

    Raises:
      ValueError: a layer declares ``mixes_examples``; or a BatchNormalization layer writes its
        moving statistics in the step (training mode), or sits in a step without a graph. The
        message names the layer and how to freeze it.
    """
    graph = None if loss is None or tf.executing_eagerly() else getattr(loss, "graph", None)
    for layer in layers:
        what = f"{layer.name!r} ({type(layer).__name__})"
        if getattr(layer, "mixes_examples", False):
            raise refuse("batch-statistics", _DECLARED.format(what=what))
        if not is_batch_norm(layer):
            continue
        if graph is None:
            raise refuse("batch-statistics", _EAGER.format(what=what))
        written = written_in_step(graph, layer.non_trainable_weights)
        if written is not None:
            op, var = written
            raise refuse("batch-statistics", _TRAINING.format(what=what, op=op.name, var=_name(var)))


def _name(var: Any) -> str:
    return getattr(var, "path", None) or var.name
