"""DP-SGD on several devices or machines with tf.distribute (Keras 3), on the bundled digits data.

Each replica clips its share of the lot and adds noise N(0, σ²C²/R) with a key of its own; the
strategy's cross-replica sum then holds N(0, σ²C²) once, the one-device mechanism, so the ε
reported is the one-device ε. Every worker samples its shard of the examples with the same q
(PoissonLots(num_workers=W, worker_index=w)): the union is one Poisson lot of the data set.

    python examples/multi_worker.py                     # MirroredStrategy, 2 logical CPU devices
    python examples/multi_worker.py --launch 2          # MultiWorkerMirroredStrategy: 2 workers on 127.0.0.1
    python examples/multi_worker.py --smoke --launch 2  # a few steps (< 1 min)

On real machines, start one process per machine with the cluster in TF_CONFIG (the same
``cluster`` everywhere, this machine's ``task`` index), e.g. on the second of two::

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 1}}' \\
        python examples/multi_worker.py --worker

The chief (worker 0) prints the result.
"""

import argparse
import json
import os
import socket
import subprocess
import sys

from keras_dpsgd.cli import import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(num_workers, argv, timeout):
    """Starts `num_workers` copies of this script as the workers of one cluster on 127.0.0.1."""
    ports = _free_ports(num_workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    workers = []
    for index in range(num_workers):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        out = None if index == 0 else subprocess.DEVNULL  # the chief prints
        workers.append(subprocess.Popen([sys.executable, __file__, "--worker", *argv], env=env, stdout=out))
    try:
        codes = [w.wait(timeout=timeout) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    return max(codes)


def train(args, strategy=None):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dpsgd.keras3 as k3
    from keras_dpsgd import PoissonLots, model_epsilon
    from keras_dpsgd.data.datasets import load_digits

    if strategy is not None:  # given by the caller (a test: one strategy per process)
        workers, index = 1, 0
    elif args.worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        workers, index = strategy.cluster_resolver.cluster_spec().num_tasks("worker"), strategy.cluster_resolver.task_id
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
        strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
        workers, index = 1, 0
    data = load_digits()
    x_train, y_train = data.x_train.reshape(len(data.x_train), -1), data.y_train
    if args.smoke:
        x_train, y_train = x_train[:400], y_train[:400]
    lots = PoissonLots(
        x_train,
        y_train,
        expected_lot_size=args.lot_size,
        num_workers=workers,
        worker_index=index,
        replicas_per_worker=strategy.num_replicas_in_sync // workers,
    )
    with strategy.scope():
        model = k3.make_private(
            keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        )
        optimizer = lots.configure(
            k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=args.noise_multiplier, learning_rate=0.5, momentum=0.9)
        )
        model.compile(
            optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        )
    epochs = 1 if args.smoke else args.epochs
    steps = 3 if args.smoke else lots.lots_per_epoch
    model.fit(lots.distribute(strategy), epochs=epochs, steps_per_epoch=steps, verbose=0)
    epsilon, delta = model_epsilon(model)
    accuracy = float(
        np.mean(np.argmax(model.predict(data.x_test.reshape(len(data.x_test), -1), verbose=0), -1) == data.y_test)
    )
    if index == 0:
        name = "MultiWorkerMirroredStrategy" if workers > 1 else "MirroredStrategy"
        print(
            json.dumps(
                {
                    "strategy": name,
                    "replicas": strategy.num_replicas_in_sync,
                    "workers": workers,
                    "noised_steps": int(optimizer.noised_steps.numpy()),
                    "epsilon": epsilon,
                    "delta": delta,
                    "test_accuracy": accuracy,
                }
            )
        )


def main(argv=None, strategy=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", type=int, default=None, metavar="W", help="start W workers on 127.0.0.1 (MWMS)")
    p.add_argument("--worker", action="store_true", help="be one worker of the cluster in TF_CONFIG")
    p.add_argument("--devices", type=int, default=2, help="logical CPU devices of the MirroredStrategy")
    p.add_argument("--lot-size", type=int, default=64)
    p.add_argument("--noise-multiplier", type=float, default=1.1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before --launch stops its workers")
    p.add_argument("--smoke", action="store_true", help="a few steps")
    args = p.parse_args(argv)
    if args.launch:
        rest = [a for i, a in enumerate(argv) if a != "--launch" and (i == 0 or argv[i - 1] != "--launch")]
        sys.exit(launch(args.launch, rest, args.timeout))
    train(args, strategy)


if __name__ == "__main__":
    main()
