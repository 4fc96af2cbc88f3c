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
from keras_dpsgd.ledger._keras_io import attach, is_dp_optimizer, recorded_sampling_rate, sync_ledger_state
from keras_dpsgd.ledger.sampling import resolve_sampling_rate

__all__ = ["DPSGD_LABEL", "layer_events", "optimizer_events", "refuse_shared_layer_seeds", "step_event"]

DPSGD_LABEL = S.DPSGD_LABEL


def step_event(q: float, noise_multipliers: Sequence[float], count: int, label: str = DPSGD_LABEL):
    """`count` steps at q: one Gaussian release (flat clipping) or a composition of several."""
    if len(noise_multipliers) == 1:
        return PoissonSampledGaussianEvent(q, noise_multipliers[0], count=count, label=label)
    return PoissonSampledComposedGaussianEvent(q, tuple(noise_multipliers), count=count, label=label)


def optimizer_events(model: Any, *, num_examples: Optional[int] = None, batch_size: Optional[int] = None) -> list:
    """The privacy events of the training steps of the model's optimizer so far.

    A DP optimizer's noised steps become PoissonSampledGaussianEvents (one per
    (q, σ_eff) segment). A non-private optimizer that has taken steps touched
    the data without noise: recorded as a noiseless Gaussian event (ε = ∞).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not is_dp_optimizer(optimizer):
        iterations = int(optimizer.iterations.numpy()) if hasattr(optimizer, "iterations") else 0
        if iterations:
            return [GaussianEvent(0.0, count=iterations, label="non-private training")]
        return []
    sigma = float(optimizer.effective_noise_multiplier)
    attach(model, optimizer)
    data = sync_ledger_state(model, recorded_sampling_rate(optimizer), sigma)
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
