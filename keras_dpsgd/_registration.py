"""Registers keras_dpsgd's serializable tf_keras classes as soon as tf_keras is imported.

``tf_keras.models.load_model`` finds the DP optimizers and layers of a saved
model (``.keras``, SavedModel, h5) by their registered names, so they must be
registered before a load, although ``import keras_dpsgd`` imports its public
names lazily (``import keras_dpsgd.accounting`` stays free of TensorFlow).
If tf_keras is imported already, the classes are registered at once;
otherwise an import hook registers them right after tf_keras is imported.

Classes made by ``make_dp_optimizer`` for other optimizers are registered
when that function is called: call it before loading a model saved with one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys

_MODULES = ("keras_dpsgd.optimizer", "keras_dpsgd.pca", "keras_dpsgd.tools._adaptive_tf")
_LOG = logging.getLogger("keras_dpsgd")


def register() -> None:
    """Imports the modules that define keras_dpsgd's serializable classes."""
    for name in _MODULES:
        importlib.import_module(name)


_pending = False  # tf_keras was imported while a keras_dpsgd module was still importing


def _ours_initializing(excluding: str = "") -> bool:
    """Whether a keras_dpsgd module (other than `excluding`) is in the middle of its import."""
    return any(
        name.startswith("keras_dpsgd") and name != excluding
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


def _register_after_import(importing: str = "") -> None:
    """Registers now, or once the keras_dpsgd import that brought tf_keras in has finished.

    Registering while one of our own modules is half imported (it imported tf_keras at its top) would
    import the optimizer modules in a circle; the finder retries after each keras_dpsgd module import.
    """
    global _pending
    if _ours_initializing(excluding=importing):
        _pending = True
        return
    _pending = False
    try:
        register()
    except Exception as err:  # never break the user's `import tf_keras`
        _LOG.warning(
            "keras_dpsgd: could not register its tf_keras classes (%s: %s); loading a saved "
            "keras_dpsgd model will fail until `import keras_dpsgd.optimizer` succeeds.",
            type(err).__name__, err,
        )


class _AfterTfKerasImport(importlib.abc.MetaPathFinder):
    """Registers keras_dpsgd after tf_keras is imported (and, while that is pending, after our imports)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "tf_keras":
            done = lambda name: _register_after_import()  # noqa: E731
        elif fullname.startswith("keras_dpsgd."):  # may be the import that brought tf_keras in
            done = lambda name: _pending and _register_after_import(importing=name)  # noqa: E731
        else:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            done(fullname)
            if "tf_keras" in sys.modules and not _pending and self in sys.meta_path:
                sys.meta_path.remove(self)  # registered (or reported): nothing left to do

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_tf_keras_is_imported() -> None:
    """Registers now if tf_keras is imported, else right after its import."""
    if "tf_keras" in sys.modules:
        _register_after_import()
    elif not any(isinstance(f, _AfterTfKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTfKerasImport())
