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
import math
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting.bandmf import BandMFEvent
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "BandMFEvent",
    "ComposedEvent",
    "GaussianEvent",
    "GaussianThresholdingEvent",
    "PoissonSampledGaussianEvent",
    "PrivacyLedger",
    "TuningEvent",
    "event_from_dict",
    "flatten_events",
]


def _check_sampling_rate(sampling_rate: float) -> float:
    return V.in_range(0, 1, "(]", sampling_rate=sampling_rate)


def _check_noise_multiplier(noise_multiplier: float) -> float:
    return V.nonnegative(noise_multiplier=noise_multiplier)


def _check_count(count: int) -> int:
    return V.integer_at_least(0, count=count)


def _check_whole_data_release(event) -> None:
    """Validates (in place) the noise multiplier, count and label of a release on the whole data set."""
    object.__setattr__(event, "noise_multiplier", _check_noise_multiplier(event.noise_multiplier))
    object.__setattr__(event, "count", _check_count(event.count))
    object.__setattr__(event, "label", str(event.label))


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


def composed_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_i 1/σ_i²)^(-1/2) of Gaussian releases computed on one sample (0 if any σ_i is 0).

    The one place σ_eff is computed (per-layer clipping's groups, adaptive clipping's norm queries).
    Release i adds N(0, σ_i² s_i²) to a query of ℓ2 sensitivity s_i. Dividing each release by its
    noise scale (post-processing) makes them one query with unit noise whose sensitivity is
    (Σ_i 1/σ_i²)^(1/2), i.e. one Gaussian mechanism with noise multiplier σ_eff; dp_accounting
    reduces a ``ComposedDpEvent`` of Gaussians the same way. One release: σ_eff = σ_1 exactly.

    Raises:
      ValueError: if `noise_multipliers` is empty or holds a value that is not a number >= 0.
    """
    if isinstance(noise_multipliers, (str, bytes)) or not isinstance(noise_multipliers, Iterable):
        raise TypeError(f"noise_multipliers must be a sequence of numbers >= 0, got {noise_multipliers!r}")
    sigmas = [V.nonnegative(**{f"noise_multipliers[{i}]": s}) for i, s in enumerate(noise_multipliers)]
    if not sigmas:
        raise ValueError("noise_multipliers must be a non-empty sequence of numbers >= 0, got an empty sequence")
    if len(sigmas) == 1 or any(s == 0.0 for s in sigmas):
        return min(sigmas)
    return float(sum(1.0 / (s * s) for s in sigmas) ** -0.5)


@dataclasses.dataclass(frozen=True)
class PoissonSampledComposedGaussianEvent:
    """`count` steps, each one Poisson sample released through several Gaussian mechanisms.

    A DP-SGD step with per-layer clipping releases one noised sum per clipping group, adaptive
    clipping adds one noised norm query per layer: every release of a step reads the same
    sample. The accountant charges each step as one sub-sampled Gaussian with the noise
    multiplier :func:`composed_noise_multiplier` derives (``noise_multiplier``).

    Args:
      sampling_rate: q in (0, 1].
      noise_multipliers: σ_i >= 0 of each release (noise standard deviation over its ℓ2
        sensitivity), at least one.
      count: number of steps, an integer >= 0.
      label: free text naming the source.
    """

    sampling_rate: float
    noise_multipliers: tuple
    count: int = 1
    label: str = ""

    def __post_init__(self):
        composed_noise_multiplier(self.noise_multipliers)  # validates every release
        checked = {
            "sampling_rate": _check_sampling_rate(self.sampling_rate),
            "noise_multipliers": tuple(float(s) for s in self.noise_multipliers),
            "count": _check_count(self.count),
            "label": str(self.label),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def noise_multiplier(self) -> float:
        """σ_eff of one step (:func:`composed_noise_multiplier`)."""
        return composed_noise_multiplier(self.noise_multipliers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "poisson_sampled_composed_gaussian",
            "sampling_rate": self.sampling_rate,
            "noise_multipliers": list(self.noise_multipliers),
            "count": self.count,
            "label": self.label,
        }


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
        _check_whole_data_release(self)

    @property
    def sampling_rate(self) -> float:
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class GaussianThresholdingEvent:
    """`count` releases of the Gaussian thresholding mechanism (DP partition selection, a DP vocabulary).

    Each example contributes weight 1 to at most k distinct keys (tokens); every key's count gets
    Gaussian noise of standard deviation σ·√k and the keys whose noisy count exceeds a threshold τ
    are released. For neighbours D' = D + {x}, the keys of x split in two parts (Gopi et al. 2020,
    "Differentially Private Set Union", Sec. 3; Wilkins et al. 2024, "Exact Privacy Analysis of the
    Gaussian Sparse Histogram Mechanism", the classical analysis):

    * keys already in D: their noisy counts are the Gaussian mechanism with ℓ2 sensitivity √k and
      noise σ·√k, noise multiplier σ; the release is post-processing of it;
    * keys of x alone (count 1 in D', absent in D, where they are never released): released in D'
      with probability at most ``threshold_delta`` = 1 − Φ((τ − 1)/(σ√k))^k.

    Outside that event of probability <= `threshold_delta` the two releases are the Gaussian part's,
    so the mechanism is (ε, δ_G(ε) + threshold_delta)-DP; in a composition the Gaussian parts compose
    as ``GaussianEvent(σ)`` and the threshold deltas add (a union bound over the bad events). Every
    accountant does exactly that: ε at δ is the Gaussian parts' ε at δ − Σ threshold_delta (∞ if that
    is <= 0).

    Args:
      noise_multiplier: σ >= 0 (σ·√k is the noise standard deviation on each count).
      threshold_delta: the δ of the thresholding, in [0, 1).
      count: repetitions, >= 0.
      label: free text naming the source ("dp-vocabulary").
    """

    noise_multiplier: float
    threshold_delta: float
    count: int = 1
    label: str = ""

    def __post_init__(self):
        _check_whole_data_release(self)
        object.__setattr__(self, "threshold_delta", V.in_range(0, 1, "[)", threshold_delta=self.threshold_delta))

    sampling_rate = GaussianEvent.sampling_rate  # q = 1: the whole data set

    def to_dict(self) -> dict[str, Any]:
        return {"type": "gaussian_thresholding", **dataclasses.asdict(self)}


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


LEAF_EVENT_TYPES = (
    PoissonSampledGaussianEvent,
    PoissonSampledComposedGaussianEvent,
    GaussianEvent,
    GaussianThresholdingEvent,
    BandMFEvent,
)
# The leaves a tuning's trial may hold (events with a Rényi DP curve).
_TRIAL_LEAF_TYPES = (PoissonSampledGaussianEvent, PoissonSampledComposedGaussianEvent, GaussianEvent)
_EVENT_TYPES = LEAF_EVENT_TYPES + (ComposedEvent,)


TUNING_DISTRIBUTIONS = ("poisson", "truncated_negative_binomial")


@dataclasses.dataclass(frozen=True)
class TuningEvent:
    """A hyperparameter search that releases only its best trial (Papernot & Steinke 2022).

    The number of trials K is random: Poisson with mean ``mu`` (their Theorem 6), or the truncated
    negative binomial D_{η,γ} (their Theorem 2; η = 0 is the logarithmic
    distribution, η = 1 the geometric). Each trial is one DP training run whose settings are drawn
    at random from a search space; its privacy is bounded uniformly over the settings it may draw:
    ``candidates`` holds one event (or composition) per distinct privacy setting (q, σ, steps), and
    the RDP of a trial at each order is the largest of the candidates' (a trial is a mixture of the
    candidates with public weights, and a Rényi divergence of mixtures is at most the largest of the
    components'). The RDP accountants compose it by :func:`keras_dpsgd.accounting.tuning.rdp_tuning`.

    Args:
      distribution: "poisson" or "truncated_negative_binomial".
      candidates: the events of one trial, one per privacy setting a trial may draw (at least one);
        each a (composition of) sub-sampled or plain Gaussian event(s).
      mu: the Poisson mean μ >= 1 ("poisson" only; below 1 the bound of Theorem 6 is not valid, see
        :mod:`keras_dpsgd.accounting.tuning`).
      eta: η in (-1, ∞) ("truncated_negative_binomial" only).
      gamma: γ in (0, 1) ("truncated_negative_binomial" only).
      count: number of such searches, an integer >= 0.
      label: free text naming the source.
    """

    distribution: str
    candidates: tuple
    mu: Optional[float] = None
    eta: Optional[float] = None
    gamma: Optional[float] = None
    count: int = 1
    label: str = "tuning"

    def __post_init__(self):
        distribution = V.one_of(TUNING_DISTRIBUTIONS, distribution=self.distribution)
        given = {"mu": self.mu, "eta": self.eta, "gamma": self.gamma}
        wanted = ("mu",) if distribution == "poisson" else ("eta", "gamma")
        extra = sorted(k for k, v in given.items() if v is not None and k not in wanted)
        missing = sorted(k for k in wanted if given[k] is None)
        if extra or missing:
            raise ValueError(
                f"a {distribution!r} tuning takes the parameters {list(wanted)}, got {given} "
                f"(missing {missing}, not used {extra})"
            )
        if distribution == "poisson":
            # μ >= 1: below, the bound's log μ term is negative and the bound fails (module `tuning`).
            object.__setattr__(self, "mu", V.in_range(1, math.inf, "[)", mu=self.mu))
        else:
            object.__setattr__(self, "eta", V.in_range(-1, math.inf, "()", eta=self.eta))
            object.__setattr__(self, "gamma", V.in_range(0, 1, "()", gamma=self.gamma))
        candidates = self.candidates
        if isinstance(candidates, _EVENT_TYPES) or not isinstance(candidates, Iterable) or isinstance(candidates, str):
            candidates = (candidates,)
        candidates = tuple(candidates)
        if not candidates:
            raise ValueError("candidates must hold at least one event (the events of one trial), got none")
        for i, c in enumerate(candidates):
            leaves = list(flatten_events((c,))) if isinstance(c, _EVENT_TYPES) else [c]
            bad = [e for e in leaves if not isinstance(e, _TRIAL_LEAF_TYPES)]
            if bad:
                raise TypeError(
                    f"candidates[{i}] must be a (composition of) Gaussian event(s) (sub-sampled or not), got "
                    f"{type(bad[0]).__name__}: a tuning bound needs the trial's Rényi DP curve"
                )
        object.__setattr__(self, "candidates", candidates)
        object.__setattr__(self, "count", _check_count(self.count))
        object.__setattr__(self, "label", str(self.label))

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "tuning",
            "distribution": self.distribution,
            "mu": self.mu,
            "eta": self.eta,
            "gamma": self.gamma,
            "candidates": [c.to_dict() for c in self.candidates],
            "count": self.count,
            "label": self.label,
        }


_EVENT_TYPES = _EVENT_TYPES + (TuningEvent,)
PrivacyEvent = Union[
    PoissonSampledGaussianEvent,
    PoissonSampledComposedGaussianEvent,
    GaussianEvent,
    GaussianThresholdingEvent,
    BandMFEvent,
    ComposedEvent,
    TuningEvent,
]


LEDGER_FORMAT = "keras_dpsgd.ledger"
# Version 2 added "poisson_sampled_composed_gaussian" and "gaussian_thresholding" events, version 3 "tuning" and
# "bandmf"; earlier files load unchanged.
LEDGER_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
# Event kinds a file of each version may hold (a file names no event kind added after its version).
_VERSION_KINDS = {
    1: frozenset({"poisson_sampled_gaussian", "gaussian", "composed"}),
    2: frozenset({"poisson_sampled_gaussian", "gaussian", "composed", "poisson_sampled_composed_gaussian"})
    | frozenset({"gaussian_thresholding"}),
}

# The fields each serialized event kind carries, exactly as `to_dict` writes them.
_EVENT_FIELDS = {
    "poisson_sampled_gaussian": ("sampling_rate", "noise_multiplier", "count", "label"),
    "poisson_sampled_composed_gaussian": ("sampling_rate", "noise_multipliers", "count", "label"),
    "gaussian": ("noise_multiplier", "count", "label"),
    "gaussian_thresholding": ("noise_multiplier", "threshold_delta", "count", "label"),
    "bandmf": ("sampling_rate", "noise_multiplier", "steps", "bands", "column_norm", "label"),
    "composed": ("events",),
    "tuning": ("distribution", "mu", "eta", "gamma", "candidates", "count", "label"),
}
_NUMBER_FIELDS = ("sampling_rate", "noise_multiplier", "threshold_delta", "column_norm")
_OPTIONAL_NUMBER_FIELDS = ("mu", "eta", "gamma")
_INTEGER_FIELDS = ("count", "steps", "bands")


def _check_serialized_fields(kind: str, data: dict) -> None:
    """Refuses an event dict whose keys or value types are not those `to_dict` writes."""
    expected = set(_EVENT_FIELDS[kind])
    got = set(data) - {"type"}
    if got != expected:
        raise refuse(
            "foreign-ledger",
            f"a serialized {kind!r} event has exactly the fields {sorted(expected)}, got {sorted(got)}: {data!r}",
        )
    for name in _NUMBER_FIELDS:
        if name in data and (isinstance(data[name], bool) or not isinstance(data[name], (int, float))):
            raise refuse(
                "foreign-ledger", f"{name} of a serialized event must be a number, got {data[name]!r}", TypeError
            )
    for name in _INTEGER_FIELDS:
        if name in data and (isinstance(data[name], bool) or not isinstance(data[name], int)):
            raise refuse(
                "foreign-ledger", f"{name} of a serialized event must be an integer, got {data[name]!r}", TypeError
            )
    if "label" in data and not isinstance(data["label"], str):
        raise refuse(
            "foreign-ledger", f"label of a serialized event must be a string, got {data['label']!r}", TypeError
        )
    multipliers = data.get("noise_multipliers", [])
    if not isinstance(multipliers, (list, tuple)) or any(
        isinstance(m, bool) or not isinstance(m, (int, float)) for m in multipliers
    ):
        raise refuse(
            "foreign-ledger",
            f"noise_multipliers of a serialized event must be a list of numbers, got {multipliers!r}",
            TypeError,
        )
    if "events" in data and not isinstance(data["events"], (list, tuple)):
        raise refuse(
            "foreign-ledger", f"events of a serialized composed event must be a list, got {data['events']!r}", TypeError
        )
    for name in _OPTIONAL_NUMBER_FIELDS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise refuse(
                "foreign-ledger", f"{name} of a serialized event must be a number or null, got {value!r}", TypeError
            )
    if "candidates" in data and not isinstance(data["candidates"], (list, tuple)):
        raise refuse(
            "foreign-ledger",
            f"candidates of a serialized tuning event must be a list, got {data['candidates']!r}",
            TypeError,
        )
    if "distribution" in data and not isinstance(data["distribution"], str):
        raise refuse(
            "foreign-ledger",
            f"distribution of a serialized tuning event must be a string, got {data['distribution']!r}",
            TypeError,
        )


def event_from_dict(data: dict[str, Any]) -> PrivacyEvent:
    """Rebuilds an event from `event.to_dict()`.

    Only what `to_dict` writes is accepted: a known "type" and exactly its
    fields, numbers as numbers. Anything else (a state of another library, a
    hand-edited or truncated file) raises rather than loading as a different,
    possibly cheaper, event.

    Raises:
      TypeError: if `data` is not a dict or a field has the wrong type.
      ValueError: if the type is unknown, a field is missing or extra, or a
        value is out of range (e.g. a negative count).
    """
    if not isinstance(data, dict):
        raise refuse(
            "foreign-ledger",
            f"a serialized privacy event must be a dict, got {type(data).__name__}: {data!r}",
            TypeError,
        )
    if "type" not in data:
        raise refuse("foreign-ledger", f"a serialized privacy event has a 'type' key, got {data!r}")
    kind = data["type"]
    if kind not in _EVENT_FIELDS:
        raise refuse("foreign-ledger", f"unknown privacy event type {kind!r} (known: {sorted(_EVENT_FIELDS)})")
    _check_serialized_fields(kind, data)
    fields = {k: v for k, v in data.items() if k != "type"}
    if kind == "poisson_sampled_gaussian":
        return PoissonSampledGaussianEvent(**fields)
    if kind == "poisson_sampled_composed_gaussian":
        return PoissonSampledComposedGaussianEvent(**fields)
    if kind == "gaussian":
        return GaussianEvent(**fields)
    if kind == "gaussian_thresholding":
        return GaussianThresholdingEvent(**fields)
    if kind == "tuning":
        return TuningEvent(**dict(fields, candidates=tuple(event_from_dict(c) for c in fields["candidates"])))
    if kind == "bandmf":
        return BandMFEvent(**fields)
    return ComposedEvent(tuple(event_from_dict(e) for e in fields["events"]))


def _walk(events: Iterable[PrivacyEvent]) -> Iterator[PrivacyEvent]:
    """Every event, composed ones and their parts included."""
    for e in events:
        yield e
        if isinstance(e, ComposedEvent):
            yield from _walk(e.events)


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

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self):
        return iter(self._events)

    def __eq__(self, other) -> bool:
        return isinstance(other, PrivacyLedger) and self._events == other._events

    def __repr__(self) -> str:
        return f"PrivacyLedger({self._events!r})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"format": "keras_dpsgd.ledger", "version": 2, "events": [...]}`` (version 3 with a search
        or a BandMF event)."""
        # The lowest version that holds these events, so that a reader of version 2 reads a ledger of its kinds.
        later = any(isinstance(e, (TuningEvent, BandMFEvent)) for e in _walk(self._events))
        return {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION if later else 2,
            "events": [e.to_dict() for e in self._events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        """Rebuilds a ledger from `to_dict()`; anything else raises.

        Accepted: the current format (``format``, ``version``, ``events``) and
        the legacy shape written by keras_dpsgd 0.1.0 (a dict whose only key is
        ``events``). A state without events (``{}``, Opacus's accountant state,
        ``None``) is not an empty ledger: loading it as one would report ε = 0
        for a model that was trained, so it is refused.

        Raises:
          TypeError: if `data` is not a dict, or `events` not a list.
          ValueError: if `data` is not a keras_dpsgd ledger (unknown keys,
            format or version, no events key, a malformed event).
        """
        if not isinstance(data, dict):
            raise refuse(
                "foreign-ledger",
                f"a serialized PrivacyLedger must be a dict from PrivacyLedger.to_dict(), "
                f"got {type(data).__name__}: {data!r}",
                TypeError,
            )
        keys = set(data)
        if keys == {"events"}:  # written by keras_dpsgd 0.1.0, before the format key
            version = 1
        elif keys == {"format", "version", "events"}:
            if data["format"] != LEDGER_FORMAT:
                raise refuse("foreign-ledger", f"ledger format must be {LEDGER_FORMAT!r}, got {data['format']!r}")
            version = data["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version not in _READABLE_VERSIONS:
                raise refuse(
                    "foreign-ledger",
                    f"ledger version must be one of {list(_READABLE_VERSIONS)} (this keras_dpsgd reads versions "
                    f"up to {LEDGER_VERSION}), got {version!r}",
                )
        else:
            raise refuse(
                "foreign-ledger",
                "not a keras_dpsgd ledger: expected a dict with keys ['events', 'format', 'version'] "
                f"(format {LEDGER_FORMAT!r}) or the 0.1.0 shape {{'events': [...]}}, got keys {sorted(keys, key=str)}",
            )
        events = data["events"]
        if not isinstance(events, (list, tuple)):
            raise refuse(
                "foreign-ledger",
                f"ledger events must be a list of serialized events, got {type(events).__name__}: {events!r}",
                TypeError,
            )
        if version in _VERSION_KINDS:
            _refuse_later_kinds(events, version)
        return cls(event_from_dict(e) for e in events)


def _refuse_later_kinds(events: Iterable[Any], version: int) -> None:
    """A ledger of an earlier version holds only the event kinds that version knew."""
    for e in events:
        kind = e.get("type") if isinstance(e, dict) else None
        if kind is not None and kind in _EVENT_FIELDS and kind not in _VERSION_KINDS[version]:
            raise refuse(
                "ledger-version-kinds",
                f"a version {version} ledger holds no {kind!r} event (added in a later version): {e!r}",
            )
        if kind == "composed" and isinstance(e.get("events"), (list, tuple)):
            _refuse_later_kinds(e["events"], version)
