"""The sampling rate q and the data size N of a model's DP steps, as the ledger records them.

The accountant assumes Poisson sampling (:mod:`keras_dpsgd.step.lots`). The rate recorded is that of the
lots ``fit`` is fed (:mod:`keras_dpsgd.step.fed_data`); where the optimizer knows none, q = B · k / N of a
``fit`` on arrays is used (:func:`note_fit_sampling`) and a warning says, once, that ε then assumes Poisson
sampling. :func:`assume_poisson` is the user's unchecked statement that other data are Poisson lots.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import tensorflow as tf

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd import _validate
from keras_dpsgd._frames import fit_frame
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.ledger._attach import (
    attach,
)
from keras_dpsgd.ledger._holders import (
    _read_state,
    is_dp_optimizer,
    ledger_state_holders,
)
from keras_dpsgd.ledger._sync import (
    _FIT_SAMPLING_ATTR,
    _fit_sampling,
)

__all__ = [
    "accumulation_steps",
    "assume_poisson",
    "assumes_poisson",
    "fit_training_size",
    "note_fit_sampling",
    "resolve_num_examples",
    "resolve_sampling_rate",
]

_LOG = logging.getLogger("keras_dpsgd")
_WARNED: set = set()


def _warn_once(key: Any, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message, *args)


def _int_arg(value: Any, name: str) -> Optional[int]:
    return None if value is None else _validate.integer_at_least(1, **{name: value})


def fit_training_size(frame: Any) -> Optional[int]:
    """N of a running fit's training data given as arrays (after ``validation_split``), or None.

    `frame`: the frame of ``fit`` (:func:`fit_frame`); fit has already split x, so its local x is
    the training part. None for a dataset, a generator or a PyDataset (no known size).
    """
    x = frame.f_locals.get("x") if frame is not None else None
    if x is None or isinstance(x, tf.data.Dataset):
        return None
    leaves = tf.nest.flatten(x)
    if not all(hasattr(leaf, "shape") for leaf in leaves):  # arrays, tensors, data frames
        return None
    shape = tuple(leaves[0].shape)
    return int(shape[0]) if shape and shape[0] is not None else None


# Keras fit's batch size when `batch_size` is None and the data are arrays (both Kerases).
_KERAS_DEFAULT_BATCH_SIZE = 32


def accumulation_steps(optimizer: Any) -> int:
    """The optimizer's gradient_accumulation_steps k (physical batches per lot; 1 if it has none)."""
    return int(getattr(optimizer, "gradient_accumulation_steps", 1) or 1)


def _warn_poisson_assumed(q: float, how: str) -> None:
    _warn_once(
        ("poisson-assumed", q),
        "keras_dpsgd: the optimizer's sampling_rate is unknown (no PoissonLots.configure), so epsilon is "
        "computed with q = %s = %g, which ASSUMES POISSON SAMPLING. Shuffled fixed-size batches (plain "
        "fit(x, y, batch_size=B)) are a different mechanism for which this epsilon is not a proven bound; "
        "train on keras_dpsgd.PoissonLots for an honest one.",
        how,
        q,
    )


_ASSUMED_ATTR = "_dpsgd_assume_poisson"


def assume_poisson(optimizer: Any) -> Any:
    """States, unchecked, that the data `optimizer`'s fits are fed are Poisson lots at its ``sampling_rate``.

    An opt-in, for data keras_dpsgd did not sample (a sampler of your own; arrays fed in fixed-size
    batches, which are *not* Poisson lots): without it, a fit of an optimizer that holds a sampling
    rate on anything but :class:`keras_dpsgd.PoissonLots` is refused (:mod:`keras_dpsgd.step.fed_data`).
    With it, ε is computed at q as if the batches were Poisson lots, which is no proven bound for
    shuffled fixed-size batches (Chua et al. 2024); a warning says so. The statement is not saved: a
    loaded optimizer is refused again until it is made again.

    Returns:
      `optimizer`.
    """
    if not is_dp_optimizer(optimizer):
        raise TypeError(f"optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}")
    setattr(optimizer, _ASSUMED_ATTR, True)
    _LOG.warning(
        "keras_dpsgd: assume_poisson(%s): the data its fits are fed are taken, unchecked, for Poisson lots at its "
        "sampling_rate; epsilon then ASSUMES POISSON SAMPLING and is no proven bound for shuffled fixed-size "
        "batches. Train on keras_dpsgd.PoissonLots for an honest one.",
        type(optimizer).__name__,
    )
    return optimizer


