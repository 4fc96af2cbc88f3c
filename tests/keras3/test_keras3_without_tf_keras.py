"""Keras 3 stands without tf_keras: importing keras_dpsgd and a Keras 3 DP fit load no tf_keras.

A fresh process (the Keras choice and ``sys.modules`` are per process) blocks ``tf_keras`` with a meta
path finder that raises on any import of it, so a module that still imports tf_keras on this path
fails with its traceback instead of passing quietly.
"""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys

    class _NoTfKeras:
        def find_spec(self, name, path=None, target=None):
            if name == "tf_keras" or name.startswith("tf_keras."):
                raise ImportError(f"tf_keras is blocked in this test: {name} imported")

    blocker = _NoTfKeras()
    sys.meta_path.insert(0, blocker)

    import os
    import tempfile

    import keras
    import numpy as np

    import keras_dpsgd

    sys.meta_path.remove(blocker)  # keras_dpsgd put its own finder first: stay in front of it
    sys.meta_path.insert(0, blocker)
    import keras_dpsgd.keras3 as k3
    from keras_dpsgd import PoissonLots, PrivacyLogger, model_epsilon

    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = (np.arange(32) % 2).astype(np.int32)
    lots = PoissonLots(x, y, sampling_rate=0.25, seed=1)
    model = k3.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    optimizer = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, seed=0))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(lots.dataset(lots.lots_per_epoch), epochs=1, callbacks=[PrivacyLogger(1e-5)], verbose=0)
    epsilon, delta = model_epsilon(model, target_delta=1e-5)
    assert epsilon > 0 and epsilon == history.history["epsilon"][-1], (epsilon, history.history)

    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert model_epsilon(loaded, target_delta=1e-5)[0] == epsilon
    assert "tf_keras" not in sys.modules, sorted(m for m in sys.modules if m.startswith("tf_keras"))
    print("NO_TF_KERAS_OK")
    """
)


# tf_keras imported after keras_dpsgd: the callbacks' classes do not change, and serve a tf_keras fit;
# tf_keras's layers are defined and registered.
_LATE_TF_KERAS = textwrap.dedent(
    """
    import sys

    import numpy as np

    from keras_dpsgd import PrivacyLogger, WithinLimit
    from keras_dpsgd.preprocessing import normalization, pca

    assert "tf_keras" not in sys.modules
    mros = (PrivacyLogger.__mro__, WithinLimit.__mro__)
    # The first access to a tf_keras DP layer imports tf_keras, whose registration imports keras_dpsgd.tf_keras,
    # which reaches the DP layers again: that re-entry waited on its own lock for ever (a fresh process hung).
    dppca = pca.DPPCA
    import tf_keras

    import keras_dpsgd.tf_keras as tk

    assert (PrivacyLogger.__mro__, WithinLimit.__mro__) == mros
    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    loss = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    model.compile(optimizer=tk.DPSGDOptimizer(1.0, 1.1, learning_rate=0.1, seed=0), loss=loss)
    x, y = np.zeros((32, 3), np.float32), np.zeros(32, np.int32)
    logger, limit = PrivacyLogger(1e-5, num_examples=32), WithinLimit(100.0, 1e-5, num_examples=32)
    history = model.fit(x, y, batch_size=8, epochs=1, callbacks=[logger, limit], verbose=0)
    assert history.history["epsilon"][-1] > 0 and int(model.optimizer.noised_steps.numpy()) == 4
    assert tk.DPPCA is pca.DPPCA is dppca
    for cls in (normalization.DPNormalization, pca.DPPCA):
        assert issubclass(cls, tf_keras.layers.Layer) and cls.__qualname__ == cls.__name__
        assert tf_keras.saving.get_registered_object(f"keras_dpsgd>{cls.__name__}") is cls
    print("NO_TF_KERAS_OK")
    """
)


def _run(script: str) -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "NO_TF_KERAS_OK" in proc.stdout, proc.stderr[-4000:]


def test_keras3_import_fit_save_and_load_import_no_tf_keras():
    _run(_SCRIPT)


def test_tf_keras_imported_later_gets_the_tf_keras_callbacks_and_layers():
    _run(_LATE_TF_KERAS)
