"""Certified float32 upper bounds of per-example squared norms: the rounding margins, written once.

The fast rules compute an example's squared gradient norm without its gradient (Goodfellow 2015; Li et al.
2022, ghost norm): ``N² = Σ_{t,s} (a_t·a_s)(δ_t·δ_s)``. Where the rows cancel (``N ≪ S = Σ_t ‖a_t‖‖δ_t‖``) the
float32 rounding of that sum (about ``u·S²``) swamps ``N²``: the computed norm can be 0 or negative and the
example would be released unclipped. Every rule therefore returns an *upper bound* of the true squared norm,
from the standard error analysis of floating-point sums and dot products (Higham 2002, "Accuracy and Stability
of Numerical Algorithms", §3.1 and Lemma 3.1, ``γ_n = n·u / (1 - n·u)``; any order of summation, so the bounds
hold whatever order a BLAS or XLA picks):

* a dot product of n terms: ``|fl(x·y) - x·y| <= γ_n Σ_k |x_k y_k| <= γ_n ‖x‖ ‖y‖``;
* a sum of n nonnegative terms: ``fl(Σ x_k) >= (1 - γ_n) Σ x_k``.

Forms and their bounds (``u`` the unit roundoff of float32, ``2⁻²⁴``; where a GPU runs float32 matmuls in
TensorFloat-32 their inputs are first rounded to 10 mantissa bits, ``u_in = 2⁻¹⁰`` (truncation or rounding),
while products and sums stay float32: every γ below is then :func:`error` ``(1 + u_in)⁴ (1 + γ_n) - 1``):

* :func:`gram_upper` (ghost norm over T rows of widths D and U, and the Embedding's Gram with id equality,
  D = 0): ``N² <= max(N̂², 0) + γ_D Σ α|ŷ| + γ_U Σ β|x̂| + 3γ_Dγ_U S² + γ_{T²+1} P`` with the computed Gram
  entries ``x̂, ŷ``, ``α_ts = ‖a_t‖‖a_s‖``, ``β_ts = ‖δ_t‖‖δ_s‖`` and ``P = Σ|x̂ŷ|``: a posteriori, so where
  nothing cancels the margin is about ``(γ_D + γ_U)·N²``, while it grows to about ``(γ_D + γ_U) S²`` where rows
  cancel (``N ≪ S``).
* :func:`positive_upper` (a sum of squares of materialized entries, Goodfellow's ``‖a‖²‖δ‖²``): relative,
  ``N² <= N̂² / (1 - γ_n)``. Enough where the release sums the *same* materialized per-example gradients.
* :func:`linear_upper` (a materialized sum over T rows whose release is computed apart, e.g. an embedding's
  rows or a bias on a sequence): ``N <= sqrt(N̂² / (1 - γ_n)) + γ_T L`` with ``L = Σ_t ‖a_t‖‖δ_t‖``.

Every bound ends with the factor ``1 + 16u``, which covers the float32 rounding of computing the bound itself
(its constants, products and sums, at most a few ``u`` relative; all its terms are nonnegative) and of the
clip factor ``C / N`` that reads it. The functions use Python operators only (``+ * ** abs``), so they run on
TensorFlow tensors and JAX arrays alike; a length ``n`` may be a Python number or a float32 scalar tensor
(a sequence length known only at run time). Where the margin dominates (rows that cancel) the bound is about
``sqrt(γ) S``: the example is clipped a little more, never less. The release's own rounding (one matmul over
all rows) is then absorbed too: with ``‖ĝ_i‖ <= N + e S``, ``‖ĝ_i‖ / upper <= sqrt(1 + e² / γ)`` (Cauchy-Schwarz),
``1 + O(u)`` for a release in the same precision as the norm.
"""

from __future__ import annotations

__all__ = ["U32", "U_TF32", "gamma", "error", "gram_upper", "positive_upper", "linear_upper", "relu"]

U32 = 2.0**-24  # float32 unit roundoff (round to nearest)
U_TF32 = 2.0**-10  # TensorFloat-32 inputs (10 explicit mantissa bits, truncated or rounded), NVIDIA Ampere and later
_GUARD = 16  # u's of slack for computing the bound and the clip factor in float32


def gamma(n, u: float = U32):
    """Higham's ``γ_n = n·u / (1 - n·u)`` (``n`` a number or a float32 scalar tensor); ∞ where ``n·u >= 1``."""
    if isinstance(n, (int, float)):
        return float("inf") if n * u >= 1.0 else n * u / (1.0 - n * u)
    return n * u / relu(1.0 - n * u)  # a tensor: 1/0 = ∞ where n·u >= 1


def error(n, u: float = U32, u_in: float = 0.0):
    """The relative error bound of n rounded operations on inputs first rounded by ``u_in`` (TF32; 0 otherwise):
    ``(1 + u_in)⁴ (1 + γ_n) - 1`` (four inputs: the two dot products of a Gram term)."""
    return (1.0 + u_in) ** 4 * (1.0 + gamma(n, u)) - 1.0


