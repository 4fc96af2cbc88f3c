"""Which Keras the top-level front-end names serve: the one ``tf.keras`` is (TensorFlow's own rule).

TensorFlow 2.21 routes ``tf.keras`` to tf_keras when the environment variable
``TF_USE_LEGACY_KERAS`` is one of "true", "True" or "1" (exactly those strings:
``tensorflow/python/util/lazy_loader.py`` and ``tensorflow/__init__.py``), and
to Keras 3 otherwise. The same test, made without importing TensorFlow, picks
the front end of ``keras_dpsgd.DPSGDOptimizer`` and of every other name that
exists once per Keras. Each front end lists its names in ``__all__``:
``keras_dpsgd.keras3`` and ``keras_dpsgd.tf_keras``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

__all__ = [
    "ENV_VAR",
    "FRONT_END_MODULES",
    "KERAS3",
    "LEGACY_VALUES",
    "TF_KERAS",
    "active_front_end",
    "front_end_attribute",
    "front_end_names",
    "import_tf_keras",
    "TF_KERAS_EXTRA",
]

ENV_VAR = "TF_USE_LEGACY_KERAS"
LEGACY_VALUES = ("true", "True", "1")  # as TensorFlow reads it
KERAS3 = "keras3"
TF_KERAS = "tf_keras"
FRONT_END_MODULES = {KERAS3: "keras_dpsgd.keras3", TF_KERAS: "keras_dpsgd.tf_keras"}
# tf_keras is an optional dependency: the extra that installs it.
TF_KERAS_EXTRA = 'pip install "keras-dpsgd[tf-keras]"'

_TITLES = {KERAS3: "Keras 3 (`import keras`)", TF_KERAS: "tf_keras (Keras 2, `import tf_keras`)"}
_HOW_TO_SELECT = {
    KERAS3: f"unset {ENV_VAR} (or set it to 0) before TensorFlow is imported",
    TF_KERAS: f"set {ENV_VAR}=1 before TensorFlow is imported",
}


def active_front_end() -> str:
    """``"tf_keras"`` if ``TF_USE_LEGACY_KERAS`` makes tf.keras the legacy Keras, else ``"keras3"``."""
    return TF_KERAS if os.environ.get(ENV_VAR) in LEGACY_VALUES else KERAS3


def import_tf_keras() -> Any:
    """The ``tf_keras`` module: every tf_keras entry point of keras_dpsgd imports it through here.

    Raises:
      ImportError: tf_keras is not installed (an optional extra); the message names the command that
        installs it and the way to Keras 3, which needs no tf_keras.
    """
    try:
        return importlib.import_module("tf_keras")
    except ModuleNotFoundError as err:
        if err.name != "tf_keras":
            raise  # tf_keras is there but one of its own imports failed: its error, unchanged
        value = os.environ.get(ENV_VAR)
        why = f" ({ENV_VAR}={value!r} selects tf_keras)" if value in LEGACY_VALUES else ""
        raise ImportError(
            f"keras_dpsgd's tf_keras (Keras 2) support needs the tf_keras package, which is not installed"
            f"{why}: {TF_KERAS_EXTRA}. Keras 3 (`import keras`, keras_dpsgd.keras3) needs no tf_keras: "
            f"{_HOW_TO_SELECT[KERAS3]}.",
            name="tf_keras",
        ) from err


def front_end_names(front_end: str, modules: Mapping[str, str] = FRONT_END_MODULES) -> list[str]:
    """The public names (``__all__``) of `front_end`'s module; imports it (and so TensorFlow)."""
    return list(importlib.import_module(modules[front_end]).__all__)


def _names_if_importable(front_end: str, modules: Mapping[str, str]) -> list[str]:
    try:
        return front_end_names(front_end, modules)
    except ImportError:  # that Keras is not installed: the name is simply unknown
        return []


def _not_on_active_message(name: str, active: str, other: str, modules: Mapping[str, str]) -> str:
    value = os.environ.get(ENV_VAR)
    why = f"{ENV_VAR}={value!r}" if value is not None else f"{ENV_VAR} is not set"
    return (
        f"keras_dpsgd.{name} is not available for {_TITLES[active]}, the Keras that tf.keras is here "
        f"({why}); it exists for {_TITLES[other]}. Code for that Keras names it explicitly, "
        f"{modules[other]}.{name}, or makes that Keras the default: {_HOW_TO_SELECT[other]}."
    )


def front_end_attribute(name: str, front_end: str | None = None, modules: Mapping[str, str] = FRONT_END_MODULES) -> Any:
    """`name` from the active front end's module (`front_end` if given).

    Raises:
      ImportError: `name` exists only for the other Keras (never hands one Keras's class to the other's
        user); the message says which Keras is active and how to switch. An ImportError, not an
        AttributeError, so that ``from keras_dpsgd import name`` shows this message too.
      AttributeError: neither front end has `name`.
    """
    active = front_end or active_front_end()
    if name in front_end_names(active, modules):
        return getattr(importlib.import_module(modules[active]), name)
    other = KERAS3 if active == TF_KERAS else TF_KERAS
    if name in _names_if_importable(other, modules):
        raise ImportError(_not_on_active_message(name, active, other, modules), name=name)
    raise AttributeError(f"module 'keras_dpsgd' has no attribute {name!r}")
