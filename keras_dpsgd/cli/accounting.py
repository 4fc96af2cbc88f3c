"""Accounting and planning subcommands: ``epsilon``, ``noise``, ``batch-table``.

Steps = ceil(E·N/L) and sampling rate q = L/N (Poisson sampling of lots of
expected size L, as in Abadi et al. 2016). δ defaults to min(1/N^1.1, 1/(10·N)); a δ >= 1/N
is refused (exit 2: such a guarantee allows publishing an example in the
clear), and so is σ = ∞. A missing optional extra (``--accountant pld``
without dp_accounting) is an ImportError, which :func:`keras_dpsgd.cli.main`
prints as one line, exit 2, like every bad input. With σ = 0 the JSON output holds ``"epsilon": "inf"``
(strict JSON has no Infinity) and ``"order": null``.

``batch-table`` is the one table command: with ``--base-learning-rate`` or
``--max-batch-size`` its rows also carry the linearly scaled learning rate and
the gradient-accumulation plan (Three Tools, Sec. 4). ``large-lots`` is its
deprecated alias (same table, the learning rate always on).

``--json`` keys. ``epsilon``: epsilon, order, noise_multiplier, num_examples,
lot_size, batch_size, epochs, steps, sampling_rate, delta, accountant (with
``--target-epsilon`` also target_epsilon, max_steps, max_epochs). ``noise``:
the same keys plus target_epsilon. ``batch-table``: rows (each lot_size,
sampling_rate, steps, noise_multiplier, noise_per_example; with the learning
rate also learning_rate, and with ``--max-batch-size`` physical_batch_size and
accumulation_steps), num_examples, epochs, target_epsilon, delta, accountant,
plot (the file, null without ``--plot``). The key batch_size (= lot_size) is
deprecated and will be removed.
"""

from __future__ import annotations

import argparse

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting import planning
from keras_dpsgd.accounting.accountants import accountant_names
from keras_dpsgd.accounting.events import PoissonSampledGaussianEvent
from keras_dpsgd.cli import add_json_flag, add_option

__all__ = ["register", "run_batch_table", "run_epsilon", "run_noise"]

_ACCOUNTANT_HELP = (
    "rdp: RDP with the tight conversion (default); moments: Abadi et al. 2016 (integer orders <= 32, "
    "classic conversion); pld: privacy loss distributions (needs dp_accounting: pip install keras-dpsgd[pld])"
)


def register(subparsers) -> None:
    eps = subparsers.add_parser("epsilon", help="ε of a DP-SGD run", description="ε spent by a DP-SGD run.")
    _add_data_args(eps, batch=True)
    eps.add_argument(
        "--noise-multiplier", type=float, required=True, metavar="S", help="noise multiplier σ >= 0, finite"
    )
    eps.add_argument(
        "--target-epsilon",
        type=float,
        default=None,
        metavar="X",
        help="also report the largest number of steps and epochs at this σ within (X, δ)",
    )
    _add_common_args(eps)
    eps.set_defaults(func=run_epsilon)

    noise = subparsers.add_parser(
        "noise", help="noise multiplier for a target ε", description="Smallest σ that keeps a run within (ε, δ)."
    )
    noise.add_argument("--target-epsilon", type=float, required=True, metavar="X", help="target ε > 0")
    _add_data_args(noise, batch=True)
    _add_common_args(noise)
    noise.set_defaults(func=run_noise)

    table = subparsers.add_parser(
        "batch-table",
        help="noise per example versus lot size (and the scaled learning rate)",
        description="For each lot size L: the smallest σ spending (ε, δ) in E epochs, and σ/L "
        "(Three Tools paper); with --base-learning-rate or --max-batch-size also the linearly scaled "
        "learning rate and the gradient-accumulation plan.",
    )
    add_table_args(table)
    table.set_defaults(func=run_batch_table)


