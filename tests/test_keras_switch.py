"""Which Keras: the top-level front-end names follow tf.keras (Keras 3 unless TF_USE_LEGACY_KERAS=1).

Each environment runs in a fresh process (the choice, like TensorFlow's, is made once per process);
the saved models are loaded in another fresh process after `import keras_dpsgd` alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

from keras_dpsgd import _which_keras
from tests._parallel import run_jobs

_TIMEOUT = 300


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, "keras3"),
        ("1", "tf_keras"),
        ("true", "tf_keras"),
        ("True", "tf_keras"),
        ("0", "keras3"),
        ("false", "keras3"),
        ("TRUE", "keras3"),
        ("yes", "keras3"),
        ("", "keras3"),
    ],
)
def test_the_env_value_is_read_as_tensorflow_reads_it(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    assert _which_keras.active_front_end() == expected
    # One rule: the CLIs, examples and tools ask it (no second reading of the variable).
    from keras_dpsgd.data import models as _models
    from keras_dpsgd.tools import front as _front

    assert _models.front_end() == _front.active().name == expected


def test_tensorflow_reads_the_same_values():
    """The accepted strings are TensorFlow's own (its source, as installed)."""
    import importlib.util

    spec = importlib.util.find_spec("tensorflow")
    with open(os.path.join(os.path.dirname(spec.origin), "python", "util", "lazy_loader.py")) as f:
        source = f.read()
    assert 'os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1")' in source
    assert _which_keras.LEGACY_VALUES == ("true", "True", "1")


@pytest.fixture
def fake_front_ends(monkeypatch):
    """Two front-end modules: `Both` in each, `OnlyK3` in the Keras 3 one, `OnlyTfk` in the tf_keras one."""
    k3 = types.ModuleType("fake_k3")
    k3.Both, k3.OnlyK3, k3.__all__ = "k3 Both", "k3 OnlyK3", ["Both", "OnlyK3"]
    tfk = types.ModuleType("fake_tfk")
    tfk.Both, tfk.OnlyTfk, tfk.__all__ = "tfk Both", "tfk OnlyTfk", ["Both", "OnlyTfk"]
    monkeypatch.setitem(sys.modules, "fake_k3", k3)
    monkeypatch.setitem(sys.modules, "fake_tfk", tfk)
    return {"keras3": "fake_k3", "tf_keras": "fake_tfk"}


def test_a_name_resolves_on_the_active_front_end_only(fake_front_ends, monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    assert _which_keras.front_end_attribute("Both", modules=fake_front_ends) == "k3 Both"
    assert _which_keras.front_end_attribute("OnlyK3", modules=fake_front_ends) == "k3 OnlyK3"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert _which_keras.front_end_attribute("Both", modules=fake_front_ends) == "tfk Both"


def _assert_refused(modules, name, *parts):
    """Asking the active Keras for `name` raises ImportError whose message holds every one of `parts`."""
    with pytest.raises(ImportError) as err:
        _which_keras.front_end_attribute(name, modules=modules)
    for part in parts:
        assert part in str(err.value), str(err.value)


def test_a_name_of_the_other_keras_is_refused_with_the_switch(fake_front_ends, monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    _assert_refused(
        fake_front_ends,
        "OnlyTfk",
        "not available for Keras 3",
        "TF_USE_LEGACY_KERAS is not set",
        "exists for tf_keras",
        "fake_tfk.OnlyTfk",
        "set TF_USE_LEGACY_KERAS=1",
    )
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "True")
    _assert_refused(
        fake_front_ends,
        "OnlyK3",
        "not available for tf_keras",
        "TF_USE_LEGACY_KERAS='True'",
        "exists for Keras 3",
        "fake_k3.OnlyK3",
        "unset TF_USE_LEGACY_KERAS",
    )
    with pytest.raises(AttributeError, match="NoSuchName"):
        _which_keras.front_end_attribute("NoSuchName", modules=fake_front_ends)


def _run(code: str, env_value: str | None, *args: str) -> subprocess.Popen:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    if env_value is not None:
        env["TF_USE_LEGACY_KERAS"] = env_value
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-3000:]
    assert "could not register" not in err, err[-3000:]
    return out


# Default environment: the top level is keras_dpsgd.keras3; one DP step through it; a Keras 3 and a
# tf_keras model saved (the tf_keras one through the explicit submodule).
_KERAS3_RUN = """
import sys
import numpy as np
import tensorflow as tf
import keras_dpsgd

k3, tfk = keras_dpsgd.keras3, keras_dpsgd.tf_keras
for name in k3.__all__:
    assert getattr(keras_dpsgd, name) is getattr(k3, name), name
assert set(k3.__all__) <= set(keras_dpsgd.__all__)
for name in sorted(set(tfk.__all__) - set(k3.__all__)):
    assert name not in keras_dpsgd.__all__ and name not in dir(keras_dpsgd), name
    try:
        getattr(keras_dpsgd, name)
    except ImportError as err:
        assert "not available for Keras 3" in str(err) and f"keras_dpsgd.tf_keras.{name}" in str(err), err
    else:
        raise AssertionError(f"keras_dpsgd.{name} was handed to a Keras 3 user")
x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
y = np.arange(8) % 3
model = keras_dpsgd.make_private(tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)]))
opt = keras_dpsgd.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
assert isinstance(opt, tf.keras.optimizers.Optimizer) and isinstance(opt, k3.DPSGDOptimizer)
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
assert int(opt.noised_steps.numpy()) == 1
model.save(sys.argv[1])

import tf_keras
legacy = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3)])
legacy.compile(optimizer=tfk.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
               loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
legacy.fit(x, y, batch_size=8, epochs=1, verbose=0)
legacy.save(sys.argv[2])
print("ok")
"""

