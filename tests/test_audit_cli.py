"""``keras-dpsgd audit``: one JSON object with the documented keys, honest ε, the verdict, the plot, errors."""

import json
import math
import os

import pytest

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon, default_delta
from keras_dpsgd.cli import main

KEYS = {"epsilon", "epsilon_lower_bound", "confidence", "canaries", "auc", "method"}
SMALL = ["--epochs", "1", "--lot-size", "128", "--width", "16", "--canaries", "200", "--seed", "3"]


def _run_json(capsys, *argv):
    code = main(["audit", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON object, got {out[:500]!r}"
    return json.loads(lines[0])


def test_json_keys_reported_epsilon_is_the_ledgers_and_plot(capsys, tmp_path):
    path = tmp_path / "audit.png"
    result = _run_json(capsys, *SMALL, "--noise-multiplier", "1", "--plot", str(path))
    assert KEYS <= set(result)
    assert result["method"] == "one-run-gradient" and result["canaries"] == 200 and result["confidence"] == 0.95
    import keras
    import tf_keras

    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"  # the form of `keras-dpsgd train --json`
    assert result["keras"] == (f"tf_keras {tf_keras.__version__}" if legacy else keras.__version__)
    q, steps = 128 / 1347, math.ceil(1347 / 128)
    eps = compute_epsilon(PoissonSampledGaussianEvent(q, 1.0, steps), default_delta(1347))
    assert result["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert 0.0 <= result["epsilon_lower_bound"] <= result["epsilon"]
    assert result["violation"] is False and result["verdict"].startswith("consistent")
    assert os.path.getsize(path) > 1000 and result["plot"] == str(path)
    assert [p["noise_multiplier"] for p in result["plot_points"]] == [0.5, 1.0, 2.0, 4.0]
    for p in result["plot_points"]:
        assert p["epsilon_lower_bound"] <= p["epsilon"]


def test_noise_multiplier_0_is_non_private(capsys):
    result = _run_json(capsys, *SMALL, "--noise-multiplier", "0")
    assert result["epsilon"] == "inf" and result["noise_multiplier"] == 0.0
    assert result["violation"] is False


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--canaries", "1"], "canaries"),
        (["--confidence", "1.5"], "confidence"),
        (["--noise-multiplier", "-1"], "noise_multiplier"),
        (["--save", "x"], "--save"),
        (["--plot", "x.jpg"], "plot"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, fragment):
    try:
        code = main(["audit", *argv])
    except SystemExit as exit_:  # argparse's own type errors: usage, then one error line
        code = exit_.code
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("keras-dpsgd audit: error:") and fragment in last