def add_table_args(table: argparse.ArgumentParser, *, base_learning_rate: float | None = None) -> None:
    """The arguments of the table command (``batch-table`` and its deprecated alias ``large-lots``)."""
    add_option(table, "--target-epsilon", "--epsilon", type=float, required=True, metavar="X", help="target ε > 0")
    _add_data_args(table, batch=False)
    table.add_argument(
        "--lot-sizes",
        nargs="+",
        metavar="L",
        help="lot sizes, space- or comma-separated (default: powers of two from 16 to N)",
    )
    table.add_argument(
        "--base-learning-rate",
        type=float,
        default=base_learning_rate,
        metavar="LR",
        help="learning rate at --base-lot-size: adds the linearly scaled learning rate (Goyal et al. 2017)",
    )
    table.add_argument("--base-lot-size", type=int, default=128, metavar="L0", help="lot size of --base-learning-rate")
    table.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        metavar="B",
        help="largest physical batch in memory: adds the gradient-accumulation plan",
    )
    table.add_argument("--plot", metavar="FILE.png", help="also draw the table (needs matplotlib)")
    _add_common_args(table)


def _add_data_args(parser: argparse.ArgumentParser, *, batch: bool) -> None:
    parser.add_argument("--num-examples", type=int, required=True, metavar="N", help="training set size N")
    if batch:
        add_option(
            parser,
            "--lot-size",
            "--batch-size",
            type=int,
            required=True,
            metavar="L",
            help="expected Poisson lot size L <= N",
        )
    parser.add_argument("--epochs", type=float, required=True, metavar="E", help="number of epochs (may be fractional)")


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--delta", type=float, default=None, metavar="D", help="δ in (0, 1/N) (default min(1/N^1.1, 1/(10·N)))"
    )
    parser.add_argument("--accountant", choices=accountant_names(), default="rdp", help=_ACCOUNTANT_HELP)
    add_json_flag(parser)


def _delta(args) -> float:
    """δ, default min(1/N^1.1, 1/(10·N)); δ >= 1/N is refused (it allows publishing an example in the clear)."""
    if args.delta is None:
        return planning.default_delta(args.num_examples)
    return planning.check_delta(args.delta, args.num_examples)


def _context(args) -> dict:
    if args.num_examples >= 1 and not 1 <= args.lot_size <= args.num_examples:
        raise ValueError(f"lot_size must be in [1, num_examples = {args.num_examples}], got {args.lot_size}")
    steps = planning.steps_for_epochs(args.num_examples, args.lot_size, args.epochs)
    return {
        "num_examples": args.num_examples,
        "lot_size": args.lot_size,
        "batch_size": args.lot_size,  # deprecated key, same value
        "epochs": args.epochs,
        "steps": steps,
        "sampling_rate": args.lot_size / args.num_examples,
        "delta": _delta(args),
        "accountant": args.accountant,
    }


def run_epsilon(args) -> dict:
    ctx = _context(args)
    sigma = V.nonnegative(noise_multiplier=args.noise_multiplier)
    event = PoissonSampledGaussianEvent(ctx["sampling_rate"], sigma, ctx["steps"], label="dp-sgd")
    eps, order = planning.compute_epsilon_and_order(event, ctx["delta"], accountant=args.accountant)
    result = {"epsilon": eps, "order": order, "noise_multiplier": sigma, **ctx}
    if args.target_epsilon is not None:
        target = V.positive(target_epsilon=args.target_epsilon)
        max_steps = planning.max_steps_within_budget(
            target_epsilon=target,
            target_delta=ctx["delta"],
            sampling_rate=ctx["sampling_rate"],
            noise_multiplier=sigma,
            accountant=args.accountant,
        )
        result.update(
            target_epsilon=target,
            max_steps=max_steps,
            max_epochs=planning.max_epochs_from_steps(args.num_examples, args.lot_size, max_steps),
        )
    if not args.json:
        print(
            f"ε = {eps:.6g} at δ = {ctx['delta']:.3g}{_order_text(order)}, accountant {args.accountant}\n"
            f"  {ctx['steps']} steps, sampling rate q = {ctx['sampling_rate']:.6g}, noise multiplier σ = {sigma:g}"
        )
        if "max_steps" in result:
            print(
                f"  budget ε = {result['target_epsilon']:g} allows at most {result['max_steps']} steps "
                f"({result['max_epochs']:.6g} epochs) at this σ"
            )
    return result


