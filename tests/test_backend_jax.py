"""Runs the JAX suite (tests/backends/jax) in one subprocess with the JAX backend (issue 29).

Keras fixes its backend at its first import and this process runs on TensorFlow (tests/conftest.py),
so the JAX modules run in a child with KERAS_DPSGD_JAX_SUITE=1 (their conftest then selects
KERAS_BACKEND=jax), on 2 host CPU devices. The behaviour suite's checks run there too
(tests/backends/jax/test_jax_behaviour.py). On main before issue 29 ``make_private`` refused the JAX backend, so the suite's
first step test fails there.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("jax")


def test_jax_suite_passes():
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.update(
        KERAS_DPSGD_JAX_SUITE="1",
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
        # 2 host CPU devices for keras.distribution.DataParallel (test_jax_distribute.py); set before JAX
        # starts (the JAX suite's conftest sets it too, for a direct run); every other test runs on device 0.
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::UserWarning",
            "-W",
            "ignore::DeprecationWarning",
            str(ROOT / "tests" / "backends" / "jax"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (
        f"the JAX suite failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    )
