"""The backend seam (keras_dpsgd.backends): which backend serves which Keras, its interface, lazy imports."""

import os
import subprocess
import sys
import textwrap
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import backends
from keras_dpsgd.backends import tensorflow as tf_backend


@pytest.mark.parametrize(
    "keras_backend, expected",
    [("tensorflow", "tensorflow"), ("tf_keras", "tensorflow"), ("jax", "jax"), ("torch", "torch")],
)
def test_each_keras_backend_has_its_keras_dpsgd_backend(keras_backend, expected):
    assert backends.name_for(keras_backend) == expected


@pytest.mark.parametrize("keras_backend", ["numpy", "openvino", "mxnet"])
def test_other_keras_backends_are_refused_by_name(keras_backend):
    with pytest.raises(ValueError, match=rf"Keras backend '{keras_backend}'.*KERAS_BACKEND=tensorflow"):
        backends.name_for(keras_backend)


@pytest.mark.parametrize("keras_backend", ["jax", "tensorflow", "tf_keras", "torch", "numpy", "openvino", "mxnet"])
def test_is_jax_names_jax_only_and_never_raises(keras_backend):
    """One predicate for "the JAX train step applies" (it was written six times), one for torch's."""
    assert backends.is_jax(keras_backend) is (keras_backend == "jax")
    assert backends.is_torch(keras_backend) is (keras_backend == "torch")


def test_is_jax_defaults_to_keras3s_backend():
    assert backends.is_jax() is (keras.config.backend() == "jax")


def test_default_is_keras3s_backend_and_tf_keras_objects_run_on_tensorflow():
    import tf_keras

    assert backends.name_for() == backends.name_for(keras.config.backend())
    assert backends.keras_backend_of(tf_keras.optimizers.SGD()) == "tf_keras"
    assert backends.keras_backend_of(tf_keras.layers.Dense) == "tf_keras"
    assert backends.keras_backend_of(keras.optimizers.SGD()) == keras.config.backend()


def test_tensorflow_backend_has_the_interface_and_its_per_example_computations():
    assert backends.load("tensorflow") is backends.load("tf_keras") is tf_backend
    for name in backends.INTERFACE:
        assert hasattr(tf_backend, name), name
    assert isinstance(backends.per_example("reference", "warn", "tensorflow"), tf_backend.ReferenceBackend)
    fast = backends.per_example("auto", "refuse", "tf_keras")
    assert isinstance(fast, tf_backend.FastBackend) and fast.jacobian_fallback == "refuse"
    with pytest.raises(ValueError, match=r"per_example_backend must be one of .*'reference'.*got 'vmap'"):
        backends.per_example("vmap", "warn", "tensorflow")


def test_tensorflow_noise_source_is_the_library_sampler():
    key = tf_backend.seeded_key(7, tf.constant(3, tf.int64), 2)
    again = tf_backend.seeded_key(7, tf.constant(3, tf.int64), 2)
    other = tf_backend.seeded_key(7, tf.constant(4, tf.int64), 2)
    np.testing.assert_array_equal(key.numpy(), again.numpy())
    assert not np.array_equal(key.numpy(), other.numpy())  # a new step, new noise
    z = tf_backend.standard_normal([20000], key).numpy()
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1.0) < 0.05  # 5 and 7 standard errors
    x = tf.zeros([20000])
    np.testing.assert_allclose(tf_backend.add_gaussian(x, 3.0, key).numpy(), 3.0 * z, rtol=1e-5, atol=1e-5)


def test_a_module_without_the_interface_is_no_backend(monkeypatch):
    fake = types.ModuleType("keras_dpsgd_fake_backend")
    fake.PER_EXAMPLE_CHOICES = ("auto",)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(backends.BACKENDS, "jax", fake.__name__)
    with pytest.raises(
        TypeError,
        match=r"lacks \['per_example', 'OPS', 'add_gaussian', 'standard_normal', 'seeded_key', 'make_local_state'\]",
    ):
        backends.load("jax")


def test_optimizers_take_their_per_example_computation_and_noise_from_the_seam():
    import keras_dpsgd.keras3 as k3
    import keras_dpsgd.tf_keras as tk
    from keras_dpsgd.step.settings import check_settings

    for optimizer in (k3.DPSGDOptimizer(1.0, 1.1), tk.DPSGDOptimizer(1.0, 1.1, per_example_backend="reference")):
        assert optimizer._dp.noise is tf_backend
    assert isinstance(
        tk.DPSGDOptimizer(1.0, 1.1, per_example_backend="reference")._backend, tf_backend.ReferenceBackend
    )
    with pytest.raises(ValueError, match="Keras backend 'numpy'"):
        check_settings(1.0, 1.1, keras_backend="numpy")


def test_the_jax_backend_is_imported_only_when_chosen():
    script = textwrap.dedent(
        """
        import sys

        import keras_dpsgd.keras3 as k3
        from keras_dpsgd import backends

        k3.DPSGDOptimizer(1.0, 1.1)
        backends.load("tensorflow")
        # (TensorFlow itself imports jax where it is installed: the check is on our JAX backend.)
        loaded = sorted(m for m in sys.modules if m.startswith("keras_dpsgd.backends.jax"))
        assert not loaded, loaded
        print("LAZY_OK")
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LAZY_OK" in proc.stdout, proc.stderr[-4000:]
