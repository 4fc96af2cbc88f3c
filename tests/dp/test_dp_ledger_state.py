"""The ledger's pure state machine (keras_dpsgd.dp.ledger_state), table-tested without TensorFlow.

Each row: a sequence of counter reads (steps, q, releases) and the segments the ledger must charge,
against the accountant of the segments (ε is the accountant's, so the table states the events).
"""

import json

import pytest

from keras_dpsgd.dp import ledger_state as S

CHANGED, UNSAVED = S.CHANGED_LABEL, S.UNSAVED_LABEL


def _run(reads, state=None, **kwargs):
    state = S.initial() if state is None else state
    for steps, q, sigmas, *flags in reads:
        state = S.advance(
            state,
            steps=steps,
            sampling_rate=q,
            noise_multipliers=sigmas,
            counter_is_new=bool(flags and flags[0]),
            **kwargs,
        )
    return state


def _seg(q, sigmas, count, label="dp-sgd", floor=None):
    return (q, tuple(sigmas), count, label, floor)


def _segments(state):
    return [
        (s["sampling_rate"], tuple(s["noise_multipliers"]), s["count"], s["label"], s["q_floor"])
        for s in state["segments"]
        if s["count"]
    ]


TABLE = {
    "nothing read": ([], []),
    "one read": ([(5, 0.1, [1.1])], [_seg(0.1, [1.1], 5)]),
    "reads under one setting add up": ([(3, 0.1, [1.1]), (7, 0.1, [1.1])], [_seg(0.1, [1.1], 7)]),
    "a change seen at once splits exactly": (
        [(3, 0.1, [1.1]), (3, 0.1, [0.9]), (8, 0.1, [0.9])],
        [_seg(0.1, [1.1], 3), _seg(0.1, [0.9], 5)],
    ),
    "steps between reads across a change are the worst case": (
        [(3, 0.1, [1.1]), (6, 0.2, [1.3]), (8, 0.2, [1.3])],
        [_seg(0.1, [1.1], 3), _seg(0.2, [1.1], 3, CHANGED), _seg(0.2, [1.3], 2)],
    ),
    "unknown q keeps the segment's q": ([(2, 0.1, [1.1]), (4, None, [1.1])], [_seg(0.1, [1.1], 4)]),
    "unknown then known q: floor": (
        [(2, None, [1.1]), (4, 0.3, [1.1])],
        [_seg(None, [1.1], 2), _seg(None, [1.1], 2, CHANGED, floor=0.3)],
    ),
    "a per-layer step keeps its releases": ([(4, 0.1, [2.0, 2.0])], [_seg(0.1, [2.0, 2.0], 4)]),
    "worst case of releases is their σ_eff": (
        [(1, 0.1, [2.0, 2.0]), (3, 0.1, [1.5])],
        [_seg(0.1, [2.0, 2.0], 1), _seg(0.1, [(2 / 2.0**2) ** -0.5], 2, CHANGED)],
    ),
    "a counter below the last read is new": (
        [(5, 0.1, [1.1]), (2, 0.1, [1.1])],
        [_seg(0.1, [1.1], 5), _seg(0.1, [1.1], 2)],
    ),
    "a new counter (its copy lost) adds to the history": (
        [(5, 0.1, [1.1]), (5, 0.1, [1.1], True)],
        [_seg(0.1, [1.1], 5), _seg(0.1, [1.1], 5)],
    ),
}


@pytest.mark.parametrize("reads,expected", list(TABLE.values()), ids=list(TABLE))
def test_transitions(reads, expected):
    state = _run(reads)
    assert _segments(state) == expected
    assert S.recorded_steps(state) == sum(e[2] for e in expected)


def test_lost_segments_are_charged_at_the_saved_worst_case():
    state = _run([(6, 0.1, [1.1])], saved_worst_case=(0.2, 0.9))
    assert _segments(state) == [_seg(0.2, [0.9], 6, UNSAVED)]
    state = S.advance(state, steps=9, sampling_rate=0.1, noise_multipliers=[1.1])
    assert _segments(state) == [_seg(0.2, [0.9], 6, UNSAVED), _seg(0.1, [1.1], 3)]
    # An unchanged run keeps exactly its setting.
    assert _segments(_run([(6, 0.1, [1.1])], saved_worst_case=(0.1, 1.1))) == [_seg(0.1, [1.1], 6)]


