"""User-level DP-SGD on the JAX backend: tests/step/test_user_lots.py's checks, run by the JAX step."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "step", "test_user_lots.py")
_SPEC = importlib.util.spec_from_file_location("step_test_user_lots", _PATH)
_TESTS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_TESTS)

releases = _TESTS.releases  # the module-scoped fixture, on this process's backend (JAX)
test_removing_a_user_with_many_examples_moves_the_release_by_at_most_c = (
    _TESTS.test_removing_a_user_with_many_examples_moves_the_release_by_at_most_c
)
test_epsilon_is_reported_over_users = _TESTS.test_epsilon_is_reported_over_users


def test_the_backend_is_jax():
    import keras

    assert keras.config.backend() == "jax"
