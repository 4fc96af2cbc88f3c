"""Adaptive per-layer clipping, the part both front ends share (tf_keras and Keras 3).

The math and its privacy derivation are in :mod:`keras_dpsgd.tools.adaptive_clipping`. A front end
puts :class:`AdaptiveClippingCore` before its DP optimizer class and supplies the ``_norm_sums``
variable (created in ``build``); the rest goes through the published hooks both front ends' DP
optimizers have: ``on_per_example_sq_norms`` (the lot's norm sums), ``on_noised_step`` (after the
gradient's release: the norm queries and the next bounds), ``standard_normal`` and ``normalize``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd.step import distribute as _distribute
from keras_dpsgd.tools._adaptive_rules import ArrayOps, next_bounds, query_sensitivity, query_terms
from keras_dpsgd.tools._bounds_logger import ClipBoundsLoggerCore
from keras_dpsgd.tools._initial_bounds import initial_clip_bounds, initial_flat_clip_bound
from keras_dpsgd.tools.adaptive_clipping import composed_noise_multiplier

__all__ = [
    "AdaptiveClippingCore",
    "TF_OPS",
    "ADAPTIVE_DOC",
    "NORM_NOISE_INDEX",
    "adaptive_optimizer_class",
    "initial_clip_bounds",
    "initial_flat_clip_bound",
    "ClipBoundsLoggerCore",
]

# Index folded into the seeded noise stream for the norm queries (the gradient noise uses the
# variable indices 0..V-1).
NORM_NOISE_INDEX = 1 << 30

ADAPTIVE_DOC = """
    Adaptive clipping arguments (van der Veen et al. 2018, Sec. 3; Andrew et al. 2021):
      l2_norm_clip: initial bound: one per trainable variable (list or dict;
        e.g. from `initial_clip_bounds`, random noise: no privacy cost) for
        per-layer bounds, or one number for one flat bound on the whole
        gradient (e.g. from `initial_flat_clip_bound`).
      norm_noise_multiplier: σ >= 0 of each group's bound query (one or one
        per variable). 0 makes the queries non-private (ε = ∞).
      alpha: rule "mean": C_t = α · (noisy mean norm of the previous lot), > 0
        (default 1.0).
      beta: rule "mean": the norm query clips at β · C_{t-1}, > 0 (default 2).
      min_clip_bound: floor of the bounds, > 0.
      rule: "mean" (Three Tools: the bound follows α × the noisy mean norm) or
        "quantile" (Andrew et al. 2021: the bound follows the
        `target_quantile` of the norms through a noisy count of the examples
        at or under it, geometric step `quantile_learning_rate`).
      target_quantile: rule "quantile": in [0, 1] (default 0.5).
      quantile_learning_rate: rule "quantile": η > 0 of
        C ← C · exp(-η (b̃ - target_quantile)) (default 0.2).
      divide_by_bound: divide each group's released gradient by its bound in
        force (post-processing of the release: no privacy cost). The step is
        then in units of the bound, as with clipping="normalize", so the
        learning rate needs no re-tuning when the bound moves (default False).
    The accountant must be charged `effective_noise_multiplier`
    = (Σ_g 1/σ_g² + Σ_g 1/σ_q,g²)^(-1/2) per step over the clipping groups g
    (one group: flat) (the ledger does).
"""

RULES = ("mean", "quantile")


# The bound rules' array functions on TensorFlow (``_adaptive_rules``).
TF_OPS = ArrayOps(tf.minimum, tf.maximum, tf.exp, tf.where, tf.zeros_like, tf.ones_like)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The adaptive settings (a plain dataclass: untracked by Keras and TensorFlow)."""

    norm_sigmas: tuple
    norm_noise_multiplier: Any  # as given: one float or a list (get_config)
    alpha: float
    beta: float
    min_clip_bound: float
    rule: str = "mean"
    target_quantile: float = 0.5
    quantile_learning_rate: float = 0.2
    divide_by_bound: bool = False


