"""Reading a DP optimizer's counter into the ledger's state: its copies brought up to date, the offsets.

The I/O around :func:`keras_dpsgd.dp.ledger_state.advance`: of the two saved copies (the optimizer's and the
model's) the one that recorded more wins; the q of the steps is the optimizer's or its fit's.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from keras_dpsgd.accounting import composed_noise_multiplier
from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.ledger._bounds import _bound_variables, _read_bounds, _write_bounds
from keras_dpsgd.ledger._holders import (
    _STATE_ATTR,
    LedgerState,
    _read_state,
    is_dp_optimizer,
    is_live_dp_optimizer,
    ledger_state_holders,
    noised_steps,
    write_ledger_offset,
)


_FIT_SAMPLING_ATTR = "_dpsgd_fit_sampling"


def _fit_sampling(optimizer: Any) -> Optional[tuple]:
    return getattr(optimizer, _FIT_SAMPLING_ATTR, None)


def recorded_sampling_rate(optimizer: Any) -> Optional[float]:
    """q the ledger records for the optimizer's steps: its sampling_rate, else the running or last
    fit's B · k / N (:func:`note_fit_sampling`), else None (the reader's q applies)."""
    q = getattr(optimizer, "sampling_rate", None)
    if q is not None:
        return q
    sampling = _fit_sampling(optimizer)
    return None if sampling is None else sampling[2]


def step_noise_multipliers(optimizer: Any, noise_multiplier: Optional[float] = None) -> tuple:
    """The noise multipliers of the Gaussian releases of one of `optimizer`'s steps.

    The optimizer's ``release_noise_multipliers`` (one per clipping group,
    plus adaptive clipping's norm queries) where it has them and they compose
    to `noise_multiplier` (default: its ``effective_noise_multiplier``), else
    the one release ``(noise_multiplier,)``.
    """
    sigma = float(optimizer.effective_noise_multiplier) if noise_multiplier is None else float(noise_multiplier)
    releases = getattr(optimizer, "release_noise_multipliers", None)
    if releases and composed_noise_multiplier(releases) == sigma:
        return tuple(float(r) for r in releases)
    return (sigma,)


def sync_ledger_state(
    model: Any,
    sampling_rate: Optional[float],
    noise_multiplier: float,
    *,
    steps: Optional[int] = None,
    optimizer: Any = None,
) -> dict:
    """Reads the optimizer's step count, closes a segment if (q, σ) changed; returns the state.

    `sampling_rate`: the optimizer's q, or None where it does not know it
    (then the segment keeps the q it has: None, the reader's assumption, or
    a known value). `noise_multiplier`: σ_eff of those steps (their releases:
    :func:`step_noise_multipliers`). `steps`: a step count read earlier under
    these (q, σ) (default: read now). `optimizer`: default ``model.optimizer``.

    The I/O around :func:`keras_dpsgd.dp.ledger_state.advance`: of the two saved
    copies the one that recorded more steps wins (a lost copy never lowers
    ε); the optimizer's counter is new when its copy is empty (its state was
    not restored, e.g. from a SavedModel, or the model was compiled with a new
    optimizer); the optimizer's saved worst case (``.keras`` files keep it, not
    the segments) charges counted steps whose segments were lost.
    """
    optimizer = model.optimizer if optimizer is None else optimizer
    with tf.init_scope():
        holders = ledger_state_holders(model, optimizer)
        raw = [h.state.numpy() for h in holders]
        states = [_read_state(h) for h in holders]
        bound_variables = _bound_variables(optimizer)
        bounds = _read_bounds(bound_variables)
        sigma = float(noise_multiplier)
        data = S.advance(
            S.merge(*states),
            steps=noised_steps(optimizer) if steps is None else int(steps),
            sampling_rate=None if sampling_rate is None else float(sampling_rate),
            noise_multipliers=step_noise_multipliers(optimizer, sigma),
            counter_is_new=not raw[0],
            saved_worst_case=S.saved_worst_case(bounds, sampling_rate, sigma),
            label=S.USER_LEVEL_LABEL if getattr(optimizer, "privacy_unit", None) == "user" else S.DPSGD_LABEL,
        )
        if bounds is not None:
            _write_bounds(bound_variables, S.fold_bounds(data, bounds))
        write_ledger_offset(optimizer, S.earlier_steps(data))
        encoded = S.dumps(data)
        for holder, old in zip(holders, raw):
            if old.decode("utf-8") != encoded:
                holder.state.assign(encoded)
    return data


def _refresh(model: Any, optimizer: Any) -> None:
    """Brings the saved copies up to date with the optimizer's counter (q as it knows it)."""
    sync_ledger_state(
        model,
        recorded_sampling_rate(optimizer),
        float(optimizer.effective_noise_multiplier),
        optimizer=optimizer,
    )


def refresh_ledger_offset(model: Any, optimizer: Any) -> None:
    """Sets `optimizer`'s ledger offset from the ledger as it is now (no step counted): at each fit's start.

    A checkpoint restored between two fits of one compiled model (``load_weights``, ``tf.train.Checkpoint``)
    restores the counter and the ledger together, with no hook of ours: the offset is read again here.
    """
    holders = [getattr(o, _STATE_ATTR, None) for o in (optimizer, model)]
    holders = [h for h in holders if isinstance(h, LedgerState)]
    if holders and is_dp_optimizer(optimizer):
        with tf.init_scope():
            write_ledger_offset(optimizer, S.earlier_steps(S.merge(*[_read_state(h) for h in holders])))


def ledger_trainer(model: Any) -> Any:
    """The DP optimizer whose counter the model's ledger reads: ``model.optimizer`` if it is one, else the last
    DP optimizer attached to the model (its copy of the ledger keeps it alive: the model was compiled again with
    a plain optimizer), else None."""
    optimizer = getattr(model, "optimizer", None)
    if is_live_dp_optimizer(optimizer):
        return optimizer
    holder = getattr(model, _STATE_ATTR, None)
    trainer = getattr(holder, "_trainer", None)
    previous = trainer() if trainer is not None else None
    return previous if is_live_dp_optimizer(previous) else None
