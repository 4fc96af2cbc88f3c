"""What the MNIST benchmarks share (mnist_paper.py, mnist_cnn.py): the common arguments, loading the IDX
files, Keras' weight averaging, and the JSON record of a run (its command, settings, the machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def add_common_arguments(p: argparse.ArgumentParser, *, epsilon: float = 2.0) -> None:
    """--data-dir, --target-epsilon, --delta, --ema, --max-train-examples, --seed, --log, --run."""
    p.add_argument("--data-dir", required=True, help="directory of MNIST's IDX files (plain or .gz)")
    p.add_argument("--target-epsilon", type=float, default=epsilon)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--ema",
        type=float,
        default=0.0,
        help="evaluate an exponential moving average of the weights with this momentum "
        "(post-processing of the noised steps: no privacy cost; 0: off)",
    )
    p.add_argument("--max-train-examples", type=int, default=None, help="first N training images only (quick runs)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--log", default=None, metavar="JSONL", help="also append the JSON object to this file")
    p.add_argument("--run", default=None, help="a name for the run, stored in the JSON object")


def load(data_dir: str, limit: int | None, *, signed_pixels: bool = False):
    """MNIST from its IDX files (the first `limit` training images); `signed_pixels`: [0, 1] -> [-1, 1]
    as [N, 28, 28, 1] float32 (public constants, no statistic of the data)."""
    from keras_dpsgd.data.datasets import load_dataset

    data = load_dataset("mnist", data_dir=data_dir)
    if signed_pixels:
        scale = lambda x: x.astype("float32").reshape(-1, 28, 28, 1) * 2.0 - 1.0  # noqa: E731
        data.x_train, data.x_test = scale(data.x_train), scale(data.x_test)
    if limit:
        data.x_train, data.y_train = data.x_train[:limit], data.y_train[:limit]
    return data


def ema_kwargs(ema: float) -> dict:
    """Keras' own weight averaging (`use_ema`); fit swaps the averages in at its end."""
    return {"use_ema": True, "ema_momentum": ema} if ema else {}


def seed_everything(seed: int | None) -> None:
    import tf_keras as keras

    if seed is not None:
        keras.utils.set_random_seed(seed)


def record(script: str, args: argparse.Namespace, argv: Sequence[str] | None, num_examples: int) -> dict[str, Any]:
    """The head of a run's JSON object: its name, command line, target ε, training size and settings."""
    hidden = ("data_dir", "log", "run")
    return {
        "run": args.run,
        "command": f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "target_epsilon": args.target_epsilon,
        "num_examples": int(num_examples),
        "settings": {k: v for k, v in vars(args).items() if k not in hidden and not k.startswith("_")},
    }


def fit_and_report(model, optimizer, lots, data, args, *, callbacks, planned: int, sigma: float, start: float) -> tuple:
    """Trains `model` on `lots` within the target ε (``WithinLimit``), then its ledger's ε and the test
    accuracy: (Keras's history, the run's common JSON fields). `start` is the run's ``time.perf_counter()``."""
    from keras_dpsgd import WithinLimit, model_epsilon

    history = model.fit(
        lots.dataset(),
        epochs=args.epochs,
        steps_per_epoch=lots.steps_per_epoch,
        callbacks=[WithinLimit(args.target_epsilon, args.delta), *callbacks],
        validation_data=(data.x_test, data.y_test),
        validation_batch_size=2000,
        verbose=0,
    )
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    steps = int(optimizer.noised_steps.numpy())
    return history, {
        "epsilon": float(epsilon),
        "delta": float(delta),
        "accuracy": float(accuracy),
        "epochs": steps / lots.steps_per_epoch,
        "steps": steps,
        "planned_steps": planned,
        "sigma": float(sigma),
        "val_accuracy_per_epoch": [round(a, 4) for a in history.history.get("val_accuracy", [])],
        "ema": args.ema,  # with EMA, accuracy is the averaged weights', val_accuracy_per_epoch the raw ones
        "wall_s": time.perf_counter() - start,
    }


def finish(result: dict[str, Any], log: str | None) -> dict[str, Any]:
    """Adds the machine's load and CPU count; appends the object to `log` (JSON lines) if given."""
    result["load_average"] = os.getloadavg()
    result["cpus"] = os.cpu_count()
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(result, sort_keys=True) + "\n")
    return result
