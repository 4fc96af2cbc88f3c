"""Privacy events: immutable records of every access to the data.

A DP-SGD run, a DP-PCA fit and the norm queries of adaptive clipping are all
(sub-sampled) Gaussian mechanisms. Each access is recorded as an event; an
accountant composes the events of a :class:`PrivacyLedger` and answers ε for a
given δ. Events and ledgers serialize to and from plain data (dicts, lists,
floats, ints and strings) so that a checkpoint can carry them.

Adjacency throughout: add/remove one example (Poisson sampling amplification
is stated for this relation).

This module is pure Python: it must import without TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Union

from keras_dpsgd.accounting import _validation as V


def _check_sampling_rate(sampling_rate: float) -> float:
    return V.check_sampling_rate(sampling_rate)


def _check_noise_multiplier(noise_multiplier: float) -> float:
    return V.check_noise_multiplier(noise_multiplier)


def _check_count(count: int) -> int:
    return V.check_nonnegative_int(count, "count")


@dataclasses.dataclass(frozen=True)
class PoissonSampledGaussianEvent:
    """`count` releases of a Gaussian mechanism on a Poisson sample.

    Each example enters the lot independently with probability
    `sampling_rate`; the released sum has ℓ2 sensitivity 1 (after scaling by
    the clip bound) and Gaussian noise of standard deviation
    `noise_multiplier` (Abadi et al. 2016, Algorithm 1).

    Args:
      sampling_rate: q in (0, 1].
      noise_multiplier: σ >= 0 (σ = 0 means no privacy: ε = ∞).
      count: number of repetitions (steps), an integer >= 0.
      label: free text naming the source ("dp-sgd", "dp-pca", ...).
    """

    sampling_rate: float
    noise_multiplier: float
    count: int = 1
    label: str = ""

    def __post_init__(self):
        object.__setattr__(self, "sampling_rate", _check_sampling_rate(self.sampling_rate))
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "count", _check_count(self.count))
        object.__setattr__(self, "label", str(self.label))

    def to_dict(self) -> dict[str, Any]:
        return {"type": "poisson_sampled_gaussian", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class GaussianEvent:
    """`count` releases of a Gaussian mechanism on the whole data set (q = 1).

    Args:
      noise_multiplier: σ >= 0, the noise standard deviation over the ℓ2
        sensitivity.
      count: number of repetitions, an integer >= 0.
      label: free text naming the source.
    """

    noise_multiplier: float
    count: int = 1
    label: str = ""

    def __post_init__(self):
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "count", _check_count(self.count))
        object.__setattr__(self, "label", str(self.label))

    @property
    def sampling_rate(self) -> float:
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class ComposedEvent:
    """Sequential composition of events (heterogeneous σ, q, sources)."""

    events: tuple = ()

    def __post_init__(self):
        events = tuple(self.events)
        for e in events:
            if not isinstance(e, _EVENT_TYPES):
                raise TypeError(f"events must be privacy events, got {type(e).__name__}")
        object.__setattr__(self, "events", events)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "composed", "events": [e.to_dict() for e in self.events]}


_EVENT_TYPES = (PoissonSampledGaussianEvent, GaussianEvent, ComposedEvent)
PrivacyEvent = Union[PoissonSampledGaussianEvent, GaussianEvent, ComposedEvent]


def event_from_dict(data: dict[str, Any]) -> PrivacyEvent:
    """Rebuilds an event from `event.to_dict()`."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a serialized privacy event: {data!r}")
    kind = data["type"]
    fields = {k: v for k, v in data.items() if k != "type"}
    if kind == "poisson_sampled_gaussian":
        return PoissonSampledGaussianEvent(**fields)
    if kind == "gaussian":
        return GaussianEvent(**fields)
    if kind == "composed":
        return ComposedEvent(tuple(event_from_dict(e) for e in fields["events"]))
    raise ValueError(f"unknown privacy event type {kind!r}")


def flatten_events(events: Iterable[PrivacyEvent]) -> Iterator[PrivacyEvent]:
    """Yields the leaf (non-composed) events, in order."""
    for e in events:
        if isinstance(e, ComposedEvent):
            yield from flatten_events(e.events)
        else:
            yield e


class PrivacyLedger:
    """An append-only list of privacy events: every access to the data.

    The ledger is plain data; an accountant turns it into (ε, δ)::

        ledger = PrivacyLedger()
        ledger.record(PoissonSampledGaussianEvent(0.01, 1.1, count=6000, label="dp-sgd"))
        ledger.to_dict()  # JSON-serializable
    """

    def __init__(self, events: Iterable[PrivacyEvent] = ()):
        self._events: list[PrivacyEvent] = []
        for e in events:
            self.record(e)

    def record(self, event: PrivacyEvent) -> None:
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(f"event must be a privacy event, got {type(event).__name__}")
        self._events.append(event)

    @property
    def events(self) -> tuple:
        return tuple(self._events)

    def composed(self) -> ComposedEvent:
        return ComposedEvent(tuple(self._events))

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self):
        return iter(self._events)

    def __eq__(self, other) -> bool:
        return isinstance(other, PrivacyLedger) and self._events == other._events

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._events!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"events": [e.to_dict() for e in self._events]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        return cls(event_from_dict(e) for e in data.get("events", []))
