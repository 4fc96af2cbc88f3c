"""Accountant speed: prints one JSON object of timings (seconds, best of several repeats).

Targets (issue 2): ε for 100,000 steps of one event < 10 ms; σ calibration < 0.5 s.

    python benchmarks/accountant.py
"""

from __future__ import annotations

import json
import platform
import time

import numpy as np

from keras_dpsgd.accounting import (
    PoissonSampledGaussianEvent,
    batch_table,
    compute_epsilon,
    compute_noise_multiplier,
    max_steps_within_budget,
    rdp_poisson_subsampled_gaussian,
)
from keras_dpsgd.accounting import rdp as rdp_module


def _best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _uncached(fn):
    def run():
        rdp_module._rdp_cached.cache_clear()
        fn()

    return run


def main() -> dict:
    event = PoissonSampledGaussianEvent(256 / 60000, 1.1, 100_000)
    eps = lambda: compute_epsilon(event, 1e-5)  # noqa: E731
    eps()  # warm the per-grid tables
    calib = lambda: compute_noise_multiplier(  # noqa: E731
        target_epsilon=1.0, target_delta=1e-5, sampling_rate=256 / 60000, steps=14063
    )
    moments = lambda: compute_epsilon(event, 1e-5, accountant="moments")  # noqa: E731
    steps = lambda: max_steps_within_budget(  # noqa: E731
        target_epsilon=3.0,
        target_delta=1e-5,
        sampling_rate=256 / 60000,
        noise_multiplier=1.1,
        prior_events=[PoissonSampledGaussianEvent(256 / 60000, 1.1, 5000)],
    )
    result = {
        "epsilon_100k_steps_cached_s": _best(eps, 20),
        "epsilon_100k_steps_uncached_s": _best(_uncached(eps), 10),
        "epsilon_100k_steps_moments_uncached_s": _best(_uncached(moments), 10),
        "rdp_one_event_default_orders_uncached_s": _best(
            _uncached(lambda: rdp_poisson_subsampled_gaussian(0.01, 1.0)), 10
        ),
        "noise_calibration_s": _best(_uncached(calib), 3),
        "max_steps_within_budget_s": _best(_uncached(steps), 5),
        "batch_table_8_rows_s": _best(
            _uncached(
                lambda: batch_table(
                    num_examples=60000,
                    epochs=15,
                    target_epsilon=1.0,
                    target_delta=1e-5,
                    lot_sizes=[2**k for k in range(5, 13)],
                )
            ),
            1,
        ),
        "targets": {"epsilon_100k_steps_s": 0.010, "noise_calibration_s": 0.5},
        "epsilon": eps(),
        "noise_multiplier": calib(),
        "machine": f"{platform.machine()} {platform.python_version()} numpy {np.__version__}",
    }
    return result


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))
