"""The front end the DP core's Algorithm 1 runs with in the torch train step (``keras_dpsgd.dp.step.FrontEnd``).

Torch's train step is eager: the lot of k batches lives in the optimizer's ``dp_accumulator`` variables, the
count in ``noised_steps``, the noise keys of an unseeded optimizer in the process (``EntropyKeys``: OS entropy,
never saved). What is torch's is here: that state, a Python ``if`` around a lot's release, the keys, the
regularization gradient and the optimizer's ``apply``. The math (clip factors, the lot, the noise σ·S, the
normalization) is the core's, over ``TORCH_OPS``; a BandMF optimizer's correlated noise is the core's recursion too
(``dp.bandmf.add_correlated_noise``), its b − 1 last draws in its ``bandmf_noise_j`` variables; adaptive clipping's
bound queries are the core's rules through the plumbing JAX's step runs too (``keras3._adaptive_values``, on the
optimizer's variables: each batch's terms summed, released after the gradient's noise under the key of index
``NORM_NOISE_INDEX``, the next bounds written to ``clip_bounds``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from keras_dpsgd.backends import torch as torch_backend
from keras_dpsgd.dp import bandmf as dp_bandmf, clip as dp_clip, lot as dp_lot, release as dp_release
from keras_dpsgd.keras3 import _adaptive_values as _adaptive

__all__ = ["TorchFront", "noise_keys"]

_KEYS_ATTR = "_dp_torch_keys"


def noise_keys(optimizer: Any) -> torch_backend.EntropyKeys:
    """The optimizer's OS-entropy keys (made on first use, renewed on load; never saved)."""
    keys = optimizer.__dict__.get(_KEYS_ATTR)
    if keys is None:
        keys = torch_backend.EntropyKeys()
        object.__setattr__(optimizer, _KEYS_ATTR, keys)
    return keys


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# A release of at most this many coordinates draws its noise ahead, on a second thread (one buffer of its size).
AHEAD_MAX = 1 << 24