def _check_settings(
    num_bounds: int,
    norm_noise_multiplier: Any,
    alpha: Any,
    beta: Any,
    min_clip_bound: Any,
    rule: Any = "mean",
    target_quantile: Any = 0.5,
    quantile_learning_rate: Any = 0.2,
    divide_by_bound: Any = False,
) -> _Settings:
    if isinstance(norm_noise_multiplier, (list, tuple)):
        if len(norm_noise_multiplier) != num_bounds:
            raise ValueError(
                f"norm_noise_multiplier must have one entry per clip bound ({num_bounds}), "
                f"got {len(norm_noise_multiplier)}"
            )
        sigmas = [
            _validate.nonnegative(**{f"norm_noise_multiplier[{i}]": s}) for i, s in enumerate(norm_noise_multiplier)
        ]
        given = list(sigmas)
    else:
        sigmas = [_validate.nonnegative(norm_noise_multiplier=norm_noise_multiplier)] * num_bounds
        given = sigmas[0]
    return _Settings(
        tuple(sigmas),
        given,
        _validate.positive(alpha=alpha),
        _validate.positive(beta=beta),
        _validate.positive(min_clip_bound=min_clip_bound),
        _validate.one_of(RULES, rule=rule),
        _validate.in_range(0.0, 1.0, target_quantile=target_quantile),
        _validate.positive(quantile_learning_rate=quantile_learning_rate),
        _check_bool(divide_by_bound=divide_by_bound),
    )


# The settings an adaptive optimizer shows as read-only attributes and writes in ``get_config`` (its
# ``__init__`` arguments); ``norm_sigmas`` is internal (one σ_q per group).
_PUBLIC_SETTINGS = tuple(f.name for f in dataclasses.fields(_Settings) if f.name != "norm_sigmas")


def _setting(name: str, doc: str) -> property:
    """A read-only attribute of the adaptive optimizer: ``_Settings.<name>``."""
    return property(lambda self: getattr(self._adaptive, name), doc=doc)


def _check_bool(**named: Any) -> bool:
    ((name, value),) = named.items()
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


