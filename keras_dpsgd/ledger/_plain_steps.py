"""A plain (non-DP) optimizer's steps after DP training: written into the model's copy of the ledger.

A model compiled again loses sight of its optimizer; the steps a plain optimizer took after DP training touched
the weights without noise (ε = ∞), so before the compile they become a noiseless segment of the model's copy
(:func:`keras_dpsgd.dp.ledger_state.record_non_private`): they are never lost.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.ledger._holders import _STATE_ATTR, LedgerState, _read_state, is_dp_optimizer
from keras_dpsgd.ledger._sync import _refresh, ledger_trainer


# Per model's copy of the ledger: each plain optimizer's `iterations` already written into it.
_PLAIN_RECORDED: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def _plain_recorded(model: Any) -> Any:
    holder = getattr(model, _STATE_ATTR, None)
    if not isinstance(holder, LedgerState):
        return {}
    return _PLAIN_RECORDED.setdefault(holder, weakref.WeakKeyDictionary())


def unrecorded_plain_steps(model: Any, optimizer: Any) -> int:
    """The steps of `model`'s plain (non-DP) `optimizer` not yet in the model's copy of the ledger; 0 for a DP one.

    All of its ``iterations`` when the copy holds none of them, or when the counter went back (reset).
    """
    if is_dp_optimizer(optimizer) or not hasattr(optimizer, "iterations"):
        return 0
    iterations = int(optimizer.iterations.numpy())
    recorded = _plain_recorded(model).get(optimizer, 0)
    return iterations - recorded if iterations >= recorded else iterations


def record_plain_steps(model: Any) -> None:
    """Writes the steps of `model`'s plain optimizer that its copy of the ledger lacks into it: noiseless, ε = ∞.

    Called before the model is compiled again (``_attach._guard_compiles``), when the optimizer is about to go out of
    sight. The last DP optimizer's steps are brought in first, so that the plain ones follow them
    (:func:`keras_dpsgd.dp.ledger_state.record_non_private`).
    """
    optimizer = getattr(model, "optimizer", None)
    holder = getattr(model, _STATE_ATTR, None)
    count = unrecorded_plain_steps(model, optimizer) if isinstance(holder, LedgerState) else 0
    if not count:
        return
    with tf.init_scope():
        trainer = ledger_trainer(model)
        if trainer is not None:
            _refresh(model, trainer)
        holder.state.assign(S.dumps(S.record_non_private(_read_state(holder), count)))
    _plain_recorded(model)[optimizer] = int(optimizer.iterations.numpy())
