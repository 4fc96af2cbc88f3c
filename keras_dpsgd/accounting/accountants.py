"""Privacy accountants: compose events, answer ε for δ (one contract, a registry of implementations).

* :class:`RdpAccountant`: RDP over an order grid (default dp_accounting's),
  tight conversion by default (or "classic").
* :class:`MomentsAccountant`: the moments accountant of Abadi et al. 2016 as
  their TensorFlow code ran it: log moments at integer λ = 1..32 (RDP orders
  2..33) and the classic conversion of Thm 2.2.
* :class:`PldAccountant`: privacy loss distributions through dp_accounting
  (optional extra ``pip install keras-dpsgd[pld]``).

Adjacency: add/remove one example.

A new accountant is one class (subclass :class:`PrivacyAccountant`, implement
``_compose_leaf`` and ``get_epsilon_and_order``) plus one registration line,
``@register_accountant("name")``; every function that takes ``accountant=``
(ε, calibration of σ, steps within a budget, the CLI's ``--accountant``) then
accepts its name or an instance.
"""

from __future__ import annotations

import abc
import copy
import functools
import math
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting import conversions, rdp, tuning
from keras_dpsgd.accounting.bandmf import BandMFEvent
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.accounting.events import (
    LEAF_EVENT_TYPES,
    ComposedEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    TuningEvent,
    flatten_events,
)

__all__ = [
    "MomentsAccountant",
    "PldAccountant",
    "PrivacyAccountant",
    "RdpAccountant",
    "accountant_names",
    "as_event_list",
    "make_accountant",
    "register_accountant",
]

# The built-in accountants' names (``accountant_names()`` also lists registered ones).
ACCOUNTANTS = ("rdp", "moments", "pld")
_REGISTRY: dict[str, Callable[[], "PrivacyAccountant"]] = {}
_A = TypeVar("_A", bound=type)
_PLD_HINT = "the PLD accountant needs dp_accounting: pip install keras-dpsgd[pld]"


def as_event_list(events) -> list:
    """Leaf events of a PrivacyLedger, one event, or an iterable of events (a TuningEvent is a leaf).

    A :class:`~keras_dpsgd.accounting.BandMFEvent` comes out as the DP-SGD event with its guarantees
    (``BandMFEvent.dpsgd_parameters``): every accountant composes that.
    """
    if isinstance(events, PrivacyLedger):
        events = events.events
    elif isinstance(events, LEAF_EVENT_TYPES + (ComposedEvent, TuningEvent)):
        events = (events,)
    elif not isinstance(events, Iterable) or isinstance(events, (str, bytes, dict)):
        raise TypeError(
            f"events must be a PrivacyLedger, an event or an iterable of events, got {type(events).__name__}"
        )
    out = []
    for e in flatten_events(events):
        if not isinstance(e, LEAF_EVENT_TYPES + (TuningEvent,)):
            raise TypeError(f"events must be privacy events, got {type(e).__name__}")
        out.append(_dpsgd_equivalent(e) if isinstance(e, BandMFEvent) else e)
    return out


def _dpsgd_equivalent(event: BandMFEvent) -> PoissonSampledGaussianEvent:
    """The DP-SGD event with a BandMF event's guarantees: ⌈n/b⌉ steps at (q, σ/ζ)."""
    q, sigma, rounds = event.dpsgd_parameters()
    return PoissonSampledGaussianEvent(q, sigma, count=rounds, label=event.label)


