"""The DP settings of a private optimizer and its local state: one definition for both front ends.

:func:`check_settings` validates the DP arguments of every private optimizer (tf_keras and Keras 3,
``keras_dpsgd.step.classes.init_private`` calls it before the Keras ``__init__`` runs), and
:class:`DPSettingsMixin` holds what the two sanitizer mixins (``keras_dpsgd.tf_keras._sanitizer`` and
``keras_dpsgd.keras3._optimizer``) share: the settings' properties, their ``get_config`` entries
and the state kept out of every save (the traced mirror of ``expected_lot_size``, the
``nonfinite_examples`` count, the noise generator: made by the backend, ``make_local_state``). The
variables that ARE saved (``noised_steps``, the ledger's bounds, ``clip_bounds``) are made by each front
end, as its Keras saves them. The step's math is the DP core's (``keras_dpsgd.dp``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence

import tensorflow as tf

from keras_dpsgd import _validate as V
from keras_dpsgd.step.clipping import DEFAULT_STABILITY, check_clipping
from keras_dpsgd.dp import release as dp_release
from keras_dpsgd.dp.clip import ClippedSum, clip_groups, sensitivity
from keras_dpsgd.step import _callback_guard, distribute as _distribute
from keras_dpsgd import backends, ledger
from keras_dpsgd.backends.tensorflow import state as _state
from keras_dpsgd.backends.tensorflow.report import FALLBACK_CHOICES, PerExampleReport
from keras_dpsgd.accounting.events import composed_noise_multiplier

# A model given a DP optimizer's ledger has its fits' callbacks checked (the ledger is below the step and calls
# back; every DP optimizer's class imports this module, so the check is registered before any ledger is attached).
ledger.on_attach(_callback_guard.watch_fits)


def check_l2_norm_clip(l2_norm_clip: Any) -> float | list[float] | dict[str, float]:
    """Validates a flat (float), per-variable (list) or by-name (dict) bound."""
    if isinstance(l2_norm_clip, dict):
        if not l2_norm_clip:
            raise ValueError("l2_norm_clip must not be an empty dict")
        return {str(k): V.positive(**{f"l2_norm_clip[{k!r}]": v}) for k, v in l2_norm_clip.items()}
    if isinstance(l2_norm_clip, (list, tuple)):
        if not l2_norm_clip:
            raise ValueError("l2_norm_clip must not be an empty list")
        return [V.positive(**{f"l2_norm_clip[{i}]": v}) for i, v in enumerate(l2_norm_clip)]
    return V.positive(l2_norm_clip=l2_norm_clip)


def check_noise_multiplier(noise_multiplier: Any, l2_norm_clip: Any) -> float | list[float]:
    """Validates σ: a float, or one per variable (per-layer clipping only)."""
    if isinstance(noise_multiplier, (list, tuple)):
        if not isinstance(l2_norm_clip, list):
            raise ValueError(
                "noise_multiplier may be a list only with a list l2_norm_clip (one entry per "
                f"trainable variable, same order); got noise_multiplier={noise_multiplier!r} "
                f"with l2_norm_clip={l2_norm_clip!r}"
            )
        if len(noise_multiplier) != len(l2_norm_clip):
            raise ValueError(
                f"noise_multiplier must have one entry per clip bound ({len(l2_norm_clip)}), "
                f"got {len(noise_multiplier)}"
            )
        return [V.nonnegative(**{f"noise_multiplier[{i}]": s}) for i, s in enumerate(noise_multiplier)]
    return V.nonnegative(noise_multiplier=noise_multiplier)


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_v 1/σ_v²)^(-1/2) of a per-variable Gaussian step (0 if any σ_v is 0).

    :func:`keras_dpsgd.accounting.composed_noise_multiplier`, the one place σ_eff is computed.
    """
    return composed_noise_multiplier(noise_multipliers)


