"""The table of array operations the DP core runs over: one instance per backend.

The core (``keras_dpsgd.dp``) writes each formula once over Python operators (``+ - * /``, comparisons,
``~``, indexing) and the functions of this table; a backend provides one :class:`ArrayOps` built from its
array library (``keras_dpsgd.backends.tensorflow.ops.TF_OPS``, ``keras_dpsgd.backends.jax.ops.JAX_OPS``).
A function here takes and returns that library's arrays; nothing in this module imports an array library.

The random words and keys are the backend's own generator (TensorFlow: Philox under stateless keys; JAX:
threefry): the core turns words into Gaussian noise (:mod:`keras_dpsgd.dp.noise`), the backend only says
how a key becomes words. A key is whatever the backend's generator takes (an int64 [2] tensor, a JAX key).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["ArrayOps"]


@dataclasses.dataclass(frozen=True)
class ArrayOps:
    """The array functions of one backend, by name (the core calls nothing else on an array).

    Elementwise (NumPy broadcasting): ``minimum``, ``maximum``, ``exp``, ``log``, ``sqrt``, ``is_finite``,
    ``where(cond, x, y)``, ``zeros_like``, ``ones_like``; ``cast(x, dtype)`` (a dtype of the library, or
    its name such as ``"float32"``).

    Shapes and reductions: ``reshape(x, shape)``; ``reduce_all(x, axis, keepdims)``; ``group_sum(x,
    groups, num_groups)``: [B, G] with column g the sum of the columns v of x [B, V] whose ``groups[v] ==
    g`` (static ints); ``gather_columns(x, index)``: the columns ``index`` (static ints) of x [B, G];
    ``rows(x)``: the list of x's rows along its first axis (a traced step builds one op, not a slice per row);
    ``concat(xs)``: the arrays of the list `xs` joined along their first axis; ``split(x, sizes, axis)``: the list
    of consecutive parts of x along `axis` of the static lengths `sizes`.

    Control: ``cond(pred, true_fn, false_fn)``: the result of one of two functions of no argument, chosen
    by a scalar bool array (traced as a conditional: only the branch taken runs).

    Randomness (the backend's generator; the core makes the Gaussian): ``random_words(key, shape,
    stream)``: uint32 words, every value of 2³² equally likely, a function of (key, stream in {0, 1})
    alone, independent for different streams; ``fold_in(key, index)``: a new key for a static int;
    ``seed_key(seed, position)``: the key of a Python int seed at an integer array `position`;
    ``unit_circle(w)``: the [2, P] grid (cos θ, sin θ) of θ = 2π·w·2⁻³² for float32 words w [P]
    (``keras_dpsgd.dp.noise.circle_by_trig`` or ``circle_by_quarter_turns``).

    The first six fields are those of the adaptive clipping rules (their order is kept).
    """

    name: str
    minimum: Callable
    maximum: Callable
    exp: Callable
    where: Callable
    zeros_like: Callable
    ones_like: Callable
    log: Callable
    sqrt: Callable
    is_finite: Callable
    cast: Callable
    reshape: Callable
    reduce_all: Callable
    group_sum: Callable
    gather_columns: Callable
    cond: Callable
    random_words: Callable
    fold_in: Callable
    seed_key: Callable
    unit_circle: Callable
    rows: Callable
    concat: Callable
    split: Callable