def relu(x):
    """``max(x, 0)`` with Python operators (exact in floating point; NaN stays NaN)."""
    return (x + abs(x)) * 0.5


def _guarded(x, u: float):
    return x * (1.0 + _GUARD * u)


def gram_upper(gram, abs_terms, s, weighted_a, weighted_g, *, widths, rows, u: float = U32, u_in: float = 0.0):
    """Upper bound of ``N² = Σ_{t,s} x_ts y_ts`` (``x_ts = a_t·a_s``, ``y_ts = δ_t·δ_s``) from its float32 value.

    With ``α_ts = ‖a_t‖‖a_s‖``, ``β_ts = ‖δ_t‖‖δ_s‖``, the computed Gram entries are ``x̂ = x + e``, ``|e| <= γ_D α``,
    ``ŷ = y + f``, ``|f| <= γ_U β``, so ``|Σ x̂ŷ - Σ xy| <= γ_D Σ α|ŷ| + γ_U Σ β|x̂| + 3 γ_D γ_U S²``: the a-posteriori
    weighted sums ``Σ α|ŷ|``, ``Σ β|x̂|`` are about ``N²`` where nothing cancels (at most ``S²`` always), so wide
    layers do not pay ``(D + U)·u·S²``. The products and the sum of the T² terms add ``γ_{T²+1} Σ|x̂ŷ|``.

    Args:
      gram: the computed ``Σ_{t,s} x̂_ts ŷ_ts``, any sign.
      abs_terms: the computed ``P = Σ_{t,s} |x̂_ts ŷ_ts|``.
      s: the computed ``S = Σ_t ‖a_t‖ ‖δ_t‖`` (each norm from its own sum of squares).
      weighted_a: the computed ``Σ_{t,s} ‖a_t‖‖a_s‖ |ŷ_ts|`` (0 where ``D = 0``).
      weighted_g: the computed ``Σ_{t,s} ‖δ_t‖‖δ_s‖ |x̂_ts|``.
      widths: (D, U), the lengths of the two dot products (D = 0 where ``x_ts`` is exact, e.g. 0 or 1).
      rows: T (a number or a float32 scalar tensor).
      u: the unit roundoff of the products and sums.
      u_in: the rounding of the matmuls' inputs (TF32), 0 where there is none.

    Returns:
      ``max(gram, 0) + margin``, guarded: >= the exact ``N²`` of the float32 rows.
    """
    d, w = widths
    # The computed nonnegative sums (S, the weighted sums, P) are low by at most this fraction: sums of squares
    # (D or U terms), square roots, products, T² terms, and a matmul's inputs.
    low = 1.0 - error(d + w + rows * rows + 8, u, u_in)
    e_a, e_g = error(d, u, u_in), error(w, u, u_in)
    pairs = error(rows * rows + 1, u, u_in)
    margin = (e_a * weighted_a + e_g * weighted_g + 3.0 * e_a * e_g * (s * s) + pairs * abs_terms) / (low * low)
    return _guarded(relu(gram) + margin, u)


def positive_upper(sq, terms, u: float = U32, u_in: float = 0.0):
    """Upper bound of a sum of ``terms`` nonnegative products computed as ``sq`` (relative: ``sq / (1 - γ_n)``)."""
    return _guarded(sq / (1.0 - error(terms, u, u_in)), u)


def linear_upper(sq, terms, lengths, rows, u: float = U32, u_in: float = 0.0):
    """Upper bound of ``‖r‖²`` where ``r = Σ_t r_t`` (T rows) was computed as ``r̂`` with ``sq = fl(‖r̂‖²)``.

    Args:
      sq: the computed squared norm of ``r̂`` (a sum of ``terms`` squares).
      terms: how many squares ``sq`` sums.
      lengths: the computed ``L = Σ_t ‖r_t‖`` (an outer product's ``Σ_t ‖a_t‖ ‖δ_t‖``).
      rows: T, the number of rows summed into each entry of ``r̂`` (each entry's error is at most
        ``γ_T Σ_t |r_t|``, whose norm is at most ``γ_T L``).
      u: the unit roundoff.
      u_in: the rounding of the matmuls' inputs (TF32), 0 where there is none.

    Returns:
      ``(sqrt(sq / (1 - γ_terms)) + γ_{T+1} L)²``, guarded (``L`` itself is low by at most ``γ_{terms+T+3}``).
    """
    hat = (positive_upper(sq, terms, u, u_in)) ** 0.5
    slack = error(rows + 1, u, u_in) / (1.0 - gamma(terms + rows + 3, u)) * lengths
    return _guarded((hat + slack) * (hat + slack), u)
