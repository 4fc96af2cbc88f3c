"""Subprocess harness for the tf.distribute tests (both front ends).

The rest of the suite has initialized TensorFlow's devices already, so a strategy over several
logical CPU devices, or over several worker processes, runs in fresh Python processes:

* :func:`run_mirrored`: one child with `devices` logical CPU devices (for a MirroredStrategy);
* :func:`run_workers`: `num_workers` children on 127.0.0.1, each with free ports in ``TF_CONFIG``
  (for a MultiWorkerMirroredStrategy).

A child is a script path; it gets this worktree on ``PYTHONPATH``, calls :func:`child_setup`
first (before anything initializes TensorFlow's devices) and :func:`write_result` last with a
JSON-able dict. Every child runs in its own process group, killed (with all its threads and
children) at the hard timeout; a child that fails or times out fails the test with the tail of
its output.

:func:`strategy_runs` launches ``tests/dist_scripts/strategy_child.py`` once per test session for
every distribution test module (both Kerases share each launch): one MirroredStrategy process, and
at the same time a cluster of 2 workers, then a relaunch of that cluster on the same directory
(resuming the first launch's interrupted fits).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
_RESULT_ENV = "KERAS_DPSGD_DIST_RESULT"
_DEVICES_ENV = "KERAS_DPSGD_DIST_CPU_DEVICES"


# ---------------------------------------------------------------- in the child
def child_setup() -> None:
    """In a child, before TensorFlow initializes its devices: the logical CPU devices asked for."""
    import tensorflow as tf

    devices = int(os.environ.get(_DEVICES_ENV, "1"))
    if devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)


def write_result(result: dict) -> None:
    """In a child: writes its result (JSON-able) for the test to read."""
    path = os.environ[_RESULT_ENV]
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def worker_index() -> int:
    """In a child of :func:`run_workers`: its index in TF_CONFIG (0 outside)."""
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    return int(config.get("task", {}).get("index", 0))


def barrier(strategy) -> None:
    """In a child: returns once every replica of `strategy` got here (a SUM all-reduce)."""
    import tensorflow as tf

    strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([])))


# ---------------------------------------------------------------- in the test
def global_batches(strategy, x, y, batch: int, worker: int = 0, local: int | None = None):
    """The global batches of (x, y), in order, as a distributed dataset: this worker's `local`
    replicas (default: all of `strategy`'s) take consecutive slices of each, after those of the
    workers before it."""
    import numpy as np
    import tensorflow as tf

    local = strategy.num_replicas_in_sync if local is None else local

    def per_worker(context):
        per_replica = batch // context.num_replicas_in_sync
        parts = []
        for start in range(0, len(x), batch):
            for r in range(local):
                first = start + (worker * local + r) * per_replica
                parts.append((x[first : first + per_replica], y[first : first + per_replica]))
        xs = np.concatenate([p[0] for p in parts])
        ys = np.concatenate([p[1] for p in parts])
        return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(per_replica)

    return strategy.distribute_datasets_from_function(per_worker)


def zero_gradient_keras3(strategy, width: int, **optimizer_args):
    """A Keras 3 private Dense-Dense model (no bias) compiled under `strategy` with a
    ``keras_dpsgd.keras3.DPSGDOptimizer(learning_rate=1.0, **optimizer_args)``: on x = 0 its gradient
    is 0, so a lot moves the first kernel by -noise/L only. Returns (model, optimizer)."""
    import keras

    import keras_dpsgd.keras3 as k3

    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = k3.make_private(
            keras.Sequential(
                [
                    keras.Input((width,)),
                    keras.layers.Dense(width, use_bias=False),
                    keras.layers.Dense(1, use_bias=False),
                ]
            )
        )
        optimizer = k3.DPSGDOptimizer(learning_rate=1.0, **optimizer_args)
        if optimizer.sampling_rate is not None:  # the zero batches stand for Poisson lots at q
            from keras_dpsgd.ledger import assume_poisson

            assume_poisson(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
    return model, optimizer


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (bound and released together)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _env(result_path: str, devices: int, extra: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env.pop("TF_CONFIG", None)
    env[_RESULT_ENV] = result_path
    env[_DEVICES_ENV] = str(devices)
    env.update(extra or {})
    return env


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _run(script: Path, envs: Sequence[dict], args: Sequence[str], timeout: float, workdir: Path) -> list[dict]:
    """Starts one child per env, waits for all (hard timeout), returns their results in order."""
    processes, logs = [], []
    try:
        for i, env in enumerate(envs):
            log = workdir / f"child{i}.log"
            logs.append(log)
            with open(log, "w") as out:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        env=env,
                        cwd=str(ROOT),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in processes):
            failed = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        timed_out = [i for i, p in enumerate(processes) if p.poll() is None]
        for p in processes:
            if p.poll() is None:
                _kill(p)
    problems = []
    for i, p in enumerate(processes):
        if i in timed_out:
            problems.append(f"child {i} killed (still running at the {timeout:.0f} s timeout or after another failed)")
        elif p.returncode != 0:
            problems.append(f"child {i} exited with {p.returncode}")
    if problems:
        details = "\n".join(f"--- child {i} output (tail)\n{_tail(log)}" for i, log in enumerate(logs))
        raise AssertionError(f"{script.name}: {'; '.join(problems)}\n{details}")
    return [json.loads(Path(env[_RESULT_ENV]).read_text()) for env in envs]


def run_mirrored(
    script: str | Path, *, devices: int = 2, timeout: float = 120.0, args: Sequence[str] = (), env: dict | None = None
) -> dict:
    """Runs `script` in one fresh process with `devices` logical CPU devices; returns its result."""
    with tempfile.TemporaryDirectory(prefix="dist_") as tmp:
        workdir = Path(tmp)
        envs = [_env(str(workdir / "result0.json"), devices, env)]
        return _run(Path(script), envs, args, timeout, workdir)[0]


def tf_config(ports: Sequence[int], index: int) -> str:
    """TF_CONFIG of worker `index` of a cluster of workers on 127.0.0.1 at `ports`."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def run_workers(
    script: str | Path,
    *,
    num_workers: int = 2,
    devices: int = 1,
    timeout: float = 150.0,
    args: Sequence[str] = (),
    env: dict | None = None,
) -> list[dict]:
    """Runs `script` as `num_workers` worker processes of one cluster on 127.0.0.1 (TF_CONFIG with
    free ports), each with `devices` logical CPU devices; returns their results by worker index."""
    with tempfile.TemporaryDirectory(prefix="dist_") as tmp:
        workdir = Path(tmp)
        ports = free_ports(num_workers)
        envs = []
        for i in range(num_workers):
            child = _env(str(workdir / f"result{i}.json"), devices, env)
            child["TF_CONFIG"] = tf_config(ports, i)
            envs.append(child)
        return _run(Path(script), envs, args, timeout, workdir)


