"""The one mechanism for lazily imported public names (PEP 562 module ``__getattr__``).

A package lists each public name with the module that defines it; the module
is imported when the name is first used, and the value is then cached in the
package. This keeps ``import keras_dpsgd.accounting`` (pure numpy/scipy) free
of TensorFlow, and it avoids import cycles between a pure module and the
TensorFlow module that builds on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["attach"]


def attach(
    package: str,
    exports: Mapping[str, str],
    *,
    submodules: Iterable[str] = (),
    fallback: Optional[Callable[[str], Any]] = None,
) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """Returns the ``__getattr__`` and ``__dir__`` of `package` for its lazy public names.

    Usage, in the package's ``__init__.py``::

        __getattr__, __dir__ = _lazy.attach(__name__, {"name": "pkg.module", ...})
        __all__ = sorted(...)

    Args:
      package: the ``__name__`` of the module being defined (already in ``sys.modules``).
      exports: public name -> the absolute name of the module that defines it.
      submodules: submodule names that are attributes of the package (imported on first use).
      fallback: called with a public (not underscore) name that is in neither; returns its value or
        raises (AttributeError when unknown). ``"__all__"`` goes to it too, for a computed ``__all__``.
    """
    namespace = sys.modules[package].__dict__
    submodules = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        if name in submodules or (fallback is not None and _is_submodule(package, name)):
            # A submodule is never a fallback name: `from package import submodule` asks here first,
            # possibly in the middle of the package's own imports.
            return importlib.import_module(f"{package}.{name}")
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif fallback is not None and (name == "__all__" or not name.startswith("_")):
            value = fallback(name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(sys.modules[package].__all__))

    return __getattr__, __dir__


def _is_submodule(package: str, name: str) -> bool:
    """Whether `package`.`name` is a module of the package (found without importing it)."""
    if not name.isidentifier():
        return False
    return importlib.util.find_spec(f"{package}.{name}") is not None
