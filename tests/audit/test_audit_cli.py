"""``keras-dpsgd audit``: one JSON object with the documented keys, honest ε, the verdict, the plot, errors,
exit codes (0 consistent, 1 a leak found, 2 bad input), both modes (step by default, one-run by name)."""

import argparse
import json
import math
import os

import numpy as np
import pytest

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon, default_delta
from keras_dpsgd.cli import main

KEYS = {"epsilon", "epsilon_lower_bound", "confidence", "canaries", "auc", "method", "mode", "verdict", "violation"}
STEP_KEYS = {
    "epsilon",
    "epsilon_lower_bound",
    "confidence",
    "canaries",
    "method",
    "mode",
    "verdict",
    "violation",
    "noise_multiplier",
    "noise_multiplier_estimate",
    "noise_multiplier_upper_bound",
    "shift_estimate",
    "observations",
    "canary_joins",
    "sampling_rate",
    "assumption",
    "steps",
    "delta",
    "keras",
    "backend",
}
BASE = ["--epochs", "1", "--lot-size", "128", "--width", "16", "--seed", "3"]
SMALL = [*BASE, "--mode", "one-run", "--canaries", "200"]


def _run_json(capsys, *argv, expect=0):
    code = main(["audit", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == expect, err[-2000:]
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
    assert result["backend"] == "tensorflow"
    q, steps = 128 / 1347, math.ceil(1347 / 128)
    eps = compute_epsilon(PoissonSampledGaussianEvent(q, 1.0, steps), default_delta(1347))
    assert result["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert 0.0 <= result["epsilon_lower_bound"] <= result["epsilon"]
    assert result["violation"] is False and result["verdict"].startswith("consistent")
    assert os.path.getsize(path) > 1000 and result["plot"] == str(path)
    assert [p["noise_multiplier"] for p in result["plot_points"]] == [0.5, 1.0, 2.0, 4.0]
    for p in result["plot_points"]:
        assert p["epsilon_lower_bound"] <= p["epsilon"]


def test_step_mode_is_the_default_json_keys_and_plot(capsys, tmp_path):
    path = tmp_path / "step.png"
    result = _run_json(capsys, *BASE, "--noise-multiplier", "1", "--plot", str(path))
    assert set(result) >= STEP_KEYS and not {"auc", "guesses"} & set(result)
    assert result["mode"] == "step" and result["method"] == "step-gradient"
    q, steps = 128 / 1347, math.ceil(1347 / 128)
    assert result["steps"] == steps and result["sampling_rate"] == pytest.approx(q)
    assert result["canaries"] == 64 * 16 + 16 + 16 * 10 + 10  # one per trainable coordinate of the MLP
    assert result["observations"] == steps * result["canaries"]
    assert result["noise_multiplier_estimate"] == pytest.approx(1.0, rel=0.03)
    assert result["epsilon"] == pytest.approx(
        compute_epsilon(PoissonSampledGaussianEvent(q, 1.0, steps), default_delta(1347)), rel=1e-9
    )
    assert 0.0 <= result["epsilon_lower_bound"] <= result["epsilon"] and result["violation"] is False
    assert os.path.getsize(path) > 1000
    for p in result["plot_points"]:
        assert p["epsilon_lower_bound"] <= p["epsilon"]


def test_a_leak_found_exits_1_with_the_result(capsys, monkeypatch):
    """A broken optimizer (half the noise charged): the JSON is printed, then one error line, exit 1."""
    import functools

    from keras_dpsgd.audit import step
    from keras_dpsgd.tools import front as _front
    from tests._audit_helpers import scaled_noise

    half = scaled_noise(_front.active().dp_sgd, 0.5)
    monkeypatch.setattr(step, "step_audit", functools.partial(step.step_audit, optimizer_cls=half))
    code = main(["audit", "--json", *BASE, "--noise-multiplier", "1"])
    out, err = capsys.readouterr()
    assert code == 1
    result = json.loads(out)
    assert result["violation"] is True and result["epsilon_lower_bound"] > result["epsilon"]
    assert err.strip().splitlines()[-1].startswith("keras-dpsgd audit: error: BUG")


@pytest.mark.parametrize("argv", [SMALL, BASE], ids=["one-run", "step"])
def test_noise_multiplier_0_is_non_private(capsys, argv):
    result = _run_json(capsys, *argv, "--noise-multiplier", "0")
    assert result["epsilon"] == "inf" and result["noise_multiplier"] == 0.0
    assert result["violation"] is False


def test_step_mode_without_dp_accounting_exits_2_before_work(capsys, monkeypatch):
    import sys

    from keras_dpsgd.audit import step

    for name in ["dp_accounting", *(m for m in list(sys.modules) if m.startswith("dp_accounting."))]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError, imported before or not
    monkeypatch.setattr(step, "step_audit", None)  # any work would fail otherwise
    assert main(["audit", *BASE]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("keras-dpsgd audit: error:") and "keras-dpsgd[pld]" in last and "--mode one-run" in last


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--mode", "one-run", "--canaries", "1"], "canaries"),
        (["--mode", "one-run", "--plot", "x.jpg"], "plot"),  # the default --canaries passes the check
        (["--canary-kind", "ood"], "--mode one-run"),
        (["--mode", "steps"], "--mode"),
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


def _tiny_csv(path, n=100, features=4, classes=3, label="label"):
    rng = np.random.default_rng(0)
    y = np.arange(n) % classes
    x = rng.normal(10.0 * y[:, None], 1.0, (n, features))
    header = ",".join([f"f{i}" for i in range(features)] + [label])
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt="%.6g")
    return str(path)


def test_audit_trains_on_the_data_given(capsys, tmp_path):
    """--data PATH is the data audited (it was ignored for digits): N, δ, q and the model's shape are the CSV's."""
    path = _tiny_csv(tmp_path / "table.csv")
    argv = ["--data", path, "--label-column", "label", "--epochs", "1", "--lot-size", "16", "--width", "16"]
    result = _run_json(capsys, *argv, "--seed", "3", "--noise-multiplier", "1")
    n = 80  # 100 rows, 20% held out
    assert result["dataset"] == path and result["num_examples"] == n
    assert result["delta"] == pytest.approx(default_delta(n), rel=1e-12)
    assert result["sampling_rate"] == pytest.approx(16 / n) and result["steps"] == math.ceil(n / 16)
    assert result["canaries"] == 4 * 16 + 16 + 16 * 3 + 3  # one per coordinate of the MLP on 4 features, 3 classes
    assert result["epsilon"] == pytest.approx(
        compute_epsilon(PoissonSampledGaussianEvent(16 / n, 1.0, math.ceil(n / 16)), default_delta(n)), rel=1e-9
    )
    assert any("asinh" in note for note in result["data_notes"])


def _commands_with_data_flag():
    from keras_dpsgd.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(name for name, p in sub.choices.items() if "--data" in p._option_string_actions)


@pytest.mark.parametrize("command", _commands_with_data_flag())
def test_every_command_with_data_refuses_a_missing_path(capsys, tmp_path, command):
    missing = str(tmp_path / "nope.csv")
    code = main([command, "--data", missing, "--label-column", "label", "--epochs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"keras-dpsgd {command}: error:") and "does not exist" in err[0] and missing in err[0]
    assert list(tmp_path.iterdir()) == []


def test_audit_refuses_dp_normalize(capsys):
    assert main(["audit", *BASE, "--dp-normalize", "2"]) == 2
    assert "--dp-normalize is not supported by audit" in capsys.readouterr().err
