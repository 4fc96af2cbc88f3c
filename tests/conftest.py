import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Tests set what they need: the caller's Keras choice (TF_USE_LEGACY_KERAS, exported by many tf_keras
# users; KERAS_BACKEND) must not change which Keras a test runs, here or in the subprocesses it
# starts. A test that wants tf_keras sets TF_USE_LEGACY_KERAS itself (monkeypatch, a subprocess's env).
os.environ.pop("TF_USE_LEGACY_KERAS", None)
os.environ["KERAS_BACKEND"] = "tensorflow"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (pytest-xdist's default ``--dist load``): whole modules per worker, the
    distribution modules together, the longest first (tests/_scheduling.py)."""
    if config.getvalue("dist") != "load":
        return None
    from _scheduling import ModuleScheduling

    return ModuleScheduling(config, log)
