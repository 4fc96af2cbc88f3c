"""Registers keras_dpsgd's serializable classes as soon as their Keras is imported.

``tf_keras.models.load_model`` and ``keras.saving.load_model`` find the DP
optimizers and layers of a saved model (``.keras``, SavedModel, h5) by their
registered names ("keras_dpsgd>DPSGDOptimizer", ...), so they must be
registered before a load, although ``import keras_dpsgd`` imports its public
names lazily (``import keras_dpsgd.accounting`` stays free of TensorFlow).
Each Keras's classes are those of its front-end module (``keras_dpsgd.tf_keras``,
``keras_dpsgd.keras3``). If that Keras is imported already they are registered
at once, otherwise right after its import, by an import hook.

Importing TensorFlow imports Keras 3 in the middle of its own import (and Keras
3 imports TensorFlow in the middle of its own), so the registration waits until
no import of TensorFlow, a Keras or keras_dpsgd is under way: registering in the
middle of one would import our modules in a circle. The hook retries after each
of those imports.

Classes made by ``make_dp_optimizer`` for other optimizers are registered
when that function is called: call it before loading a model saved with one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys

from keras_dpsgd._which_keras import FRONT_END_MODULES, KERAS3, TF_KERAS

__all__ = ["register", "register_when_keras_is_imported"]

# The import that makes a front end's classes registrable -> the front end.
_KERAS_PACKAGES = {"tf_keras": TF_KERAS, "keras": KERAS3}
# Packages whose import, while under way, defers the registration, and whose end retries it (with
# every keras_dpsgd module: one of ours may be the import that brought a Keras in).
_WATCHED = ("tensorflow", "keras", "tf_keras")
_LOG = logging.getLogger("keras_dpsgd")

_ORDER = (TF_KERAS, KERAS3)
_wanted: set = set()  # front ends whose Keras is imported and whose classes are not registered yet


def register(front_end: str = TF_KERAS) -> None:
    """Imports the module that defines (and so registers) `front_end`'s serializable classes."""
    importlib.import_module(FRONT_END_MODULES[front_end])


def _watched(name: str) -> bool:
    return name in _WATCHED or name == "keras_dpsgd" or name.startswith("keras_dpsgd.")


def _import_under_way(excluding: str = "") -> bool:
    """Whether TensorFlow, a Keras or keras_dpsgd (other than `excluding`) is in the middle of its import.

    A package is marked as importing until all the submodules its import pulls in are done, so the
    top-level packages (and our own modules) are the ones to look at.
    """
    return any(
        name != excluding and _watched(name) and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


def _register_wanted(just_imported: str = "") -> None:
    """Registers every wanted front end, unless an import it would interleave with is under way.

    `just_imported` has finished executing but is still marked as importing.
    """
    while _wanted and not _import_under_way(excluding=just_imported):
        front_end = min(_wanted, key=_ORDER.index)  # a fixed order, whatever the string hashes
        _wanted.discard(front_end)
        try:
            register(front_end)
        except Exception as err:  # never break the user's import
            _LOG.warning(
                "keras_dpsgd: could not register its %s classes (%s: %s); loading a saved "
                "keras_dpsgd model will fail until `import %s` succeeds.",
                front_end,
                type(err).__name__,
                err,
                FRONT_END_MODULES[front_end],
            )


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Wants a front end registered once its Keras is imported; retries after each watched import."""

    def find_spec(self, fullname, path=None, target=None):
        if not _watched(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if fullname in _KERAS_PACKAGES:
                _wanted.add(_KERAS_PACKAGES[fullname])
            _register_wanted(just_imported=fullname)
            if all(name in sys.modules for name in _KERAS_PACKAGES) and not _wanted and self in sys.meta_path:
                sys.meta_path.remove(self)  # both registered (or reported): nothing left to do

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_keras_is_imported() -> None:
    """Registers each Keras's classes now if that Keras is imported, else right after its import.

    Called at the end of ``keras_dpsgd/__init__.py`` (the package itself is complete by then).
    """
    _wanted.update(front_end for name, front_end in _KERAS_PACKAGES.items() if sys.modules.get(name) is not None)
    _register_wanted(just_imported="keras_dpsgd")
    pending = _wanted or not all(name in sys.modules for name in _KERAS_PACKAGES)
    if pending and not any(isinstance(f, _AfterKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())
