"""The suite does not depend on the caller's environment (issue 27, item 10): with TF_USE_LEGACY_KERAS=1
or KERAS_BACKEND=jax exported, every test still runs the Keras it chose (conftest.py normalizes both)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_session_ignores_the_callers_keras_choice():
    assert "TF_USE_LEGACY_KERAS" not in os.environ
    assert os.environ["KERAS_BACKEND"] == "tensorflow"


def test_an_exported_keras_choice_does_not_reach_the_tests():
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", KERAS_BACKEND="jax")
    probe = f"{os.path.relpath(__file__, ROOT)}::test_the_session_ignores_the_callers_keras_choice"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
