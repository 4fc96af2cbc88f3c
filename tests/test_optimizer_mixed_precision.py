"""Mixed precision: loss scaling (mixed_float16) is refused with the fix; mixed_bfloat16 trains."""

import numpy as np, pytest, tf_keras as keras
import keras_dpsgd

def _fit(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Activation("linear", dtype="float32")])
        model.compile(optimizer=keras_dpsgd.tf_keras.DPSGDOptimizer(1.0, 0.0, learning_rate=0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
        x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32"); y = np.arange(8) % 3
        return model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")

def test_mixed_float16_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        _fit("mixed_float16")

def test_mixed_bfloat16_trains():
    _fit("mixed_bfloat16")
