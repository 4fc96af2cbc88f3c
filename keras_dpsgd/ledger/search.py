"""A hyperparameter search in a model's ledger: the released trial charges the whole search (Papernot & Steinke 2022)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from keras_dpsgd.accounting import DEFAULT_ORDERS, RdpAccountant, TuningEvent
from keras_dpsgd.accounting.tuning import rdp_trial
from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.ledger._holders import (
    _read_state,
    is_dp_optimizer,
    ledger_state_holders,
)
from keras_dpsgd.ledger.queries import model_privacy_ledger

__all__ = ["check_trial", "record_search"]


def check_trial(model: Any, event: TuningEvent) -> None:
    """Refuses a model whose ledger spends more than one trial of the search `event` may, at some RDP order.

    A search's bound (Papernot & Steinke 2022) holds only if every trial is within one RDP bound (their
    Sec. 3.3): the model's whole ledger (its layers' events and its optimizer's steps) is composed at
    :data:`~keras_dpsgd.accounting.DEFAULT_ORDERS` and must not exceed the search's trial curve
    (:func:`keras_dpsgd.accounting.tuning.rdp_trial`) at any of them. A model whose layers release too
    (DP-PCA, ...) or that trained more than planned is refused.

    Raises:
      TypeError: `event` is not a TuningEvent.
      ValueError: naming the order where the model's RDP exceeds the trial's.
    """
    if not isinstance(event, TuningEvent):
        raise TypeError(f"event must be a TuningEvent, got {type(event).__name__}")
    ledger = model_privacy_ledger(model)
    used = RdpAccountant(DEFAULT_ORDERS).compose(ledger).rdp
    bound = rdp_trial(event, DEFAULT_ORDERS)
    if not np.all(used <= bound):
        with np.errstate(invalid="ignore"):  # ∞ − ∞ at orders where both are ∞
            worst = int(np.argmax(np.where(used <= bound, -np.inf, np.nan_to_num(used - bound, nan=np.inf))))
        raise refuse(
            "search-beyond-trial",
            f"the model's ledger ({len(ledger)} events) spends more than one trial of the search may: RDP "
            f"{used[worst]:.6g} > {bound[worst]:.6g} at order {DEFAULT_ORDERS[worst]:g}; a trial runs only its "
            "planned DP-SGD steps (no layer that releases, no training before or after)",
        )


def record_search(model: Any, event: TuningEvent) -> None:
    """Records that `model` is the released (best) trial of the hyperparameter search `event`.

    From now on the model's ledger charges the whole search (:class:`~keras_dpsgd.accounting.TuningEvent`,
    Papernot & Steinke 2022) instead of its optimizer's steps so far, which the search covers; steps taken
    later are charged as before. The record lives in the ledger's state, so it travels with the model
    wherever the ledger does (checkpoints, SavedModels, Keras 3 files); a tf_keras ``.keras``/h5 model,
    which keeps only the optimizer's counter, is refused (:func:`refuse_lost_history`).

    Fail closed: the model must be within one trial of the search (:func:`check_trial`).

    Raises:
      TypeError: `event` is not a TuningEvent.
      ValueError: the model has no DP optimizer, or its ledger exceeds the search's trial bound.
    """
    optimizer = getattr(model, "optimizer", None)
    if not is_dp_optimizer(optimizer):
        raise ValueError(f"the model's optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}")
    check_trial(model, event)
    with tf.init_scope():
        holders = ledger_state_holders(model, optimizer)
        state = S.record_search(S.merge(*[_read_state(h) for h in holders]), event.to_dict())
        for holder in holders:
            holder.state.assign(S.dumps(state))
