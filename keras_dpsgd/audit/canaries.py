"""Canaries for the one-run audit: gradient (Dirac) canaries in the step, input canaries in the data.

**Gradient canaries** (Steinke et al. 2023, Sec. 6, white box): canary i is the
gradient C·e_{j_i} (a Dirac vector on one randomly chosen coordinate j_i of
the trainable variables, norm C, the clipping bound: the largest gradient a
clipped example may contribute). A canary that was drawn "in" before training
joins each lot with the lots' sampling rate q, exactly like an example, and
is added to the lot's clipped sum *before* the noise. Its score is the sum,
over the noised steps, of the noised sum's coordinate j_i: what a white-box
adversary who sees every released gradient observes. The canary's sign is
drawn afresh for every lot (±C·e_{j_i}, a public random sign independent of
the coins) and the score multiplies each step by it, so the data's own
gradient at j_i averages out of the score instead of accumulating. This audits the DP-SGD
step itself (clip bound, noise, sampling) and needs no memorization, so it is
strong and cheap.

The hook is :class:`GradientCanaryMixin`, which wraps the noise step (step 4) of
the sanitizer, the published ``add_noise`` hook of both front ends
(``keras_dpsgd.tf_keras._sanitizer.DPSanitizerMixin``, ``keras_dpsgd.keras3.DPKeras3Mixin``): the canaries
go into its input and the scores are read from its output. Whatever the
optimizer under it does to the sum (a correct one adds N(0, σ²C²); a broken
one may not) is what the audit measures.

**Input canaries**: m extra training examples, out of distribution (uniform
noise images with random labels) or mislabeled (held-out images with a wrong
label); each is added to the training set with probability 1/2. The score is
minus the loss of the canary's label after training (black box: the final
model only).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate as V
from keras_dpsgd.dp.refusals import refuse

__all__ = ["GradientCanaryMixin", "make_input_canaries", "per_example_loss", "with_gradient_canaries"]

CANARY_KINDS = ("gradient", "ood", "mislabeled")


@dataclasses.dataclass
class _Canaries:
    """The installed canaries (a plain dataclass: never tracked, saved or checkpointed)."""

    coords: list  # per variable: (canary ids, flat coordinates)
    included: tf.Tensor
    rate: float
    generator: tf.random.Generator
    scores: tf.Variable
    draws: tf.Variable


class GradientCanaryMixin:
    """Adds gradient (Dirac) canaries to a DP optimizer's clipped sum; put before the DP class.

    Build the class with :func:`with_gradient_canaries` (a tf_keras or a Keras 3 DP class), then
    call :meth:`install_gradient_canaries` once the model is built and before training.
    ``canary_scores()`` returns the scores after training. The noise step it wraps is the
    published ``add_noise`` hook (tf_keras and Keras 3).
    """

    def install_gradient_canaries(
        self,
        var_list: Sequence[Any],
        included: Sequence[bool],
        *,
        rng: np.random.Generator,
        sampling_rate: float | None = None,
    ) -> None:
        """Places m canaries on distinct random coordinates of `var_list`.

        Args:
          var_list: the model's trainable variables (the order the optimizer
            sees them in, ``model.trainable_variables``).
          included: m booleans, the fair coins drawn before training.
          rng: draws the coordinates and seeds the per-lot sampling.
          sampling_rate: q of the per-lot inclusion; default the optimizer's
            ``sampling_rate`` (set by ``PoissonLots.configure``).

        Raises:
          ValueError: fewer coordinates than canaries, no sampling rate, or
            canaries installed twice.
        """
        if getattr(self, "_canaries", None) is not None:
            raise ValueError("gradient canaries are already installed on this optimizer")
        included = np.asarray(included, dtype=bool)
        m = int(included.size)
        sizes = [int(np.prod(v.shape)) for v in var_list]
        total = sum(sizes)
        if not 1 <= m <= total:
            raise ValueError(f"canaries must be in [1, {total}] (one coordinate of the model each), got {m}")
        q = self.sampling_rate if sampling_rate is None else float(sampling_rate)
        if q is None or not 0.0 < q <= 1.0:
            raise ValueError(
                f"sampling_rate must be in (0, 1] (call PoissonLots.configure(optimizer) first), got {q!r}"
            )
        flat = np.sort(rng.choice(total, size=m, replace=False))
        order = rng.permutation(m)  # canary ids independent of coordinate order
        starts = np.cumsum([0] + sizes)
        var_of = np.searchsorted(starts, flat, side="right") - 1
        coords = [
            (order[var_of == v].astype(np.int64), (flat[var_of == v] - starts[v]).astype(np.int64))
            for v in range(len(var_list))
        ]
        with tf.init_scope():
            self._canaries = _Canaries(
                coords=coords,
                included=tf.constant(included),
                rate=float(q),
                generator=tf.random.Generator.from_seed(int(rng.integers(2**62))),
                scores=tf.Variable(tf.zeros([m], tf.float32), trainable=False, name="canary_scores"),
                draws=tf.Variable(tf.zeros([m], tf.float32), trainable=False, name="canary_draws"),
            )

    @property
    def _canary_coords(self) -> list:
        return self._canaries.coords

    def canary_scores(self) -> np.ndarray:
        """Σ over noised steps of sign × the noised sum at each canary's coordinate, shape [m]."""
        return self._canaries.scores.numpy().astype(np.float64)

    def canary_inclusions(self) -> np.ndarray:
        """How many lots each canary joined (0 for canaries drawn "out"), shape [m]."""
        return self._canaries.draws.numpy().astype(np.int64)

    def _insert_canaries(self, summed: list[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor]:
        """Included canaries join the lot at rate q: (the sum with them, the lot's signs)."""
        c = getattr(self, "_canaries", None)
        if c is None:
            raise refuse(
                "canaries-not-installed",
                f"{type(self).__name__}: call install_gradient_canaries(model.trainable_variables, ...) before training",
            )
        m = c.scores.shape[0]
        joined = tf.cast(tf.logical_and(c.included, c.generator.uniform([m]) < c.rate), tf.float32)
        c.draws.assign_add(joined)
        # A fresh random sign per canary and lot (public to the auditor, independent of the coins):
        # the data's own gradient at a coordinate then averages out of the score instead of adding up.
        signs = tf.sign(c.generator.uniform([m]) - 0.5)
        bounds = tf.convert_to_tensor(self.clip_bounds)
        with_canaries = []
        for v, (s, (ids, flat)) in enumerate(zip(summed, c.coords)):
            if ids.size == 0:
                with_canaries.append(s)
                continue
            bound = bounds[v] if self.per_layer_clipping else tf.reduce_max(bounds)
            values = tf.gather(joined * signs, ids) * bound  # each canary gradient has norm C (or C_v)
            delta = tf.scatter_nd(flat[:, None], tf.cast(values, s.dtype), [int(np.prod(s.shape))])
            with_canaries.append(s + tf.reshape(delta, tf.shape(s)))
        return with_canaries, signs

    def _score_canaries(self, noised: list[tf.Tensor], signs: tf.Tensor) -> None:
        c = self._canaries
        observed = tf.zeros([c.scores.shape[0]], tf.float32)
        for g, (ids, flat) in zip(noised, c.coords):
            if ids.size:
                seen = tf.cast(tf.gather(tf.reshape(g, [-1]), flat), tf.float32)
                observed += tf.scatter_nd(ids[:, None], seen, [c.scores.shape[0]])
        c.scores.assign_add(signs * observed)

    def add_noise(self, summed: list[tf.Tensor]) -> list[tf.Tensor]:
        """Step 4 with canaries (the published hook of both front ends): the canaries join, then the
        parent adds noise."""
        with_canaries, signs = self._insert_canaries(summed)
        noised = super().add_noise(with_canaries)
        self._score_canaries(noised, signs)
        self._observe_step(summed, with_canaries, noised)
        return noised

    def _observe_step(self, summed: list[tf.Tensor], with_canaries: list[tf.Tensor], noised: list[tf.Tensor]) -> None:
        """What a white-box auditor sees of each step (the step audit overrides it); nothing here."""


_CANARY_CLASSES: dict[tuple[type, type], type] = {}


def with_gradient_canaries(optimizer_cls: type) -> type:
    """The subclass of a keras_dpsgd optimizer class (tf_keras or Keras 3) that carries gradient canaries.

    Raises:
      ValueError: if `optimizer_cls` is not a DP optimizer of this package
        (a subclass of ``keras_dpsgd.tf_keras._sanitizer.DPSanitizerMixin`` or of
        ``keras_dpsgd.keras3.DPKeras3Mixin``).
    """
    return with_canary_mixin(GradientCanaryMixin, optimizer_cls)


def with_canary_mixin(mixin: type, optimizer_cls: type) -> type:
    """The subclass (mixin, optimizer_cls) of a keras_dpsgd DP optimizer class, made once per pair."""
    if not (
        _is_dp_class(optimizer_cls, "keras_dpsgd.tf_keras._sanitizer.DPSanitizerMixin")
        or _is_dp_class(optimizer_cls, "keras_dpsgd.keras3._optimizer.DPKeras3Mixin")
    ):
        raise ValueError(f"optimizer_cls must be a keras_dpsgd DP optimizer class, got {optimizer_cls!r}")
    if issubclass(optimizer_cls, mixin):
        return optimizer_cls
    if (mixin, optimizer_cls) not in _CANARY_CLASSES:
        _CANARY_CLASSES[(mixin, optimizer_cls)] = type(
            f"{mixin.__name__.replace('Mixin', '')}{optimizer_cls.__name__}",
            (mixin, optimizer_cls),
            {"__module__": mixin.__module__},
        )
    return _CANARY_CLASSES[(mixin, optimizer_cls)]


def _is_dp_class(cls: Any, base_path: str) -> bool:
    # A class derives from a base only once the base's module is imported: looked up, not imported (the
    # tf_keras front end's package imports tf_keras, which a Keras 3 run may not have).
    module, name = base_path.rsplit(".", 1)
    loaded = sys.modules.get(module)
    return isinstance(cls, type) and loaded is not None and issubclass(cls, getattr(loaded, name))


def make_input_canaries(
    kind: str,
    num_canaries: int,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    rng: np.random.Generator,
    pool: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """m input canaries: "ood" (uniform noise, random labels) or "mislabeled" (pool images, wrong labels).

    Args:
      kind: "ood" or "mislabeled".
      num_canaries: m >= 2.
      input_shape: shape of one example.
      num_classes: K >= 2.
      rng: the canaries' randomness.
      pool: (x, y) examples that are NOT training data (e.g. the held-out
        split), for "mislabeled"; each canary takes a distinct one and a
        label drawn uniformly among the K − 1 wrong ones.

    Raises:
      ValueError: unknown kind, m out of range or a pool too small.
    """
    if kind not in ("ood", "mislabeled"):
        raise ValueError(f"kind must be 'ood' or 'mislabeled', got {kind!r}")
    m = V.integer_at_least(2, num_canaries=num_canaries)
    if kind == "ood":
        x = rng.random((m,) + tuple(int(d) for d in input_shape), dtype=np.float32)
        y = rng.integers(num_classes, size=m).astype(np.int64)
        return x, y
    if pool is None or len(pool[0]) < m:
        have = 0 if pool is None else len(pool[0])
        raise ValueError(f"num_canaries must be <= the pool of held-out examples ({have}) for 'mislabeled', got {m}")
    pick = rng.choice(len(pool[0]), size=m, replace=False)
    shift = rng.integers(1, num_classes, size=m)
    return pool[0][pick].astype(np.float32), ((pool[1][pick] + shift) % num_classes).astype(np.int64)


def per_example_loss(model: Any, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Cross-entropy of labels `y` under the model's logits (inference mode), shape [n]."""
    out = []
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch], training=False)
        logits = logits.detach().cpu().numpy() if hasattr(logits, "detach") else logits  # torch: off the tape
        out.append(tf.nn.sparse_softmax_cross_entropy_with_logits(y[i : i + batch], logits).numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros([0])
