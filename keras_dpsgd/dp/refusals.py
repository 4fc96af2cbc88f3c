"""The one registry of what keras_dpsgd refuses, and why: every refusal kind, by id.

keras_dpsgd fails closed: where it cannot prove the per-example sensitivity bound or the completeness of the
ledger, it refuses with a ``ValueError`` instead of guessing. Each kind of refusal is registered here once: an id,
the one line "what is refused and why", and its entry of the documentation (``docs/refusals.md``, an anchor of the
same id: a test checks that the page and this registry list the same ids). A check raises through the registry::

    raise refuse("batch-statistics", f"Layer {name!r} runs in training mode ...")

which builds a plain ``ValueError`` holding the check's own detail (what it found, in this model, and what to do)
followed by the kind's id, its registered line and the address of its entry. A check that has always raised another
built-in type keeps it (``refuse(id, detail, TypeError)``: ``TypeError``, ``NotImplementedError``, ``RuntimeError``);
a run-time check of a traced step, which cannot raise in Python, puts :func:`refusal_message` in its assertion. (A
plain built-in type, not a subclass: TensorFlow re-raises an error from a traced step as a new exception of the same
type, which it can do only for the built-in types; :func:`refusal_id` reads the kind back from the message.) The check
stays where it must inspect the model (a front end, a backend's graph analysis, the ledger's I/O); its kind and the
text every refusal of that kind shares come from here. ``tests/test_refusals.py`` keeps ``docs/refusals.md`` and this
registry the same, finds every kind raised by a check, and finds no refusal raised past the registry.

Pure Python: no TensorFlow, JAX or Keras import (the core, ``keras_dpsgd.dp``).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = [
    "DOCS_PAGE",
    "ERROR_TYPES",
    "RefusalKind",
    "kind",
    "kinds",
    "refusal_id",
    "refusal_message",
    "refuse",
    "register",
]

# The page of the documentation that lists every kind (its anchors are the ids).
DOCS_PAGE = "https://keras-dpsgd.github.io/keras-dpsgd/refusals/"

# The types a refusal may be (built-in ones, which TensorFlow can re-raise from a traced step); ValueError unless a
# check has always raised another.
ERROR_TYPES = (ValueError, TypeError, NotImplementedError, RuntimeError)


@dataclasses.dataclass(frozen=True)
class RefusalKind:
    """One kind of refusal.

    Attributes:
      id: its name (lower case, words joined by "-"), also the anchor of its entry in ``docs/refusals.md``.
      summary: one line: what is refused, and why (the privacy argument that fails).
    """

    id: str
    summary: str

    @property
    def url(self) -> str:
        """The address of its entry in the documentation."""
        return f"{DOCS_PAGE}#{self.id}"


_ID = re.compile(r"\[Refused \(([a-z0-9-]+)\): ")

_KINDS: dict[str, RefusalKind] = {}


def register(id: str, summary: str) -> RefusalKind:
    """Registers a kind of refusal (once per id).

    Raises:
      ValueError: the id is registered already, or is not lower-case words joined by "-".
    """
    if id in _KINDS:
        raise ValueError(f"refusal kind {id!r} is registered already")
    if not id or id.strip("-") != id or not all(part.isalnum() and part.islower() for part in id.split("-")):
        raise ValueError(f"a refusal id is lower-case words joined by '-', got {id!r}")
    _KINDS[id] = RefusalKind(id, summary)
    return _KINDS[id]


def kind(id: str) -> RefusalKind:
    """The registered kind `id` (KeyError if none: a check names a kind that is not registered)."""
    return _KINDS[id]


def kinds() -> tuple[RefusalKind, ...]:
    """Every registered kind, in registration order (the order of ``docs/refusals.md``)."""
    return tuple(_KINDS.values())


def refusal_message(id: str, detail: str) -> str:
    """The message of a refusal of kind `id` for the check's `detail` (one line).

    For a run-time assertion of a traced step (which fails as TensorFlow's own error, with this message); a check in
    Python raises :func:`refuse`.

    Args:
      id: a registered kind.
      detail: what the check found and what to do instead (the model's layer, op, callback, value ...).

    Returns:
      `detail`, then ``[Refused (id): the kind's line. See its entry]``.
    """
    refused = kind(id)
    detail = detail.rstrip()
    end = "" if detail.endswith((".", "!", "?")) else "."
    return f"{detail}{end} [Refused ({refused.id}): {refused.summary}. See {refused.url}]"


def refuse(id: str, detail: str, error: type[Exception] = ValueError) -> Exception:
    """The refusal of kind `id` for the check's `detail` (to ``raise``).

    Args:
      id: a registered kind.
      detail: what the check found and what to do instead (the model's layer, op, callback, value ...).
      error: its type, one of :data:`ERROR_TYPES` (``ValueError`` unless the check has always raised another).

    Returns:
      An `error` whose message is :func:`refusal_message` (one line).

    Raises:
      TypeError: `error` is not one of :data:`ERROR_TYPES`.
    """
    if error not in ERROR_TYPES:
        raise TypeError(f"a refusal is one of {[t.__name__ for t in ERROR_TYPES]}, got {error!r}")
    return error(refusal_message(id, detail))


def refusal_id(error: BaseException) -> str | None:
    """The id of the kind of refusal `error` is (read from its message), or None if it is no refusal."""
    found = _ID.search(str(error))
    return found.group(1) if found and found.group(1) in _KINDS else None


# The kinds, in the order of docs/refusals.md. --------------------------------------------------------------------

# The training step: the sensitivity bound.
register(
    "mixing-op",
    "an op upstream of the loss that mixes the examples of the batch: one example would change the other "
    "examples' losses, so per-example clipping bounds nothing",
)
register(
    "batch-statistics",
    "BatchNormalization in training mode (or in an eager step) and layers with mixes_examples = True: batch "
    "statistics let one example change every other example's output",
)
register(
    "unknown-op",
    "an op upstream of the loss that the per-example analysis does not know: it may mix the examples, and "
    "nothing then proves each example's loss depends on that example alone",
)
register(
    "no-input",
    "a per-example loss upstream of which no input of the step is found: nothing proves each example's loss "
    "depends on that example alone",
)
register(
    "loss-entries",
    "a per-example loss without exactly one entry per example: it would be clipped as one example holding several",
)
register(
    "batch-statistic-read",
    "a variable the step writes a value of the batch into and the loss reads afterwards: the statistic "
    "reaches every example's loss",
)
register(
    "batch-statistic-stored",
    "a variable of the model the step writes a value of the batch into: it would hold an un-noised statistic "
    "of the data, outside the ledger, saved with the model",
)
register(
    "eager-step",
    "a DP step that runs eagerly: without the traced graph none of the checks of the sensitivity bound can run",
)

# The ledger: every step counted, in every save format.
register(
    "lot-steps-per-epoch",
    "steps_per_epoch not a multiple of gradient_accumulation_steps with a known sampling rate: the incomplete lot "
    "discarded at every epoch end would shift every later Poisson lot",
)
register(
    "epoch-inside-lot",
    "an epoch of fit that ends inside a lot with a known sampling rate: the lots no longer align with the "
    "Poisson stream",
)
register(
    "fit-not-on-lots",
    "a fit of a DP model on other data than the Poisson lots its optimizer's sampling rate was set for: "
    "epsilon at that rate is no proven bound for them",
)
register(
    "step-outside-fit",
    "a DP step outside fit (train_on_batch, a custom loop) while the optimizer holds a Poisson sampling rate: "
    "nothing shows which data reach the step",
)
register(
    "bandmf-participation",
    "a BandMF optimizer of b > 1 bands fed anything but cyclic Poisson lots of b parts in step with its steps: its "
    "sensitivity and its accounting need each example's steps at least b apart",
)
register(
    "lots-rate-under-strategy",
    "a fit on PoissonLots whose rate differs from the optimizer's when the step is traced in a replica of a "
    "tf.distribute strategy: the optimizer cannot take the lots' rate there",
)
register(
    "callback-plain-optimizer",
    "PrivacyLogger or WithinLimit on a model compiled with a plain optimizer: there is no DP step and no "
    "epsilon to report",
)
register(
    "unknown-sampling-rate",
    "epsilon asked for while the sampling rate q is unknown (no PoissonLots.configure, data of unknown size, "
    "no num_examples and batch_size): it cannot be computed",
)
register(
    "num-examples-above-split",
    "num_examples larger than fit's training split (validation_split): epsilon at q = B/N of the full data "
    "would be under-reported",
)
register(
    "save-loses-history",
    "a .keras or full .h5 save of a model whose ledger holds steps of an earlier optimizer: the format keeps "
    "only the optimizer's counter, so the resumed epsilon would be under-reported",
)
register(
    "h5-weights",
    "tf_keras h5 weights of a model with a ledger: they hold the layers' weights only, so a run resumed from "
    "them would restart epsilon at 0",
)
register(
    "model-without-ledger",
    "epsilon of a model that carries no record of its training (no DP optimizer, no copy of a ledger, no step of a "
    "plain optimizer), e.g. loaded with compile=False: its weights may have been trained, and epsilon = 0 would "
    "under-report",
)
register(
    "foreign-ledger",
    "PrivacyLedger.from_dict of a state that is not a keras_dpsgd ledger (another format, an unknown version): "
    "loading it as an empty ledger would report epsilon = 0 for a trained model",
)
register(
    "ledger-version-kinds",
    "a version 1 ledger file naming an event kind added in version 2: version 1 never wrote one, so the file "
    "was edited or is not ours and its epsilon cannot be trusted",
)
register(
    "foreign-ledger-state",
    "a saved ledger state (in a checkpoint, a .keras or .weights.h5 file) that is not a keras_dpsgd ledger state: "
    "loading it as one could drop recorded steps and under-report epsilon",
)
register(
    "search-beyond-trial",
    "record_search (and each trial of tune) on a model whose ledger spends more, at some RDP order, than one trial "
    "of the search may: the search's bound holds only for trials within one RDP bound",
)
register(
    "search-without-bound",
    "a hyperparameter search composed by an accountant that has no bound for it (pld): epsilon would leave out "
    "the search's cost",
)
register(
    "search-not-recorded",
    "a tuned model whose ledger does not report the search's epsilon: the model would be released with an epsilon "
    "that leaves out the search",
)
register(
    "user-grouping",
    "UserPoissonLots without a user id for every example, with a user of more examples than max_examples_per_user, "
    "or labels that are not classes >= 0: a user's examples could not be proven to form one block (one clip, one lot)",
)
register(
    "lots-accumulation-mismatch",
    "PoissonLots whose gradient_accumulation_steps differs from the optimizer's: a release would hold part of a lot, "
    "or parts of two lots, each charged as one Poisson lot",
)
register(
    "stream-size-changed",
    "a streamed data set whose size differs from the N its rate q = L/N was set for (num_examples that is not its "
    "cardinality, a pass that held another number of examples): epsilon would be computed at the wrong rate",
)
register(
    "plan-fixed-fit",
    "fit arguments of a make_private_with_epsilon run other than its plan's: epsilon was calibrated for the plan's "
    "Poisson lots and epochs",
)
register(
    "epsilon-already-spent",
    "make_private_with_epsilon of a model whose recorded releases already spend target_epsilon: no noise keeps the "
    "total within it",
)

# Callbacks: decisions on the training data.
register(
    "private-decision",
    "a callback that decides (stops, restores, keeps the best, changes the learning rate) on a quantity "
    "computed on the private training lots without noise: a decision on the data that epsilon does not count",
)
register(
    "validation-not-held-out",
    "a deciding callback on a val_ quantity when validation rows are training rows, or when the rows of either "
    "side cannot be read: it would decide on the private training data without noise",
)

# Data and preprocessing.
register(
    "adapted-preprocessing",
    "a Keras preprocessing layer fitted on the data in a model trained with DP: its exact statistics would "
    "ship with the model, outside the ledger",
)
register(
    "shared-layer-seeds",
    "two DP preprocessing layers adapted with the same seed: they released the same noise, which epsilon "
    "would count as independent releases",
)

register(
    "delta-above-one-over-n",
    "delta >= 1/N where N is known: such a guarantee allows publishing an example in the clear",
)
register(
    "save-dir-unwritable",
    "keras-dpsgd train --save DIR when DIR is a file, lies under a file or cannot be written: the run would be "
    "lost after training",
)
register(
    "data-file-unreadable",
    "a --data file that is missing, of unknown type, malformed or without training arrays: nothing to train on",
)
register(
    "csv-label-column",
    "a CSV without --label-column, or naming a column that is not in its header: the labels cannot be guessed",
)
register(
    "csv-cells",
    "a non-numeric or empty CSV cell, or a ragged row: features must be numbers",
)
register(
    "non-finite-data",
    "NaN or infinite features or labels, or values float32 cannot hold: they break clipping and training silently",
)
register(
    "labels-not-classes",
    "labels that are not integer classes 0..K-1: not a classification task",
)
register(
    "lot-size-above-n",
    "a --lot-size larger than the training rows: a lot cannot exceed N",
)
register(
    "data-source-ambiguous",
    "--data with --dataset/--data-dir, or options of --data without it: the source of the data is ambiguous",
)
register(
    "cnn-on-flat-features",
    "--model cnn on flat (N, F) features: the convnet needs images",
)
register(
    "dp-layer-adapt",
    "a DP preprocessing layer adapted on labelled data, or again with another (sampling_rate, noise_multiplier): the "
    "first would release the labels too, the second would make the layer's recorded releases wrong",
)
register(
    "dp-normalize-sigma",
    "keras-dpsgd train --dp-normalize 0 (or a non-finite sigma), or --dp-normalize-bounds without it: sigma = 0 "
    "would publish the exact statistics (epsilon = infinity), and bounds alone would do nothing asked for",
)

# Keras 3.
register(
    "no-private-step",
    "a model trained without the private train step or without a DP optimizer: the optimizer would get the "
    "summed gradient, and training on would not be private",
)
register(
    "own-loss-hook",
    "make_private of a model that overrides a hook through which Keras computes the loss and its gradient: the "
    "private step computes each example's loss itself and would silently skip the override",
)
register(
    "data-losses",
    "add_loss terms (e.g. activity_regularizer) in a private step: they may depend on the data, so their "
    "gradient cannot be added without clipping and noise",
)
register(
    "loss-scaling",
    "loss scaling (loss_scale_factor, a LossScaleOptimizer) around a Keras 3 DP optimizer: it would rescale "
    "the sanitized gradients",
)
register(
    "num-microbatches",
    "num_microbatches other than None: keras_dpsgd clips each example, not microbatches (microbatch clipping "
    "adds more noise per example for the same epsilon)",
)
register(
    "crossentropy-from-data",
    'loss="crossentropy" or "ce" in the Keras 3 private step: Keras picks that loss from the data, so no '
    "per-example loss can be derived from the compiled one",
)
register(
    "keras-accumulation",
    "Keras's own gradient_accumulation_steps on a Keras 3 DP optimizer: Keras would average separately noised "
    "batches, which is not one DP-SGD lot",
)
register(
    "sanitize-lot",
    "sanitized_gradients (tf_keras: compute_gradients) with gradient_accumulation_steps > 1: a lot is several "
    "batches and must be released once",
)
register(
    "sanitize-variables",
    "sanitize (a model's own step) with other variables, or in another order, than the optimizer was built with: "
    "its per-variable clip bounds and state would apply to other variables",
)
register(
    "multi-output-mismatch",
    "Keras 3 multi-output losses whose losses, weights, targets or sample weights do not match the model's "
    "outputs: a per-example loss cannot be derived",
)
register(
    "per-example-loss-unknown",
    "a compiled loss from which no per-example loss can be derived (a custom Loss that its get_config does not rebuild "
    "with reduction=None, an identifier keras_dpsgd cannot read): clipping needs each example's loss",
)
register(
    "own-train-step",
    "a DP step of one's own (private_update, sanitized_gradients, minimize with a loss callable) on the JAX or torch "
    "backend: their per-example clipping, noise and ledger live in keras_dpsgd's private step only",
)
register(
    "own-release-hooks",
    "an optimizer overriding the sanitizer hooks (gradient canaries, a noise or normalization of its own) on the JAX "
    "or torch backend: their private steps run keras_dpsgd's release and would silently skip the override",
)
register(
    "adaptive-clipping-backend",
    "adaptive clipping on JAX under keras.distribution: its noised norm queries and bound updates are not built "
    "there, so the bounds would not adapt and their privacy cost would be missing",
)
register(
    "augmentation-not-applied",
    "augmentation multiplicity where the private step does not build it (the JAX and torch backends, a tf_keras model "
    "with its own train_step): the views would be ignored, or clipped as separate examples",
)
register(
    "torch-jit-compile",
    "jit_compile=True (torch.compile) of the private step on the torch backend: the step decides a lot's release with "
    "Python control flow, which a compiled graph would fix at trace time",
)
register(
    "keras-distribution",
    "a keras.distribution the private step does not build (any on torch; on JAX anything but DataParallel in one "
    "process over a 1-D mesh with replicated variables): the clipping and the noise are not split across its devices",
)
register(
    "per-example-backend-choice",
    "a per_example_backend the active Keras 3 backend does not build (JAX and torch take 'auto' and 'reference'): "
    "the step would compute per-example gradients in another way than the one asked for",
)
register(
    "bandmf-setup",
    "a BandMF optimizer on the JAX or torch backend, or with per-layer clipping: those train steps carry no noise "
    "history, and BandMF's accounting is for one Gaussian release per step",
)
register(
    "lots-py-dataset-workers",
    "PoissonLotsPyDataset with workers other than 1 or use_multiprocessing=True: worker processes would draw "
    "the same lots, and threads could reorder them",
)
register(
    "lots-physical-batches",
    "PoissonLots.as_py_dataset() when a lot is split into several physical batches: Keras reads batches ahead "
    "and skips them, so the physical batches would straddle two lots",
)
register(
    "grouped-convolution",
    "a grouped convolution whose per-example gradients would come from TensorFlow's vectorized jacobian, "
    "which computes them wrong: clipping would not bound each example's contribution",
)
register(
    "per-example-check",
    "a run-time check of the per-example gradients that fails (TensorFlow's vectorized jacobian against the plain "
    "gradient, a per-example rule against the layer's output, a layer called otherwise than the step was planned "
    "for): clipping them would not bound each example's contribution",
)

# Several devices or machines (tf.distribute).
register(
    "replica-clipping",
    "Keras's clipnorm, clipvalue or global_clipnorm on a Keras 3 DP optimizer under several replicas: Keras "
    "clips each replica's gradient, which holds only 1/R of the noise",
)
register(
    "replica-lot-options",
    "gradient_accumulation_steps > 1 with weight_decay, use_ema or adaptive clipping under several replicas: "
    "the lot's gated cross-replica update would skip them",
)
register(
    "replica-own-release",
    "an optimizer overriding the sanitizer hooks (gradient canaries, ...) under several replicas: its own "
    "release is not split across the replicas",
)

register(
    "unsupported-strategy",
    "a tf.distribute strategy other than MirroredStrategy, MultiWorkerMirroredStrategy and "
    "OneDeviceStrategy: the noise split and the cross-replica SUM are derived and tested for those only",
)
register(
    "lots-num-workers",
    "PoissonLots whose num_workers is not the number of workers of the optimizer's strategy: unsharded workers "
    "would each sample the whole set, so the union is no Poisson lot",
)
register(
    "lots-sharded-dataset",
    "PoissonLots.dataset() or as_py_dataset() with num_workers > 1: the strategy's input splitting would spread "
    "each worker's lot over several steps, so a step would no longer be one Poisson lot",
)
register(
    "tf-keras-replica-lot-options",
    "tf_keras gradient_accumulation_steps > 1 with weight_decay or use_ema under several replicas: tf_keras "
    "applies them at every batch there, not once per lot",
)
register(
    "tf-keras-adaptive-replicas",
    "tf_keras adaptive clipping under several replicas: its noised norm queries are not split across replicas "
    "and the next bounds would not be set identically on every replica",
)
register(
    "worker-dataset",
    "a tf_keras fit under MultiWorkerMirroredStrategy on a per-worker dataset handed over as is: fit would "
    "release each lot in parts, each charged as a Poisson lot",
)
register(
    "backup-workers-differ",
    "keras_dpsgd.keras3.BackupAndRestore when the workers restored different training states: a worker would "
    "train other weights and count other steps than the others",
)

# Auditing.
register(
    "audit-save",
    "keras-dpsgd audit --save: an audit's model was trained with canaries and is not a model to release",
)
register(
    "canaries-not-installed",
    "a GradientCanaryMixin step before install_gradient_canaries(...): a canary optimizer without its canaries "
    "would audit nothing while looking like an audit",
)
register(
    "audit-setup",
    "an audit of a setup it does not measure (the step audit with per-layer clipping or several replicas; "
    "keras-dpsgd audit with physical batches, clipping normalize or --dp-normalize): its estimate would not be "
    "of the DP-SGD step as trained",
)
