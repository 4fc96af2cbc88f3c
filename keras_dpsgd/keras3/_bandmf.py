"""BandMF optimizers for Keras 3 (TensorFlow, JAX, PyTorch): DP-SGD's step with correlated noise (issue 42).

The step is the DP optimizer's (clip, sum, noise, normalize, apply); only step 4 changes: the fresh draw z_t
(N(0, σ²C²), drawn exactly as DP-SGD draws it, keyed by the release's position in the model's ledger when seeded)
becomes w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0 (:func:`keras_dpsgd.dp.bandmf.add_correlated_noise`, the
one implementation of the recursion: here in ``add_noise`` on TensorFlow, in ``keras3._jax_front`` on JAX and
``keras3._torch_front`` on PyTorch), with
the b − 1 last w kept in optimizer variables (saved with the optimizer: ``.keras`` files, checkpoints,
``BackupAndRestore``), so a resumed run continues the same noise and never repeats a draw. With b = 1 (C = I) the
release is DP-SGD's, bit for bit. The key of the random split of the examples into parts
(``bandmf_partition``, :mod:`keras_dpsgd.step.cyclic_lots`) is saved with them. Both are secrets of the run: a
file with the optimizer's variables is a training checkpoint, not a model to publish (``docs/bandmf.md``).

The accounting needs cyclic Poisson lots (:class:`keras_dpsgd.CyclicPoissonLots` with the strategy's bands):
a fit fed anything else is refused (``keras_dpsgd.step.fed_data``), and the model's ledger records the steps as
:class:`keras_dpsgd.accounting.BandMFEvent` (``keras_dpsgd.ledger``).

Not supported (refused by name): per-layer clipping, several replicas (a ``tf.distribute`` strategy with R > 1:
the overridden ``add_noise`` is refused there; JAX's ``DataParallel``), and tf_keras.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_dpsgd.dp.bandmf import BandedToeplitzStrategy, add_correlated_noise
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.keras3._optimizer import _register, make_dp_optimizer

__all__ = ["BandMFAdamOptimizer", "BandMFSGDOptimizer", "make_bandmf_optimizer"]


def check_strategy(strategy: Any) -> BandedToeplitzStrategy:
    """A :class:`BandedToeplitzStrategy`, or its ``get_config`` form ``{"coefficients": [...], "steps": n}``."""
    if isinstance(strategy, dict) and set(strategy) == {"coefficients", "steps"}:
        return BandedToeplitzStrategy(tuple(strategy["coefficients"]), strategy["steps"])
    if not isinstance(strategy, BandedToeplitzStrategy):
        raise TypeError(
            "strategy must be a keras_dpsgd.dp.bandmf.BandedToeplitzStrategy (from optimize_banded_toeplitz) "
            f"or its config dict, got {strategy!r}"
        )
    return strategy


class BandMFMixin:
    """Correlated noise for a Keras 3 DP optimizer; put before the DP class (:func:`make_bandmf_optimizer`)."""

    def _init_bandmf(self, strategy: Any) -> None:
        strategy = check_strategy(strategy)
        name = type(self).__name__
        if self.per_layer_clipping:
            raise refuse(
                "bandmf-setup",
                f"{name} takes flat clipping or clipping='normalize', got per-layer l2_norm_clip="
                f"{self.l2_norm_clip!r}: the accounting of BandMF is for one Gaussian release per step",
            )
        self._bandmf_strategy = strategy
        self._bandmf_history: list = []
        # The key of the random split of the examples into b parts (keras_dpsgd.step.cyclic_lots), [0, 0] until
        # CyclicPoissonLots.follow writes it: saved with the noise history, so a resumed run keeps every part.
        self.bandmf_partition_key = self.add_variable((2,), initializer="zeros", dtype="int32", name="bandmf_partition")

    @property
    def bandmf_strategy(self) -> BandedToeplitzStrategy:
        """The strategy C (its coefficients c_0..c_{b−1})."""
        return self._bandmf_strategy

    @property
    def bandmf_bands(self) -> int:
        """b: the lots must be :class:`keras_dpsgd.CyclicPoissonLots` with ``bands=b``."""
        return self._bandmf_strategy.bands

    @property
    def bandmf_column_norm(self) -> float:
        """ζ, the sensitivity of one participation per unit of clip (the ledger divides σ by it)."""
        return self._bandmf_strategy.column_norm

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # [j][v]: w_{t−1−j} of variable v, zeros before the first release (saved with the optimizer's variables).
        self._bandmf_history = [
            [self.add_variable_from_reference(v, name=f"bandmf_noise_{j}") for v in variables]
            for j in range(self.bandmf_bands - 1)
        ]

    def add_noise(self, summed: list) -> list:
        """Step 4: Σ_i clip(g_i) + w_t, w_t = C⁻¹'s recursion on DP-SGD's own draw z_t (module docstring)."""
        draws = super().add_noise([keras.ops.zeros_like(s) for s in summed])  # z_t: 0 + N(0, σ²C²), DP-SGD's key
        history = [[keras.ops.copy(h.value) for h in row] for row in self._bandmf_history]  # read before writing
        out, new = add_correlated_noise(summed, draws, history, self._bandmf_strategy.coefficients)
        for row, values in zip(self._bandmf_history, new):
            for variable, value in zip(row, values):
                variable.assign(value)
        return out

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["strategy"] = {
            "coefficients": list(self._bandmf_strategy.coefficients),
            "steps": self._bandmf_strategy.steps,
        }
        return config


_BANDMF_CLASSES: dict[type, type] = {}


def make_bandmf_optimizer(optimizer_cls: type, *, name: str | None = None) -> type:
    """The BandMF version of a Keras 3 optimizer class: its DP class (``make_dp_optimizer``) with correlated noise.

    The class takes the DP optimizer's arguments plus ``strategy`` (keyword, required): a
    :class:`keras_dpsgd.dp.bandmf.BandedToeplitzStrategy` (``optimize_banded_toeplitz(steps, bands)``).

    Raises:
      TypeError: as ``make_dp_optimizer``.
    """
    if optimizer_cls in _BANDMF_CLASSES:
        return _BANDMF_CLASSES[optimizer_cls]
    dp_cls = make_dp_optimizer(optimizer_cls)
    cls_name = name or f"BandMF{optimizer_cls.__name__}Optimizer"

    def __init__(self, l2_norm_clip, noise_multiplier, *, strategy, **kwargs):
        kwargs.setdefault("name", cls_name)
        dp_cls.__init__(self, l2_norm_clip, noise_multiplier, **kwargs)
        self._init_bandmf(strategy)

    doc = (
        f"Keras 3 {optimizer_cls.__name__} with BandMF's correlated noise (keras_dpsgd.keras3._bandmf).\n\n"
        "    strategy: the banded strategy C (keras_dpsgd.dp.bandmf.optimize_banded_toeplitz); feed fit\n"
        "      keras_dpsgd.CyclicPoissonLots(..., bands=strategy.bands). Other arguments: the DP optimizer's.\n"
    )
    cls = type(
        cls_name, (BandMFMixin, dp_cls), {"__init__": __init__, "__doc__": doc, "__module__": "keras_dpsgd.keras3"}
    )
    _BANDMF_CLASSES[optimizer_cls] = _register(cls)
    return cls


BandMFSGDOptimizer = make_bandmf_optimizer(keras.optimizers.SGD, name="BandMFSGDOptimizer")
BandMFAdamOptimizer = make_bandmf_optimizer(keras.optimizers.Adam, name="BandMFAdamOptimizer")