def register_accountant(name: str) -> Callable[[_A], _A]:
    """Class decorator: makes ``make_accountant(name)`` return ``cls()``.

    Args:
      name: the accountant's name (``accountant="name"``, ``--accountant name``).

    Raises:
      ValueError: `name` is empty or already registered.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"an accountant named {name!r} is already registered: {_REGISTRY[name]!r}")

    def register(cls: _A) -> _A:
        if not (isinstance(cls, type) and issubclass(cls, PrivacyAccountant)):
            raise TypeError(f"register_accountant registers PrivacyAccountant subclasses, got {cls!r}")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return register


def accountant_names() -> tuple[str, ...]:
    """The names `make_accountant` knows, in registration order."""
    return tuple(_REGISTRY)


class PrivacyAccountant(abc.ABC):
    """Composes privacy events and converts the total to (ε, δ).

    Subclasses implement ``_compose_leaf`` (one (sub-sampled) Gaussian
    mechanism, repeated) and ``get_epsilon_and_order``, and may tune how
    planning searches over them:

    * ``calibration_rtol``: relative width at which the bisection for σ stops
      (the upper end of the bracket is returned, so ε(σ) <= target always);
    * ``calibration_hint``: the name of a faster accountant whose answer is a
      good starting point (the search still runs on this accountant).
    """

    name: str = ""
    calibration_rtol: float = 1e-7
    calibration_hint: str | None = None
    # Σ of the thresholding deltas composed (GaussianThresholdingEvent): taken off δ before ε is computed.
    threshold_delta: float = 0.0

    def __init_subclass__(cls, **kwargs):
        """Every accountant's ``get_epsilon_and_order`` answers for δ minus the thresholding deltas."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("get_epsilon_and_order")
        if own is not None and not getattr(own, "_takes_threshold_delta", False):
            cls.get_epsilon_and_order = _after_threshold_delta(own)

    def compose(self, event, count: int = 1) -> "PrivacyAccountant":
        """Adds `count` repetitions of `event` (a ledger, event or iterable). Returns self.

        A :class:`~keras_dpsgd.accounting.GaussianThresholdingEvent` composes its Gaussian part as a
        Gaussian mechanism and adds its ``threshold_delta`` (times the repetitions) to ``threshold_delta``.
        """
        count = V.integer_at_least(0, count=count)
        for e in as_event_list(event):
            if e.count and count and isinstance(e, TuningEvent):
                self._compose_tuning(e, e.count * count)
            elif e.count and count:
                self._compose_leaf(e.sampling_rate, e.noise_multiplier, e.count * count)
                self.threshold_delta += e.count * count * getattr(e, "threshold_delta", 0.0)
        return self

    @abc.abstractmethod
    def _compose_leaf(self, sampling_rate: float, noise_multiplier: float, count: int) -> None:
        """Adds `count` steps of one (sub-sampled) Gaussian mechanism."""

    def _compose_tuning(self, event: TuningEvent, count: int) -> None:
        """Adds `count` searches that release their best trial; an accountant without a bound for them refuses.

        Raises:
          ValueError: always, here (the RDP accountants implement it: Papernot & Steinke 2022).
        """
        raise refuse(
            "search-without-bound",
            f"the {self.name or type(self).__name__!r} accountant has no bound for a hyperparameter search "
            f"({event.label!r}: the best of a random number of trials); use accountant='rdp' (or 'moments'), "
            "which compose it by Papernot & Steinke 2022",
        )

    @abc.abstractmethod
    def get_epsilon_and_order(self, delta: float) -> tuple[float, float | None]:
        """(ε, order attaining it) at δ; order is None where undefined (PLD, ε = ∞)."""

    def get_epsilon(self, delta: float) -> float:
        """ε at δ of everything composed so far (0 if nothing was composed)."""
        return self.get_epsilon_and_order(delta)[0]


def _after_threshold_delta(get_epsilon_and_order):
    """Wraps an accountant's ``get_epsilon_and_order``: ε at δ − threshold_delta (∞ if that is <= 0)."""

    @functools.wraps(get_epsilon_and_order)
    def wrapped(self, delta):
        delta = V.in_range(0, 1, "()", delta=delta)
        if self.threshold_delta <= 0.0:
            return get_epsilon_and_order(self, delta)
        if delta <= self.threshold_delta:
            return math.inf, None
        return get_epsilon_and_order(self, delta - self.threshold_delta)

    wrapped._takes_threshold_delta = True
    return wrapped


