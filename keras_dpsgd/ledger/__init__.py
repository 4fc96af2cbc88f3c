"""The privacy ledger of a training run: every access to the data, resumable.

A model's ledger holds (1) the events of every layer that declares a
``privacy_events`` property (e.g. DP-PCA), found recursively through nested
models and layers, and (2) the DP-SGD steps of its optimizer, one
:class:`PoissonSampledGaussianEvent` per segment of constant (q, σ_eff)
(Abadi et al. 2016, Algorithm 1: each noised step is a sub-sampled Gaussian
mechanism with sampling ratio q and noise multiplier σ).

The state and its transitions are pure (:mod:`keras_dpsgd.dp.ledger_state`, one
schema, no TensorFlow); the Keras I/O is in private modules: ``_holders`` (the
string variables that hold the state, the optimizer's counter), ``_bounds`` (its
worst-case bounds), ``_sync`` (reading the counters into the state),
``_plain_steps`` (a plain optimizer's steps) and ``_attach`` (attaching the
ledger to the model, the guards of its saves and compiles). :mod:`keras_dpsgd.ledger.queries` holds the
public queries (:func:`model_privacy_ledger`, :func:`model_epsilon`,
:func:`steps_remaining`), :mod:`keras_dpsgd.ledger.model_events` the events of a
model's steps and layers, :mod:`keras_dpsgd.ledger.sampling` the q and N of its steps, :mod:`keras_dpsgd.ledger.search`
a hyperparameter search's record.
This module only re-exports (``keras_dpsgd.ledger.X``: the public names and what
the other packages use).

The ledger is the model's. The DP step attaches it to the model it trains
when it is traced (no callback needed); every save brings it up to date
first, whatever the callback order; a model compiled again with a new DP
optimizer adds the new steps to the old ones.

Resuming. The step count is the optimizer's ``noised_steps`` variable; the
segments (runs of steps with one (q, σ)) live in a string variable of a small
``tf.Module`` attached to the optimizer and to the model (attribute
``_dpsgd_ledger_state``; a checkpoint dependency, never one of the model's
weights). What each way of saving keeps:

* ``tf.train.Checkpoint``, ``model.save_weights(path)`` with a TF-format path
  (no ``.h5``), ``ModelCheckpoint(save_weights_only=True)`` to such a path,
  ``BackupAndRestore``: everything; resumed training continues ε exactly.
* SavedModel (``model.save(directory)``, ``ModelCheckpoint`` with full models
  to a directory): the model's copy of the ledger (steps and segments, as of
  the save). tf_keras does not restore the optimizer's variables, so
  ``noised_steps`` restarts at 0 and the new steps are added on top.
* ``.keras`` and full ``.h5`` models: the optimizer's variables, not the
  segments. Besides ``noised_steps`` the optimizer keeps, as variables, the
  worst case the ledger has charged so far: the largest q
  (``ledger_max_sampling_rate``) and the smallest σ_eff
  (``ledger_min_noise_multiplier``). After such a load every step taken so far
  is charged at (max q, min σ) over those and the current values, which never
  under-reports ε (the sub-sampled Gaussian's ε grows with q and shrinks with
  σ); a run that never changed (q, σ) gets exactly the ε of a checkpointed run.
  Where the ledger holds more than the optimizer's counter (steps of an
  earlier optimizer: compiled again, or loaded from a SavedModel) these saves
  are refused. For an exact ledger after changing q or σ, save with checkpoints.
* tf_keras h5 weights (``save_weights("w.h5")``, ``ModelCheckpoint("w.h5",
  save_weights_only=True)``): the layers' weights only, no ledger: refused
  (the callback at the start of ``fit``), since a run resumed from them
  would restart ε at 0.
* Keras 3 (``keras_dpsgd.keras3``): ``.keras`` files and ``.weights.h5``
  weights (``model.save``, ``save_weights``, ``ModelCheckpoint``,
  ``BackupAndRestore``) keep the optimizer's variables and its copy of the
  ledger (a Keras 3 holder saves its state through ``save_own_variables``),
  which also holds an earlier optimizer's steps (the model compiled again:
  the save attaches the ledger first): resumed training continues ε exactly.

Out of sight of the DP optimizer. A model compiled again with a plain optimizer keeps its copy of the ledger
(and its last DP optimizer, which brings it up to date): its ε is the DP history's, ∞ once the plain
optimizer steps; compiled again, the model first writes the plain optimizer's steps into its copy (a noiseless
segment: ``_plain_steps.record_plain_steps``), so they are never lost. A model loaded with ``compile=False`` (the
ledger was in its optimizer) or otherwise carrying no record of its training is refused
(``model-without-ledger``) unless the caller states ``untrained=True``: ε = 0 would be a guess
(:func:`optimizer_events`).

Never saved: ``nonfinite_examples`` (an un-noised count over the private
data, a local diagnostic outside the ledger) and incomplete lots (discarded,
see :mod:`keras_dpsgd.tf_keras._sanitizer`).

A checkpoint restored before the state is attached is applied when it is
attached (deferred restoration). Steps taken after the last checkpoint of a
killed run are not in the restored ledger: their results died with the
process and are not part of the released model.

Changing q or σ during training is detected at each ledger read (every batch
with WithinLimit, every epoch with PrivacyLogger) and at every save. Steps taken between the last read under the old values
and the first read under the new ones cannot be attributed exactly; they are
recorded with the worst case of both (larger q, smaller σ), which never
under-reports ε (the sub-sampled Gaussian's ε grows with q and shrinks with σ).

Sampling. The accountant assumes Poisson sampling (:mod:`keras_dpsgd.step.lots`
explains the difference from shuffled fixed-size batches). The rate recorded is
that of the lots ``fit`` is fed (:mod:`keras_dpsgd.step.fed_data`: a fit on
``PoissonLots.dataset()`` sets the optimizer's rate to those lots'; other data
while the optimizer holds a rate are refused). When the optimizer knows no
sampling rate, q = batch_size · gradient_accumulation_steps / N is used and a
warning says, once, that this ε assumes Poisson sampling.
"""

