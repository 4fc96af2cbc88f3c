"""Saved models and checkpoints written by keras_dpsgd 0.2.0 still load (issue 38: the layout moved, the files did not).

tests/fixtures/saved_0_2_0/ was written by 0.2.0 (commit 9d06de3, the last of 2026-12-02) with the script in
``tests/fixtures/saved_0_2_0/README.md``: a 3-4-1 Dense model, DPSGDOptimizer(l2_norm_clip=1, noise_multiplier=1.1,
seed=7), one epoch of 8 lots of expected size 8 out of 64 examples. ``facts.json`` holds what 0.2.0 read back:
``noised_steps``, ``model_epsilon(δ = 1e-5)`` and the predictions on a probe. Loading must give the same three, and
training must continue on top of the loaded ledger (its steps counted once).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "saved_0_2_0"


def keras3_file_loads_and_continues(folder: pathlib.Path):
    """The Keras 3 ``model.keras`` of 0.2.0 in `folder` (on this process's backend) loads with its facts and trains
    on one epoch of Poisson lots on top of its ledger: (the model, the lots, the facts)."""
    import keras

    import keras_dpsgd
    from keras_dpsgd.keras3 import make_private

    facts = json.loads((folder / "facts.json").read_text())
    probe = np.asarray(facts["probe"], np.float32)
    model = keras.saving.load_model(folder / "model.keras")
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == facts["noised_steps"]
    assert keras_dpsgd.model_epsilon(model, target_delta=1e-5)[0] == pytest.approx(facts["epsilon"], rel=1e-9)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(probe)), facts["predictions"], rtol=1e-6, atol=1e-6)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=8, seed=11)
    model = make_private(model)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == facts["noised_steps"] + lots.steps_per_epoch
    return model, lots, facts


def test_keras3_model_and_weights_of_0_2_0_load_and_continue():
    import keras

    import keras_dpsgd
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

    model, lots, facts = keras3_file_loads_and_continues(FIXTURES / "keras3")
    probe = np.asarray(facts["probe"], np.float32)
    assert keras_dpsgd.model_epsilon(model, target_delta=1e-5)[0] > facts["epsilon"]

    fresh = make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    )
    fresh.compile(
        optimizer=lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1)),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    fresh.load_weights(FIXTURES / "keras3" / "model.weights.h5")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(fresh(probe)), facts["predictions"], rtol=1e-6, atol=1e-6)
    assert keras_dpsgd.model_epsilon(fresh, target_delta=1e-5)[0] == pytest.approx(facts["epsilon"], rel=1e-9)


_TF_KERAS = """
import json, sys
import numpy as np
import tensorflow as tf
import tf_keras
import keras_dpsgd
from keras_dpsgd.tf_keras import DPSGDOptimizer
root = sys.argv[1]
facts = json.load(open(root + "/facts.json"))
probe = np.asarray(facts["probe"], np.float32)
model = tf_keras.models.load_model(root + "/model.keras")
assert int(model.optimizer.noised_steps.numpy()) == facts["noised_steps"], model.optimizer.noised_steps
np.testing.assert_allclose(model(probe).numpy(), facts["predictions"], rtol=1e-6, atol=1e-6)
eps = keras_dpsgd.model_epsilon(model, target_delta=1e-5)[0]
assert abs(eps - facts["epsilon"]) <= 1e-9 * facts["epsilon"], eps

model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(4, activation="relu"), tf_keras.layers.Dense(1)])
opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, sampling_rate=8 / 64)
model.compile(optimizer=opt, loss=tf_keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
keras_dpsgd.ledger.assume_poisson(opt)  # 0.2.0's fit on arrays: refused since unless stated (issue 37)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 3)).astype("float32")
y = (x[:, :1] > 0).astype("float32")
model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # builds the optimizer's variables (one step)
tf.train.Checkpoint(model=model, optimizer=opt).read(root + "/ckpt").assert_existing_objects_matched()
assert int(opt.noised_steps.numpy()) == facts["noised_steps"], opt.noised_steps
np.testing.assert_allclose(model(probe).numpy(), facts["predictions"], rtol=1e-6, atol=1e-6)
model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
assert int(opt.noised_steps.numpy()) == facts["noised_steps"] + 8, opt.noised_steps
print("ok")
"""


def test_tf_keras_model_and_checkpoint_of_0_2_0_load_and_continue():
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND",)}
    env.update(TF_USE_LEGACY_KERAS="1", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    run = subprocess.run(
        [sys.executable, "-c", _TF_KERAS, str(FIXTURES / "tf_keras")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
