"""Algorithm 1 of Abadi et al. 2016 (DP-SGD), written once: :func:`private_step`, every backend's step.

The backend computes what needs its library (each example's squared gradient norms, and the clipped sum
``Σ_i c_i g_i`` given the factors c: TensorFlow's graph rules or jacobians, JAX's ``vmap``); the front
end keeps the state (the lot, ``noised_steps``) where its Keras keeps state and applies the descent rule.
Everything between is here, over the backend's :class:`keras_dpsgd.dp.ops.ArrayOps`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from keras_dpsgd.dp import lot as _lot
from keras_dpsgd.dp.clip import ClippedSum, clip_factors, finite_rows, sensitivity
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["Clip", "FrontEnd", "private_step"]


class Clip:
    """The clip factors of one batch (stage 2), as the backend calls them: ``clip(sq_norms) -> factors``.

    Remembers the squared norms and the finite rows of its call (``sq_norms``, ``finite``: [B, V], [B, 1]).
    """

    def __init__(self, ops: ArrayOps, bounds: Any, groups: Sequence[int], stability: float | None):
        self.ops, self.bounds, self.groups, self.stability = ops, bounds, list(groups), stability
        self.sq_norms = self.finite = None

    def __call__(self, sq_norms: Any) -> Any:
        self.sq_norms, self.finite = sq_norms, finite_rows(self.ops, sq_norms)
        return clip_factors(self.ops, sq_norms, self.bounds, self.groups, self.finite, self.stability)


class FrontEnd(Protocol):
    """What :func:`private_step` asks of the front end that runs it (its state and its hooks)."""

    ops: ArrayOps
    accumulation: int  # k batches per lot

    def clipping(self) -> tuple[Any, Sequence[int], float | None]:
        """(C_g [G] in force, the group of each variable, γ of normalization or None)."""

    def observe(self, clip: Clip) -> None:
        """After the clipped sum: the batch's norms and finite rows (counts, hooks, refusals at trace time)."""

    def load_lot(self) -> _lot.Lot:
        """The lot being accumulated (k > 1)."""

    def store_lot(self, lot: _lot.Lot) -> None:
        """Keeps `lot` (k > 1)."""

    def add_noise(self, clipped: ClippedSum) -> list:
        """Stage 5: ``dp.release.add_noise`` (an overridable hook of the optimizer)."""

    def normalize(self, noised: list, num_examples: Any) -> list:
        """Stage 6: ``dp.release.normalize`` by the lot size (an overridable hook of the optimizer)."""

    def count(self, num_examples: Any) -> None:
        """Stage 7: the release counted (``noised_steps`` + 1, the hook ``on_noised_step``)."""

    def when_complete(self, complete: Any, release: Callable[[], list], reset: Callable[[], None]) -> Any:
        """Runs `release` (then applies its gradients) and `reset` where `complete` holds (a conditional)."""


def private_step(front: FrontEnd, clipped_sum: Callable[[Clip], tuple[Sequence[Any], Any]]) -> Any:
    """One batch of DP-SGD (Abadi et al. 2016, Algorithm 1; lots of k batches: Sec. 3.1). `clipped_sum(clip)`:
    the backend's (Σ_i c_i g_i per variable, the batch's number of examples). Returns ``front.when_complete``'s."""
    ops = front.ops
    bounds, groups, stability = front.clipping()
    # 1. Per-example gradients g_i and their squared norms ||g_i[v]||² (the backend, inside clipped_sum).
    # 2. Clip factors c_i = min(1, C_g / ||g_i[g]||) per group g, 0 for a non-finite example (Clip).
    clip = Clip(ops, bounds, groups, stability)
    # 3. The clipped sum Σ_i c_i g_i (the backend), carrying its sensitivity C_g and its example count.
    sums, num_examples = clipped_sum(clip)
    batch = ClippedSum(tuple(sums), num_examples, sensitivity(bounds, groups))
    front.observe(clip)
    # 4. Accumulate the batch into its lot of k batches; a lot of one batch is complete at once.
    if front.accumulation == 1:
        lot, complete, reset = batch, True, lambda: None
    else:
        state = _lot.accumulate(ops, front.load_lot(), batch)
        front.store_lot(state)
        lot, complete = _lot.as_clipped_sum(ops, state, batch.sensitivity), _lot.is_complete(state, front.accumulation)

        def reset():
            front.store_lot(_lot.reset(ops, state))

    def release() -> list:
        # 5. Noise: Σ + N(0, σ_v² S_v²), S_v the sensitivity the sum carries (drawn once per lot).
        noised = front.add_noise(lot)
        # 6. Normalize: divide by the expected lot size L (else the realized count).
        grads = front.normalize(noised, lot.num_examples)
        # 7. Count the step for the accountant (noised_steps + 1, on_noised_step).
        front.count(lot.num_examples)
        return grads

    return front.when_complete(complete, release, reset)