from __future__ import annotations

from keras_dpsgd._frames import fit_frame
from keras_dpsgd.ledger._attach import (  # noqa: F401 (keras_dpsgd.ledger.X: what the other packages use)
    attach,
    is_h5,
    on_attach,
    recorded_releases,
    refuse_h5_weights,
    refuse_lost_history,
    saving_model,
)
from keras_dpsgd.ledger._bounds import (  # noqa: F401 (idem)
    BOUND_VARIABLES,
    add_bound_variables,
    note_sampling_rate_change,
)
from keras_dpsgd.ledger._holders import (  # noqa: F401 (idem)
    LedgerState,
    discard_partial_lot,
    is_dp_optimizer,
    is_keras3,
    ledger_state_holders,
    noised_steps,
)
from keras_dpsgd.ledger._sync import (  # noqa: F401 (idem)
    recorded_sampling_rate,
    refresh_ledger_offset,
    step_noise_multipliers,
    sync_ledger_state,
)
from keras_dpsgd.ledger.model_events import (  # noqa: F401 (idem)
    DPSGD_LABEL,
    layer_events,
    optimizer_events,
    refuse_shared_layer_seeds,
    step_event,
)
from keras_dpsgd.ledger.queries import model_epsilon, model_privacy_ledger, resolve_delta, steps_remaining
from keras_dpsgd.ledger.search import check_trial, record_search
from keras_dpsgd.ledger.sampling import (
    accumulation_steps,
    assume_poisson,
    assumes_poisson,
    fit_training_size,
    note_fit_sampling,
    resolve_num_examples,
    resolve_sampling_rate,
)

__all__ = [
    "LedgerState",
    "accumulation_steps",
    "assume_poisson",
    "assumes_poisson",
    "attach",
    "check_trial",
    "fit_frame",
    "fit_training_size",
    "is_dp_optimizer",
    "layer_events",
    "ledger_state_holders",
    "model_epsilon",
    "model_privacy_ledger",
    "note_fit_sampling",
    "noised_steps",
    "optimizer_events",
    "record_search",
    "recorded_sampling_rate",
    "refuse_lost_history",
    "resolve_delta",
    "resolve_num_examples",
    "resolve_sampling_rate",
    "saving_model",
    "steps_remaining",
    "sync_ledger_state",
]
