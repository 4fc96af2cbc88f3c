"""The DP-SGD part of a model's privacy ledger as a pure state machine (no TensorFlow).

A state is plain JSON-able data with one schema::

    {"version": 3,
     "segments": [segment, ...],   # runs of steps with one (q, releases), in order
     "open_start": int | None,      # counter value at which the last segment began; None: it is closed
     "seen": int,                   # the optimizer's step counter when last read
     "searches": [event dict, ...], # hyperparameter searches whose best trial this run is (TuningEvent)
     "covered": int}                # the first steps of the segments, charged inside those searches

    segment = {"sampling_rate": q | None,         # None: the reader's q (B·k/N) applies
               "q_floor": float | None,           # with q None: charge at least this q
               "noise_multipliers": [σ_1, ...],   # the step's Gaussian releases (see below)
               "count": int, "label": str}

While ``open_start`` is set, the last segment is open: its count is ``seen - open_start`` and grows
with the counter. A step is a Poisson-sampled composition of Gaussian releases: one per clipping
group (flat clipping is one group) plus, for adaptive clipping, one per norm query; each release
is recorded by its noise multiplier (noise standard deviation over its ℓ2 sensitivity), and the
accountant derives σ_eff (:func:`keras_dpsgd.accounting.composed_noise_multiplier`).

A search (:func:`record_search`, Papernot & Steinke 2022) charges the trial it released, and the other
trials, through one :class:`~keras_dpsgd.accounting.TuningEvent`: the steps it covers stay in the
segments (they are releases: a seeded noise key counts them) but are not charged again.

A plain (non-DP) optimizer's steps after DP training (the model compiled again) are a closed noiseless
segment, labelled :data:`NON_PRIVATE_LABEL` (:func:`record_non_private`): ε = ∞ from then on.

Every transition returns a new state and never mutates its argument. :mod:`keras_dpsgd.ledger`
does the I/O (the string variables, the optimizer's counter and its saved worst-case bounds).

Fail closed: whatever cannot be attributed exactly (steps between the last read under old
values and the first read under new ones; steps whose segments were not saved) is charged at the
worst case (largest q, smallest σ_eff), which never under-reports ε: the sub-sampled Gaussian's ε
grows with q and shrinks with σ.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from keras_dpsgd.accounting.events import composed_noise_multiplier
from keras_dpsgd.dp.refusals import refuse

VERSION = 3
_KEYS = {"version", "segments", "open_start", "seen", "searches", "covered"}
DPSGD_LABEL = "dp-sgd"
CHANGED_LABEL = f"{DPSGD_LABEL} (q/sigma changed: worst case)"
UNSAVED_LABEL = f"{DPSGD_LABEL} (segments not saved: worst case)"
USER_LEVEL_LABEL = f"{DPSGD_LABEL} (user-level)"  # steps on lots of users (keras_dpsgd.UserPoissonLots)
NON_PRIVATE_LABEL = "non-private training"  # a plain optimizer's steps: noiseless, ε = ∞


def initial() -> dict:
    """The state of a run that has recorded nothing."""
    return {"version": VERSION, "segments": [], "open_start": None, "seen": 0, "searches": [], "covered": 0}


def segment(
    sampling_rate: Optional[float],
    noise_multipliers: Sequence[float],
    count: int,
    label: str = DPSGD_LABEL,
    q_floor: Optional[float] = None,
) -> dict:
    """One segment: `count` steps at q (None: the reader's, at least `q_floor`) with these releases."""
    return {
        "sampling_rate": None if sampling_rate is None else float(sampling_rate),
        "q_floor": None if q_floor is None else float(q_floor),
        "noise_multipliers": [float(s) for s in noise_multipliers],
        "count": int(count),
        "label": str(label),
    }


def is_open(state: dict) -> bool:
    return state["open_start"] is not None


def recorded_steps(state: dict) -> int:
    """Steps the state charges (closed segments and the open one)."""
    return sum(s["count"] for s in state["segments"])


def earlier_steps(state: dict) -> int:
    """Steps recorded before the current counter began (an earlier optimizer's, or a reset counter's)."""
    if not is_open(state):
        return 0
    closed = recorded_steps(state) - state["segments"][-1]["count"]
    return closed - state["open_start"]


def _open(state: dict) -> Optional[dict]:
    return state["segments"][-1] if is_open(state) else None


def _sigma(noise_multipliers: Sequence[float]) -> float:
    return composed_noise_multiplier(noise_multipliers)


def _worst_q(a: Optional[float], b: Optional[float]) -> tuple:
    """(q, q_floor) of the worst case of two q's, None standing for the reader's q."""
    if a is None and b is None:
        return None, None
    if a is None or b is None:
        return None, (a if b is None else b)
    return max(a, b), None


def close_segment(state: dict) -> dict:
    """Closes the open segment (dropped if it holds no step); the next advance opens a new one."""
    new = copy(state)
    if is_open(new):
        if new["segments"][-1]["count"] == 0:
            new["segments"].pop()
        new["open_start"] = None
    return new


def _open_at(state: dict, sampling_rate, noise_multipliers, start: int, label: str = DPSGD_LABEL) -> None:
    state["segments"].append(segment(sampling_rate, noise_multipliers, 0, label))
    state["open_start"] = int(start)


def advance(
    state: dict,
    *,
    steps: int,
    sampling_rate: Optional[float],
    noise_multipliers: Sequence[float],
    counter_is_new: bool = False,
    saved_worst_case: Optional[tuple] = None,
    label: str = DPSGD_LABEL,
) -> dict:
    """The state after reading the counter at `steps`, the last steps run under (q, releases).

    Args:
      state: the state as saved.
      steps: the optimizer's step counter now.
      sampling_rate: q, or None where the optimizer does not know it (then the open segment
        keeps its q: None, the reader's assumption, or a known value).
      noise_multipliers: the noise multipliers of one step's Gaussian releases.
      counter_is_new: the counter restarted (its own copy of the state was lost while the
        model's recorded steps: a SavedModel load, a new optimizer): every step it shows is new.
        A counter below ``seen`` is new too.
      saved_worst_case: (largest q, smallest σ_eff) charged so far, as kept where the segments
        were not (a ``.keras`` file), or None. Used only when the state holds no segment.
      label: the label of the steps from now on (a new label opens a new segment, as a new (q, σ)
        does): ``DPSGD_LABEL``, or :data:`USER_LEVEL_LABEL` for lots of users.

    Returns:
      A new state; `state` is not modified.
    """
    steps = int(steps)
    if steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    sigmas = tuple(float(s) for s in noise_multipliers)
    if not sigmas:
        raise ValueError("noise_multipliers must name at least one Gaussian release, got an empty sequence")
    q = None if sampling_rate is None else float(sampling_rate)
    new = copy(state)
    opened = _open(new)
    if opened is None and not new["segments"]:
        worst = saved_worst_case if steps > 0 else None
        if worst is not None and tuple(worst) != (q, _sigma(sigmas)):
            # Segments lost, counter and worst case kept (.keras): never under-report.
            new["segments"].append(segment(worst[0], [worst[1]], steps, UNSAVED_LABEL))
            _open_at(new, q, sigmas, steps, label)
        else:
            # Nothing known about earlier steps: they ran with the current values.
            _open_at(new, q, sigmas, 0, label)
    elif opened is None:
        _open_at(new, q, sigmas, new["seen"] if steps >= new["seen"] and not counter_is_new else 0, label)
    else:
        if q is None:
            q = opened["sampling_rate"]  # the optimizer does not know q: nothing new about it
        old = (opened["sampling_rate"], tuple(opened["noise_multipliers"]))
        changed = old != (q, sigmas) or opened["label"] != label
        reset = steps < new["seen"] or (counter_is_new and recorded_steps(new) > 0)
        first_unread = 0 if reset else new["seen"]
        if changed or reset:
            new = close_segment(new)
            start = first_unread
            if changed and steps > first_unread:
                worst_q, floor = _worst_q(q, old[0])
                sigma = min(_sigma(sigmas), _sigma(old[1]))
                new["segments"].append(segment(worst_q, [sigma], steps - first_unread, CHANGED_LABEL, floor))
                start = steps
            _open_at(new, q, sigmas, start, label)
    new["seen"] = steps
    new["segments"][-1]["count"] = steps - new["open_start"]
    return new


def record_non_private(state: dict, count: int) -> dict:
    """The state after `count` steps of a plain (non-DP) optimizer: a closed noiseless segment (ε = ∞).

    They touched every example with no noise: q = 1, σ = 0 (:data:`NON_PRIVATE_LABEL`). The open segment is
    closed first; ``seen`` is kept, so the next advance of the same DP counter opens its segment there (its
    earlier steps are not counted again) and a new counter (``counter_is_new``) opens at 0.
    """
    count = int(count)
    if count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    new = close_segment(state)
    if count:
        new["segments"].append(segment(1.0, [0.0], count, NON_PRIVATE_LABEL))
    return new


def is_non_private(label: str) -> bool:
    """True for the label of a plain optimizer's steps (:func:`record_non_private`)."""
    return label == NON_PRIVATE_LABEL


def discard_partial_lot(state: dict) -> dict:
    """The state after an incomplete lot is discarded: unchanged (no noise drawn, no release)."""
    return copy(state)


def merge(*states: dict) -> dict:
    """Of several saved copies of one run's state, the one that recorded more (a lost copy never lowers ε).

    The searches are those of the copy that holds the most; the steps they cover, the fewest any copy says.
    """
    if not states:
        raise ValueError("merge needs at least one state")
    new = copy(max(states, key=recorded_steps))
    searched = max(states, key=lambda s: len(s["searches"]))
    new["searches"] = [dict(e) for e in searched["searches"]]
    new["covered"] = min(s["covered"] for s in states if s["searches"]) if new["searches"] else 0
    return new


def record_search(state: dict, event: dict) -> dict:
    """The state after the run so far is recorded as the released trial of a search (a TuningEvent's dict).

    Every step recorded so far becomes covered by the search (the caller checks that the search's
    trial bound covers them); later steps are charged as before.
    """
    new = copy(state)
    new["searches"].append(dict(event))
    new["covered"] = recorded_steps(new)
    return new


def searches(state: dict) -> list:
    """The searches' event dicts, in order."""
    return [dict(e) for e in state["searches"]]


def resume(state: dict, restored: dict) -> dict:
    """The state after `restored` (a checkpoint's copy) replaces the live one: the one recording more."""
    return merge(restored, state)


def events(state: dict, reader_sampling_rate: float) -> list:
    """The segments with steps not covered by a search, as ``(q, noise_multipliers, count, label)``; q None resolved.

    A segment of unknown q is charged at the reader's q, at least its floor.
    """
    out = []
    covered = state["covered"]
    for s in state["segments"]:
        skipped = min(covered, s["count"])
        covered -= skipped
        s = dict(s, count=s["count"] - skipped)
        if s["count"] == 0:
            continue
        q = s["sampling_rate"]
        if q is None:
            q = max(float(reader_sampling_rate), s["q_floor"] or 0.0)
        out.append((q, tuple(s["noise_multipliers"]), s["count"], s["label"]))
    return out


def fold_bounds(state: dict, bounds: tuple) -> tuple:
    """`bounds` (largest q, smallest σ_eff charged so far) widened by every DP segment of known q.

    The open segment counts from the moment it opens (before its first step). The bounds charge a DP
    optimizer's counted steps: a plain optimizer's (:func:`record_non_private`) are not among them.
    """
    pairs = [
        (s["sampling_rate"], _sigma(s["noise_multipliers"]))
        for s in state["segments"]
        if s["sampling_rate"] is not None and not is_non_private(s["label"])  # no step of a DP counter
    ]
    if not pairs:
        return tuple(bounds)
    return max([bounds[0]] + [p[0] for p in pairs]), min([bounds[1]] + [p[1] for p in pairs])


def widen_bounds(bounds: tuple, sampling_rate: float, sigma: float) -> tuple:
    """`bounds` (largest q, smallest σ_eff) widened by steps taken at (q, σ)."""
    return max(bounds[0], float(sampling_rate)), min(bounds[1], float(sigma))


def saved_worst_case(bounds: Optional[tuple], sampling_rate: Optional[float], sigma: float) -> Optional[tuple]:
    """(max q, min σ) over saved `bounds` and the current (q, σ); None when nothing was saved."""
    if bounds is None or bounds[0] <= 0.0:
        return None
    q = bounds[0] if sampling_rate is None else max(bounds[0], sampling_rate)
    return q, min(bounds[1], sigma)


# -------------------------------------------------------------------- serialization
def copy(state: dict) -> dict:
    return {
        "version": VERSION,
        "segments": [dict(s, noise_multipliers=list(s["noise_multipliers"])) for s in state["segments"]],
        "open_start": state["open_start"],
        "seen": state["seen"],
        "searches": [dict(e) for e in state.get("searches", [])],
        "covered": int(state.get("covered", 0)),
    }


def _from_version_1(data: dict) -> dict:
    """The two-schema state of keras_dpsgd <= this release: closed event dicts plus an open (q, σ, start)."""
    state = initial()
    for e in data["closed"]:
        state["segments"].append(
            segment(
                e["sampling_rate"], [e["noise_multiplier"]], e["count"], e.get("label", DPSGD_LABEL), e.get("q_floor")
            )
        )
    opened = data["open"]
    if opened is not None:
        state["segments"].append(segment(opened["q"], [opened["sigma"]], data["seen"] - opened["start"]))
        state["open_start"] = int(opened["start"])
    state["seen"] = int(data["seen"])
    return state


def loads(raw: str) -> dict:
    """A state from its JSON (empty: the initial state); reads this version and version 1."""
    if not raw:
        return initial()
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise refuse("foreign-ledger-state", f"a saved ledger state must be a JSON object, got {raw[:200]!r}")
    if set(data) == {"closed", "open", "seen"}:
        return _from_version_1(data)
    if data.get("version") == 2 and set(data) == _KEYS - {"searches", "covered"}:
        return copy(data)  # version 2: no search
    if data.get("version") != VERSION or set(data) != _KEYS:
        raise refuse(
            "foreign-ledger-state", f"not a keras_dpsgd ledger state (version {VERSION}, 2 or 1): {raw[:200]!r}"
        )
    return copy(data)


def dumps(state: dict) -> str:
    """The JSON of a state: version 2 (which earlier releases read) unless it records a search."""
    if not state["searches"] and not state["covered"]:
        state = dict({k: v for k, v in state.items() if k not in ("searches", "covered")}, version=2)
    return json.dumps(state, sort_keys=True)
