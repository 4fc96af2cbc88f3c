"""``keras-dpsgd audit``: train with canaries, measure ε_emp, and check it against the reported ε.

The privacy flags are those of ``keras-dpsgd train`` (the parser is built
from its own, so the two cannot drift); ``--noise-multiplier 0`` trains
without noise (ε = ∞). Two modes, each training ONE model with canaries:

* ``--mode step`` (default, the strongest): the white-box step audit
  (:func:`keras_dpsgd.audit.step_audit`, after Nasr et al. 2023): Dirac canaries on every coordinate,
  the noised release of every step measured against the claimed Gaussian mechanism; it assumes the
  noise is Gaussian and measures its scale.
* ``--mode one-run``: m canaries, each included with probability 1/2, the canaries' scores turned into
  a lower bound (Steinke, Nasr, Jagielski 2023); assumes nothing about the noise's form.

ε_emp > ε is a bug.

The audit run is a training run on the data: the ε it prints is its own. It trains on the data that
``train`` would (``--data PATH`` with its flags, else ``--dataset``); features without a public range are
mapped by ``asinh`` (fixed, no privacy cost) and not centred (``--dp-normalize`` is refused: the audit
measures the DP-SGD steps alone). ``--json`` adds ``dataset``, ``num_examples`` and ``data_notes``.

It trains on Keras 3 (``keras_dpsgd.keras3``) unless ``TF_USE_LEGACY_KERAS=1`` selects tf_keras,
as ``tf.keras`` does; the output says which, on which backend (``--json`` keys ``keras`` and
``backend``, as ``keras-dpsgd train`` writes them: "3.15.0" or "tf_keras 2.21.0"; "tensorflow" or "jax").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys

from keras_dpsgd import _validate
from keras_dpsgd.cli import fit_verbosity, positive_int
from keras_dpsgd.dp.refusals import refuse

__all__ = ["audit", "register", "run"]

_KINDS = ("gradient", "ood", "mislabeled")
_MODES = ("step", "one-run")
_ONE_RUN_CANARIES = 1000  # --canaries default of --mode one-run (step: one on every coordinate)
_PLOT_SCALES = (0.5, 1.0, 2.0, 4.0)  # --plot: σ of the run times these


def _confidence(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def register(subparsers) -> None:
    from keras_dpsgd.cli import train as train_cli

    scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
    train_cli.register(scratch)
    p = subparsers.add_parser(
        "audit",
        parents=[scratch.choices["train"]],
        conflict_handler="resolve",
        help="audit DP training empirically: one run with canaries gives a lower bound on ε",
        description=(
            "Train one model with canaries, compute an empirical lower bound ε_emp on its privacy loss and "
            "compare it with the ε the accountant reports: ε_emp > ε flags a bug. --mode step (default): "
            "the noised release of every step against the claimed Gaussian mechanism (white box, Nasr et al. "
            "2023; assumes Gaussian noise, measures its scale); --mode one-run: canaries included by fair "
            "coins, scored after training (Steinke, Nasr, Jagielski 2023). Privacy flags as for "
            "`keras-dpsgd train`; --noise-multiplier 0 trains without noise. The audit is itself a training "
            "run on the data."
        ),
    )
    p.add_argument(
        "--mode",
        choices=_MODES,
        default="step",
        help="step: white-box audit of every step's noised release (default, the strongest); one-run: the "
        "one-run canary audit, which assumes nothing about the noise's form",
    )
    p.add_argument(
        "--canaries",
        type=positive_int,
        default=None,
        metavar="M",
        help=f"number of canaries (one-run: m >= 2, default {_ONE_RUN_CANARIES}; step: default one on every "
        "trainable coordinate)",
    )
    p.add_argument(
        "--canary-kind",
        choices=_KINDS,
        default="gradient",
        help="gradient: Dirac canaries in the clipped sum (audits the step; default); ood: noise "
        "images with random labels; mislabeled: held-out images with wrong labels (these two: --mode one-run)",
    )
    p.add_argument(
        "--confidence", type=_confidence, default=0.95, metavar="C", help="confidence of ε_emp (default %(default)s)"
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also audit σ × (0.5, 1, 2, 4) and plot ε_emp against the reported ε",
    )
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run, uses_tensorflow=True)


def _check(args) -> None:
    from keras_dpsgd.cli import train as train_cli

    if args.save is not None:
        raise refuse(
            "audit-save", "--save is not supported by audit: an audit's model holds canaries and is not for release"
        )
    if args.physical_batch_size is not None:
        raise refuse("audit-setup", "--physical-batch-size is not supported by audit (lots are one physical batch)")
    if args.clipping != "clip":
        raise refuse("audit-setup", f"--clipping {args.clipping} is not supported by audit (it audits clipping at C)")
    if args.dp_normalize is not None or args.dp_normalize_bounds is not None:
        raise refuse("audit-setup", "--dp-normalize is not supported by audit (it audits the DP-SGD steps alone)")
    if args.mode == "one-run":
        if args.canaries is not None:  # None: the mode's default, _ONE_RUN_CANARIES
            _validate.integer_at_least(2, canaries=args.canaries)
    elif args.canary_kind != "gradient":
        raise ValueError(
            f"--canary-kind {args.canary_kind} needs --mode one-run (the step audit uses gradient canaries)"
        )
    else:
        from keras_dpsgd.audit.statistics import require_pld

        require_pld()  # before any work: ImportError, exit 2
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ValueError(f"plot must be a file name ending in .png, got {args.plot!r}")
    train_cli._check_args(args)


def _audit(args, data, noise_multiplier):
    """One audited run; `noise_multiplier` None: calibrated to the target as `train` does."""
    from keras_dpsgd.data import models as _models
    from keras_dpsgd.audit.one_run import canary_audit
    from keras_dpsgd.audit.step import step_audit
    from keras_dpsgd.cli import train as train_cli
    from keras_dpsgd.tools import front as _front

    keras_module = _front.active().keras

    def sigma(lots, delta):
        args.noise_multiplier = noise_multiplier
        return train_cli._plan(args, lots.num_examples, delta, lots.lots_per_epoch, lots.sampling_rate)[1]

    common = dict(
        num_classes=data.num_classes,
        noise_multiplier=sigma,
        l2_norm_clip=args.l2_norm_clip,
        lot_size=args.lot_size,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        momentum=args.momentum,
        delta=args.delta,
        confidence=args.confidence,
        accountant=args.accountant,
        seed=args.seed,
        verbose=fit_verbosity(args.json),
    )
    build = lambda: _models.build_model(  # noqa: E731
        args.model, data.input_shape, data.num_classes, width=args.width, keras_module=keras_module
    )
    train = (data.x_train, data.y_train)
    if args.mode == "step":
        return step_audit(build, train, canaries=args.canaries, **common)
    return canary_audit(
        build,
        train,
        canaries=args.canaries or _ONE_RUN_CANARIES,
        kind=args.canary_kind,
        held_out=(data.x_test, data.y_test),
        **common,
    )


def audit(args) -> dict:
    """Runs the audit described by parsed CLI arguments; returns the result dict."""
    from keras_dpsgd.cli import _dp_normalize
    from keras_dpsgd.cli import train as train_cli
    from keras_dpsgd.data import models as _models

    _check(args)
    given = args.noise_multiplier
    data = train_cli._load_data(args)  # --data PATH (the user's own) or --dataset, as train reads them
    notes = list(data.notes)
    if not data.known_range:  # train's default scaling without its DP centring (a release of its own)
        data = dataclasses.replace(
            data,
            x_train=_dp_normalize.public_transform(data.x_train),
            x_test=_dp_normalize.public_transform(data.x_test),
        )
        notes.append("features mapped by asinh (fixed, no privacy cost); the audit does not centre them")
    for note in notes:
        print(f"data: {note}")
    if args.lot_size is None:  # train's default from N (the audit's result records the lot size)
        from keras_dpsgd.cli.train import default_lot_size

        args.lot_size = default_lot_size(data.num_examples)
    result = _audit(args, data, given)
    out = {
        **result.to_dict(),
        "mode": args.mode,
        "backend": _models.backend_label(_models.front_end()),
        "dataset": data.name,
        "num_examples": data.num_examples,
        "data_notes": notes,
    }
    if args.plot:
        points = [(result.noise_multiplier, result.epsilon, result.epsilon_lower_bound)]
        base = result.noise_multiplier if result.noise_multiplier > 0 else 1.0
        for scale in _PLOT_SCALES:
            sigma = base * scale
            if any(math.isclose(sigma, p[0]) for p in points):
                continue
            r = _audit(args, data, sigma)
            points.append((r.noise_multiplier, r.epsilon, r.epsilon_lower_bound))
        out["plot"] = _plot(args.plot, sorted(points), result)
        out["plot_points"] = [
            {"noise_multiplier": s, "epsilon": e, "epsilon_lower_bound": lb} for s, e, lb in sorted(points)
        ]
    return out


def _plot(path: str, points, result) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [(s, e, lb) for s, e, lb in points if math.isfinite(e) and math.isfinite(lb)]
    per_step = getattr(result, "per_step", None)  # the step audit: what every step released
    fig, axes = plt.subplots(1, 1 if per_step is None else 2, figsize=(5 if per_step is None else 10, 4))
    ax = axes if per_step is None else axes[0]
    top = max([e for _, e, _ in finite] + [lb for _, _, lb in finite] + [1.0])
    ax.plot([0, top], [0, top], "k--", lw=1, label="ε_emp = ε (above: a bug)")
    ax.plot([e for _, e, _ in finite], [lb for _, e, lb in finite], "o-", label=f"ε_emp ({result.method})")
    for s, e, lb in finite:
        ax.annotate(f"σ={s:.2g}", (e, lb), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("reported ε (accountant)")
    ax.set_ylabel(f"ε_emp at {result.confidence:.0%} confidence")
    ax.set_title(f"{result.method} audit, {result.canaries} canaries, δ = {result.delta:.2g}")
    ax.legend(fontsize=8)
    if per_step is not None:
        steps = range(1, len(per_step) + 1)
        axes[1].plot(steps, per_step[:, 0], ".", label="noise std / C measured")
        axes[1].plot(steps, per_step[:, 1], "x", ms=4, label="canaries' shift / C measured (claimed 1)")
        axes[1].axhline(
            result.noise_multiplier, color="k", ls="--", lw=1, label=f"claimed σ = {result.noise_multiplier:.3g}"
        )
        axes[1].axhline(1.0, color="gray", ls=":", lw=1)
        axes[1].set_xlabel("step")
        axes[1].set_title("every step of the audited run")
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args) -> dict:
    from keras_dpsgd.data import models as _models

    if args.json:
        with contextlib.redirect_stdout(sys.stderr):
            return _flag(_select(audit(args)))
    out = audit(args)
    if args.mode == "step":
        detail = (
            f"noise measured σ = {out['noise_multiplier_estimate']:.4g} (at most "
            f"{out['noise_multiplier_upper_bound']:.4g} of the canaries' shift), {out['observations']} "
            f"projections over {out['steps']} steps; assumes {out['assumption']}"
        )
    else:
        detail = f"AUC {out['auc']:.3f}, {out['correct']} of {out['guesses']} guesses right"
    print(
        f"\nreported ε = {out['epsilon']:.4g}, empirical lower bound ε_emp = {out['epsilon_lower_bound']:.4g} "
        f"at {out['confidence']:.0%} confidence (δ = {out['delta']:.3g}, {out['canaries']} canaries, "
        f"{out['method']}, {detail}, "
        f"σ = {out['noise_multiplier']:.4g}, {_models.keras_display(_models.front_end())})\n{out['verdict']}"
        + (f"\nplot written to {out['plot']}" if "plot" in out else "")
    )
    return _flag(_select(out))


def _flag(out: dict) -> dict:
    """A leak found is the command's failure (exit 1, the result still reported): CI can gate on it."""
    from keras_dpsgd.cli import CommandFailed

    if out["violation"]:
        raise CommandFailed(out["verdict"], out)
    return out


def _select(out: dict) -> dict:
    keys = (
        "epsilon",
        "epsilon_lower_bound",
        "confidence",
        "canaries",
        "auc",
        "method",
        "mode",
        "delta",
        "verdict",
        "violation",
        "noise_multiplier",
        "guesses",
        "correct",
        "noise_multiplier_estimate",
        "noise_multiplier_upper_bound",
        "shift_estimate",
        "observations",
        "canary_joins",
        "sampling_rate",
        "assumption",
        "steps",
        "keras",
        "backend",
        "dataset",
        "num_examples",
        "data_notes",
        "plot",
        "plot_points",
    )
    return {k: out[k] for k in keys if k in out}