def load_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


STRATEGY_CHILD = ROOT / "tests" / "dist_scripts" / "strategy_child.py"
_RUNS: dict[str, Any] = {}


def _launch_all() -> dict:
    with (
        tempfile.TemporaryDirectory(prefix="dist_shared_") as mirrored_dir,
        tempfile.TemporaryDirectory(prefix="dist_shared_") as shared,
    ):
        # Hard timeouts ~4x their time on the 2-core CI machine, where under `pytest -n 2` the other
        # worker runs tests beside these 3 processes.
        def cluster() -> tuple[list[dict], list[dict]]:
            main = run_workers(STRATEGY_CHILD, num_workers=2, timeout=600, args=["mwms", shared, "main"])
            resumed = run_workers(STRATEGY_CHILD, num_workers=2, timeout=300, args=["mwms", shared, "resume"])
            return main, resumed

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            mirrored = pool.submit(
                run_mirrored, STRATEGY_CHILD, devices=2, timeout=900, args=["mirrored", mirrored_dir]
            )
            workers = pool.submit(cluster)
            main, resumed = workers.result()
            return {"mirrored": mirrored.result(), "workers": main, "resumed": resumed}


def strategy_runs() -> dict:
    """The results of ``strategy_child.py``, launched once per session (a failure is kept too):
    ``{"mirrored": {...}, "workers": [worker 0, worker 1], "resumed": [worker 0, worker 1]}``,
    each with one part per checked module ("replicas", "keras3", "keras3_accumulate" (mirrored only),
    "keras3_checkpoints" (workers only), "tf_keras")."""
    if "runs" not in _RUNS:
        try:
            _RUNS["runs"] = _launch_all()
        except AssertionError as err:
            _RUNS["runs"] = err
    if isinstance(_RUNS["runs"], AssertionError):
        raise AssertionError(str(_RUNS["runs"]))
    return _RUNS["runs"]
