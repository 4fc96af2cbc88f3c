"""examples/frozen_backbone.py --smoke (subprocesses, offline: scikit-learn's digits, public 0-4, private 5-9)."""

import numpy as np
import pytest
from test_examples_main import _load_example, _run

# The smoke's DP head on the private digits 5-9 (5 classes: chance 0.2) after 3 epochs of public pretraining on the
# digits 0-4 reaches about 0.40-0.45 at ε = 3; a random frozen backbone (the example before) stayed at chance.
SMOKE_ACCURACY = 0.30


def _saved_backbone(keras, path):
    backbone = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), include_top=False, alpha=0.35)
    gen = np.random.default_rng(0)
    backbone.set_weights([w + gen.normal(0, 0.01, w.shape).astype(w.dtype) for w in backbone.get_weights()])
    backbone.save_weights(path)
    return backbone


@pytest.mark.parametrize("legacy, front_end", [("0", "Keras 3"), ("1", "tf_keras")])
def test_frozen_backbone_smoke_pretrains_on_public_and_learns_a_dp_head(legacy, front_end, tmp_path):
    argv = ["--seed", "0"]
    if legacy == "0":  # Keras 3 starts from a backbone's weights in a local file, then pretrains on public data.
        example = _load_example("frozen_backbone")
        path = str(tmp_path / "backbone.weights.h5")
        backbone = _saved_backbone(example.keras, path)
        model = example.frozen_backbone_model(32, 5, 0.35, path)
        for got, want in zip(model.layers[1].get_weights(), backbone.get_weights()):
            np.testing.assert_array_equal(got, want)
        argv += ["--weights", path, "--pretrain-epochs", "3"]
    out, acc, eps, delta, steps = _run("frozen_backbone.py", *argv, TF_USE_LEGACY_KERAS=legacy)
    assert out.startswith(front_end)
    assert "public data (outside the ledger): 901 digits 0-4" in out
    assert "private data (in the ledger): digits 5-9, 672 training and 224 test examples" in out
    assert "(2 DP-trained variables)" in out and ("weights from" in out) == (legacy == "0")
    # σ calibrated to 5 epochs of ceil(672 / 64) = 11 lots: the whole run spends ε = 3 at δ = 1e-5, not more.
    assert steps == 55 and delta == 1e-5 and 2.9 <= eps <= 3.0
    assert acc >= SMOKE_ACCURACY, out[-2000:]
    assert "per-example gradients: 2 variables fast, 0 on per-example jacobians" in out


def test_split_by_class_keeps_public_and_private_digits_apart():
    from keras_dpsgd.data.datasets import load_digits

    example = _load_example("frozen_backbone")
    data = load_digits()
    (x_pub, y_pub), (x_train, y_train), (x_test, y_test) = example.split_by_class(data)
    assert set(y_pub) == {0, 1, 2, 3, 4} and set(y_train) == set(y_test) == {0, 1, 2, 3, 4}
    assert len(y_pub) + len(y_train) + len(y_test) == len(data.y_train) + len(data.y_test)
    private = {x.tobytes() for x in np.concatenate([x_train, x_test])}
    assert not any(x.tobytes() in private for x in x_pub)  # no private image is in the public set
    np.testing.assert_array_equal(x_train, data.x_train[data.y_train >= 5])
    np.testing.assert_array_equal(y_train, data.y_train[data.y_train >= 5] - 5)


def test_frozen_backbone_refuses_a_missing_weights_file_before_importing_tensorflow(tmp_path):
    import subprocess
    import sys

    from test_examples_main import EXAMPLES, ROOT

    missing = str(tmp_path / "nope.h5")
    proc = subprocess.run(  # -X importtime: every module the process imported, on stderr
        [sys.executable, "-X", "importtime", f"{EXAMPLES}/frozen_backbone.py", "--weights", missing],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "--weights must be an existing file" in proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "argparse" in imported and "tensorflow" not in imported  # refused before any work
