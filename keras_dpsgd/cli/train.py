"""``keras-dpsgd train``: train a differentially private classifier end to end.

The run is Abadi et al. (2016)'s Algorithm 1 with the library's parts:
Poisson-sampled lots (:class:`keras_dpsgd.PoissonLots`), the DP-SGD optimizer
(:class:`keras_dpsgd.tf_keras.DPSGDOptimizer`), ε in the Keras progress bar
(:class:`keras_dpsgd.PrivacyLogger`) and the budget enforced by
:class:`keras_dpsgd.WithinLimit`. It runs on Keras 3 (a model made private with
``keras_dpsgd.keras3.make_private``) unless ``TF_USE_LEGACY_KERAS=1`` selects
tf_keras, TensorFlow's rule for ``tf.keras``; the plan line and the JSON keys
"keras" ("3.15.0", "tf_keras 2.21.0") and "backend" ("tensorflow", or "jax" under
``KERAS_BACKEND=jax``) say which one ran, on which backend. ``--physical-batch-size``
splits every lot into physical batches whose clipped sums are accumulated and
noised once per lot, on either Keras. Unless ``--noise-multiplier`` is given, σ is
the smallest noise multiplier that keeps the planned number of steps within
(target ε, δ) (``compute_noise_multiplier``, which never returns less than the
exact value).

Defaults (digits, offline) were tuned for test accuracy at ε = 3 (a few runs,
about 0.94 on the 450 test images): N = 1,347 training examples is small for
DP. The noise on a lot's mean gradient has standard deviation σC/L, L cannot
be large when N is small, and σ grows with the number of steps, so the best
runs are short: lots of 256 (q ≈ 0.19), 10 epochs (60 steps), σ ≈ 2.06, a
large learning rate with momentum. Longer runs at the same ε lose accuracy. The loss and accuracy in the progress bar are computed on the
training lots without noise: they help the operator but are not covered by ε
(publish the test accuracy and ε, not them).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.step.clipping import CLIPPING_CHOICES, DEFAULT_STABILITY
from keras_dpsgd.cli import CommandFailed, _dp_normalize, add_json_flag, fit_verbosity, positive_float, positive_int
from keras_dpsgd.dp.refusals import refuse

__all__ = ["check_save_destination", "register", "run", "train"]

DEFAULTS = {
    "dataset": "digits",
    "model": "mlp",
    "width": 256,
    "target_epsilon": 3.0,
    "lot_size": 256,  # the most; smaller tables get default_lot_size(N)
    "epochs": 10,
    "l2_norm_clip": 1.0,
    "learning_rate": {"mlp": 0.5, "cnn": 2.0},  # per model (tuned on digits at ε = 3)
    "momentum": 0.9,
}

# The numeric options of ``train``, in help order: (flag, type, metavar, help); defaults from DEFAULTS.
_NUMBER_OPTIONS = (
    ("--width", positive_int, None, "MLP hidden units (default %(default)s)"),
    ("--target-epsilon", positive_float, "X", "privacy budget ε (default %(default)s)"),
    ("--delta", float, "D", "δ < 1/N (default min(1/N^1.1, 1/(10·N)))"),
    (
        "--lot-size",
        positive_int,
        "L",
        "expected Poisson lot size L (default: the largest power of two <= N/5, at most 256)",
    ),
    (
        "--physical-batch-size",
        positive_int,
        "B",
        "split each lot into physical batches of B rows (gradient accumulation; saves memory)",
    ),
    ("--epochs", positive_int, "E", "epochs of ceil(N/L) lots each (default %(default)s)"),
    ("--noise-multiplier", float, "S", "σ >= 0 (default: calibrated so that the planned steps spend the target ε)"),
    (
        "--l2-norm-clip",
        positive_float,
        "C",
        "per-example gradient norm bound C (default 1.0; not with --clipping normalize)",
    ),
    ("--stability", positive_float, "G", "γ of --clipping normalize: g/(||g|| + γ) (default 0.01)"),
    ("--learning-rate", positive_float, "LR", "SGD learning rate (default: 0.5 for mlp, 2.0 for cnn)"),
    ("--momentum", float, None, "SGD momentum (default %(default)s)"),
)


def register(subparsers) -> None:
    from keras_dpsgd.data.datasets import DATASETS
    from keras_dpsgd.data.models import MODELS

    d = DEFAULTS
    p = subparsers.add_parser(
        "train",
        help="train a DP model end to end (default: scikit-learn digits, offline)",
        description=(
            "Train a differentially private classifier with DP-SGD on Poisson-sampled lots, showing ε as it "
            "trains and stopping before ε would exceed the target. σ is calibrated from the target unless "
            "--noise-multiplier is given. ε covers the training set (add/remove one example)."
        ),
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default=d["dataset"],
        help="digits (default): bundled with scikit-learn (offline); the others download through "
        "tensorflow-datasets on first use (mnist, fashion_mnist: or read from --data-dir DIR of IDX files)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="tensorflow-datasets data directory, or a directory of IDX files for mnist/fashion_mnist",
    )
    _register_local_data(p)
    _dp_normalize.register(p)
    p.add_argument("--model", choices=MODELS, default=d["model"], help="mlp (default) or cnn")
    for flag, kind, metavar, text in _NUMBER_OPTIONS:
        dest = flag[2:].replace("-", "_")
        # learning rate: per model, C and γ: per --clipping, set in _check_args; lot size: from N, set in train
        default = None if dest in ("learning_rate", "lot_size", "l2_norm_clip") else d.get(dest)
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    p.add_argument(
        "--clipping",
        choices=CLIPPING_CHOICES,
        default="clip",
        help="clip (default): each example's gradient clipped to norm C; normalize: rescaled to g/(||g|| + γ) "
        "(automatic clipping, Bu et al. 2023): sensitivity 1, no C, the same ε",
    )
    p.add_argument(
        "--accountant", choices=("rdp", "moments", "pld"), default="rdp", help="privacy accountant (default rdp)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for initialization, sampling and noise (reproducible runs; default: OS entropy). "
        "Whoever knows the seed knows the lots and the noise: keep it secret or the guarantee is void",
    )
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write DIR/model.keras and DIR/privacy_report.json (ledger, ε, δ, settings); DIR is "
        "checked before training, the files are written atomically",
    )
    add_json_flag(p)
    p.set_defaults(func=run, uses_tensorflow=True)


def _register_local_data(p) -> None:
    """The flags of ``--data PATH`` (the user's own data; see keras_dpsgd.data.local_data)."""
    from keras_dpsgd.data.local_data import DEFAULT_TEST_FRACTION

    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="your own data: a .npz (x_train, y_train[, x_test, y_test]), a .csv with a header row "
        "(needs --label-column), or a directory of IDX files (train-images-idx3-ubyte ..., plain or .gz)",
    )
    p.add_argument(
        "--label-column",
        default=None,
        metavar="NAME",
        help="the CSV column holding the labels (integers, or text mapped to 0..K-1 in sorted order)",
    )
    p.add_argument(
        "--feature-range",
        action="append",
        default=None,
        metavar="[NAME=]LO,HI",
        help="public range of the features (repeat for NAME=LO,HI per CSV column): features are clipped "
        "to it and scaled to [0, 1]. Never fitted on the data; default 0..255 for IDX/uint8, else as given",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=DEFAULT_TEST_FRACTION,
        metavar="F",
        help="rows held out as the test set when the data has none (default %(default)s, a fixed split)",
    )
    p.add_argument(
        "--num-classes",
        type=positive_int,
        default=None,
        metavar="K",
        help="number of classes if public (default: the largest label + 1, read from the data)",
    )


