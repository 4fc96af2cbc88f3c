"""The adaptive clipping bound rules as array math, written once for every backend.

Three Tools (van der Veen et al. 2018, Sec. 3) rule "mean" and Andrew et al. 2021 rule "quantile";
the derivation and the privacy accounting are in :mod:`keras_dpsgd.tools.adaptive_clipping`. Each
function takes the adaptive settings (``_adaptive_core._Settings``: rule, alpha, beta, min_clip_bound,
target_quantile, quantile_learning_rate) and the backend's :class:`ArrayOps`; the backend supplies
the state (TensorFlow: ``_adaptive_core.AdaptiveClippingCore``'s variables and hooks; JAX: the
stateless plumbing of ``keras_dpsgd.backends.jax._adaptive``). Nothing here imports an array library.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["ArrayOps", "next_bounds", "query_sensitivity", "query_terms"]


@dataclasses.dataclass(frozen=True)
class ArrayOps:
    """The array functions the bound rules use, from one backend's library (TensorFlow: :data:`TF_OPS`;
    JAX: ``keras_dpsgd.backends.jax._adaptive``): the rules below are written once, over these."""

    minimum: Callable
    maximum: Callable
    exp: Callable
    where: Callable
    zeros_like: Callable
    ones_like: Callable


def query_terms(settings: Any, norms: Any, bounds: Any, finite: Any, ops: ArrayOps) -> Any:
    """[B, G] each example's term of each group's bound query, 0 for a non-finite example.

    Rule "mean" (Three Tools, Sec. 3): min(‖g_i^g‖, β C_g); rule "quantile" (Andrew et al. 2021,
    Alg. 1): 1[‖g_i^g‖ <= C_g]. `norms` [B, G], `bounds` [1, G] (in force), `finite` [B, 1].
    """
    if settings.rule == "quantile":
        terms = ops.where(norms <= bounds, ops.ones_like(norms), ops.zeros_like(norms))
    else:
        terms = ops.minimum(norms, settings.beta * bounds)
    return ops.where(finite, terms, ops.zeros_like(terms))


def query_sensitivity(settings: Any, bounds: Any) -> Any:
    """[G] the L2 sensitivity of each group's query sum to one example: β C_g ("mean"), 1 (a count).

    The query is released as Σ_i term_i + N(0, σ_q,g² · sensitivity²)."""
    return 1.0 if settings.rule == "quantile" else settings.beta * bounds


def next_bounds(settings: Any, bounds: Any, released: Any, ops: ArrayOps) -> Any:
    """[G] the next bounds from the bounds in force and the released query divided by L.

    "mean": C ← α · released; "quantile": C ← C · exp(-η (b̃ - target_quantile)), b̃ = released;
    both floored at ``min_clip_bound``. Post-processing of the released query only."""
    if settings.rule == "quantile":
        new = bounds * ops.exp(-settings.quantile_learning_rate * (released - settings.target_quantile))
    else:
        new = settings.alpha * released
    return ops.maximum(new, settings.min_clip_bound)
