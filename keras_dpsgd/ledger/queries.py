"""The public queries of a model's privacy ledger: the ledger, ε so far, the steps left within a budget."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from keras_dpsgd.accounting import (
    PrivacyLedger,
    check_delta,
    compute_epsilon,
    default_delta,
    max_steps_within_budget,
)
from keras_dpsgd.accounting.planning import DEFAULT_DELTA_RULE
from keras_dpsgd.ledger._holders import (
    is_dp_optimizer,
)
from keras_dpsgd.ledger._sync import (
    ledger_trainer,
)
from keras_dpsgd.ledger.model_events import layer_events, optimizer_events
from keras_dpsgd.ledger.sampling import _int_arg, _warn_once, resolve_num_examples, resolve_sampling_rate

__all__ = ["model_epsilon", "model_privacy_ledger", "resolve_delta", "steps_remaining"]


def model_privacy_ledger(
    model: Any,
    *,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
    untrained: bool = False,
) -> PrivacyLedger:
    """Every recorded access to the data by `model`: its layers' events, then its optimizer's steps.

    Args:
      model: a Keras 3 or tf_keras model (compiled or not).
      extra_events: events of data accesses outside the model (e.g. a DP-PCA
        layer applied to the data before fit), placed first.
      num_examples: N, needed only when the optimizer's sampling_rate is unknown.
      batch_size: the physical batch size given to fit, idem (Poisson sampling is then assumed and
        a warning says so once).
      untrained: states that the weights of a model carrying no record of its training (no DP optimizer,
        no copy of a ledger, no plain optimizer's step) were never trained on the data: see
        :func:`~keras_dpsgd.ledger.optimizer_events`.

    Returns:
      A PrivacyLedger whose DP-SGD events carry the label "dp-sgd" (a plain optimizer's steps: "non-private
      training", ε = ∞).

    Raises:
      ValueError: if the optimizer's sampling_rate is unknown and num_examples or batch_size is missing; if the
        model carries no record of its training and `untrained` is False (e.g. loaded with ``compile=False``).
    """
    events = list(extra_events) + layer_events(model)
    events.extend(optimizer_events(model, num_examples=num_examples, batch_size=batch_size, untrained=untrained))
    return PrivacyLedger(events)


def resolve_delta(delta: Optional[float], num_examples: Optional[int]) -> float:
    """δ, or the default min(1/N^1.1, 1/(10·N)) (announced once); refuses δ >= 1/N when N is known.

    Raises:
      ValueError: if δ is None and N unknown, or δ >= 1/N.
    """
    if delta is None:
        if num_examples is None:
            raise ValueError(
                "target_delta is None and num_examples is unknown: give target_delta or num_examples "
                "(the default delta is min(1/N^1.1, 1/(10·N)))"
            )
        delta = default_delta(num_examples)
        _warn_once(
            ("delta", num_examples), "keras_dpsgd: delta = %s = %.3g (N = %d).", DEFAULT_DELTA_RULE, delta, num_examples
        )
        return delta
    if num_examples is not None:
        return check_delta(delta, num_examples)
    return float(delta)


def model_epsilon(
    model: Any,
    *,
    target_delta: Optional[float] = None,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
    accountant: str = "rdp",
    untrained: bool = False,
) -> tuple[float, float]:
    """(ε, δ) spent so far by `model` (all its ledger events composed).

    Arguments as for :func:`model_privacy_ledger` and :func:`resolve_delta`. N defaults to that of the DP
    optimizer the ledger reads (the model's, or the last one that trained it: :func:`ledger_trainer`).
    """
    n = resolve_num_examples(ledger_trainer(model), num_examples)
    delta = resolve_delta(target_delta, n)
    ledger = model_privacy_ledger(
        model, num_examples=n, batch_size=batch_size, extra_events=extra_events, untrained=untrained
    )
    if not ledger.events:
        return 0.0, delta
    return compute_epsilon(ledger, delta, accountant=accountant), delta


def steps_remaining(
    model_or_ledger: Any,
    *,
    target_epsilon: float,
    target_delta: Optional[float] = None,
    sampling_rate: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
    accountant: str = "rdp",
) -> int:
    """How many more DP-SGD steps keep ε <= target_epsilon (Abadi et al. 2016, "while within_limit").

    Args:
      model_or_ledger: a model (its ledger, q and σ_eff come from it and its optimizer) or a
        PrivacyLedger (then `sampling_rate` and `noise_multiplier` are required).
      target_epsilon: the budget ε.
      target_delta: δ; default min(1/N^1.1, 1/(10·N)) (N from num_examples or the configured optimizer).
      sampling_rate: q of the future steps (overrides the optimizer's).
      noise_multiplier: σ of the future steps (overrides the optimizer's).
      num_examples: as for :func:`model_privacy_ledger`.
      batch_size: as for :func:`model_privacy_ledger`.
      extra_events: as for :func:`model_privacy_ledger` (added to a given PrivacyLedger too).
      accountant: "rdp", "moments" or "pld".

    Returns:
      The largest k >= 0 with ε(ledger + k steps) <= target_epsilon.
    """
    if isinstance(model_or_ledger, PrivacyLedger):
        if sampling_rate is None or noise_multiplier is None:
            raise ValueError(
                "sampling_rate and noise_multiplier are required with a PrivacyLedger, got "
                f"sampling_rate={sampling_rate!r}, noise_multiplier={noise_multiplier!r}"
            )
        ledger = PrivacyLedger(list(extra_events) + list(model_or_ledger.events))
        n = _int_arg(num_examples, "num_examples")
    else:
        optimizer = getattr(model_or_ledger, "optimizer", None)
        if not is_dp_optimizer(optimizer):
            raise ValueError(
                f"the model's optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}"
            )
        n = resolve_num_examples(optimizer, num_examples)
        ledger = model_privacy_ledger(model_or_ledger, num_examples=n, batch_size=batch_size, extra_events=extra_events)
        if sampling_rate is None:
            sampling_rate = resolve_sampling_rate(optimizer, num_examples=n, batch_size=batch_size)
        if noise_multiplier is None:
            noise_multiplier = float(optimizer.effective_noise_multiplier)
    delta = resolve_delta(target_delta, n)
    return max_steps_within_budget(
        target_epsilon=target_epsilon,
        target_delta=delta,
        sampling_rate=sampling_rate,
        noise_multiplier=noise_multiplier,
        prior_events=ledger.events,
        accountant=accountant,
    )
