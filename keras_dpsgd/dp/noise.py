"""Standard normal noise for the Gaussian mechanism, with tails that reach far enough: one sampler, every backend.

Why not the libraries' own normals: TensorFlow's CPU and GPU samplers (``random_distributions.h``,
``BoxMullerFloat``) turn a 23-bit uniform ``u1`` into the radius ``sqrt(-2 ln u1)`` after clamping
``u1 >= 1e-7``: no sample is ever farther than 5.68 from 0, and the whole mass beyond sits on that radius
(JAX's normal is an inverse-erf of a clamped uniform, truncated likewise). Noise with bounded support breaks
the Gaussian mechanism's guarantee: on neighbouring datasets the noised sums are shifted by up to C, so
outputs near the edge of one support lie outside the other's, with privacy loss ∞. For σ = 1.1 that
happens with probability of order 1e-6 per step, which over thousands of steps dwarfs a δ of 1e-5 (cf.
Mironov 2012, "On significance of the least significant bits for differential privacy").

This sampler is Box–Muller (Box & Muller 1958) from the backend's random words (``ops.random_words``),
except for the radius: ``u1 = (x0 + ½)·2⁻³²`` from a 32-bit word ``x0``, and in the rare pairs with
``x0 = 0`` (probability 2⁻³²) two more words (stream 1) refine it to ``u1 = (x2 + (x3 + ½)·2⁻³²)·2⁻⁶⁴``.
The largest radius is then ``sqrt(2·97·ln 2) ≈ 11.6``: the probability that a shift by C/(σC) = 1/σ
leaves the support is below ``exp(-(11.6 - 1/σ)²/2)`` per pair, under 1e-20 for σ >= 0.5. The refinement
words are drawn only in the rare draws that have a pair with ``x0 = 0`` (``ops.cond``); shapes are static.

The angle's (cos θ, sin θ) come from the table (``ops.unit_circle``): the library's ``cos``/``sin``
(:func:`circle_by_trig`, TensorFlow) or polynomials on one eighth of the circle
(:func:`circle_by_quarter_turns`, JAX: XLA's ``cos``/``sin`` on CPU cost ~6 ns an element).

Several tensors can be one draw (:func:`scaled_normals`): P pairs of words under one key, the pairs of each
tensor after those of the tensors before it (TensorFlow's release; JAX and torch draw each tensor under its own
key). Keys: a seeded optimizer's draw at ledger position `position` is made under :func:`noise_key` (seed,
position, index of the tensor, or of the release's first tensor): reproducible, resumable and never repeated
within a model's ledger.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from keras_dpsgd.dp.ops import ArrayOps

__all__ = [
    "box_muller",
    "scaled_pairs",
    "circle_by_quarter_turns",
    "circle_by_trig",
    "cos_by_quarter_turns",
    "noise_key",
    "scaled_normal",
    "scaled_normals",
]

_TWO_POW_MINUS_32 = 2.0**-32


def coarse_unit(w0: Any) -> Any:
    """``u1 = (w0 + ½)·2⁻³²`` of words already cast to float32 (``u1`` without refinement)."""
    return (w0 + 0.5) * _TWO_POW_MINUS_32


def refined_unit(w0: Any, w2: Any, w3: Any, where: Callable, coarse: Any = None) -> Any:
    """``u1`` from float32 words: ``(w2 + (w3 + ½)·2⁻³²)·2⁻⁶⁴`` where ``w0 == 0``, else :func:`coarse_unit`
    (`coarse`: ``coarse_unit(w0)`` if already computed)."""
    fine = (w2 + coarse_unit(w3)) * _TWO_POW_MINUS_32**2
    return where(w0 == 0.0, fine, coarse_unit(w0) if coarse is None else coarse)


def radius(ops: ArrayOps, u1: Any, scale: Any) -> Any:
    """``scale · sqrt(-2 ln u1)``, the Box–Muller radius."""
    return ops.sqrt(ops.log(u1) * (-2.0 * scale * scale))


def circle_by_trig(cos: Callable, sin: Callable, stack: Callable) -> Callable:
    """``unit_circle`` from a library's ``cos``, ``sin`` and ``stack``: w [P] -> [2, P], θ = 2π·w·2⁻³²."""

    def circle(w1: Any) -> Any:
        angle = w1 * (2.0 * math.pi * _TWO_POW_MINUS_32)
        return stack([cos(angle), sin(angle)])

    return circle


