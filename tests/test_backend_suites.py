"""Runs the JAX suite (tests/backends/jax, issue 29) and the torch suite (tests/backends/torch, issue 39), each in
one subprocess with its Keras backend.

Keras fixes its backend at its first import and this process runs on TensorFlow (tests/conftest.py), so each
backend's modules run in a child with KERAS_DPSGD_<BACKEND>_SUITE=1 (its conftest then selects KERAS_BACKEND); the
behaviour suite's checks run there too (tests/backends/<backend>/test_<backend>_behaviour.py). Under ``-n 2`` each
child is a unit of work of its own (tests/_scheduling.py), started first. On main before issue 29 (JAX) and issue 39
(torch) ``make_private`` refused the backend, so each suite's step tests fail there.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What each child's environment adds. JAX: 2 host CPU devices for keras.distribution.DataParallel
# (test_jax_distribute.py), set before JAX starts (the JAX suite's conftest sets it too, for a direct run); every
# other test runs on device 0.
CHILD_ENV = {
    "jax": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    "torch": {},
}


@pytest.mark.parametrize("backend", sorted(CHILD_ENV))
def test_backend_suite_passes(backend):
    pytest.importorskip(backend)
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.update(
        CHILD_ENV[backend],
        KERAS_BACKEND=backend,
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    env[f"KERAS_DPSGD_{backend.upper()}_SUITE"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-W",
            "ignore::UserWarning",
            "-W",
            "ignore::DeprecationWarning",
            str(ROOT / "tests" / "backends" / backend),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (
        f"the {backend} suite failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    )
