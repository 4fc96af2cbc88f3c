"""The lot/release state machine is written once (keras_dpsgd.step.release): both front ends supply its
hooks and override none of it. Its behaviour is the behavioural suite's (tests/test_behaviour.py:
lots, discarded partial lots, noise drawn once per lot, on both Kerases)."""

import pytest

from keras_dpsgd.step.release import LotReleaseMixin, resolve_bounds

HOOKS = {
    "_value",
    "_bounds_variable",
    "_apply_release",
    "_apply_lot_across_replicas",
    "_fit_steps_per_epoch",
    "_first_epoch_of_fit",
    "_first_step_of_fit",
}
OPTIONAL_HOOKS = {"_count_replica_lot", "on_per_example_sq_norms", "on_noised_step"}


def _front_end_mixin(front):
    if front == "tf_keras":
        from keras_dpsgd.tf_keras._sanitizer import DPSanitizerMixin

        return DPSanitizerMixin
    from keras_dpsgd.keras3._optimizer import DPKeras3Mixin

    return DPKeras3Mixin


@pytest.mark.parametrize("front", ["tf_keras", "keras3"])
def test_front_end_supplies_hooks_and_overrides_none_of_the_state_machine(front):
    mixin = _front_end_mixin(front)
    assert issubclass(mixin, LotReleaseMixin)
    machine = {name for name, value in vars(LotReleaseMixin).items() if callable(value)} - HOOKS - OPTIONAL_HOOKS
    assert sorted(machine & set(vars(mixin))) == []
    assert sorted(h for h in HOOKS if h not in vars(mixin)) == []


def test_bounds_by_position_and_by_name():
    assert resolve_bounds(None, ["a", "b"]) == [1.0, 1.0]
    assert resolve_bounds(2.0, ["a", "b"]) == [2.0, 2.0]
    assert resolve_bounds({"d/kernel": 1.0, "d/bias:0": 3.0}, ["d/kernel:0", "d/bias:0"]) == [1.0, 3.0]
    with pytest.raises(ValueError, match=r"one bound per trainable variable \(2: \['a', 'b'\]\), got 1"):
        resolve_bounds([1.0], ["a", "b"])
    with pytest.raises(ValueError, match="no bound for trainable variable 'b'"):
        resolve_bounds({"a": 1.0}, ["a", "b"])
    with pytest.raises(ValueError, match=r"not trainable variables of the model: \['c'\]"):
        resolve_bounds({"a": 1.0, "b": 1.0, "c": 1.0}, ["a", "b"])
