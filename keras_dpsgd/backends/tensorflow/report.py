"""What the per-example backend did in the last traced step: which variables took per-example
jacobians, and why (``PerExampleReport``, read as ``optimizer.per_example_report``).

The fast backend computes a variable's per-example norms and clipped sums from its uses' rules
(ghost norms, book-keeping); a variable with a use no rule reads takes exact per-example jacobians
instead (pfor), which cost about B times its gradient (B: the batch size) in time and B times its
size in memory. That is never silent: a traced step with such a variable logs one warning naming
them, the op that stopped the analysis and the cost (a retrace or an eager step that finds the same
again says nothing more); ``jacobian_fallback="refuse"`` on the DP
optimizer raises instead (:func:`refuse_or_warn`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

FALLBACK_CHOICES = ("warn", "refuse")
COST = "per-example jacobians: about B times the time of their gradient and B times their size in memory (B: the batch)"
_LOG = logging.getLogger("keras_dpsgd")


@dataclasses.dataclass(frozen=True)
class Fallback:
    """One variable that took per-example jacobians: the op where the fast analysis stopped."""

    variable: str
    op: str  # The op's name ("" where no single op is to blame, e.g. an eager step).
    op_type: str
    reason: str

    def __str__(self) -> str:
        where = f" at op {self.op!r} ({self.op_type})" if self.op else ""
        return f"{self.variable!r}{where}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class PerExampleReport:
    """The per-example computation of the last traced step of a DP optimizer.

    Attributes:
      backend: "fast" or "reference" (the optimizer's ``per_example_backend`` resolved).
      fast: names of the variables whose per-example norms came from the fast rules.
      fallback: the variables that took per-example jacobians (:class:`Fallback`: variable, op, op
        type, reason); empty when none did. With ``per_example_backend="reference"`` every
        variable is listed (that backend's choice, not a fallback: no warning).
    """

    backend: str
    fast: tuple[str, ...]
    fallback: tuple[Fallback, ...]

    @property
    def fallback_variables(self) -> list[str]:
        return [f.variable for f in self.fallback]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if not self.fallback:
            return f"keras_dpsgd: per-example gradients of all {len(self.fast)} variables from the fast rules"
        lines = "; ".join(str(f) for f in self.fallback)
        return (
            f"keras_dpsgd: {len(self.fallback)} of {len(self.fast) + len(self.fallback)} variables take {COST}. "
            f"The fast per-example analysis stopped for: {lines}"
        )


def fallback_of(variable: Any, op: Any, reason: str) -> Fallback:
    """The :class:`Fallback` of ``variable`` (named by its name) stopped at ``op`` (or None)."""
    name = getattr(variable, "name", str(variable))
    if op is None:
        return Fallback(name, "", "", reason)
    return Fallback(name, op.name, op.type, reason)


def refuse_or_warn(report: PerExampleReport, mode: str) -> None:
    """With fallbacks: raises ValueError (``mode == "refuse"``, at trace time, before any update) or
    logs one warning (``"warn"``). Nothing without fallbacks."""
    if not report.fallback:
        return
    if mode == "refuse":
        raise ValueError(  # not a privacy refusal: the fallback's cost (exact per-example jacobians), at the user's ask
            f"{report} jacobian_fallback='refuse' was asked: rewrite those layers with ops the fast "
            "backend has rules for (CONTRIBUTING.md, 'A new per-example rule'; "
            "keras_dpsgd.per_example_rules.register_rule), freeze them (trainable = False), or pass "
            "jacobian_fallback='warn' to accept the cost."
        )
    _LOG.warning("%s. Read it as optimizer.per_example_report; jacobian_fallback='refuse' raises instead.", report)