def test_transitions_do_not_mutate_their_input():
    state = _run([(3, 0.1, [1.1])])
    frozen = json.dumps(state, sort_keys=True)
    S.advance(state, steps=9, sampling_rate=0.2, noise_multipliers=[0.5])
    S.close_segment(state)
    S.discard_partial_lot(state)
    S.merge(state, S.initial())
    assert json.dumps(state, sort_keys=True) == frozen


def test_close_segment_then_advance_continues_from_the_last_read():
    state = S.close_segment(_run([(3, 0.1, [1.1])]))
    assert not S.is_open(state)
    state = S.advance(state, steps=5, sampling_rate=0.1, noise_multipliers=[1.1])
    assert _segments(state) == [_seg(0.1, [1.1], 3), _seg(0.1, [1.1], 2)]
    assert S.close_segment(S.close_segment(S.initial())) == S.initial()


def test_a_discarded_lot_charges_nothing():
    state = _run([(3, 0.1, [1.1])])
    assert S.discard_partial_lot(state) == state


def test_merge_and_resume_keep_the_copy_that_recorded_more():
    small, big = _run([(2, 0.1, [1.1])]), _run([(7, 0.1, [1.1])])
    assert S.merge(small, big) == big and S.merge(big, small) == big
    assert S.resume(small, restored=big) == big and S.resume(big, restored=small) == big
    with pytest.raises(ValueError):
        S.merge()


def test_earlier_steps_are_those_the_current_counter_does_not_hold():
    state = _run([(5, 0.1, [1.1]), (2, 0.1, [1.1], True)])
    assert S.earlier_steps(state) == 5
    assert S.earlier_steps(_run([(3, 0.1, [1.1]), (3, 0.1, [0.9]), (8, 0.1, [0.9])])) == 0


def test_events_resolve_an_unknown_q_at_the_reader_q_and_at_least_its_floor():
    state = _run([(2, None, [1.1]), (4, 0.3, [1.1])])
    assert S.events(state, 0.1) == [(0.1, (1.1,), 2, "dp-sgd"), (0.3, (1.1,), 2, CHANGED)]
    assert S.events(state, 0.5) == [(0.5, (1.1,), 2, "dp-sgd"), (0.5, (1.1,), 2, CHANGED)]


def test_bounds_fold_every_segment_of_known_q():
    state = _run([(3, 0.1, [1.1]), (3, 0.2, [2.0, 2.0])])
    assert S.fold_bounds(state, (0.0, float("inf"))) == (0.2, 1.1)
    assert S.fold_bounds(_run([(3, 0.2, [2.0, 2.0])]), (0.1, 3.0)) == (0.2, (2 / 2.0**2) ** -0.5)
    assert S.fold_bounds(_run([(3, None, [1.1])]), (0.0, float("inf"))) == (0.0, float("inf"))
    assert S.saved_worst_case((0.0, float("inf")), 0.1, 1.1) is None
    assert S.saved_worst_case((0.2, 1.0), None, 1.1) == (0.2, 1.0)
    assert S.saved_worst_case((0.2, 1.0), 0.3, 0.9) == (0.3, 0.9)


def test_json_round_trip_and_version_1_states_load():
    state = _run([(3, 0.1, [1.1]), (6, 0.2, [1.3])])
    assert S.loads(S.dumps(state)) == state
    assert S.loads("") == S.initial()
    old = {
        "closed": [
            {
                "type": "poisson_sampled_gaussian",
                "sampling_rate": 0.1,
                "noise_multiplier": 1.1,
                "count": 3,
                "label": "dp-sgd",
            }
        ],
        "open": {"q": 0.2, "sigma": 1.3, "start": 3},
        "seen": 7,
    }
    loaded = S.loads(json.dumps(old))
    assert _segments(loaded) == [_seg(0.1, [1.1], 3), _seg(0.2, [1.3], 4)]
    assert _segments(S.advance(loaded, steps=9, sampling_rate=0.2, noise_multipliers=[1.3])) == [
        _seg(0.1, [1.1], 3),
        _seg(0.2, [1.3], 6),
    ]
    for bad in ("[]", '{"segments": []}', '{"version": 3, "segments": [], "open_start": null, "seen": 0}'):
        with pytest.raises(ValueError):
            S.loads(bad)


