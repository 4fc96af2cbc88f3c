"""tf_keras is an optional extra (``keras-dpsgd[tf-keras]``): without it Keras 3 works, and every tf_keras
entry point raises an ImportError that names the command installing it (issue 28, item 3).

The missing package is simulated with ``sys.modules["tf_keras"] = None`` (``import tf_keras`` then raises
ModuleNotFoundError, as it does where tf_keras is not installed), in a fresh process: the Keras choice and
``sys.modules`` are per process.
"""

import configparser
import os
import pathlib
import subprocess
import sys
import textwrap

from keras_dpsgd._which_keras import TF_KERAS_EXTRA

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import importlib
    import os
    import sys

    sys.modules["tf_keras"] = None  # as if tf_keras were not installed
    os.environ.pop("TF_USE_LEGACY_KERAS", None)

    import keras_dpsgd
    from keras_dpsgd import PrivacyLogger, WithinLimit, keras3  # Keras 3 and the neutral names: no tf_keras

    PrivacyLogger(1e-5), WithinLimit(1.0, 1e-5), keras3.DPSGDOptimizer(1.0, 1.1)
    import keras_dpsgd.audit as audit

    audit.membership_inference  # the attack takes either Keras's model

    def refused(get):
        try:
            get()
        except ImportError as err:
            assert EXTRA in str(err), str(err)
            return
        raise AssertionError(f"no ImportError from {get}")

    refused(lambda: __import__("keras_dpsgd.tf_keras"))
    refused(lambda: audit.MembershipInferenceCallback)
    refused(lambda: importlib.import_module("keras_dpsgd.preprocessing.normalization").DPNormalization)
    refused(lambda: keras_dpsgd.tools.AdaptiveDPSGDOptimizer)
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # the top-level names now follow tf_keras
    refused(lambda: keras_dpsgd.DPSGDOptimizer)
    print("REFUSED_OK")
    """
)


def test_without_tf_keras_keras3_works_and_every_tf_keras_entry_point_names_the_extra():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    script = f"EXTRA = {TF_KERAS_EXTRA!r}\n" + _SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "REFUSED_OK" in proc.stdout, proc.stderr[-4000:]
    assert "could not register" not in proc.stderr, proc.stderr[-4000:]  # a missing tf_keras is no warning


def test_cli_under_legacy_keras_without_tf_keras_names_the_extra_before_any_work(capsys, monkeypatch):
    from keras_dpsgd.data import datasets as _datasets
    from keras_dpsgd.cli import main

    monkeypatch.setitem(sys.modules, "tf_keras", None)
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")

    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work before checking for tf_keras")

    monkeypatch.setattr(_datasets, "load_dataset", no_work)
    assert main(["train", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and TF_KERAS_EXTRA in err and "TF_USE_LEGACY_KERAS=1" in err, err


def test_tf_keras_is_an_extra_and_part_of_the_test_extra():
    config = configparser.ConfigParser()
    config.read(_ROOT / "setup.cfg")
    required = config["options"]["install_requires"]
    extras = config["options.extras_require"]
    assert "tf-keras" not in required and "tf_keras" not in required
    assert extras["tf-keras"].split() == ["tf-keras>=2.21,<2.22"]
    assert "tf-keras>=2.21,<2.22" in extras["test"].split()
    assert '"keras-dpsgd[tf-keras]"' in TF_KERAS_EXTRA
