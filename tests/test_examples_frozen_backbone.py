"""examples/frozen_backbone.py --smoke (subprocesses, offline: scikit-learn's digits, random or local weights)."""

import numpy as np
import pytest
from test_examples_main import _load_example, _run


def _saved_backbone(keras, path):
    backbone = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), include_top=False, alpha=0.35)
    gen = np.random.default_rng(0)
    backbone.set_weights([w + gen.normal(0, 0.01, w.shape).astype(w.dtype) for w in backbone.get_weights()])
    backbone.save_weights(path)
    return backbone


@pytest.mark.parametrize("legacy, front_end", [("0", "Keras 3"), ("1", "tf_keras")])
def test_frozen_backbone_smoke_trains_only_the_head_on_the_fast_path(legacy, front_end, tmp_path):
    argv = []
    if legacy == "0":  # Keras 3 reads the backbone's weights from a local file.
        example = _load_example("frozen_backbone")
        path = str(tmp_path / "backbone.weights.h5")
        backbone = _saved_backbone(example.keras, path)
        model = example.frozen_backbone_model(32, 10, 0.35, path)
        for got, want in zip(model.layers[1].get_weights(), backbone.get_weights()):
            np.testing.assert_array_equal(got, want)
        argv = ["--weights", path]
    out, acc, eps, delta, steps = _run("frozen_backbone.py", *argv, TF_USE_LEGACY_KERAS=legacy)
    assert out.startswith(front_end)
    assert "(2 DP-trained variables)" in out and ("weights from" in out) == bool(argv)
    assert 1 <= steps <= 4 and 0 < eps <= 3.0 and delta == 1e-3 and 0.0 <= acc <= 1.0
    assert "per-example gradients: 2 variables fast, 0 on per-example jacobians" in out


def test_frozen_backbone_refuses_a_missing_weights_file(tmp_path):
    import subprocess
    import sys

    from test_examples_main import EXAMPLES, ROOT

    missing = str(tmp_path / "nope.h5")
    proc = subprocess.run(
        [sys.executable, f"{EXAMPLES}/frozen_backbone.py", "--weights", missing],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "--weights must be an existing file" in proc.stderr