def _load_data(args):
    """The training data: --data PATH (the user's own), else --dataset (default digits)."""
    from keras_dpsgd.data import datasets as _datasets

    if args.data is None:
        local_only = [
            f
            for f, v in (
                ("--label-column", args.label_column),
                ("--feature-range", args.feature_range),
                ("--num-classes", args.num_classes),
            )
            if v is not None
        ]
        if local_only:
            raise refuse("data-source-ambiguous", f"{', '.join(local_only)} apply to --data PATH only")
        return _datasets.load_dataset(args.dataset, data_dir=args.data_dir)
    if args.dataset != DEFAULTS["dataset"] or args.data_dir is not None:
        raise refuse(
            "data-source-ambiguous", "give either --data PATH (your own data) or --dataset/--data-dir, not both"
        )
    data = _datasets.load_local(
        args.data,
        label_column=args.label_column,
        feature_range=args.feature_range,
        test_fraction=args.test_fraction,
        num_classes=args.num_classes,
    )
    if args.model == "cnn" and len(data.input_shape) != 3:
        raise refuse(
            "cnn-on-flat-features",
            f"model cnn needs images of shape (H, W, C), got examples of shape {data.input_shape}; use --model mlp",
        )
    return data


def _check_args(args) -> None:
    if args.learning_rate is None:
        args.learning_rate = DEFAULTS["learning_rate"][args.model]
    _check_clipping(args)
    if args.noise_multiplier is not None:
        _validate.nonnegative(noise_multiplier=args.noise_multiplier)
    _validate.in_range(0, 1, "[)", momentum=args.momentum)
    _dp_normalize.check(args)
    if args.save:
        check_save_destination(args.save)