def release_noise_multipliers(l2_norm_clip: Any, noise_multiplier: Any) -> tuple[float, ...]:
    """σ of each Gaussian release of one step: one per clipping group (flat clipping, normalization: one)."""
    if not isinstance(l2_norm_clip, (list, dict)):
        return (noise_multiplier,)
    if isinstance(noise_multiplier, list):
        return tuple(noise_multiplier)
    return (noise_multiplier,) * len(l2_norm_clip)


def check_lot_size(value: Any) -> float | None:
    """expected_lot_size: None or a finite number > 0."""
    return None if value is None else V.positive(expected_lot_size=value)


def check_sampling_rate(value: Any) -> float | None:
    """sampling_rate: None or a number in (0, 1]."""
    return None if value is None else V.in_range(0, 1, "(]", sampling_rate=value)


def check_seed(value: Any) -> int | None:
    """seed: None or an int64."""
    return None if value is None else V.integer_in_range(-(2**63), 2**63 - 1, seed=value)


def check_accumulation_steps(value: Any) -> int:
    """gradient_accumulation_steps: an integer >= 1."""
    return V.integer_at_least(1, gradient_accumulation_steps=value)


@dataclasses.dataclass
class DPState:
    """A private optimizer's DP settings and local state: a plain object, untracked by Keras and TF.

    The settings are those of the constructor, checked (:func:`check_settings`); ``lot``,
    ``nonfinite`` and ``generator`` are made by the backend (``make_local_state``) and are never
    saved. ``sigmas`` (σ of each variable) is set when the optimizer is built; ``pending`` holds the
    gradients of the last release, the only ones the optimizer applies. ``pending`` and
    ``keras_view`` are per thread: a MirroredStrategy traces each replica's step in a thread of its own.
    """

    l2_norm_clip: Any
    noise_multiplier: Any
    backend: Any
    accumulation: int
    per_example_backend: str
    jacobian_fallback: str
    seed: int | None
    sampling_rate: float | None
    expected_lot_size: float | None
    clipping: str = "clip"
    stability: float = DEFAULT_STABILITY
    # The local state, made by the backend (``make_local_state``: tf.Variables on TensorFlow, optimizer
    # variables made at build on JAX): the traced mirror of expected_lot_size (0 = unset); the examples zeroed
    # for a non-finite gradient (local, never saved); TensorFlow's OS-entropy generator (seed None, never saved).
    lot: Any = None
    nonfinite: Any = None
    generator: Any = None
    # An integer variable: the releases the model's ledger recorded before this optimizer's counter began
    # (written by the ledger, ``keras_dpsgd.ledger.sync_ledger_state``; never saved). A seeded key is a
    # function of (seed, ledger_offset + noised_steps): the release's position in the model's ledger.
    ledger_offset: Any = None
    noise: Any = None  # The noise source: the backend module (keras_dpsgd.backends) that serves this Keras.
    sigmas: list = dataclasses.field(default_factory=list)
    local: threading.local = dataclasses.field(default_factory=threading.local)

    @property
    def pending(self) -> list:
        """The gradients of this thread's last release, the only ones the optimizer applies."""
        if not hasattr(self.local, "pending"):
            self.local.pending = []
        return self.local.pending

    @property
    def keras_view(self) -> int:
        """Keras 3: > 0 while Keras's own code runs (in this thread), which must see no DP accumulation."""
        return getattr(self.local, "keras_view", 0)

    @keras_view.setter
    def keras_view(self, value: int) -> None:
        self.local.keras_view = value

    def config(self) -> dict[str, Any]:
        """The DP entries of the optimizer's ``get_config`` (the constructor's arguments)."""
        return dict(
            l2_norm_clip=self.l2_norm_clip,
            noise_multiplier=self.noise_multiplier,
            gradient_accumulation_steps=self.accumulation,
            expected_lot_size=self.expected_lot_size,
            sampling_rate=self.sampling_rate,
            per_example_backend=self.per_example_backend,
            jacobian_fallback=self.jacobian_fallback,
            seed=self.seed,
            clipping=self.clipping,
            stability=self.stability,
        )


