"""Privacy accountants: compose events, answer ε for δ (one contract, three implementations).

* :class:`RdpAccountant`: RDP over an order grid (default dp_accounting's),
  tight conversion by default (or "classic").
* :class:`MomentsAccountant`: the moments accountant of Abadi et al. 2016 as
  their TensorFlow code ran it: log moments at integer λ = 1..32 (RDP orders
  2..33) and the classic conversion of Thm 2.2.
* :class:`PldAccountant`: privacy loss distributions through dp_accounting
  (optional extra ``pip install keras-dpsgd[pld]``).

Adjacency: add/remove one example.
"""

from __future__ import annotations

import abc
import math
from typing import Iterable, Sequence

import numpy as np

from keras_dpsgd.accounting import _validation as V
from keras_dpsgd.accounting import conversions, rdp
from keras_dpsgd.accounting.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    flatten_events,
)

__all__ = [
    "MomentsAccountant",
    "PldAccountant",
    "PrivacyAccountant",
    "RdpAccountant",
    "as_event_list",
    "make_accountant",
]

ACCOUNTANTS = ("rdp", "moments", "pld")
_PLD_HINT = "the PLD accountant needs dp_accounting: pip install keras-dpsgd[pld]"


def as_event_list(events) -> list:
    """Leaf events of a PrivacyLedger, one event, or an iterable of events."""
    if isinstance(events, PrivacyLedger):
        events = events.events
    elif isinstance(events, (PoissonSampledGaussianEvent, GaussianEvent, ComposedEvent)):
        events = (events,)
    elif not isinstance(events, Iterable) or isinstance(events, (str, bytes, dict)):
        raise TypeError(f"events must be a PrivacyLedger, an event or an iterable of events, got {type(events).__name__}")
    out = []
    for e in flatten_events(events):
        if not isinstance(e, (PoissonSampledGaussianEvent, GaussianEvent)):
            raise TypeError(f"events must be privacy events, got {type(e).__name__}")
        out.append(e)
    return out


class PrivacyAccountant(abc.ABC):
    """Composes privacy events and converts the total to (ε, δ)."""

    name: str = ""

    def compose(self, event, count: int = 1) -> "PrivacyAccountant":
        """Adds `count` repetitions of `event` (a ledger, event or iterable). Returns self."""
        count = V.check_nonnegative_int(count, "count")
        for e in as_event_list(event):
            if e.count and count:
                self._compose_leaf(e.sampling_rate, e.noise_multiplier, e.count * count)
        return self

    @abc.abstractmethod
    def _compose_leaf(self, sampling_rate: float, noise_multiplier: float, count: int) -> None:
        """Adds `count` steps of one (sub-sampled) Gaussian mechanism."""

    @abc.abstractmethod
    def get_epsilon_and_order(self, delta: float) -> tuple[float, float | None]:
        """(ε, order attaining it) at δ; order is None where undefined (PLD, ε = ∞)."""

    def get_epsilon(self, delta: float) -> float:
        """ε at δ of everything composed so far (0 if nothing was composed)."""
        return self.get_epsilon_and_order(delta)[0]


class RdpAccountant(PrivacyAccountant):
    """RDP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019).

    Args:
      orders: RDP orders α > 1; default :data:`rdp.DEFAULT_ORDERS`
        (dp_accounting's grid).
      conversion: "tight" (Canonne-Kamath-Steinke 2020, default) or "classic"
        (Abadi et al. 2016 Thm 2.2); see :mod:`conversions`.
    """

    name = "rdp"

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

    def get_epsilon_and_order(self, delta):
        delta = V.check_delta(delta)
        if not self._rdp.any():
            return 0.0, None
        return conversions.epsilon_from_rdp(self._orders, self._rdp, delta, self._conversion)

    def get_delta(self, epsilon: float) -> float:
        """Smallest δ at `epsilon` over the order grid."""
        return conversions.delta_from_rdp(self._orders, self._rdp, epsilon, self._conversion)[0]


class MomentsAccountant(RdpAccountant):
    """Abadi et al. 2016's moments accountant: integer λ <= 32, Thm 2.2.

    The log moment at λ is α_M(λ) = λ·r(λ + 1); reported orders are RDP orders
    α = λ + 1 in 2..33.
    """

    name = "moments"

    def __init__(self):
        super().__init__(orders=rdp.MOMENTS_ORDERS, conversion="classic")


class PldAccountant(PrivacyAccountant):
    """Privacy loss distribution accountant, delegating to dp_accounting.

    Uses dp_accounting's pessimistic (upper-bounding) discretization.

    Args:
      value_discretization_interval: PLD grid step (smaller is tighter and slower).

    Raises:
      ImportError: dp_accounting is not installed (``pip install keras-dpsgd[pld]``).
    """

    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4):
        try:
            import dp_accounting  # noqa: F401  (optional dependency)
            from dp_accounting import pld as _pld
        except ImportError as err:
            raise ImportError(_PLD_HINT) from err
        self._dp_accounting = dp_accounting
        self._interval = V.check_positive_float(value_discretization_interval, "value_discretization_interval")
        self._accountant = _pld.PLDAccountant(value_discretization_interval=self._interval)
        self._infinite = False
        self._empty = True

    def _compose_leaf(self, sampling_rate, noise_multiplier, count):
        self._empty = False
        if noise_multiplier == 0.0:
            self._infinite = True
            return
        dp_event = self._dp_accounting.dp_event
        event = dp_event.GaussianDpEvent(noise_multiplier)
        if sampling_rate < 1.0:
            event = dp_event.PoissonSampledDpEvent(sampling_rate, event)
        self._accountant.compose(event, count)

    def get_epsilon_and_order(self, delta):
        delta = V.check_delta(delta)
        if self._infinite:
            return math.inf, None
        if self._empty:
            return 0.0, None
        return max(0.0, float(self._accountant.get_epsilon(delta))), None


def make_accountant(accountant: str | PrivacyAccountant = "rdp") -> PrivacyAccountant:
    """A fresh accountant by name: "rdp", "moments" or "pld"."""
    if accountant == "rdp":
        return RdpAccountant()
    if accountant == "moments":
        return MomentsAccountant()
    if accountant == "pld":
        return PldAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