class AdaptiveClippingCore:
    """Adaptive clipping bounds (Three Tools, Sec. 3; Andrew et al. 2021), shared by both front ends.

    The bounds are per clipping group: one per trainable variable (``l2_norm_clip`` a list or
    dict: per-layer) or one for the whole gradient (a number: flat). Per lot: the gradient is
    clipped to the bounds in force C_g (``clip_bounds``), noised and released (the usual
    sanitizer); in the same step each group's bound query is released and sets the next bound:

    * rule "mean" (Three Tools): Σ_i min(‖g_i^g‖, β C_g) + N(0, σ_q² β² C_g²) (sensitivity β C_g),
      C_g ← max(α · query / L, min_clip_bound);
    * rule "quantile" (Andrew et al. 2021): Σ_i 1[‖g_i^g‖ <= C_g] + N(0, σ_q²) (a count,
      sensitivity 1), b̃ = query / L, C_g ← max(C_g · exp(-η (b̃ - target_quantile)), min_clip_bound).

    L is the same normalizer as the gradient's (expected_lot_size, else the realized lot).
    ``effective_noise_multiplier`` is (Σ_g 1/σ_g² + Σ_g 1/σ_q,g²)^(-1/2) (see
    :mod:`keras_dpsgd.tools.adaptive_clipping`), so the ledger, which charges the optimizer's
    σ_eff, charges the bound queries too.
    """

    def _init_adaptive(
        self,
        norm_noise_multiplier: float | Sequence[float],
        alpha: float,
        beta: float,
        min_clip_bound: float,
        rule: str = "mean",
        target_quantile: float = 0.5,
        quantile_learning_rate: float = 0.2,
        divide_by_bound: bool = False,
    ) -> None:
        if getattr(self, "clipping", "clip") != "clip":
            raise ValueError(
                "adaptive clipping adapts the bound C of clipping='clip'; clipping='normalize' has no bound "
                f"to adapt (use the plain DP optimizer for it), got clipping={self.clipping!r}"
            )
        groups = len(self.l2_norm_clip) if self.per_layer_clipping else 1
        self._adaptive = _check_settings(
            groups,
            norm_noise_multiplier,
            alpha,
            beta,
            min_clip_bound,
            rule,
            target_quantile,
            quantile_learning_rate,
            divide_by_bound,
        )
        # Untracked (no Keras or TensorFlow tracking): the per-replica query sums between two hooks of one step.
        object.__setattr__(self, "_adaptive_replica_state", threading.local())

    def _num_bound_groups(self, num_variables: int) -> int:
        """Size of the bound queries: one per variable (per-layer) or one (flat)."""
        return num_variables if self.per_layer_clipping else 1

    # The settings, read-only (``_Settings``; ``get_config`` writes them all).
    norm_noise_multiplier = _setting(
        "norm_noise_multiplier", "σ_q of the bound queries, as given (one, or one per group)."
    )
    alpha = _setting("alpha", 'Rule "mean": C_t = α · (noisy mean norm of the previous lot).')
    beta = _setting("beta", 'Rule "mean": the norm query clips at β · C_{t-1}.')
    min_clip_bound = _setting("min_clip_bound", "Floor of the bounds.")
    rule = _setting("rule", '"mean" (Three Tools) or "quantile" (Andrew et al. 2021).')
    target_quantile = _setting("target_quantile", 'Rule "quantile": the quantile of the norms the bound follows.')
    quantile_learning_rate = _setting("quantile_learning_rate", 'Rule "quantile": η of C ← C · exp(-η (b̃ - q)).')
    divide_by_bound = _setting(
        "divide_by_bound", "Whether the released gradient is divided by the bound in force (the step in units of C)."
    )

    def add_noise(self, summed: list[tf.Tensor]) -> list[tf.Tensor]:
        """The gradient's release (Σ clip(g_i) + N(0, σ² C²)); with ``divide_by_bound``, divided by C_g
        of each variable's group (post-processing: C_g was released before this lot)."""
        noised = super().add_noise(summed)
        if not self.divide_by_bound:
            return noised
        bounds = tf.gather(self._group_bounds(), self._clip_groups())
        return [n / tf.cast(bounds[v], n.dtype) for v, n in enumerate(noised)]

    @property
    def release_noise_multipliers(self) -> tuple[float, ...]:
        """σ of each Gaussian release of one step: the gradient groups, then the bound queries."""
        sigmas = self.noise_multiplier
        if not isinstance(sigmas, list):
            sigmas = [sigmas] * len(self._adaptive.norm_sigmas)
        return tuple(sigmas) + tuple(self._adaptive.norm_sigmas)

    @property
    def effective_noise_multiplier(self) -> float:
        """σ_eff of one step: gradient releases and bound queries composed (Three Tools Sec. 3)."""
        sigmas = self.release_noise_multipliers
        split = len(sigmas) - len(self._adaptive.norm_sigmas)
        return composed_noise_multiplier(sigmas[:split], sigmas[split:])

    def _query_terms(self, sq_norms: tf.Tensor) -> tf.Tensor:
        """[B, G] each example's term of each group's bound query (0 for a non-finite example)."""
        finite = tf.reduce_all(tf.math.is_finite(sq_norms), axis=1, keepdims=True)
        groups = self._clip_groups()
        num = max(groups) + 1
        if num != len(groups):  # flat: the squared norms of the group's variables add up
            sq_norms = tf.transpose(tf.math.unsorted_segment_sum(tf.transpose(sq_norms), groups, num))
        norms = tf.sqrt(tf.maximum(sq_norms, 0.0))
        return query_terms(self._adaptive, norms, self._group_bounds()[None, :], finite, TF_OPS)

    def on_per_example_sq_norms(self, sq_norms: tf.Tensor) -> None:
        """Accumulates each group's query Σ_i term_i over the lot (:meth:`_query_terms`).

        Under R > 1 replicas (Keras 3, where a lot is one batch there) each replica keeps the sums
        of its share of the lot for this step's release (:meth:`_update_clip_bounds`)."""
        super().on_per_example_sq_norms(sq_norms)
        sums = tf.reduce_sum(self._query_terms(sq_norms), axis=0)
        if _distribute.num_replicas() > 1:  # one batch per lot: accumulation is refused under R > 1
            self._replica_state().norm_sums = sums
        else:
            self._norm_sums.assign_add(sums)

    def _replica_state(self) -> threading.local:
        """This replica's trace-time state (MirroredStrategy traces each replica in a thread of its own)."""
        return self.__dict__["_adaptive_replica_state"]

    def _update_clip_bounds(self, num_examples: tf.Tensor) -> None:
        """Releases the bound queries of the lot and sets the next bounds (call after the gradient's release).

        Under R replicas the query is split like the gradient's release (``keras_dpsgd.step.distribute``):
        replica r adds N(0, s_g² / R) (s_g: the query's noise std) to the sums of its share under a
        key of its own, the noised sums are summed across the replicas once (an all-reduce: ΣS_r +
        N(0, s_g²), the one-device release), and every replica sets the same next bounds from that sum.
        """
        bounds = self._group_bounds()
        noise = self.standard_normal(tf.shape(bounds), NORM_NOISE_INDEX)  # this replica's own key
        sigmas = tf.constant(self._adaptive.norm_sigmas, tf.float32) * _distribute.replica_noise_scale()
        if _distribute.num_replicas() > 1:
            state = self._replica_state()
            sums, state.norm_sums = state.norm_sums, None
        else:
            sums = tf.convert_to_tensor(self._norm_sums)
        noisy = _distribute.global_sum(sums + sigmas * query_sensitivity(self._adaptive, bounds) * noise)
        new_bounds = next_bounds(self._adaptive, bounds, self.normalize([noisy], num_examples)[0], TF_OPS)
        self.clip_bounds.assign(tf.gather(new_bounds, self._clip_groups()))  # flat: C once per variable
        if _distribute.num_replicas() == 1:
            self._norm_sums.assign(tf.zeros_like(noisy))

    def discard_partial_lot(self, where: str = "") -> int:
        """Drops an incomplete lot, and its norm sums: a discarded example never enters a later lot's
        norm query (it was not sampled into that lot; counting it would double the query's sensitivity)."""
        parent = getattr(super(), "discard_partial_lot", None)
        batches = parent(where) if parent is not None else 0
        if batches and getattr(self, "_norm_sums", None) is not None:
            with tf.init_scope():
                self._norm_sums.assign(tf.zeros_like(tf.convert_to_tensor(self._norm_sums)))
        return batches

    def on_noised_step(self, num_examples: tf.Tensor) -> None:
        """After the gradient's release (with the bounds in force): the norm queries and the next bounds."""
        super().on_noised_step(num_examples)
        self._update_clip_bounds(num_examples)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({name: getattr(self, name) for name in _PUBLIC_SETTINGS})
        return config