def assumes_poisson(optimizer: Any) -> bool:
    """True after :func:`assume_poisson` (`optimizer`)."""
    return bool(getattr(optimizer, _ASSUMED_ATTR, False))


def note_fit_sampling(model: Any, optimizer: Any) -> None:
    """Records q = B · k / N of a running ``fit(x, y, batch_size=B)`` on arrays, where the optimizer
    does not know its sampling rate (no ``PoissonLots.configure``).

    Called by :func:`keras_dpsgd.step.fed_data.check_fed_data` (when the DP step is traced, at every
    fit's ``make_train_function``, at every epoch start of fit and by the privacy callbacks'
    ``on_train_begin``, before the fit's first step) for data other than Poisson lots. The ledger then records the fit's steps at
    that q (a new fit with another q starts a new segment; a fit whose data have no known size
    records its steps at the reader's q, as before), and ``model_epsilon(model)`` needs neither
    ``num_examples`` nor ``batch_size``. A warning says, once, that this ε assumes Poisson sampling.
    """
    if not is_dp_optimizer(optimizer) or getattr(optimizer, "sampling_rate", None) is not None:
        return
    frame = fit_frame(model)
    if frame is None:
        return
    n = fit_training_size(frame)
    batch = frame.f_locals.get("batch_size") or _KERAS_DEFAULT_BATCH_SIZE
    k = accumulation_steps(optimizer)
    sampling = None
    if n is not None and isinstance(batch, int) and batch >= 1:
        sampling = (n, batch, min(1.0, batch * k / n))
    previous = _fit_sampling(optimizer)
    if sampling == previous:
        return
    if previous is not None and model is not None:
        attach(model, optimizer)  # the earlier fit's steps, at its q
        if sampling is None:
            _close_segment(model, optimizer)  # the steps of this fit: at the reader's q
    setattr(optimizer, _FIT_SAMPLING_ATTR, sampling)
    if sampling is not None:
        _warn_poisson_assumed(
            sampling[2],
            f"batch_size * gradient_accumulation_steps / N = {batch} * {k} / {n} (fit's batch size and training set)",
        )
        if model is not None:
            attach(model, optimizer)


def _close_segment(model: Any, optimizer: Any) -> None:
    with tf.init_scope():
        for holder in ledger_state_holders(model, optimizer):
            holder.state.assign(S.dumps(S.close_segment(_read_state(holder))))


def resolve_num_examples(optimizer: Any, num_examples: Optional[int] = None) -> Optional[int]:
    """N: `num_examples`, else expected_lot_size / sampling_rate of a configured optimizer, else
    the training set of the optimizer's last ``fit`` on arrays."""
    n = _int_arg(num_examples, "num_examples")
    if n is not None:
        return n
    lot = getattr(optimizer, "expected_lot_size", None)
    q = getattr(optimizer, "sampling_rate", None)
    if lot is not None and q is not None:
        return int(round(float(lot) / float(q)))
    sampling = _fit_sampling(optimizer)
    return None if sampling is None else sampling[0]


def resolve_sampling_rate(
    optimizer: Any, *, num_examples: Optional[int] = None, batch_size: Optional[int] = None
) -> float:
    """q of the optimizer's steps: its `sampling_rate`, else (B · accumulation) / N with a warning.

    B and N: `batch_size` and `num_examples` where given, and fit's own where the optimizer's
    last ``fit`` was on arrays (:func:`note_fit_sampling`); with both, the larger q.

    Raises:
      ValueError: if q is unknown and num_examples or batch_size is missing.
    """
    q = getattr(optimizer, "sampling_rate", None)
    if q is not None:
        return float(q)
    n = _int_arg(num_examples, "num_examples")
    b = _int_arg(batch_size, "batch_size")
    fitted = _fit_sampling(optimizer)
    if n is None or b is None:
        if fitted is not None:
            return fitted[2]
        raise refuse(
            "unknown-sampling-rate",
            "the optimizer's sampling_rate is unknown and its fit's data have no known size: train on "
            "keras_dpsgd.PoissonLots and call lots.configure(optimizer), or pass num_examples and batch_size "
            f"(then Poisson sampling is assumed), got num_examples={num_examples!r}, batch_size={batch_size!r}",
        )
    k = accumulation_steps(optimizer)
    q = min(1.0, b * k / n)
    _warn_poisson_assumed(q, f"batch_size * gradient_accumulation_steps / N = {b} * {k} / {n}")
    return q if fitted is None else max(q, fitted[2])