@pytest.mark.parametrize("kwargs", [dict(steps=-1, noise_multipliers=[1.0]), dict(steps=1, noise_multipliers=[])])
def test_bad_reads_are_refused(kwargs):
    with pytest.raises(ValueError):
        S.advance(S.initial(), sampling_rate=0.1, **kwargs)


# Imports without TensorFlow: tests/test_keras_switch.py::test_keras_neutral_modules_import_without_tensorflow.


def test_a_recorded_search_covers_the_steps_so_far_and_later_steps_are_charged():
    search = {"type": "tuning", "distribution": "poisson", "mu": 2.0}  # the state stores the dict as given
    state = _run([(3, 0.1, [1.1]), (6, 0.2, [1.3])])
    searched = S.record_search(state, search)
    assert S.searches(searched) == [search] and searched["covered"] == 6
    assert S.events(searched, 0.5) == []  # the search charges them
    later = _run([(10, 0.2, [1.3])], searched)
    assert S.events(later, 0.5) == [(0.2, (1.3,), 4, "dp-sgd")]
    assert S.recorded_steps(later) == 10  # the covered steps stay releases (seeded noise keys count them)
    assert S.loads(S.dumps(later)) == later
    # a copy that lost the search never wins: the merge keeps it, and covers the fewest steps any copy says
    merged = S.merge(_run([(12, 0.2, [1.3])], state), later)
    assert S.searches(merged) == [search] and merged["covered"] == 6 and S.recorded_steps(merged) == 12


def test_version_2_states_load_without_searches():
    state = _run([(3, 0.1, [1.1])])
    old = {k: v for k, v in state.items() if k not in ("searches", "covered")}
    loaded = S.loads(json.dumps(dict(old, version=2)))
    assert loaded == state and S.searches(loaded) == []


def test_a_new_label_opens_a_new_segment():
    user = S.USER_LEVEL_LABEL
    state = S.advance(S.initial(), steps=3, sampling_rate=0.1, noise_multipliers=[1.1], label=user)
    state = S.advance(state, steps=5, sampling_rate=0.1, noise_multipliers=[1.1], label=user)
    state = S.advance(state, steps=5, sampling_rate=0.1, noise_multipliers=[1.1])  # read at once under the new label
    state = S.advance(state, steps=7, sampling_rate=0.1, noise_multipliers=[1.1])
    assert _segments(state) == [_seg(0.1, [1.1], 5, user), _seg(0.1, [1.1], 2)]


def test_a_plain_optimizers_steps_are_a_noiseless_segment_between_the_dp_ones():
    """A model compiled again after a plain optimizer's steps: they follow the DP steps as a closed segment of
    q = 1, σ = 0, the same DP counter then continues from its last read and a new one counts from 0."""
    plain = _seg(1.0, [0.0], 2, S.NON_PRIVATE_LABEL)
    state = S.record_non_private(_run([(3, 0.1, [1.1])]), 2)
    assert not S.is_open(state) and _segments(state) == [_seg(0.1, [1.1], 3), plain]
    assert S.record_non_private(state, 0) == state
    same = S.advance(state, steps=5, sampling_rate=0.1, noise_multipliers=[1.1])  # its 3 steps not counted again
    assert _segments(same) == [_seg(0.1, [1.1], 3), plain, _seg(0.1, [1.1], 2)]
    new = S.advance(state, steps=4, sampling_rate=0.2, noise_multipliers=[1.1], counter_is_new=True)
    assert _segments(new) == [_seg(0.1, [1.1], 3), plain, _seg(0.2, [1.1], 4)]
    assert S.recorded_steps(new) == 9 and S.earlier_steps(new) == 5
    assert S.events(new, 0.5)[1] == (1.0, (0.0,), 2, S.NON_PRIVATE_LABEL)
    assert S.fold_bounds(new, (0.0, float("inf"))) == (0.2, 1.1)  # the DP optimizers' steps only
    assert S.loads(S.dumps(new)) == new
    with pytest.raises(ValueError, match="count must be an integer >= 0, got -1"):
        S.record_non_private(state, -1)
