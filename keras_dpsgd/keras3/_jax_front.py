"""The front end the DP core's Algorithm 1 runs with in the JAX train step (``keras_dpsgd.dp.step.FrontEnd``).

JAX's train step is stateless: the optimizer's variables come in as values and go out as new values
(:class:`OptimizerState`), the lot of k batches in its ``dp_accumulator`` variables, the count in
``noised_steps``, the noise key of an unseeded optimizer in ``dp_noise_key`` (``backends.jax.state``). What
is JAX's is here: that state plumbing, ``jax.lax.cond`` around a lot's release, the keys, adaptive
clipping's queries (``keras3._adaptive_values``), the regularization gradient and ``stateless_apply``. The
math (clip factors, the lot, the noise σ·S, the normalization) is the core's, over ``JAX_OPS``; a BandMF
optimizer's correlated noise is the core's recursion too (``dp.bandmf.add_correlated_noise``), its b − 1 last
draws carried in its ``bandmf_noise_j`` variables like any other optimizer state.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from keras_dpsgd.backends.jax import add_gaussian, seeded_key, standard_normal
from keras_dpsgd.backends.jax.ops import JAX_OPS, key_data
from keras_dpsgd.dp import bandmf as dp_bandmf, lot as dp_lot, release as dp_release
from keras_dpsgd.keras3 import _adaptive_values as _adaptive

__all__ = ["JaxFront", "OptimizerState", "clipping_of"]


class OptimizerState:
    """The optimizer's variables of one traced step as a list, read and written by variable."""

    def __init__(self, optimizer: Any, values: Any):
        self.values = list(values)
        self._pos = {id(v): i for i, v in enumerate(optimizer.variables)}

    def __getitem__(self, variable):
        return self.values[self._pos[id(variable)]]

    def __setitem__(self, variable, value):
        self.values[self._pos[id(variable)]] = jnp.asarray(value).astype(variable.dtype)


def clipping_of(optimizer: Any, clip_bounds: Any) -> tuple[Any, list[int], float | None]:
    """(C_g of each group, the group of each variable, γ or None) from the value of ``clip_bounds`` (flat
    clipping saves C once per variable: the first is the group's)."""
    bounds = clip_bounds if optimizer.per_layer_clipping else clip_bounds[:1]
    stability = optimizer.stability if optimizer.clipping == "normalize" else None
    return bounds, optimizer._clip_groups(), stability