class TorchFront:
    """``dp.step.private_step``'s front end on torch (module docstring)."""

    ops = torch_backend.TORCH_OPS

    def __init__(self, optimizer: Any, variables: list, reg_grads: Any):
        self.optimizer, self.variables, self.reg_grads = optimizer, list(variables), reg_grads
        self.accumulation = optimizer._dp.accumulation
        self.adaptive = _adaptive.is_adaptive(optimizer)
        self.bounds = self.clipping()[0].clone()  # in force for this batch (clip_bounds is assigned in place)
        self.key_for: Callable[[int], Any] | None = None
        self._ahead: torch_backend.NoiseAhead | None = None

    def draw_ahead(self) -> None:
        """Starts this step's noise on a second thread while the step computes its clipped sum
        (``backends.torch.NoiseAhead``): a lot of one batch (released in this step), not BandMF, at most
        :data:`AHEAD_MAX` coordinates, where the step leaves a CPU core free (``spare_core``: a step on an
        accelerator, or fewer intra-op threads than cores; else the release draws it, in two halves on two threads).
        Its keys and scales σ_v·C_g are fixed before the step reads any example (the keys of this release: its ledger
        position, or its OS-entropy count, taken once for the release)."""
        optimizer, sigmas = self.optimizer, self.optimizer._dp.sigmas
        if self.accumulation != 1 or getattr(optimizer, "bandmf_strategy", None) is not None:
            return
        if not self.variables or not torch_backend.spare_core(self.variables[0].value.device.type):
            return
        sizes = [math.prod(v.shape) for v in self.variables]
        noised = [v for v, n in enumerate(sizes) if sigmas[v] and n]
        if not noised or sum(sizes[v] for v in noised) > AHEAD_MAX:
            return
        bounds, groups, _ = self.clipping()
        scales = dp_clip.sensitivity(bounds, groups)
        key_for = self.key_for = self._keys()
        self._ahead = torch_backend.NoiseAhead(
            {v: (key_for(v), sizes[v], float(sigmas[v] * scales[v])) for v in noised}
        )

    def close(self) -> None:
        """Drops a noise drawn ahead and not taken (a step that did not reach its release)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def clipping(self):
        optimizer = self.optimizer
        bounds = optimizer.clip_bounds.value
        stability = optimizer.stability if optimizer.clipping == "normalize" else None
        return (bounds if optimizer.per_layer_clipping else bounds[:1]), optimizer._clip_groups(), stability

    def observe(self, clip) -> None:
        """The non-finite count (local to the process, never saved)."""
        nonfinite = int((~clip.finite).sum())
        if nonfinite:
            self.optimizer._dp.nonfinite.assign_add(nonfinite)
        if self.adaptive:  # the batch's bound queries, from the same norms
            state = _adaptive.Variables()
            _adaptive.accumulate_queries(self.optimizer, self.ops, state, clip.sq_norms, clip.finite, self.bounds)

    def load_lot(self) -> dp_lot.Lot:
        optimizer = self.optimizer
        sums = tuple(acc.value for acc in optimizer._accumulators)
        return dp_lot.Lot(sums, optimizer._accum_examples.value, optimizer._accum_batches.value)

    def store_lot(self, lot: dp_lot.Lot) -> None:
        optimizer = self.optimizer
        for acc, s in zip(optimizer._accumulators, lot.sums):
            acc.assign(s)
        optimizer._accum_examples.assign(lot.examples)
        optimizer._accum_batches.assign(lot.batches)

    def _keys(self) -> Callable[[int], Any]:
        """The key of each noise tensor of this release: seeded, a function of (seed, ledger position, index);
        else of the process's OS entropy and the release's count."""
        optimizer, dp = self.optimizer, self.optimizer._dp
        if dp.seed is None:
            return noise_keys(optimizer).next_release()
        position = int(optimizer.noised_steps.numpy()) + int(dp.ledger_offset.numpy())  # in the model's ledger
        return lambda index: torch_backend.seeded_key(dp.seed, position, index)

    def add_noise(self, clipped) -> list:
        noised = self._noised(clipped)
        if self.adaptive:  # post-processing: the step in units of the bound (C was released before this lot)
            noised = _adaptive.divide_by_bound(self.optimizer, self.ops, noised, self.bounds)
        return noised

    def _noised(self, clipped) -> list:
        if self._ahead is None:
            self.key_for = self._keys()
        key_for, ahead = self.key_for, self._ahead
        fresh = self._fresh = {}  # id -> this release's own tensors (held: no id is reused during the release)
        # A lot of one batch: the clipped sums are this step's own new tensors (the backend's), noised in place.
        # A lot of k batches: its sums are the lot's state, left as they are.
        own = self.accumulation == 1

        def gaussian(x, stddev, index):
            key, scale = key_for(index), float(stddev)
            drawn = None if ahead is None else ahead.take(index, key, x.numel(), scale)
            if drawn is None:
                noised = torch_backend.add_gaussian(x, scale, key, in_place=own)
            elif own and x.dtype == torch.float32 and x.device.type == "cpu":
                noised = x.add_(drawn.view(x.shape))  # add_gaussian's values: float32 x + noise
            else:
                noised = x + drawn.view(x.shape).to(device=x.device, dtype=x.dtype)
            if (own and noised is x) or (noised is not x and not _aliases(noised, x)):
                fresh[id(noised)] = noised  # this release's own tensor: divided by L in place
            return noised

        strategy = getattr(self.optimizer, "bandmf_strategy", None)
        if strategy is None:
            return dp_release.add_noise(clipped, self.optimizer._dp.sigmas, dp_release.each(gaussian))
        # BandMF: DP-SGD's draw z_t under the same keys, through C⁻¹'s recursion on the saved history.
        zeros = clipped.with_sums([torch.zeros_like(s) for s in clipped.sums])
        draws = dp_release.add_noise(zeros, self.optimizer._dp.sigmas, dp_release.each(gaussian))
        rows = self.optimizer._bandmf_history
        history = [[variable.value.clone() for variable in row] for row in rows]
        noised, new = dp_bandmf.add_correlated_noise(clipped.sums, draws, history, strategy.coefficients)
        for row, values in zip(rows, new):
            for variable, value in zip(row, values):
                variable.assign(value)
        return noised

    def normalize(self, noised: list, num_examples) -> list:
        lot = self.optimizer._dp.expected_lot_size  # the setter keeps it and the TensorFlow mirror in step
        denominator = dp_release.lot_denominator(self.ops, num_examples, float(lot or 0.0))
        if self.adaptive:  # the lot's bound queries: released with the gradient, after it
            noise = torch_backend.standard_normal(self.bounds.shape, self.key_for(_adaptive.NORM_NOISE_INDEX))
            _adaptive.release_queries(self.optimizer, self.ops, _adaptive.Variables(), self.bounds, denominator, noise)
        fresh = getattr(self, "_fresh", {})

        def divide(g, d):  # in place where the tensor is this release's own (no fresh memory for the quotient)
            return g.div_(d) if fresh.get(id(g)) is g else g / d

        return dp_release.normalize(self.ops, noised, denominator, divide)

    def count(self, num_examples) -> None:
        self.optimizer.noised_steps.assign(int(self.optimizer.noised_steps.numpy()) + 1)

    def when_complete(self, complete, release: Callable[[], list], reset: Callable[[], None]) -> list | None:
        """On a lot's last batch: the release, the regularization gradient (un-noised), the optimizer's apply
        (which takes the release only) and a new lot; the gradients applied, or None."""
        if not bool(complete):
            return None
        grads = release()
        if self.reg_grads is not None:
            grads = [g + r.to(g.dtype) for g, r in zip(grads, self.reg_grads)]
        grads = [g.to(v.value.dtype) for g, v in zip(grads, self.variables)]
        self.optimizer._dp.pending[:] = grads  # the only gradients its apply accepts
        with torch.no_grad():
            self.optimizer.apply(grads, self.variables)
        reset()
        return grads
