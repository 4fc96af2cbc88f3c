"""The privacy events of a model: its optimizer's DP-SGD steps and its layers' releases.

Each noised step is a sub-sampled Gaussian mechanism (Abadi et al. 2016, Algorithm 1) with sampling ratio q
and noise multiplier σ: one :class:`PoissonSampledGaussianEvent` per segment of constant (q, σ_eff) of the
ledger state (:mod:`keras_dpsgd.dp.ledger_state`). A layer that releases statistics of the data (DP-PCA, DP
moments, ...) declares its events in a ``privacy_events`` property.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    event_from_dict,
)
from keras_dpsgd.ledger._bandmf import bandmf_events
from keras_dpsgd.ledger._attach import (
    attach,
)
from keras_dpsgd.ledger._holders import (
    is_live_dp_optimizer,
    model_ledger_state,
)
from keras_dpsgd.ledger._plain_steps import (
    unrecorded_plain_steps,
)
from keras_dpsgd.ledger._sync import (
    ledger_trainer,
    recorded_sampling_rate,
    sync_ledger_state,
)
from keras_dpsgd.ledger.sampling import resolve_sampling_rate

__all__ = [
    "DPSGD_LABEL",
    "NON_PRIVATE_LABEL",
    "layer_events",
    "optimizer_events",
    "refuse_shared_layer_seeds",
    "step_event",
]

DPSGD_LABEL = S.DPSGD_LABEL
NON_PRIVATE_LABEL = S.NON_PRIVATE_LABEL


def step_event(q: float, noise_multipliers: Sequence[float], count: int, label: str = DPSGD_LABEL):
    """`count` steps at q: one Gaussian release (flat clipping) or a composition of several; a plain optimizer's
    (label :data:`NON_PRIVATE_LABEL`): one noiseless Gaussian release (ε = ∞)."""
    if S.is_non_private(label):
        return GaussianEvent(0.0, count=count, label=label)
    if len(noise_multipliers) == 1:
        return PoissonSampledGaussianEvent(q, noise_multipliers[0], count=count, label=label)
    return PoissonSampledComposedGaussianEvent(q, tuple(noise_multipliers), count=count, label=label)


def optimizer_events(
    model: Any,
    *,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    untrained: bool = False,
) -> list:
    """The privacy events of the model's training steps so far; fail closed where it carries no record of them.

    Read from (1) the model's DP optimizer: its noised steps and those of the earlier DP optimizers of the
    model (:func:`~keras_dpsgd.ledger.attach` folds them in); else (2) the model's copy of the ledger (a model
    compiled again with a plain optimizer after DP training, a tf_keras SavedModel loaded with
    ``compile=False``), brought up to date first from the last DP optimizer that trained the model while it
    lives. A DP optimizer's noised steps become PoissonSampledGaussianEvents (one per (q, σ_eff) segment). The
    steps of a plain (non-DP) optimizer touched the data without noise: one noiseless Gaussian event (ε = ∞),
    after the DP history, never instead of it; those of a plain optimizer the model was compiled with before
    it was compiled again are in its copy (:func:`~keras_dpsgd.ledger.record_plain_steps`), in their place.

    Args:
      model: a Keras 3 or tf_keras model.
      num_examples: N, needed only where the sampling rate of recorded steps is unknown.
      batch_size: the physical batch size of those steps, idem.
      untrained: the caller states that the model's weights were not trained on the data outside what the
        model records (a new model, or weights from public data). Needed only for a model that carries no
        record at all (no DP optimizer, no copy of a ledger, no step of a plain optimizer), whose training
        history keras_dpsgd cannot see: its DP-SGD part is then empty instead of refused.

    Raises:
      ValueError: the model carries no record and `untrained` is False (refusal ``model-without-ledger``:
        e.g. a model loaded with ``compile=False``, whose file kept the ledger with its optimizer).
    """
    optimizer = getattr(model, "optimizer", None)
    if is_live_dp_optimizer(optimizer):
        attach(model, optimizer)
        return _dp_events(model, optimizer, num_examples, batch_size)
    events = _recorded_events(model, num_examples, batch_size)
    # A plain optimizer's steps not yet in the copy; a revived DP skeleton's are DP steps, in the model's copy.
    iterations = unrecorded_plain_steps(model, optimizer)
    if iterations:
        return (events or []) + [step_event(1.0, (0.0,), iterations, NON_PRIVATE_LABEL)]
    if events is None and not untrained:
        raise refuse("model-without-ledger", _no_ledger_detail(model, optimizer))
    return events or []


def _dp_events(model: Any, optimizer: Any, num_examples: Optional[int], batch_size: Optional[int]) -> list:
    """The events of the model's ledger, brought up to date first from DP `optimizer`'s counter."""
    sigma = float(optimizer.effective_noise_multiplier)
    data = sync_ledger_state(model, recorded_sampling_rate(optimizer), sigma, optimizer=optimizer)
    return _state_events(data, optimizer, num_examples, batch_size)


def _recorded_events(model: Any, num_examples: Optional[int], batch_size: Optional[int]) -> Optional[list]:
    """The events of the model's copy of the ledger (no DP optimizer compiled), or None if it holds none.

    Its last DP optimizer, while it lives (the copy keeps it alive in this process), brings it up to date
    first; without it (a SavedModel's copy) the copy is read as saved, each step a DP-SGD event (an upper
    bound on a BandMF step too: :mod:`keras_dpsgd.ledger._bandmf`).
    """
    trainer = ledger_trainer(model)
    if trainer is not None:
        return _dp_events(model, trainer, num_examples, batch_size)
    data = model_ledger_state(model)
    return None if data is None else _state_events(data, None, num_examples, batch_size)


def _state_events(data: dict, optimizer: Any, num_examples: Optional[int], batch_size: Optional[int]) -> list:
    """The events of ledger state `data`; `optimizer`: the DP optimizer of its last steps, or None."""
    q = None  # the reader's q: needed only for steps recorded without one
    if (
        num_examples is not None
        or batch_size is not None
        or any(s["sampling_rate"] is None and s["count"] for s in data["segments"])
    ):
        q = resolve_sampling_rate(optimizer, num_examples=num_examples, batch_size=batch_size)
    searches = [event_from_dict(e) for e in S.searches(data)]
    if getattr(optimizer, "bandmf_bands", None) is not None and not searches:
        # Correlated noise on cyclic lots (issue 42); after a search, DP-SGD's events (an upper bound).
        return bandmf_events(data, S.events(data, q), optimizer, step_event)
    return searches + [step_event(*segment) for segment in S.events(data, q)]


def _no_ledger_detail(model: Any, optimizer: Any) -> str:
    compiled = "it is not compiled" if optimizer is None else f"its optimizer {type(optimizer).__name__} is no DP one"
    return (
        f"epsilon of model {getattr(model, 'name', type(model).__name__)!r} cannot be proven complete: {compiled} "
        "and it carries no copy of a privacy ledger, so keras_dpsgd cannot see whether its weights were trained "
        "(a model loaded with load_model(..., compile=False) lost the ledger its file kept with the optimizer). "
        "Load it with compile=True, which restores its DP optimizer and the whole ledger; if you know its earlier privacy cost, pass those events "
        "as extra_events= together with untrained=True; if its weights were never trained on the private data "
        "(a new model, or public weights), pass untrained=True"
    )


def _releasing_layers(model: Any) -> list:
    """(layer, its events) of every layer (recursively, the model included) with `privacy_events`."""
    found, seen = [], set()
    layers = model._flatten_layers(include_self=True, recursive=True) if hasattr(model, "_flatten_layers") else [model]
    for layer in layers:
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        declared = getattr(layer, "privacy_events", None)
        if declared:
            found.append((layer, declared))
    return found


def refuse_shared_layer_seeds(model: Any) -> None:
    """Refuses a model whose ledger holds releases of two layers adapted with one seed (issue 37.4).

    A seeded DP preprocessing layer draws the noise of its k-th adapt from (seed, k)
    (``keras_dpsgd.preprocessing.adapt``): two such layers with one seed drew the same noise for their
    first adapts, which the ledger would count as independent releases.

    Raises:
      ValueError: naming both layers and the seed.
    """
    by_seed = {}
    for layer, _ in _releasing_layers(model):
        seed = getattr(layer, "seed", None)
        if not isinstance(seed, int) or isinstance(seed, bool):
            continue
        if seed in by_seed:
            raise refuse(
                "shared-layer-seeds",
                f"layers {by_seed[seed].name!r} and {layer.name!r} of this model were adapted with the same seed "
                f"({seed}): a seeded layer draws the noise of its k-th adapt from (seed, k), so both released the "
                "same noise, which epsilon would count as independent releases. Give each DP layer its own seed "
                "(or none: OS entropy) and adapt them again",
            )
        by_seed[seed] = layer


def layer_events(model: Any) -> list:
    """Events of every layer (recursively, the model included) with a `privacy_events` property.

    Raises:
      ValueError: two of these layers adapted with one seed (:func:`refuse_shared_layer_seeds`).
    """
    refuse_shared_layer_seeds(model)
    return [event for _, declared in _releasing_layers(model) for event in declared]
