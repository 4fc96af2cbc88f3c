"""The cost of padding Poisson lots (issue 41 item 6): DP step on a padded lot against non-private on L rows.

Usage::

    python benchmarks/padding.py --models conv mlp --lot-sizes 64 256            # Keras 3 on TensorFlow
    KERAS_BACKEND=jax python benchmarks/padding.py --models mlp --lot-sizes 64

What is measured, in one process, interleaved in rounds (``overhead.py``'s models and step timer):

* ``nonprivate``: a Keras 3 ``fit`` on batches of exactly L rows;
* ``equal_rows``: the DP step (``make_private``, ``DPSGDOptimizer``, the fast backend) on plain batches of L rows
  (Keras slices the arrays into full batches: the traced step knows the batch size, L);
* ``equal_rows_dynamic``: the same DP step on batches of exactly L rows from a ``tf.data.Dataset`` whose batch
  dimension is None, as a lot's is (a Poisson lot's size varies, so the step is traced for any batch size);
* ``lots``: the same DP step fed ``PoissonLots(expected_lot_size=L)`` (configured on the optimizer), whose
  batches have the physical size ``lots.physical_batch_size`` (``rows`` in the JSON): padded to the capacity;
* ``lots_multiple``: the same with ``pad_to_multiple_of=m``, m = ceil(√L) by default (``multiple``), each lot
  padded to the next multiple of m rows (``rows_multiple_mean``: the mean over 400 lots of the same sampler).

Warm-up: two steps of each fixed-shape configuration, ``--warmup-lots`` lots (default 40) of each sampled one. A
batch of a size not seen before costs once more than the same step again (on CPU, oneDNN builds its kernels for each
new shape: measured, the conv model at L = 64 on exactly n rows, one thread, 1.23x the DP step on L rows after 3 warm-up
lots, 1.07x after 60; under JAX each new size compiles): a training of thousands of steps pays that once per size, so
the timed steps are those of sizes already seen, as in a long training, not the first lots' one-time cost.

Ratios: ``equal_rows_ratio`` = equal_rows / nonprivate, ``lots_ratio`` = lots / nonprivate, and
``padding_cost`` = lots / equal_rows (what the padding adds; issue 41 asks for at most 1.2 at L >= 64),
``padding_cost_multiple`` = lots_multiple / equal_rows; ``dynamic_batch_cost`` = equal_rows_dynamic / equal_rows (what
a step traced for any batch size costs over one traced for L rows: no padding in it), ``padding_cost_dynamic`` and
``padding_cost_multiple_dynamic``: lots and lots_multiple over equal_rows_dynamic (the padding alone). ``*_cpu``: the
same ratios of the steps' process CPU times (all threads; less sensitive to other processes on the machine than wall
time, still not immune), ``median_step_cpu_s``.
One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402 (benchmarks/ is not a package)

DATA_LOTS = 16  # the data set holds this many expected lots: N = 16·L


def _batches_of_unknown_size(x, y, lot_size: int, n: int):
    """`n` batches of exactly `lot_size` rows whose batch dimension is None in the element spec, as a lot's."""
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().take(n * lot_size)
    return data.batch(lot_size).prefetch(tf.data.AUTOTUNE)  # no drop_remainder: the batch dimension stays None


def run_padding(
    name: str, lot_size: int, steps: int, rounds: int, multiple: int | None = None, warmup_lots: int = 40
) -> dict:
    """Step times of the four configurations for one model and one expected lot size (see the module doc)."""
    from keras_dpsgd import PoissonLots

    overhead._KERAS["which"] = "3"
    multiple = multiple or math.isqrt(lot_size - 1) + 1
    x, y = overhead.make_data(name, lot_size, DATA_LOTS)
    samplers = {
        "lots": PoissonLots(x, y, expected_lot_size=lot_size, seed=0),
        "lots_multiple": PoissonLots(x, y, expected_lot_size=lot_size, pad_to_multiple_of=multiple, seed=0),
    }
    weights, models = None, {}
    for config in ("nonprivate", "equal_rows", "equal_rows_dynamic", *samplers):
        model = overhead.build_model(name)
        weights = weights or model.get_weights()
        model.set_weights(weights)
        model = overhead.compile_model(model, "nonprivate" if config == "nonprivate" else "fast", lot_size)
        if config in samplers:
            samplers[config].configure(model.optimizer)
        models[config] = model
    times = {config: [] for config in models}
    cpu = {config: [] for config in models}

    def fit(config: str, n: int) -> list:
        if config in samplers or config == "equal_rows_dynamic":
            timer = overhead._BatchTimer()
            data = samplers[config].dataset(n) if config in samplers else _batches_of_unknown_size(x, y, lot_size, n)
            models[config].fit(data, epochs=1, verbose=0, callbacks=[timer])
            cpu[config] += timer.cpu_times
            return timer.times
        return overhead.time_steps(models[config], x, y, lot_size, n, cpu[config])

    for config in models:  # warm-up: traces the train function; the sampled sizes' kernels (see the module doc)
        fit(config, warmup_lots if config in samplers else 2)
    for config in models:
        cpu[config].clear()
    for _ in range(rounds):
        for config in models:
            times[config] += fit(config, steps)
    med = {config: statistics.median(ts) for config, ts in times.items()}
    med_cpu = {config: statistics.median(ts) for config, ts in cpu.items()}
    probe = PoissonLots(x, y, expected_lot_size=lot_size, pad_to_multiple_of=multiple, seed=1)
    return {
        "lot_size": lot_size,
        "rows": samplers["lots"].physical_batch_size,
        "multiple": multiple,
        "rows_multiple_mean": statistics.fmean(len(w) for _, _, w in probe.lots(400)),
        "warmup_lots": warmup_lots,
        "median_step_s": med,
        "steps": {config: len(ts) for config, ts in times.items()},
        "equal_rows_ratio": med["equal_rows"] / med["nonprivate"],
        "lots_ratio": med["lots"] / med["nonprivate"],
        "padding_cost": med["lots"] / med["equal_rows"],
        "padding_cost_multiple": med["lots_multiple"] / med["equal_rows"],
        "dynamic_batch_cost": med["equal_rows_dynamic"] / med["equal_rows"],
        "padding_cost_dynamic": med["lots"] / med["equal_rows_dynamic"],
        "padding_cost_multiple_dynamic": med["lots_multiple"] / med["equal_rows_dynamic"],
        "median_step_cpu_s": med_cpu,
        "padding_cost_cpu": med_cpu["lots"] / med_cpu["equal_rows"],
        "padding_cost_multiple_cpu": med_cpu["lots_multiple"] / med_cpu["equal_rows"],
        "dynamic_batch_cost_cpu": med_cpu["equal_rows_dynamic"] / med_cpu["equal_rows"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["conv", "mlp"], choices=list(overhead.MODEL_NAMES))
    parser.add_argument("--lot-sizes", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-lots", type=int, default=40, help="warm-up lots of each sampled configuration")
    args = parser.parse_args(argv)
    report = {"backend": os.environ.get("KERAS_BACKEND", "tensorflow"), "load_average_start": os.getloadavg()}
    report["results"] = {
        f"{name}/L={lot}": run_padding(name, lot, args.steps, args.rounds, warmup_lots=args.warmup_lots)
        for name in args.models
        for lot in args.lot_sizes
    }
    report["load_average_end"] = os.getloadavg()
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
