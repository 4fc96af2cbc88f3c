"""Adaptive clipping's optimizer mixin, the part both front ends share (tf_keras and Keras 3 on TensorFlow).

The settings, the bound rules and the release of the bound queries are the core's
(:mod:`keras_dpsgd.dp.adaptive`, written once for every backend; the derivation is in
:mod:`keras_dpsgd.tools.adaptive_clipping`); here they run on TensorFlow over the optimizer's variables. A front
end puts :class:`AdaptiveClippingCore` before its DP optimizer class and supplies the ``_norm_sums`` variable
(created in ``build``); the rest goes through the published hooks both front ends' DP optimizers have:
``on_per_example_sq_norms`` (the lot's norm sums), ``on_noised_step`` (after the gradient's release: the norm
queries and the next bounds), ``standard_normal`` and ``normalize``. On JAX the Keras 3 train step runs the same
core functions on the variables' values instead of these hooks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import tensorflow as tf

from keras_dpsgd.backends.tensorflow.ops import TF_OPS
from keras_dpsgd.dp import adaptive as core
from keras_dpsgd.dp.clip import finite_rows
from keras_dpsgd.step import distribute as _distribute

__all__ = ["AdaptiveClippingCore", "ADAPTIVE_DOC", "adaptive_optimizer_class"]

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


def _setting(name: str, doc: str) -> property:
    """A read-only attribute of the adaptive optimizer: ``AdaptiveSettings.<name>``."""
    return property(lambda self: getattr(self._adaptive, name), doc=doc)


class AdaptiveClippingCore:
    """Adaptive clipping bounds (Three Tools, Sec. 3; Andrew et al. 2021), shared by both front ends.

    The bounds are per clipping group: one per trainable variable (``l2_norm_clip`` a list or
    dict: per-layer) or one for the whole gradient (a number: flat). Per lot: the gradient is
    clipped to the bounds in force C_g (``clip_bounds``), noised and released (the usual
    sanitizer); in the same step each group's bound query is released and sets the next bound
    (the rules: :mod:`keras_dpsgd.dp.adaptive`).

    L is the same normalizer as the gradient's (expected_lot_size, else the realized lot).
    ``effective_noise_multiplier`` is (Σ_g 1/σ_g² + Σ_g 1/σ_q,g²)^(-1/2) (see
    :mod:`keras_dpsgd.tools.adaptive_clipping`): ``release_noise_multipliers`` lists the bound queries
    after the gradient's groups, so the ledger, which charges the optimizer's σ_eff, charges them too.
    """

    def _init_adaptive(self, **settings: Any) -> None:
        """Checks and keeps the adaptive `settings` (:func:`keras_dpsgd.dp.adaptive.check_settings`'s keywords)."""
        if getattr(self, "clipping", "clip") != "clip":
            raise ValueError(
                "adaptive clipping adapts the bound C of clipping='clip'; clipping='normalize' has no bound "
                f"to adapt (use the plain DP optimizer for it), got clipping={self.clipping!r}"
            )
        groups = len(self.l2_norm_clip) if self.per_layer_clipping else 1
        self._adaptive = core.check_settings(groups, **settings)
        # Untracked (no Keras or TensorFlow tracking): the per-replica query sums between two hooks of one step.
        object.__setattr__(self, "_adaptive_replica_state", threading.local())

    def _num_bound_groups(self, num_variables: int) -> int:
        """Size of the bound queries: one per variable (per-layer) or one (flat)."""
        return num_variables if self.per_layer_clipping else 1

    # The settings, read-only (``AdaptiveSettings``; ``get_config`` writes them all).
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
        return tuple(super().release_noise_multipliers) + tuple(self._adaptive.norm_sigmas)

    def _query_terms(self, sq_norms: tf.Tensor) -> tf.Tensor:
        """[B, G] each example's term of each group's bound query (0 for a non-finite example)."""
        finite = finite_rows(TF_OPS, sq_norms)
        return core.example_query_terms(
            self._adaptive, sq_norms, self._group_bounds(), finite, self._clip_groups(), TF_OPS
        )

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
        noise = self.standard_normal(tf.shape(bounds), core.NORM_NOISE_INDEX)  # this replica's own key
        sigmas = tf.constant(self._adaptive.norm_sigmas, tf.float32) * _distribute.replica_noise_scale()
        if _distribute.num_replicas() > 1:
            state = self._replica_state()
            sums, state.norm_sums = state.norm_sums, None
        else:
            sums = tf.convert_to_tensor(self._norm_sums)

        def normalize(noisy: tf.Tensor) -> tf.Tensor:
            return self.normalize([_distribute.global_sum(noisy)], num_examples)[0]

        new_bounds = core.next_bounds_from_sums(self._adaptive, sums, bounds, sigmas, noise, normalize, TF_OPS)
        self.clip_bounds.assign(tf.gather(new_bounds, self._clip_groups()))  # flat: C once per variable
        if _distribute.num_replicas() == 1:
            self._norm_sums.assign(tf.zeros_like(sums))

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
        config.update({name: getattr(self, name) for name in core.PUBLIC_SETTINGS})
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
        given = locals()
        settings = {name: given[name] for name in core.PUBLIC_SETTINGS}  # the adaptive arguments, as given
        kwargs.setdefault("name", cls_name)
        dp_optimizer_cls.__init__(self, l2_norm_clip, noise_multiplier, **kwargs)
        self._init_adaptive(**settings)

    doc = f"{dp_optimizer_cls.__name__} with adaptive clipping bounds (per layer or flat).\n" + ADAPTIVE_DOC
    cls = type(cls_name, (mixin, dp_optimizer_cls), {"__init__": __init__, "__doc__": doc, "__module__": module})
    cache[dp_optimizer_cls] = register(package="keras_dpsgd", name=cls_name)(cls)
    return cache[dp_optimizer_cls]
