"""Adaptive clipping on torch (issue 39): the checks JAX and torch share (tests/_adaptive_checks.py: per-layer
Three Tools, flat, quantile, divide_by_bound against a one-example loop, a discarded partial lot's norm sums, the
norm query's noise N(0, σ_q² β² C²) and the ledger's ε = the accountant's of the composed release, a hook of one's
own refused). Before issue 39's adaptive work the torch step refused adaptive clipping by name
(adaptive-clipping-backend), so each of these failed there."""

from tests._adaptive_checks import *  # noqa: F403 (the checks JAX and torch share, collected here)