def _check_clipping(args) -> None:
    """--clipping clip takes --l2-norm-clip (default 1.0), normalize takes --stability (default 0.01)."""
    if args.clipping == "normalize":
        if args.l2_norm_clip is not None:
            raise ValueError(
                "--l2-norm-clip does not apply to --clipping normalize (each example's gradient is rescaled to "
                "norm < 1: there is no C; the learning rate absorbs the scale)"
            )
        args.stability = DEFAULT_STABILITY if args.stability is None else args.stability
        return
    if args.stability is not None:
        raise ValueError("--stability applies to --clipping normalize only")
    if args.l2_norm_clip is None:
        args.l2_norm_clip = DEFAULTS["l2_norm_clip"]


def default_lot_size(num_examples: int) -> int:
    """L = the largest power of two <= N/5, at most 256 (digits: 256; a table of 142 rows: 16)."""
    n = _validate.integer_at_least(1, num_examples=num_examples)
    lot = 1
    while lot * 2 <= min(DEFAULTS["lot_size"], n / 5):
        lot *= 2
    return lot


def _plan(
    args, num_examples: int, delta: float, lots_per_epoch: int, sampling_rate: float, prior_events=()
) -> tuple[int, float, bool]:
    """(planned steps, σ, calibrated?); σ calibrated on top of `prior_events` (e.g. a DP normalization).

    A calibrated σ that makes no sense (the noise against one example's or the lot's bound,
    ``accounting._budget``) is warned about on stderr with its numbers.
    """
    from keras_dpsgd.accounting import compute_noise_multiplier
    from keras_dpsgd.accounting.budget import budget_warnings

    steps = args.epochs * lots_per_epoch
    if args.noise_multiplier is not None:
        return steps, float(args.noise_multiplier), False
    sigma = compute_noise_multiplier(  # pld without dp_accounting: refused by cli's require_extras first
        target_epsilon=args.target_epsilon,
        target_delta=delta,
        sampling_rate=sampling_rate,
        steps=steps,
        accountant=args.accountant,
        prior_events=prior_events,
    )
    clip = 1.0 if args.l2_norm_clip is None else args.l2_norm_clip  # normalize: sensitivity 1
    for warning in budget_warnings(
        target_epsilon=args.target_epsilon, noise_multiplier=sigma, expected_lot_size=args.lot_size, l2_norm_clip=clip
    ):
        print(f"keras-dpsgd {getattr(args, 'command', 'train')}: warning: {warning}", file=sys.stderr)
    return steps, float(sigma), True


def _accuracy(model, x, y, batch: int = 1024) -> float:
    import numpy as np

    correct = 0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch], training=False)
        logits = np.asarray(logits.detach().cpu() if hasattr(logits, "detach") else logits)  # torch: off the tape
        correct += int(np.sum(np.argmax(logits, axis=-1) == y[i : i + batch]))
    return correct / max(1, len(x))


