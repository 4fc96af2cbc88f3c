"""The table of array operations the DP core runs over: one instance per backend.

The core (``keras_dpsgd.dp``) writes each formula once over Python operators and the functions of this table;
a backend provides one :class:`ArrayOps` built from its array library (``keras_dpsgd.backends.<name>``). A
function here takes and returns that library's arrays; nothing in this module imports an array library.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["ArrayOps"]


@dataclasses.dataclass(frozen=True)
class ArrayOps:
    """The array functions of one backend, by name (the core calls nothing else on an array)."""

    name: str
    minimum: Callable
    maximum: Callable
    exp: Callable
    where: Callable
    zeros_like: Callable
    ones_like: Callable