def run_noise(args) -> dict:
    ctx = _context(args)
    target = V.positive(target_epsilon=args.target_epsilon)
    sigma = planning.compute_noise_multiplier(
        target_epsilon=target,
        target_delta=ctx["delta"],
        sampling_rate=ctx["sampling_rate"],
        steps=ctx["steps"],
        accountant=args.accountant,
    )
    event = PoissonSampledGaussianEvent(ctx["sampling_rate"], sigma, ctx["steps"], label="dp-sgd")
    eps, order = planning.compute_epsilon_and_order(event, ctx["delta"], accountant=args.accountant)
    result = {"noise_multiplier": sigma, "target_epsilon": target, "epsilon": eps, "order": order, **ctx}
    if not args.json:
        print(
            f"noise multiplier σ = {sigma:.6g} (ε = {eps:.6g} <= {target:g} at δ = {ctx['delta']:.3g}"
            f"{_order_text(order)}, accountant {args.accountant})\n"
            f"  {ctx['steps']} steps, sampling rate q = {ctx['sampling_rate']:.6g}"
        )
    return result


def _lot_sizes(tokens, num_examples: int) -> list[int]:
    if not tokens:
        if num_examples < 1:
            raise ValueError(f"num_examples must be an integer >= 1, got {num_examples}")
        sizes, lot = [], 16
        while lot <= num_examples:
            sizes.append(lot)
            lot *= 2
        return sizes or [num_examples]
    sizes = []
    for token in tokens:
        for part in token.split(","):
            if not part.strip():
                continue
            try:
                sizes.append(int(part))
            except ValueError:
                raise ValueError(f"lot sizes must be integers in [1, num_examples], got {part!r}") from None
    for lot in sizes:
        if not 1 <= lot <= num_examples:
            raise ValueError(f"lot sizes must be integers in [1, num_examples = {num_examples}], got {lot}")
    return sizes


_EXTRA_COLUMNS = ("learning_rate", "physical_batch_size", "accumulation_steps")


def _table_rows(args, sizes: list[int], target: float, delta: float) -> list[dict]:
    """The accountant's rows; with a base learning rate or a memory cap, Three Tools' extra columns."""
    from keras_dpsgd.tools.large_lots import large_lot_table

    common = dict(
        num_examples=args.num_examples,
        epochs=args.epochs,
        target_epsilon=target,
        target_delta=delta,
        lot_sizes=sizes,
        accountant=args.accountant,
    )
    if args.base_learning_rate is None and args.max_batch_size is None:
        return planning.batch_table(**common)
    return large_lot_table(
        **common,
        base_learning_rate=0.01 if args.base_learning_rate is None else args.base_learning_rate,
        base_lot_size=args.base_lot_size,
        max_batch_size=args.max_batch_size,
    )


def run_batch_table(args) -> dict:
    sizes = _lot_sizes(args.lot_sizes, args.num_examples)
    delta = _delta(args)
    target = V.positive(target_epsilon=args.target_epsilon)
    rows = _table_rows(args, sizes, target, delta)
    result = {
        "rows": rows,
        "num_examples": args.num_examples,
        "epochs": args.epochs,
        "target_epsilon": target,
        "delta": delta,
        "accountant": args.accountant,
        "plot": args.plot,
    }
    if args.plot:
        _plot(rows, args.plot)
    if not args.json:
        extra = [c for c in _EXTRA_COLUMNS if c in rows[0]]
        print(
            f"ε = {target:g}, δ = {delta:.3g}, N = {args.num_examples}, {args.epochs:g} epochs, accountant {args.accountant}"
        )
        print(f"{'lot size':>9} {'q':>10} {'steps':>9} {'σ':>10} {'σ / lot':>11}" + "".join(f" {c:>19}" for c in extra))
        for r in rows:
            print(
                f"{r['lot_size']:>9} {r['sampling_rate']:>10.4g} {r['steps']:>9} "
                f"{r['noise_multiplier']:>10.4g} {r['noise_per_example']:>11.4g}"
                + "".join(f" {r[c]:>19.6g}" for c in extra)
            )
        if args.plot:
            print(f"plot written to {args.plot}")
    return result


def _plot(rows: list[dict], path: str) -> None:
    """The one noise-per-example plot (:func:`keras_dpsgd.tools.large_lots.plot_noise_per_example`), saved."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from keras_dpsgd.tools.large_lots import plot_noise_per_example

    fig = plot_noise_per_example(rows)
    try:
        fig.savefig(path)
    except OSError as err:
        raise ValueError(f"cannot write plot {path!r}: {err}") from None
    finally:
        plt.close(fig)


def _order_text(order) -> str:
    return f" (RDP order α = {order:g})" if order is not None else ""