# Taylor coefficients of sin φ / φ and of cos φ in φ²: on |φ| <= π/4 the first omitted terms,
# (π/4)¹¹/11! < 2e-9 and (π/4)¹²/12! < 2e-10, are below float32's half ulp of the results.
_SIN_TAYLOR = (1.0, -1.0 / 6, 1.0 / 120, -1.0 / 5040, 1.0 / 362880)
_COS_TAYLOR = (1.0, -1.0 / 2, 1.0 / 24, -1.0 / 720, 1.0 / 40320, -1.0 / 3628800)


def _horner(coefficients, x):
    acc = coefficients[-1]
    for c in coefficients[-2::-1]:
        acc = acc * x + c
    return acc


def cos_by_quarter_turns(w1: Any, shift: Any, round_: Callable, floor: Callable, where: Callable) -> Any:
    """``cos(θ − shift·π/2)`` of θ = 2π·w1·2⁻³², from polynomials on one eighth of the circle.

    ``shift`` (a whole number, broadcast against ``w1``) 0 gives cos θ and 1 gives sin θ: both halves of a
    Box–Muller pair come out of one elementwise expression over a [2, P] grid, which XLA fuses into its
    consumer without a concatenation.

    The angle, in quarter turns ``4·w1·2⁻³²``, splits into the nearest whole ``q`` and
    ``φ = (4·w1·2⁻³² − q)·π/2``, |φ| <= π/4; the subtraction is exact (Sterbenz), so this is as accurate
    as ``cos`` of the float32 angle (about 1e-7) and exact at the quarter turns. Rotating (cos φ, sin φ) by
    ``(q − shift) mod 4`` quarter turns gives the result.
    """
    quarters = w1 * (4.0 * _TWO_POW_MINUS_32)
    q = round_(quarters)
    phi = (quarters - q) * (math.pi / 2)
    phi2 = phi * phi
    c, s = _horner(_COS_TAYLOR, phi2), phi * _horner(_SIN_TAYLOR, phi2)
    turn = q - shift
    m = turn - 4.0 * floor(turn * 0.25)  # (q − shift) mod 4
    return where(m == 1.0, -s, where(m == 2.0, -c, where(m == 3.0, s, c)))


_SHIFTS = np.arange(2, dtype=np.float32)[:, None]  # [2, 1]: row 0 cos θ, row 1 sin θ


def circle_by_quarter_turns(round_: Callable, floor: Callable, where: Callable) -> Callable:
    """``unit_circle`` as one [2, P] grid of :func:`cos_by_quarter_turns` (no ``cos``/``sin`` called)."""

    def circle(w1: Any) -> Any:
        return cos_by_quarter_turns(w1[None, :], _SHIFTS, round_, floor, where)

    return circle


def _pairs(ops: ArrayOps, u1: Any, w1: Any, scale: Any) -> Any:
    """[2, P]: row 0 ``scale·r cos θ``, row 1 ``scale·r sin θ`` (one elementwise grid)."""
    return ops.reshape(radius(ops, u1, scale), (1, -1)) * ops.unit_circle(w1)


def scaled_pairs(ops: ArrayOps, x0: Any, x1: Any, scale: Any, x2: Any = None, x3: Any = None) -> Any:
    """``scale`` times two standard normals per pair of uint32 words: [2, P] from ``x0``, ``x1`` ([P]).

    Where ``x0 == 0``, the words ``x2``, ``x3`` (same shape, if given) refine ``u1``. Pairs are independent of each
    other: a backend may run this on slices of the words (``keras_dpsgd.backends.torch``: cache-sized chunks).
    """
    w0 = ops.cast(x0, "float32")
    if x2 is None:
        u1 = coarse_unit(w0)
    else:
        u1 = refined_unit(w0, ops.cast(x2, "float32"), ops.cast(x3, "float32"), ops.where)
    return _pairs(ops, u1, ops.cast(x1, "float32"), ops.cast(scale, "float32"))


