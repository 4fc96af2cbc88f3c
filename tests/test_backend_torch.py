"""Runs the torch suite (tests/backends/torch) in one subprocess with the torch backend (issue 39).

Keras fixes its backend at its first import and this process runs on TensorFlow (tests/conftest.py),
so the torch modules run in a child with KERAS_DPSGD_TORCH_SUITE=1 (their conftest then selects
KERAS_BACKEND=torch). The behaviour suite's checks run there too (tests/backends/torch/test_torch_behaviour.py).
On main before issue 39 ``make_private`` refused the torch backend, so every step test fails there.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("torch")


def test_torch_suite_passes():
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env.update(
        KERAS_DPSGD_TORCH_SUITE="1",
        KERAS_BACKEND="torch",
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
            "-p",
            "no:xdist",
            "-W",
            "ignore::UserWarning",
            "-W",
            "ignore::DeprecationWarning",
            str(ROOT / "tests" / "backends" / "torch"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"the torch suite failed (rc {proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    )