@register_accountant("rdp")
class RdpAccountant(PrivacyAccountant):
    """RDP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019).

    Args:
      orders: RDP orders α > 1; default :data:`rdp.DEFAULT_ORDERS`
        (dp_accounting's grid).
      conversion: "tight" (Canonne-Kamath-Steinke 2020, default) or "classic"
        (Abadi et al. 2016 Thm 2.2); see :mod:`conversions`.
    """

    def __init__(self, orders: Sequence[float] | None = None, conversion: str = "tight"):
        self._orders = rdp.check_orders(rdp.DEFAULT_ORDERS if orders is None else orders)
        self._conversion = conversions.check_conversion(conversion)
        self._rdp = np.zeros(len(self._orders))

    @property
    def orders(self) -> np.ndarray:
        return np.asarray(self._orders)

    @property
    def rdp(self) -> np.ndarray:
        """The composed RDP curve (a copy)."""
        return self._rdp.copy()

    @property
    def conversion(self) -> str:
        return self._conversion

    def _compose_leaf(self, sampling_rate, noise_multiplier, count):
        step = rdp.rdp_poisson_subsampled_gaussian(sampling_rate, noise_multiplier, self._orders)
        with np.errstate(invalid="ignore"):
            self._rdp = self._rdp + count * step

    def _compose_tuning(self, event, count):
        """Papernot & Steinke 2022, Theorems 2 and 6, at this accountant's orders (:mod:`tuning`)."""
        search = tuning.rdp_tuning(event, self._orders)
        with np.errstate(invalid="ignore"):
            self._rdp = self._rdp + count * search

    def get_epsilon_and_order(self, delta):
        delta = V.in_range(0, 1, "()", delta=delta)
        if not self._rdp.any():
            return 0.0, None
        return conversions.epsilon_from_rdp(self._orders, self._rdp, delta, self._conversion)

    def get_delta(self, epsilon: float) -> float:
        """Smallest δ at `epsilon` over the order grid (0 if nothing was composed)."""
        if not self._rdp.any():
            return min(1.0, self.threshold_delta)
        delta = conversions.delta_from_rdp(self._orders, self._rdp, epsilon, self._conversion)[0]
        return min(1.0, delta + self.threshold_delta)


@register_accountant("moments")
class MomentsAccountant(RdpAccountant):
    """Abadi et al. 2016's moments accountant: integer λ <= 32, Thm 2.2.

    The log moment at λ is α_M(λ) = λ·r(λ + 1); reported orders are RDP orders
    α = λ + 1 in 2..33.
    """

    def __init__(self):
        super().__init__(orders=rdp.MOMENTS_ORDERS, conversion="classic")


@register_accountant("pld")
class PldAccountant(PrivacyAccountant):
    """Privacy loss distribution accountant, delegating to dp_accounting.

    Uses dp_accounting's pessimistic (upper-bounding) discretization.

    Args:
      value_discretization_interval: PLD grid step (smaller is tighter and slower).

    Raises:
      ImportError: dp_accounting is not installed (``pip install keras-dpsgd[pld]``).
    """

    # PLD probes are slow (~0.1-0.5 s): calibration starts from the RDP answer,
    # which is close, and stops at a relative width of 1e-4.
    calibration_rtol = 1e-4
    calibration_hint = "rdp"

    def __init__(self, value_discretization_interval: float = 1e-4):
        try:
            from dp_accounting import pld as _pld
        except ImportError as err:
            raise ImportError(_PLD_HINT) from err
        self._interval = V.positive(value_discretization_interval=value_discretization_interval)
        self._accountant = _pld.PLDAccountant(value_discretization_interval=self._interval)
        self._infinite = False
        self._empty = True

    def _compose_leaf(self, sampling_rate, noise_multiplier, count):
        self._empty = False
        if noise_multiplier == 0.0:
            self._infinite = True
            return
        from dp_accounting import dp_event

        event = dp_event.GaussianDpEvent(noise_multiplier)
        if sampling_rate < 1.0:
            event = dp_event.PoissonSampledDpEvent(sampling_rate, event)
        self._accountant.compose(event, count)

    def get_epsilon_and_order(self, delta):
        delta = V.in_range(0, 1, "()", delta=delta)
        if self._infinite:
            return math.inf, None
        if self._empty:
            return 0.0, None
        return max(0.0, float(self._accountant.get_epsilon(delta))), None


def make_accountant(accountant: str | PrivacyAccountant = "rdp") -> PrivacyAccountant:
    """An accountant to compose into, from a registered name or an accountant object.

    Args:
      accountant: a name of :func:`accountant_names` ("rdp", "moments",
        "pld", or one added with :func:`register_accountant`), or an accountant
        object, e.g. ``RdpAccountant(orders=...)``. An object is copied with
        everything it has composed so far (so what it holds is counted, never
        dropped), and the caller's object is left unchanged.

    Raises:
      ValueError: an unknown name.
    """
    if isinstance(accountant, PrivacyAccountant):
        return copy.deepcopy(accountant)
    return _REGISTRY[V.one_of(accountant_names(), accountant=accountant)]()