def train(args) -> dict:
    """Runs one training job described by parsed CLI arguments; returns the result dict.

    Keras 3 by default, tf_keras where ``TF_USE_LEGACY_KERAS=1`` (TensorFlow's
    rule for tf.keras); the result's "keras" and "backend" keys say which one ran, on which backend.
    """
    _check_args(args)
    from keras_dpsgd.data import models as _models
    from keras_dpsgd.accounting import check_delta, default_delta
    from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit
    from keras_dpsgd.ledger import model_epsilon, model_privacy_ledger
    from keras_dpsgd.step.lots import PoissonLots

    front = _models.front_end()
    keras = _models.keras_module(front)
    start = time.perf_counter()
    data = _load_data(args)
    n = data.num_examples
    notes = list(data.notes)
    if args.lot_size is None:
        args.lot_size = default_lot_size(n)
        notes.append(
            f"lot size L = {args.lot_size}: the default for N = {n} (the largest power of two <= N/5, at most "
            f"{DEFAULTS['lot_size']}); --lot-size L to choose"
        )
    if args.lot_size > n:
        raise refuse("lot-size-above-n", f"lot_size must be in [1, N = {n}], got {args.lot_size}")
    delta = default_delta(n) if args.delta is None else check_delta(args.delta, n)
    for note in notes:  # after every check: a refused run prints one line
        print(f"data: {note}")
    auto_scaling = not data.known_range and args.dp_normalize is None
    feature_map = _raw_feature_map(keras, args, data, auto_scaling)
    if feature_map is None:
        x_train, x_test, mapped = data.x_train, data.x_test, data.x_train
    else:  # the model takes the rows as read (issue 40.2): its first layer maps them
        x_train, x_test = (np.asarray(x, np.float32) for x in data.raw)
        # the DP centring is adapted on the rows as the model's next layer sees them
        mapped = np.asarray(feature_map(x_train)) if args.dp_normalize is not None or auto_scaling else None
        notes.append(
            "the model takes the rows as read: its first layer (PublicFeatureMap: "
            + (
                "asinh"
                if feature_map.asinh
                else "the public range scaling"
                if feature_map.lower
                else "the channel axis"
            )
            + ", fixed, no privacy cost) maps them, so a saved model predicts from raw rows"
        )
        print(f"data: {notes[-1]}")
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    lots = PoissonLots(
        x_train,
        data.y_train,
        expected_lot_size=args.lot_size,
        physical_batch_size=args.physical_batch_size,
        seed=args.seed,
    )
    scaling = _dp_normalize.adapted_layer(args, mapped, keras, seed=args.seed, auto=auto_scaling)
    prior = scaling.privacy_events if scaling is not None else ()
    planned, sigma, calibrated = _plan(args, n, delta, lots.lots_per_epoch, lots.sampling_rate, prior)
    optimizer = _models.dp_sgd(
        front,
        l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=sigma,
        lots=lots,
        **_clipping_kwargs(args),
        learning_rate=args.learning_rate,
        momentum=args.momentum,
        seed=args.seed,
    )
    model = _models.build_model(args.model, data.input_shape, data.num_classes, width=args.width, keras_module=keras)
    # the DP layer's release is in the model's ledger; the feature map releases nothing
    model = _dp_normalize.prepend(keras, scaling, model, feature_map, x_train.shape[1:])
    # weighted: padding rows (sample_weight 0) do not count in the accuracy
    model = _models.compile_private(model, optimizer, front, weighted_metrics=["accuracy"])
    logger = PrivacyLogger(delta, accountant=args.accountant)
    limit = WithinLimit(args.target_epsilon, delta, accountant=args.accountant)
    print(_plan_text(args, data.name, n, delta, lots, planned, sigma, calibrated, _models.keras_display(front)))
    if scaling is not None:
        notes.append(_dp_normalize.describe(scaling))
        if auto_scaling:
            notes[-1] += (
                " (the default for features without a public range: --feature-range or --dp-normalize to choose)"
            )
        print(notes[-1])
    model.fit(
        lots.dataset(),
        epochs=args.epochs,
        steps_per_epoch=lots.steps_per_epoch,
        callbacks=[logger, limit],
        validation_data=(x_test, data.y_test),
        validation_batch_size=1024,
        verbose=fit_verbosity(args.json),
        shuffle=False,  # lots are random already
    )
    epsilon, delta = model_epsilon(model, target_delta=delta, accountant=args.accountant)
    steps = int(optimizer.noised_steps.numpy())
    result = {
        "dataset": data.name,
        "model": args.model,
        "keras": _models.keras_label(front),
        "backend": _models.backend_label(front),
        "num_examples": n,
        "data_notes": notes,
        "epsilon": float(epsilon),
        "target_epsilon": args.target_epsilon,
        "delta": float(delta),
        "accountant": args.accountant,
        "test_accuracy": _accuracy(model, x_test, data.y_test),
        "steps": steps,
        "planned_steps": planned,
        # True when the budget ran out before the planned steps (a given σ too small for them).
        "stopped_by_within_limit": bool(limit.stopped) and steps < planned,
        "epochs": args.epochs,
        "lot_size": args.lot_size,
        "sampling_rate": lots.sampling_rate,
        "noise_multiplier": sigma,
        "noise_calibrated": calibrated,
        "l2_norm_clip": args.l2_norm_clip,
        "clipping": args.clipping,
        "stability": args.stability,
        "learning_rate": args.learning_rate,
        "momentum": args.momentum,
        "seed": args.seed,
        "dp_normalize": _dp_normalize.summary(scaling),
        "seconds": time.perf_counter() - start,
    }
    if args.save:
        try:
            result["saved_to"] = _save(args.save, model, model_privacy_ledger(model), result)
        except OSError as err:  # after training: report the run anyway (see run)
            result["save_error"] = f"cannot save to {args.save!r}: {err.strerror or err}; nothing was written"
    return result