def adaptive_optimizer_class(
    dp_optimizer_cls: type, mixin: type, register: Callable, module: str, cache: dict[type, type]
) -> type:
    """The class ``Adaptive<dp_optimizer_cls name>``: `mixin` (a front end's adaptive mixin) before
    `dp_optimizer_cls`, registered with `register` (the front end's ``register_keras_serializable``)
    under package "keras_dpsgd"; the same class for the same `dp_optimizer_cls` (`cache`)."""
    if issubclass(dp_optimizer_cls, AdaptiveClippingCore):
        raise ValueError(f"dp_optimizer_cls already clips adaptively: {dp_optimizer_cls.__name__}")
    if dp_optimizer_cls in cache:
        return cache[dp_optimizer_cls]
    cls_name = f"Adaptive{dp_optimizer_cls.__name__}"

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier,
        norm_noise_multiplier,
        *,
        alpha=1.0,
        beta=2.0,
        min_clip_bound=1e-6,
        rule="mean",
        target_quantile=0.5,
        quantile_learning_rate=0.2,
        divide_by_bound=False,
        **kwargs,
    ):
        kwargs.setdefault("name", cls_name)
        dp_optimizer_cls.__init__(self, l2_norm_clip, noise_multiplier, **kwargs)
        self._init_adaptive(
            norm_noise_multiplier,
            alpha,
            beta,
            min_clip_bound,
            rule,
            target_quantile,
            quantile_learning_rate,
            divide_by_bound,
        )

    doc = f"{dp_optimizer_cls.__name__} with adaptive clipping bounds (per layer or flat).\n" + ADAPTIVE_DOC
    cls = type(cls_name, (mixin, dp_optimizer_cls), {"__init__": __init__, "__doc__": doc, "__module__": module})
    cache[dp_optimizer_cls] = register(package="keras_dpsgd", name=cls_name)(cls)
    return cache[dp_optimizer_cls]
