import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n N`` (pytest-xdist's default ``--dist load``): whole modules per worker, the
    distribution modules together, the longest first (tests/_scheduling.py)."""
    if config.getvalue("dist") != "load":
        return None
    from _scheduling import ModuleScheduling

    return ModuleScheduling(config, log)
