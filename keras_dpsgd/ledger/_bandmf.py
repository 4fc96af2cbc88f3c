"""The model ledger's events for a BandMF optimizer: its own steps as :class:`BandMFEvent`, the rest as recorded.

A BandMF optimizer (``keras_dpsgd.keras3.BandMFSGDOptimizer``) records its steps in the model's ledger like any DP
optimizer: segments of (q, σ, count). Only its own steps (the last ``recorded − earlier`` of the model's ledger:
an earlier optimizer's steps, or steps of a counter that restarted, are not its own) are BandMF releases on
cyclic lots; they become BandMF events of its bands and column norm, each charged at the smallest σ of those
segments (a participation's rows may straddle two segments). Every other step keeps its DP-SGD event (each step
a Poisson-sampled Gaussian at its q: an upper bound on a BandMF step too); a plain optimizer's steps between two of
its own (the model compiled again) keep their noiseless event. Fail closed: where the state says
nothing about which steps are its own (no open segment), none is converted.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.accounting import BandMFEvent

__all__ = ["bandmf_events"]


def bandmf_events(state: dict, segments: Sequence[tuple], optimizer: Any, step_event: Callable) -> list:
    """The events of `segments` (``dp.ledger_state.events``: (q, σs, count, label), in order), the optimizer's own
    last steps as BandMF events (module docstring)."""
    own = S.recorded_steps(state) - S.earlier_steps(state) if S.is_open(state) else 0
    earlier, mine = [], []  # both newest first while walking back
    for q, sigmas, count, label in reversed(segments):
        take = 0 if S.is_non_private(label) else min(count, own)  # a plain optimizer's steps: never its own
        own -= take
        if take:
            mine.append((q, sigmas, take))
        if count - take:
            earlier.append(step_event(q, sigmas, count - take, label))
    if not mine:
        return earlier[::-1]
    sigma = min(step_event(q, sigmas, 1).noise_multiplier for q, sigmas, _ in mine)
    bands, norm = optimizer.bandmf_bands, optimizer.bandmf_column_norm
    own_events = [BandMFEvent(q, sigma, steps=n, bands=bands, column_norm=norm) for q, _, n in mine]
    return earlier[::-1] + own_events[::-1]