def check_settings(
    l2_norm_clip: Any,
    noise_multiplier: Any,
    *,
    gradient_accumulation_steps: Any = 1,
    expected_lot_size: Any = None,
    sampling_rate: Any = None,
    per_example_backend: str = "auto",
    jacobian_fallback: str = "warn",
    seed: Any = None,
    clipping: Any = "clip",
    stability: Any = DEFAULT_STABILITY,
    keras_backend: str | None = None,
) -> DPState:
    """The checked DP arguments of a private optimizer (both front ends), as a :class:`DPState`.

    `keras_backend` (``keras_dpsgd.backends.keras_backend_of`` the optimizer: "tf_keras", or Keras 3's
    backend, the default) chooses the per-example computation and the noise source.

    Raises:
      ValueError: naming the first argument out of range (in the order of the signature).
      TypeError: for a value of the wrong type (bools and strings are refused).
    """
    clipping, stability = check_clipping(clipping, stability, l2_norm_clip)
    clip = None if clipping == "normalize" else check_l2_norm_clip(l2_norm_clip)
    sigma = check_noise_multiplier(noise_multiplier, clip)
    fallback = V.one_of(FALLBACK_CHOICES, jacobian_fallback=jacobian_fallback)
    return DPState(
        l2_norm_clip=clip,
        noise_multiplier=sigma,
        accumulation=check_accumulation_steps(gradient_accumulation_steps),
        expected_lot_size=check_lot_size(expected_lot_size),
        sampling_rate=check_sampling_rate(sampling_rate),
        backend=backends.per_example(per_example_backend, fallback, keras_backend),
        noise=backends.load(keras_backend),
        per_example_backend=per_example_backend,
        jacobian_fallback=fallback,
        seed=check_seed(seed),
        clipping=clipping,
        stability=stability,
    )


