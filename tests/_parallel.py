"""Run independent subprocess jobs two at a time (the CI machine has 2 cores; the test process only waits).

Each job is a callable that runs its own bounded subprocess(es) and returns their results; a job's
exception is raised by :func:`run_jobs` for that job only when the test reads it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def run_jobs(jobs: dict[str, Callable[[], Any]], workers: int = 2) -> dict[str, Future]:
    """Starts every job (at most `workers` at once) and waits for all; returns their futures by name."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    return futures