def box_muller(ops: ArrayOps, x0: Any, x1: Any, x2: Any = None, x3: Any = None) -> Any:
    """Two standard normals per pair of uint32 words: [2, P] from ``x0``, ``x1`` ([P]) (:func:`scaled_pairs`, scale 1)."""
    return scaled_pairs(ops, x0, x1, 1.0, x2, x3)


def scaled_normal(ops: ArrayOps, n: Any, key: Any, scale: Any) -> Any:
    """``scale`` · N(0, I_n), float32 [n]: a function of `key` (``n`` a Python int or a scalar int array).

    Computed in float32; the scale is folded into the radius (one pass fewer over n than ``scale * z``).
    """
    return scaled_normals(ops, [n], key, [scale])[0]


def scaled_normals(
    ops: ArrayOps, sizes: Sequence[Any], key: Any, scales: Sequence[Any], shapes: Sequence[Any] = None
) -> list:
    """``scale_k`` · N(0, I_{n_k}) for each (n_k, scale_k), one draw under `key`; each shaped like the matching
    entry of `shapes` (n_k values) if given, else [n_k].

    The draw has P = Σ_k ⌈n_k/2⌉ pairs of words (rows 0 and 1 of the [2, P] words of `key`'s stream 0); draw k takes
    its pairs after those of the draws before it, as :func:`scaled_normal` takes its ⌈n/2⌉ (row 0 of the pairs,
    then row 1, cut to n): one draw alone is :func:`scaled_normal`'s (0.2.0's values). A traced step builds the
    sampler once per release, not once per tensor: one draw of words, one refinement check (``ops.cond``), one
    radius and one unit circle, then one split. The scale is folded into the radius, per pair where the scales
    differ (one scalar where they are all the same object).
    """
    if not sizes:
        return []
    pairs = [(n + 1) // 2 for n in sizes]
    total = sum(pairs)
    w0, w1 = ops.rows(ops.cast(ops.random_words(key, (2, total), 0), "float32"))  # w0 is 0.0 exactly iff x0 == 0
    coarse = coarse_unit(w0)

    def refined():
        w2, w3 = ops.rows(ops.cast(ops.random_words(key, (2, total), 1), "float32"))
        return refined_unit(w0, w2, w3, ops.where, coarse)

    u1 = ops.cond(ops.reduce_all(w0 != 0.0, None, False), lambda: coarse, refined)
    if all(scale is scales[0] for scale in scales):
        scale = ops.cast(scales[0], "float32")
    else:  # each pair's own: the values of a scalar scale, pair by pair
        scale = ops.concat(
            [ops.ones_like(part) * ops.cast(s, "float32") for part, s in zip(ops.split(w0, pairs, 0), scales)]
        )
    z = _pairs(ops, u1, w1, scale)
    out = []
    for k, (part, n) in enumerate(zip([z] if len(sizes) == 1 else ops.split(z, pairs, 1), sizes)):
        shape = (n,) if shapes is None else tuple(shapes[k])
        if isinstance(n, int) and n % 2 == 0:  # 2P = n values: no pair to cut
            out.append(ops.reshape(part, shape))
        else:
            out.append(ops.reshape(ops.reshape(part, (-1,))[:n], shape))
    return out


def noise_key(ops: ArrayOps, seed: int, position: Any, index: int) -> Any:
    """The key of the noise on tensor `index` of the release at ledger position `position` under `seed`.

    A function of (seed, the release's position in the model's ledger, index): reproducible, resumable, and
    never the same for two tensors of one release or two releases of one ledger. `index` >= 2**30 keeps a
    hook's own release (adaptive clipping's bound queries) apart from the gradient's (0..V-1).
    """
    return ops.fold_in(ops.seed_key(seed, position), index)
