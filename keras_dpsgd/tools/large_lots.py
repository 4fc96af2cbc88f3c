"""Large lots with a linearly scaled learning rate (Three Tools, tool 3).

Van der Veen et al. 2018 ("Three Tools for Practical Differential Privacy",
Section 4 and Table 1) observe that for a fixed privacy budget (ε, δ) and a
fixed number of epochs, the noise each example's gradient sees falls as the
lot grows: the accountant needs σ to grow more slowly than the lot size L, so
σ / L (the noise standard deviation on the averaged gradient, in units of the
clip bound) shrinks. Large lots only help if the learning rate grows with the
lot (Goyal et al. 2017, "Accurate, Large Minibatch SGD", linear scaling rule):
lr(L) = lr_base · L / L_base, with lr_base = 0.01 at L_base = 128 in the paper.
Lots that do not fit in memory are processed as several physical batches whose
clipped per-example gradients are summed before the noise is added once
(`DPSGDOptimizer(gradient_accumulation_steps=k)`): the privacy analysis sees
one lot.

The privacy numbers come from the accountant
(:func:`keras_dpsgd.accounting.batch_table`); this module only adds the
learning rate and the memory plan to its rows, and plots them.

This module is pure Python (no TensorFlow).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from keras_dpsgd import _validate

__all__ = ["large_lot_table", "plan_gradient_accumulation", "plot_noise_per_example", "scale_learning_rate"]


def scale_learning_rate(lot_size: float, base_learning_rate: float = 0.01, base_lot_size: float = 128) -> float:
    """Linear learning-rate scaling rule (Goyal et al. 2017), as in Three Tools Table 1.

    lr(L) = base_learning_rate · L / base_lot_size. The paper's base is
    lr = 0.01 at L = 128, so L = 1024 trains with lr = 0.08.

    Args:
      lot_size: the (expected) lot size L > 0; with Poisson sampling use the
        expected lot size q · N.
      base_learning_rate: learning rate that works at `base_lot_size`, > 0.
      base_lot_size: lot size the base learning rate was tuned for, > 0.

    Returns:
      The scaled learning rate.

    Raises:
      ValueError: if an argument is not a finite number > 0.
    """
    lot = _validate.positive(lot_size=lot_size)
    base_lr = _validate.positive(base_learning_rate=base_learning_rate)
    base_lot = _validate.positive(base_lot_size=base_lot_size)
    return base_lr * lot / base_lot


def plan_gradient_accumulation(lot_size: int, max_batch_size: int) -> dict[str, int]:
    """Splits a lot into equal physical batches that fit in memory.

    Finds the smallest number of accumulation steps k with L / k <= max_batch_size
    and k dividing L, so that the lot is exactly k physical batches of L / k
    examples (`DPSGDOptimizer(gradient_accumulation_steps=k)`). With Poisson
    sampling the realized lot varies around its expectation; size the
    physical batches with headroom (see `examples/large_lots.py`).

    Args:
      lot_size: lot size L, an integer >= 1.
      max_batch_size: largest physical batch that fits in memory, an integer >= 1.

    Returns:
      dict with keys lot_size, physical_batch_size, accumulation_steps.

    Raises:
      ValueError: if an argument is not an integer >= 1.
    """
    lot = _validate.integer_at_least(1, lot_size=lot_size)
    cap = _validate.integer_at_least(1, max_batch_size=max_batch_size)
    steps = math.ceil(lot / cap)
    while lot % steps:
        steps += 1
    return {"lot_size": lot, "physical_batch_size": lot // steps, "accumulation_steps": steps}


def large_lot_table(
    *,
    num_examples: int,
    epochs: float,
    target_epsilon: float,
    target_delta: float,
    lot_sizes: Sequence[int],
    base_learning_rate: float = 0.01,
    base_lot_size: float = 128,
    max_batch_size: int | None = None,
    accountant: str = "rdp",
) -> list[dict[str, Any]]:
    """Noise per example vs lot size, with the scaled learning rate (Three Tools Table 1).

    Calls the accountant's :func:`keras_dpsgd.accounting.batch_table` for the
    noise multiplier each lot size needs to train `epochs` epochs within
    (target_epsilon, target_delta), and adds to each row the linearly scaled
    learning rate and, when `max_batch_size` is given, the gradient
    accumulation plan.

    Args:
      num_examples: training set size N.
      epochs: number of epochs (steps = epochs · N / L).
      target_epsilon: ε budget > 0.
      target_delta: δ, must be < 1/N (see `accounting.check_delta`).
      lot_sizes: lot sizes to tabulate.
      base_learning_rate: learning rate at `base_lot_size`.
      base_lot_size: lot size of the base learning rate.
      max_batch_size: optional largest physical batch; adds
        physical_batch_size and accumulation_steps columns.
      accountant: accountant name passed to `batch_table`.

    Returns:
      The accountant's rows (lot_size, sampling_rate, steps, noise_multiplier,
      noise_per_example) plus learning_rate (and the accumulation plan).
    """
    from keras_dpsgd.accounting import batch_table

    _validate.positive(base_learning_rate=base_learning_rate)
    _validate.positive(base_lot_size=base_lot_size)
    if max_batch_size is not None:
        _validate.integer_at_least(1, max_batch_size=max_batch_size)
    rows = batch_table(
        num_examples=num_examples,
        epochs=epochs,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        lot_sizes=list(lot_sizes),
        accountant=accountant,
    )
    out = []
    for row in rows:
        row = dict(row)
        row["learning_rate"] = scale_learning_rate(row["lot_size"], base_learning_rate, base_lot_size)
        if max_batch_size is not None:
            plan = plan_gradient_accumulation(int(row["lot_size"]), max_batch_size)
            row["physical_batch_size"] = plan["physical_batch_size"]
            row["accumulation_steps"] = plan["accumulation_steps"]
        out.append(row)
    return out


def plot_noise_per_example(rows: Sequence[dict[str, Any]], path: str | None = None, *, ax=None):
    """Plots noise per example (σ / L) and the scaled learning rate against the lot size.

    Args:
      rows: output of :func:`large_lot_table` (or the accountant's `batch_table`;
        the learning-rate curve is drawn only when rows carry `learning_rate`).
      path: if given, the figure is saved there (format from the extension).
      ax: optional matplotlib Axes to draw on.

    Returns:
      The matplotlib Figure.

    Raises:
      ImportError: with the fix, when matplotlib is not installed.
    """
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("plot_noise_per_example needs matplotlib: pip install 'keras-dpsgd[plot]'") from err
    if not rows:
        raise ValueError("rows must hold at least one row, got an empty sequence")
    lots = [r["lot_size"] for r in rows]
    noise = [r["noise_per_example"] for r in rows]
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
    else:
        fig = ax.figure
    ax.plot(lots, noise, "o-", color="C0", label="noise per example σ/L")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("lot size L")
    ax.set_ylabel("σ / L", color="C0")
    if all("learning_rate" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot(lots, [r["learning_rate"] for r in rows], "s--", color="C1", label="learning rate")
        ax2.set_yscale("log")
        ax2.set_ylabel("scaled learning rate", color="C1")
    ax.set_title("Large lots: less noise per example at fixed (ε, δ)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