class JaxFront:
    """``dp.step.private_step``'s front end on JAX (module docstring); :attr:`opt` holds the new values."""

    ops = JAX_OPS

    def __init__(self, optimizer: Any, opt: OptimizerState, trainable: list, reg_grads: Any):
        self.optimizer, self.opt, self.trainable, self.reg_grads = optimizer, opt, list(trainable), reg_grads
        self.accumulation = optimizer._dp.accumulation
        self.adaptive = _adaptive.is_adaptive(optimizer)
        self.bounds, _, _ = self.clipping()
        self.key_for: Callable[[int], Any] | None = None

    def clipping(self):
        return clipping_of(self.optimizer, self.opt[self.optimizer.clip_bounds])

    def observe(self, clip) -> None:
        """The non-finite count (never saved) and, with adaptive clipping, the batch's bound queries."""
        optimizer, opt = self.optimizer, self.opt
        opt[optimizer._jax_nonfinite] = opt[optimizer._jax_nonfinite] + jnp.sum((~clip.finite[:, 0]).astype(jnp.int32))
        if self.adaptive:  # the bound queries read the same norms (refused under DataParallel)
            _adaptive.accumulate_queries(optimizer, JAX_OPS, opt, clip.sq_norms, clip.finite, self.bounds)

    def load_lot(self) -> dp_lot.Lot:
        optimizer, opt = self.optimizer, self.opt
        sums = tuple(opt[acc] for acc in optimizer._accumulators)
        return dp_lot.Lot(sums, opt[optimizer._accum_examples], opt[optimizer._accum_batches])

    def store_lot(self, lot: dp_lot.Lot) -> None:
        optimizer, opt = self.optimizer, self.opt
        for acc, s in zip(optimizer._accumulators, lot.sums):
            opt[acc] = s
        opt[optimizer._accum_examples] = lot.examples
        opt[optimizer._accum_batches] = lot.batches

    def _keys(self) -> Callable[[int], Any]:
        """The key of each noise tensor of this release: seeded, a function of (seed, ledger position, index);
        else split from the OS-entropy key, which moves on."""
        optimizer, opt, seed = self.optimizer, self.opt, self.optimizer._dp.seed
        position = opt[optimizer.noised_steps] + opt[optimizer._jax_offset]  # in the model's ledger (issue 37.4)
        if seed is not None:
            return lambda index: seeded_key(seed, position, index)
        carry, draw = jax.random.split(key_data(opt[optimizer._jax_key]))
        opt[optimizer._jax_key] = jax.random.key_data(carry)
        return lambda index: jax.random.fold_in(draw, index)

    def add_noise(self, clipped) -> list:
        self.key_for = self._keys()

        # One draw per tensor under its index's key: XLA on CPU runs the release's one draw (dp.release.add_gaussians,
        # TensorFlow's) 1.5-2x slower than the tensors' own draws (the MLP's DP step 7.4 -> 14.7 ms).
        gaussians = dp_release.each(lambda x, stddev, index: add_gaussian(x, stddev, self.key_for(index)))

        strategy = getattr(self.optimizer, "bandmf_strategy", None)
        if strategy is None:
            noised = dp_release.add_noise(clipped, self.optimizer._dp.sigmas, gaussians)
        else:
            noised = self._correlated(clipped, gaussians, strategy.coefficients)
        if self.adaptive:  # post-processing: the step in units of the bound (C was released before this lot)
            noised = _adaptive.divide_by_bound(self.optimizer, JAX_OPS, noised, self.bounds)
        return noised

    def _correlated(self, clipped, gaussians: Callable, coefficients) -> list:
        """BandMF: DP-SGD's draw z_t under the same keys, through C⁻¹'s recursion on the saved history."""
        zeros = clipped.with_sums([jnp.zeros_like(s) for s in clipped.sums])
        draws = dp_release.add_noise(zeros, self.optimizer._dp.sigmas, gaussians)
        rows = self.optimizer._bandmf_history
        history = [[self.opt[variable] for variable in row] for row in rows]
        noised, new = dp_bandmf.add_correlated_noise(clipped.sums, draws, history, coefficients)
        for row, values in zip(rows, new):
            for variable, value in zip(row, values):
                self.opt[variable] = value
        return noised

    def normalize(self, noised: list, num_examples) -> list:
        denominator = dp_release.lot_denominator(JAX_OPS, num_examples, self.opt[self.optimizer._jax_lot])
        if self.adaptive:  # the lot's bound queries: released with the gradient, after it
            noise = standard_normal(self.bounds.shape, self.key_for(_adaptive.NORM_NOISE_INDEX), jnp.float32)
            _adaptive.release_queries(self.optimizer, JAX_OPS, self.opt, self.bounds, denominator, noise)
        return dp_release.normalize(JAX_OPS, noised, denominator)

    def count(self, num_examples) -> None:
        self.opt[self.optimizer.noised_steps] = self.opt[self.optimizer.noised_steps] + 1

    def when_complete(self, complete, release: Callable[[], list], reset: Callable[[], None]) -> list:
        """The release, the regularization gradient (un-noised), ``stateless_apply`` and a new lot, in
        ``jax.lax.cond`` for lots of k > 1 batches; returns the trainable values (``opt`` holds the rest)."""
        optimizer = self.optimizer

        def released(carry):
            params, values = carry
            outer, self.opt = self.opt, OptimizerState(optimizer, values)
            try:
                grads = release()
                if self.reg_grads is not None:
                    grads = [g + r.astype(g.dtype) for g, r in zip(grads, self.reg_grads)]
                grads = [g.astype(t.dtype) for g, t in zip(grads, params)]
                optimizer._dp.pending[:] = grads  # the only gradients its apply accepts
                params, values = optimizer.stateless_apply(self.opt.values, grads, list(params))
                self.opt.values = list(values)
                reset()
                return list(params), self.opt.values
            finally:
                self.opt = outer

        carry = (self.trainable, self.opt.values)
        if self.accumulation == 1:
            params, values = released(carry)
        else:
            params, values = jax.lax.cond(complete, released, lambda c: c, carry)
        self.opt.values = list(values)
        return list(params)