class DPSettingsMixin:
    """The DP settings of a private optimizer, read the same way on tf_keras and Keras 3.

    The front end's ``_init_dp(state)`` calls :meth:`_init_dp_state` with the checked settings;
    everything here reads ``self._dp`` (a :class:`DPState`).
    """

    _dp: DPState

    def _init_dp_state(self, state: DPState) -> None:
        """Stores the checked settings; the backend makes the local state (never saved) where it keeps state
        (TensorFlow: ``tf.Variable``s now; JAX: optimizer variables when the optimizer is built)."""
        state.noise.make_local_state(state)
        self._dp = state
        self.discarded_lots = 0
        self.discarded_batches = 0

    @property
    def l2_norm_clip(self):
        return self._dp.l2_norm_clip

    @property
    def noise_multiplier(self):
        return self._dp.noise_multiplier

    @property
    def seed(self) -> int | None:
        return self._dp.seed

    @property
    def per_example_backend(self) -> str:
        """The backend asked for ("auto", "reference" or "fast")."""
        return self._dp.per_example_backend

    @property
    def jacobian_fallback(self) -> str:
        """ "warn" or "refuse": what the fast backend does with a variable no per-example rule reads."""
        return self._dp.jacobian_fallback

    @property
    def per_example_report(self) -> PerExampleReport | None:
        """How the last traced step computed per-example gradients (None before the first step).

        ``report.fallback`` lists the variables that took per-example jacobians (about B times the
        cost of their gradient), each with the op that stopped the fast analysis and why;
        ``report.fast`` the variables the fast rules computed; ``str(report)`` is the warning's text.
        """
        return getattr(self._dp.backend, "last_report", None)

    @property
    def _backend(self):
        """The per-example backend in use (resolved from ``per_example_backend``)."""
        return self._dp.backend

    @property
    def clipping(self) -> str:
        """ "clip" (``min(1, C/||g_i||)``) or "normalize" (``g_i/(||g_i|| + stability)``, sensitivity 1)."""
        return self._dp.clipping

    @property
    def stability(self) -> float:
        """γ of per-example normalization (clipping="normalize"; Bu et al. 2023's automatic clipping)."""
        return self._dp.stability

    @property
    def per_layer_clipping(self) -> bool:
        return isinstance(self._dp.l2_norm_clip, (list, dict))

    @property
    def nonfinite_examples(self) -> tf.Variable:
        """Examples whose gradient was non-finite (zeroed): an un-noised statistic of the private data,
        kept in this process only (never saved: not in `.keras` or h5 files nor checkpoints)."""
        return self._dp.nonfinite

    @property
    def release_noise_multipliers(self) -> tuple[float, ...]:
        """σ of each Gaussian release of one step (one per clipping group), as the ledger records it."""
        return release_noise_multipliers(self._dp.l2_norm_clip, self._dp.noise_multiplier)

    @property
    def effective_noise_multiplier(self) -> float:
        """σ_eff of one noised step: σ (flat) or (Σ_v 1/σ_v²)^(-1/2) (per variable).

        Per-layer clipping with V variables and one σ gives σ/√V.
        """
        return composed_noise_multiplier(self.release_noise_multipliers)

    @property
    def expected_lot_size(self) -> float | None:
        return self._dp.expected_lot_size

    @expected_lot_size.setter
    def expected_lot_size(self, value: float | None) -> None:
        self._dp.expected_lot_size = check_lot_size(value)
        if self._dp.lot is not None:  # None before JAX's build, which starts it from expected_lot_size
            self._dp.lot.assign(0.0 if value is None else float(value))

    @property
    def sampling_rate(self) -> float | None:
        return self._dp.sampling_rate

    @sampling_rate.setter
    def sampling_rate(self, value: float | None) -> None:
        """A new q: the steps already taken at the old q stay charged at least at it."""
        new = check_sampling_rate(value)
        old = self._dp.sampling_rate
        if old is not None and new != old:
            ledger.note_sampling_rate_change(self, old)
        self._dp.sampling_rate = new

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(self._dp.config())
        return config

    # ------------------------------------------------- steps 5-6 of a release, both front ends
    # The front end provides ``clip_bounds`` (its saved variable) and ``noised_steps``; the math is the DP
    # core's (``keras_dpsgd.dp``), over the table of the backend (``self._dp.noise.OPS``).
    def _clip_groups(self) -> list[int]:
        """The clipping group of each variable (``dp.clip.clip_groups``): flat clipping is one group."""
        return clip_groups(len(self._dp.sigmas), self.per_layer_clipping)

    def _group_bounds(self) -> Any:
        """C_g of each group; flat: clip_bounds holds C once per variable (the saved shape), take one.
        Per-example normalization: C = 1, the sensitivity (``_release.resolve_bounds``)."""
        bounds = tf.convert_to_tensor(self.clip_bounds)
        return bounds if self.per_layer_clipping else bounds[:1]

    def _clipping(self) -> tuple[Any, list[int], float | None]:
        """(C_g in force, the group of each variable, γ of per-example normalization or None)."""
        stability = self._dp.stability if self._dp.clipping == "normalize" else None
        return self._group_bounds(), self._clip_groups(), stability

    def add_noise(self, summed: list[tf.Tensor]) -> list[tf.Tensor]:
        """Step 5, overridable: Σ_i clip(g_i)[v] + N(0, σ_v² S_v²) for each variable v (``dp.release.add_noise``),
        S_v the sensitivity the clipped sum being released carries (C of v's group; per-example
        normalization: 1). Called outside a release (a test, an audit), S_v is the bound in force.

        Under R replicas each adds N(0, σ_v² S_v² / R) with a key of its own; the cross-replica sum
        holds N(0, σ_v² S_v²) once (``keras_dpsgd.step.distribute``).
        """
        clipped = getattr(self._dp.local, "releasing", None)
        if clipped is None:
            bounds, groups, _ = self._clipping()
            clipped = ClippedSum(tuple(summed), None, sensitivity(bounds, groups))

        def gaussians(xs, stddevs, indices):  # one draw for the release (``dp.release.add_gaussians``)
            return dp_release.add_gaussians(self._dp.noise.OPS, xs, stddevs, self._noise_key(indices[0]))

        scale = _distribute.replica_noise_scale()  # 1/√R per replica (1 for one replica)
        return dp_release.add_noise(clipped.with_sums(summed), self._dp.sigmas, gaussians, scale)

    def normalize(self, noised: list[tf.Tensor], num_examples: tf.Tensor) -> list[tf.Tensor]:
        """Step 6: divide by expected_lot_size, else by the realized lot size (``dp.release.normalize``).

        The result is the step's release: what the step computes from it (the update of the
        weights) is post-processing, not a write of the batch (``_state.mark_released``)."""
        ops = self._dp.noise.OPS
        released = dp_release.normalize(ops, noised, dp_release.lot_denominator(ops, num_examples, self._dp.lot))
        _state.mark_released(released)
        return released

    def _refuse_batch_writes(self, loss: tf.Tensor, model: Any) -> None:
        """At trace time: the step writes no value of the batch into a variable other than this
        optimizer's own (slots, counters, lot sums, noise state) and Keras's metrics' (``_state``).

        Raises:
          ValueError: naming the variable, the op and its layer, and the way out.
        """
        if tf.executing_eagerly() or not hasattr(loss, "graph"):
            return  # An eager step is refused by the per-example backend.
        own = self.variables() if callable(self.variables) else self.variables
        own = list(own) + [self._dp.lot, self._dp.nonfinite]
        if self._dp.generator is not None:
            own.append(self._dp.generator.state)
        # Keras's metrics (the compiled loss's mean, compile metrics): documented as not released.
        own += [v for m in (getattr(model, "metrics", None) or ()) for v in m.variables]
        _state.refuse_batch_writes(loss, own, model)

    def standard_normal(self, shape: Any, index: int, dtype: Any = tf.float32) -> tf.Tensor:
        """N(0, 1) noise for a hook's own release (``keras_dpsgd.dp.noise``: tails to 11.6, not TF's
        clamp at 5.68), drawn like the gradient's; `index` >= 2**30 keeps a seeded stream apart
        from the gradient's (indices 0..V-1)."""
        return self._dp.noise.standard_normal(shape, self._noise_key(index), dtype)

    def _ledger_position(self) -> tf.Tensor:
        """int64: this release's position among every release the model's ledger records.

        ``noised_steps`` counts this optimizer's releases only; a model compiled again with a new
        optimizer (or ``make_private_with_epsilon`` called again) starts a new counter at 0. The
        ledger's offset (the releases recorded before this counter began) makes the position unique
        in the model's ledger, so a seed passed again never draws a noise it drew before (issue 37.4).
        """
        steps = tf.cast(tf.convert_to_tensor(self.noised_steps), tf.int64)
        return steps + tf.cast(tf.convert_to_tensor(self._dp.ledger_offset), tf.int64)

    def _noise_key(self, index: int) -> tf.Tensor:
        """The [2] int64 key of one draw of noise (``index``: the release's first tensor, or a hook's own index),
        this replica's own under a strategy (``_distribute.replica_key``)."""
        if self._dp.seed is None:  # A fresh Philox key per draw.
            key = self._dp.generator.make_seeds(1)[:, 0]
        else:  # Reproducible and resumable: a function of (seed, position in the model's ledger, tensor[, replica]).
            key = self._dp.noise.seeded_key(self._dp.seed, self._ledger_position(), index)
        return _distribute.replica_key(key)
