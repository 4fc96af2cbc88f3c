"""The privacy event of amplified banded matrix factorization (BandMF) with cyclic Poisson sampling.

Choquette-Choo et al. 2023 ("(Amplified) Banded Matrix Factorization: A unified approach to private training",
NeurIPS 2023, arXiv:2306.08153) prove that a b-banded strategy on cyclic Poisson lots "enjoys the same privacy
amplification" as DP-SGD (their abstract); the amplification theorem is their **Theorem 4** (the number other
implementations cite for this reduction; the paper's own text was not readable where this was written, so the
reduction below is derived here and checked against JAX Privacy's). The reduction:

* Sampling (:class:`keras_dpsgd.CyclicPoissonLots`): the examples are split into b parts at random, each example's
  part drawn independently of the others (never by position: removing an example must not move the others, see
  :mod:`keras_dpsgd.step.cyclic_lots`); the lot of step t is a Poisson sample, at rate q, of part t mod b only.
  An example takes part in at most ⌈n/b⌉ of n steps, any two of them at least b steps apart.
* Release: C y = C G + Z with y the noised gradient sums (y_t = G_t + w_t, C w = Z), Z ~ N(0, σ² clip² I);
  C y and y are each other's post-processing (C is invertible). Example x in the lot of step j adds a vector of
  norm <= clip to row j of G, which moves only rows j..j+b−1 of C G (C has b bands), by at most ‖C[:, j]‖ clip
  <= ζ clip (ζ = the strategy's column norm). Participations b steps apart move disjoint blocks of rows, each
  with independent noise: block by block, one sub-sampled Gaussian mechanism with noise multiplier σ/ζ, run
  adaptively ⌈n/b⌉ times (the rows of the other steps do not depend on x given the earlier outputs).

So the run satisfies every guarantee of DP-SGD run for ⌈n/b⌉ steps with sampling rate q and noise multiplier
σ/ζ (add/remove adjacency), which is what every accountant composes for this event
(:meth:`BandMFEvent.dpsgd_parameters`). At b = 1 (C = I, ζ = 1) it is DP-SGD's event itself.

The same parameters as JAX Privacy (``jax_privacy.accounting.amplified_bandmf_event``: DP-SGD's event for
⌈iterations / num_bands⌉ rounds at the Poisson probability of an example within its group, the noise multiplier
"assuming the strategy matrix has maximum L2 column norm of one": its ``BandMFConfig`` multiplies the noise by the
coefficients' norm, as dividing σ by ζ does here; its ``CyclicPoissonSampling`` splits the examples independently
at random under add/remove adjacency, and into equal groups only under zero-out adjacency with a public N).

Pure Python: imports without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from keras_dpsgd import _validate as V

__all__ = ["BANDMF_LABEL", "BandMFEvent"]

BANDMF_LABEL = "bandmf"


@dataclasses.dataclass(frozen=True)
class BandMFEvent:
    """`steps` steps of BandMF with `bands` bands on cyclic Poisson lots (module docstring).

    Args:
      sampling_rate: q in (0, 1]: the probability that an example of the step's part enters the lot.
      noise_multiplier: σ >= 0: the standard deviation of the fresh draws z_t over the clip bound.
      steps: n >= 0, the noised steps.
      bands: b >= 1, the bands of the strategy C (participations at least b steps apart).
      column_norm: ζ > 0, an upper bound on C's column norms (the sensitivity per unit of clip); 1 for a
        normalized strategy (:attr:`keras_dpsgd.dp.bandmf.BandedToeplitzStrategy.column_norm`).
      label: free text naming the source.
    """

    sampling_rate: float
    noise_multiplier: float
    steps: int
    bands: int
    column_norm: float = 1.0
    label: str = BANDMF_LABEL

    def __post_init__(self):
        checked = {
            "sampling_rate": V.in_range(0, 1, "(]", sampling_rate=self.sampling_rate),
            "noise_multiplier": V.nonnegative(noise_multiplier=self.noise_multiplier),
            "steps": V.integer_at_least(0, steps=self.steps),
            "bands": V.integer_at_least(1, bands=self.bands),
            "column_norm": V.positive(column_norm=self.column_norm),
            "label": str(self.label),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def rounds(self) -> int:
        """⌈n/b⌉: the most steps one example takes part in."""
        return math.ceil(self.steps / self.bands)

    @property
    def effective_noise_multiplier(self) -> float:
        """σ/ζ: the noise multiplier of each participation's Gaussian mechanism."""
        return self.noise_multiplier / self.column_norm

    def dpsgd_parameters(self) -> tuple[float, float, int]:
        """(q, σ/ζ, ⌈n/b⌉): DP-SGD with these has the run's guarantees (the module docstring's reduction);
        accountants compose that event (``keras_dpsgd.accounting.accountants.as_event_list``)."""
        return self.sampling_rate, self.effective_noise_multiplier, self.rounds

    def to_dict(self) -> dict[str, Any]:
        return {"type": "bandmf", **dataclasses.asdict(self)}