def feature_map_layer(keras: Any, **kwargs: Any) -> Any:
    """A PublicFeatureMap of `keras`'s front end (the ``keras`` or ``tf_keras`` module) with `kwargs`."""
    if keras.__name__.startswith("tf_keras"):
        from keras_dpsgd.preprocessing import feature_map

        return feature_map.PublicFeatureMap(**kwargs)  # tf_keras's, defined and registered at first access
    import keras_dpsgd.keras3  # noqa: F401 (registers the Keras 3 class, keras_dpsgd.keras3._layers.PublicFeatureMap)

    return keras.saving.get_registered_object("keras_dpsgd>PublicFeatureMap")(**kwargs)


def _raw_feature_map(keras, args, data, auto_scaling: bool):
    """The PublicFeatureMap that maps ``--data``'s rows as read to the model's features, or None.

    Its constants are public (the given ``--feature-range``, the uint8 range, ``asinh``), never fitted on the
    data. None for the bundled and tfds data sets (the model takes their arrays as loaded) and for ``--data``
    used as given (a float npz or CSV with ``--dp-normalize``: the DPNormalization is the first layer).
    """
    if args.data is None or data.raw is None:
        return None
    raw_shape = data.raw[0].shape[1:]
    reshape = tuple(data.input_shape) if tuple(data.input_shape) != raw_shape else None
    if data.feature_range is not None:
        lower, upper = data.feature_range
        return feature_map_layer(keras, lower=lower, upper=upper, target_shape=reshape, name="public_feature_map")
    if auto_scaling or reshape is not None:
        return feature_map_layer(keras, asinh=auto_scaling, target_shape=reshape, name="public_feature_map")
    return None


def _clipping_kwargs(args) -> dict:
    """The optimizer's clipping keywords (none for the default, clip)."""
    return dict(clipping="normalize", stability=args.stability) if args.clipping == "normalize" else {}


def _clipping_text(l2_norm_clip, stability) -> str:
    return f"C = {l2_norm_clip:g}" if l2_norm_clip is not None else f"per-example normalization (γ = {stability:g})"


def _plan_text(args, name, n, delta, lots, planned, sigma, calibrated, keras_display) -> str:
    how = "calibrated to the target" if calibrated else "given"
    return (
        f"DP-SGD on {name} (N = {n}): {planned} steps planned ({args.epochs} epochs of "
        f"{lots.lots_per_epoch} Poisson lots, expected size {args.lot_size}, q = {lots.sampling_rate:.4g}), "
        f"σ = {sigma:.4g} ({how}), {_clipping_text(args.l2_norm_clip, args.stability)}; budget ε = {args.target_epsilon:g} at "
        f"δ = {delta:.3g}; {keras_display}"
    )


