"""Adaptive clipping's saves written by keras_dpsgd 0.2.0 still load, with their bounds, and train on.

tests/fixtures/saved_0_2_0/<front>_adaptive/ was written by 0.2.0 (commit 9d06de3) with
``tests/fixtures/saved_0_2_0/generate.py`` (``<front>_adaptive``): the 3-4-1 Dense model, AdaptiveDPSGDOptimizer with per-layer
bounds (rule "mean") and with one flat bound (rule "quantile"), one epoch of 8 Poisson lots. ``facts.json`` holds
what 0.2.0 read back. Loading gives the same steps, bounds (exactly), ε and predictions, and the next lots move
the bounds on from there. Keras 3 on JAX: tests/backends/jax/test_jax_adaptive.py.
"""

import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "saved_0_2_0"
KINDS = ["per_layer", "flat"]


def _lots():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    return keras_dpsgd.PoissonLots(x, (x[:, :1] > 0).astype("float32"), expected_lot_size=8, seed=11)


def _check_loaded(model, facts: dict, epsilon: bool = True) -> None:
    opt = model.optimizer
    assert int(np.asarray(opt.noised_steps)) == facts["noised_steps"]
    np.testing.assert_array_equal(np.asarray(opt.clip_bounds), np.float32(facts["clip_bounds"]))
    assert not epsilon or keras_dpsgd.model_epsilon(model, target_delta=1e-5)[0] == pytest.approx(
        facts["epsilon"], rel=1e-9
    )


def _check_continued(model, facts: dict, steps: int) -> None:
    opt = model.optimizer
    assert int(np.asarray(opt.noised_steps)) == facts["noised_steps"] + steps
    bounds = np.asarray(opt.clip_bounds)
    assert np.all(bounds >= opt.min_clip_bound) and not np.array_equal(bounds, np.float32(facts["clip_bounds"]))


@pytest.mark.parametrize("kind", KINDS)
def test_keras3_adaptive_model_of_0_2_0_loads_and_continues(kind):
    import keras

    from keras_dpsgd.keras3 import make_private

    facts = json.loads((FIXTURES / "keras3_adaptive" / "facts.json").read_text())
    model = keras.saving.load_model(FIXTURES / "keras3_adaptive" / f"{kind}.keras")
    _check_loaded(model, facts[kind])
    probe = np.asarray(facts["probe"], np.float32)
    np.testing.assert_allclose(np.asarray(model(probe)), facts[kind]["predictions"], rtol=1e-6, atol=1e-6)
    lots = _lots()
    model = make_private(model)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    _check_continued(model, facts[kind], lots.steps_per_epoch)


@pytest.mark.parametrize("kind", KINDS)
def test_tf_keras_adaptive_model_and_checkpoint_of_0_2_0_load_and_continue(kind):
    import tf_keras

    from keras_dpsgd.tf_keras import AdaptiveDPSGDOptimizer

    facts = json.loads((FIXTURES / "tf_keras_adaptive" / "facts.json").read_text())
    model = tf_keras.models.load_model(FIXTURES / "tf_keras_adaptive" / f"{kind}.keras")
    _check_loaded(model, facts[kind])

    bounds, rule = ([0.5, 0.2, 0.4, 0.1], "mean") if kind == "per_layer" else (0.6, "quantile")
    tf_keras.utils.set_random_seed(1)
    model = tf_keras.Sequential(
        [tf_keras.Input((3,)), tf_keras.layers.Dense(4, activation="relu"), tf_keras.layers.Dense(1)]
    )
    lots = _lots()
    opt = lots.configure(AdaptiveDPSGDOptimizer(bounds, 1.1, 2.0, rule=rule, learning_rate=0.1))
    model.compile(optimizer=opt, loss=tf_keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    model.fit(lots.dataset(), steps_per_epoch=1, verbose=0)  # builds the optimizer's variables (one step)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    ckpt.read(str(FIXTURES / "tf_keras_adaptive" / f"{kind}_ckpt")).assert_existing_objects_matched()
    _check_loaded(model, facts[kind], epsilon=False)  # ε: checked on the .keras file above
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    _check_continued(model, facts[kind], lots.steps_per_epoch)