# TF_USE_LEGACY_KERAS=True: the top level is keras_dpsgd.tf_keras; Keras 3 names are refused.
_TF_KERAS_RUN = """
import numpy as np
import tensorflow as tf
import keras_dpsgd

k3, tfk = keras_dpsgd.keras3, keras_dpsgd.tf_keras
for name in tfk.__all__:
    assert getattr(keras_dpsgd, name) is getattr(tfk, name), name
for name in sorted(set(k3.__all__) - set(tfk.__all__)):
    assert name not in keras_dpsgd.__all__, name
    try:
        getattr(keras_dpsgd, name)
    except ImportError as err:
        assert "not available for tf_keras" in str(err) and f"keras_dpsgd.keras3.{name}" in str(err), err
    else:
        raise AssertionError(f"keras_dpsgd.{name} was handed to a tf_keras user")
try:
    from keras_dpsgd import private_update  # noqa: F401
except ImportError as err:  # the message survives `from ... import`
    assert "unset TF_USE_LEGACY_KERAS" in str(err), err
else:
    raise AssertionError("private_update imported under tf_keras")
x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
y = np.arange(8) % 3
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
opt = keras_dpsgd.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
assert isinstance(opt, tf.keras.optimizers.Optimizer) and type(opt) is tfk.DPSGDOptimizer
model.compile(optimizer=opt,
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
model.fit(x, y, batch_size=8, epochs=1, verbose=0)
assert int(opt.noised_steps.numpy()) == 1
print("ok")
"""

# A fresh process (TF_USE_LEGACY_KERAS=0: Keras 3) loads both files after `import keras_dpsgd` alone.
_LOAD = """
import sys
import keras_dpsgd
import keras
import tf_keras

loaded = keras.saving.load_model(sys.argv[1])
assert type(loaded.optimizer).__module__.startswith("keras_dpsgd.keras3"), type(loaded.optimizer)
assert type(loaded.optimizer) is keras_dpsgd.DPSGDOptimizer is keras_dpsgd.keras3.DPSGDOptimizer
assert int(loaded.optimizer.noised_steps.numpy()) == 1
legacy = tf_keras.models.load_model(sys.argv[2])
assert type(legacy.optimizer) is keras_dpsgd.tf_keras.DPSGDOptimizer, type(legacy.optimizer)
assert int(legacy.optimizer.noised_steps.numpy()) == 1
print("ok")
"""


# A fresh process that imports both Kerases before keras_dpsgd: `from keras_dpsgd import PoissonLots` after
# `import tf_keras` registers both Kerases' classes. It failed (a circular import, logged as "could not
# register"): `from keras_dpsgd import ledger` inside our own imports asked the top-level __getattr__, which
# took it for a front-end name.
_REGISTRATION = """
import numpy, tf_keras, keras
from keras_dpsgd import PoissonLots  # noqa: F401
assert tf_keras.saving.get_registered_object("keras_dpsgd>DPSGDOptimizer") is not None
assert keras.saving.get_registered_object("keras_dpsgd>DPSGDOptimizer") is not None
print("ok")
"""

# The Keras-neutral modules import (and the ledger's state machine runs) without TensorFlow.
_NO_TENSORFLOW = """
import sys
import keras_dpsgd, keras_dpsgd.accounting, keras_dpsgd.tools.adaptive_clipping
import keras_dpsgd.audit, keras_dpsgd.audit.statistics
import keras_dpsgd.dp.ledger_state as S
S.advance(S.initial(), steps=1, sampling_rate=0.1, noise_multipliers=[1.0])
print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
"""


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Every fresh process of this module, two at a time (2 CPU cores); each test reads its own."""
    directory = tmp_path_factory.mktemp("saved")
    paths = str(directory / "keras3.keras"), str(directory / "tf_keras.keras")
    saving = run_jobs(
        {
            "keras3": lambda: _finish(_run(_KERAS3_RUN, None, *paths)),
            "tf_keras": lambda: _finish(_run(_TF_KERAS_RUN, "True")),
        }
    )
    # The load needs the files the Keras 3 process saved (only if it succeeded).
    load = (
        (lambda: _finish(_run(_LOAD, "0", *paths))) if saving["keras3"].exception() is None else saving["keras3"].result
    )
    rest = run_jobs(
        {
            "load": load,
            "registration": lambda: _finish(_run(_REGISTRATION, None)),
            "no_tensorflow": lambda: _finish(_run(_NO_TENSORFLOW, None)),
        }
    )
    return {**saving, **rest}


def test_each_environment_and_saved_models_name_the_right_classes(processes):
    assert processes["keras3"].result().split()[-1] == "ok"
    assert processes["tf_keras"].result().split()[-1] == "ok"
    assert processes["load"].result().split()[-1] == "ok"


def test_keras_neutral_modules_import_without_tensorflow(processes):
    assert processes["no_tensorflow"].result().strip() == "[]"


def test_registration_when_both_kerases_are_imported_before_keras_dpsgd(processes):
    """See _REGISTRATION."""
    assert processes["registration"].result().split()[-1] == "ok"