SAVED_FILES = ("model.keras", "privacy_report.json")


def check_save_destination(directory: str) -> None:
    """Raises ValueError unless `directory` is (or can be created as) a writable directory.

    Checked before training so that a run is not lost to a bad ``--save``: the
    nearest existing path must be a directory in which a file can be created
    (a real probe, since permission bits do not bind root), and the files to be
    written must not exist as anything but regular files.
    """
    path = os.path.abspath(directory)
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is an existing file" if existing == path else f"is under {existing!r}, which is not a directory"
        raise refuse("save-dir-unwritable", f"--save {directory!r} {what}: give a directory")
    for name in SAVED_FILES:
        target = os.path.join(path, name)
        if os.path.lexists(target) and not os.path.isfile(target):
            raise refuse("save-dir-unwritable", f"--save {directory!r}: {target!r} exists and is not a regular file")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".keras-dpsgd-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise refuse("save-dir-unwritable", f"--save {directory!r} is not writable: {err.strerror or err}") from None


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: set it back at once
    os.umask(mask)
    return mask


def _save(directory: str, model, ledger, result: dict) -> str:
    """Writes DIR/model.keras and DIR/privacy_report.json atomically (both or neither).

    Each file is written under a temporary name in DIR, then renamed over its
    final name (os.replace, atomic on one file system); on an error the
    temporary files are removed and earlier files of those names stay as they
    were. The files get the mode a new file gets (0666 less the umask), not
    the temporary files' 0600.

    Raises:
      OSError: if a file cannot be written (full disk, permissions).
    """
    os.makedirs(directory, exist_ok=True)
    report = {
        "epsilon": result["epsilon"],
        "delta": result["delta"],
        "accountant": result["accountant"],
        "privacy_unit": "one training example (add/remove adjacency)",
        "ledger": ledger.to_dict(),
        "settings": {k: v for k, v in result.items() if k not in ("epsilon", "delta", "accountant")},
        "model": "model.keras",
    }
    temporary = {}
    try:
        for name in SAVED_FILES:  # both Kerases pick the .keras format by the suffix
            suffix = ".keras" if name.endswith(".keras") else ".tmp"
            fd, temporary[name] = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=suffix)
            os.close(fd)
        model.save(temporary["model.keras"])
        with open(temporary["privacy_report.json"], "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, sort_keys=True)
        mode = 0o666 & ~_umask()  # what open() gives a new file (mkstemp's are 0600)
        for name in SAVED_FILES:
            os.chmod(temporary[name], mode)
            os.replace(temporary.pop(name), os.path.join(directory, name))
    finally:
        for leftover in temporary.values():
            with contextlib.suppress(OSError):
                os.remove(leftover)
    return directory


def run(args) -> dict:
    """Trains; a failed ``--save`` still prints the result, then exits with code 1."""
    if args.json:
        # stdout must carry exactly one JSON object: everything train prints (plan, progress,
        # tfds messages) goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            result = train(args)
    else:
        from keras_dpsgd.data import models as _models

        result = train(args)
        print(
            f"\n{result['dataset']}: test accuracy {result['test_accuracy']:.4f} at ε = {result['epsilon']:.4g} "
            f"(target {result['target_epsilon']:g}), δ = {result['delta']:.3g}, accountant {result['accountant']}, "
            f"{_models.keras_display(_models.front_end())}\n"
            f"  {result['steps']} of {result['planned_steps']} planned steps, σ = {result['noise_multiplier']:.4g}, "
            f"{_clipping_text(result['l2_norm_clip'], result['stability'])}, lr = {result['learning_rate']:g}, {result['seconds']:.1f} s"
            + (f"\n  saved to {result['saved_to']}" if "saved_to" in result else "")
        )
    if "save_error" in result:
        raise CommandFailed(result["save_error"], result)
    return result
