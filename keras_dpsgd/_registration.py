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
import importlib.util
import logging
import sys

_MODULES = ("keras_dpsgd.optimizer", "keras_dpsgd.pca", "keras_dpsgd.tools._adaptive_tf")
_LOG = logging.getLogger("keras_dpsgd")


def register() -> None:
    """Imports the modules that define keras_dpsgd's serializable classes."""
    for name in _MODULES:
        importlib.import_module(name)


def _register_after_import() -> None:
    try:
        register()
    except Exception as err:  # never break the user's `import tf_keras`
        _LOG.warning(
            "keras_dpsgd: could not register its tf_keras classes (%s: %s); loading a saved "
            "keras_dpsgd model will fail until `import keras_dpsgd.optimizer` succeeds.",
            type(err).__name__, err,
        )


class _AfterTfKerasImport(importlib.abc.MetaPathFinder):
    """Finds tf_keras with the other finders and registers keras_dpsgd after it has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tf_keras":
            return None
        sys.meta_path.remove(self)  # once: tf_keras is imported a single time
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_after_import()

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_tf_keras_is_imported() -> None:
    """Registers now if tf_keras is imported, else right after its import."""
    if "tf_keras" in sys.modules:
        _register_after_import()
    elif not any(isinstance(f, _AfterTfKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTfKerasImport())
