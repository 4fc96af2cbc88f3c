"""Issue 40, item 6 on JAX: a loss callable given to minimize/sanitize is traced with TensorFlow, so on the JAX
backend it is refused by name (fit after make_private is the JAX path), before any update."""

import keras
import numpy as np
import pytest

from keras_dpsgd.keras3 import DPSGDOptimizer


@pytest.mark.parametrize("method", ["minimize", "sanitize"])
def test_a_loss_callable_is_refused_by_name_on_jax(method):
    assert keras.config.backend() == "jax"
    var = keras.Variable(np.array([1.0, 2.0], np.float32))
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=rf"{method}\(loss_fn, variables\) with a loss callable needs the TensorFlow"):
        getattr(opt, method)(lambda: keras.ops.sum(var), [var])
    np.testing.assert_array_equal(np.array(var), [1.0, 2.0])
