"""The accounting subcommands: epsilon, noise, batch-table."""

import json
import math
import sys

import pytest

from keras_dpsgd.accounting import (
    PoissonSampledGaussianEvent,
    batch_table,
    compute_epsilon_and_order,
    compute_noise_multiplier,
    default_delta,
)
from keras_dpsgd.cli import main

EPS_ARGS = ["epsilon", "--num-examples", "60000", "--lot-size", "150", "--noise-multiplier", "1.3", "--epochs", "15"]


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_epsilon_json_reproduces_the_anchor(capsys):
    result = _json(capsys, EPS_ARGS + ["--delta", "1e-5"])
    assert {"epsilon", "delta", "steps", "sampling_rate", "order", "accountant"} <= set(result)
    assert result["steps"] == 6000
    assert result["sampling_rate"] == 150 / 60000
    assert result["delta"] == 1e-5
    assert result["accountant"] == "rdp"
    assert result["order"] == 19.0
    assert result["epsilon"] == pytest.approx(0.72422, abs=5e-6)


def test_epsilon_moments_and_default_delta(capsys):
    result = _json(
        capsys,
        [
            "epsilon",
            "--num-examples",
            "60000",
            "--lot-size",
            "256",
            "--noise-multiplier",
            "1.1",
            "--epochs",
            "60",
            "--delta",
            "1e-5",
            "--accountant",
            "moments",
        ],
    )
    assert result["accountant"] == "moments" and result["steps"] == 60 * 235  # 60 epochs of ceil(N/L) lots
    moments = compute_epsilon_and_order(
        PoissonSampledGaussianEvent(256 / 60000, 1.1, 14100), 1e-5, accountant="moments"
    )
    assert result["epsilon"] == moments[0]
    result = _json(capsys, EPS_ARGS)
    assert result["delta"] == default_delta(60000)
    event = PoissonSampledGaussianEvent(150 / 60000, 1.3, 6000)
    assert (result["epsilon"], result["order"]) == compute_epsilon_and_order(event, default_delta(60000))


def test_epsilon_text_output(capsys):
    assert main(EPS_ARGS + ["--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "ε = 0.724223" in out and "6000 steps" in out and "{" not in out


def test_noise_json(capsys):
    argv = [
        "noise",
        "--target-epsilon",
        "2",
        "--num-examples",
        "60000",
        "--lot-size",
        "256",
        "--epochs",
        "10",
        "--delta",
        "1e-5",
    ]
    result = _json(capsys, argv)
    assert {"noise_multiplier", "epsilon", "delta", "steps", "sampling_rate", "order", "accountant"} <= set(result)
    steps = 10 * math.ceil(60000 / 256)  # 10 epochs of ceil(N/L) lots
    assert result["steps"] == steps
    assert result["noise_multiplier"] == compute_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sampling_rate=256 / 60000, steps=steps
    )
    assert result["epsilon"] <= 2.0 and result["target_epsilon"] == 2.0


def test_batch_table_json_text_and_plot(capsys, tmp_path):
    argv = [
        "batch-table",
        "--target-epsilon",
        "2",
        "--num-examples",
        "10000",
        "--epochs",
        "5",
        "--delta",
        "1e-5",
        "--lot-sizes",
        "32,100",
        "1000",
    ]
    result = _json(capsys, argv)
    assert result["rows"] == batch_table(
        num_examples=10000, epochs=5, target_epsilon=2.0, target_delta=1e-5, lot_sizes=[32, 100, 1000]
    )
    pytest.importorskip("matplotlib")
    png = tmp_path / "table.png"
    assert main(argv + ["--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "lot size" in out and "1000" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_table_default_lot_sizes(capsys):
    result = _json(capsys, ["batch-table", "--target-epsilon", "4", "--num-examples", "100", "--epochs", "1"])
    assert [r["lot_size"] for r in result["rows"]] == [16, 32, 64]


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = [
        "batch-table",
        "--target-epsilon",
        "2",
        "--num-examples",
        "1000",
        "--epochs",
        "1",
        "--lot-sizes",
        "10",
        "--plot",
        str(tmp_path / "x.png"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "keras-dpsgd[plot]"' in err


def test_pld_without_dp_accounting_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    assert main(EPS_ARGS + ["--accountant", "pld"]) == 2
    assert "keras-dpsgd[pld]" in capsys.readouterr().err


BAD = [
    (EPS_ARGS[:2] + ["0"] + EPS_ARGS[3:], "num_examples must be an integer >= 1, got 0"),
    (EPS_ARGS[:2] + ["-5"] + EPS_ARGS[3:], "num_examples must be an integer >= 1"),
    (EPS_ARGS[:2] + ["100"] + EPS_ARGS[3:], "lot_size must be in [1, num_examples = 100], got 150"),
    (EPS_ARGS[:6] + ["-1"] + EPS_ARGS[7:], "noise_multiplier must be a finite number >= 0, got -1.0"),
    (EPS_ARGS[:6] + ["nan"] + EPS_ARGS[7:], "noise_multiplier must be a finite number >= 0, got nan"),
    (EPS_ARGS + ["--delta", "0"], "delta must be in (0, 1), got 0.0"),
    (EPS_ARGS + ["--delta", "1.5"], "delta must be in (0, 1), got 1.5"),
    (EPS_ARGS[:8] + ["0"], "epochs must be a finite number > 0, got 0.0"),
    (
        ["noise", "--target-epsilon", "0", "--num-examples", "100", "--lot-size", "10", "--epochs", "1"],
        "target_epsilon must be a finite number > 0, got 0.0",
    ),
    (
        ["noise", "--target-epsilon", "-2", "--num-examples", "100", "--lot-size", "10", "--epochs", "1"],
        "target_epsilon must be a finite number > 0",
    ),
    (
        ["batch-table", "--target-epsilon", "1", "--num-examples", "100", "--epochs", "1", "--lot-sizes", "500"],
        "lot sizes must be integers in [1, num_examples = 100], got 500",
    ),
    (
        ["batch-table", "--target-epsilon", "1", "--num-examples", "100", "--epochs", "1", "--lot-sizes", "a,b"],
        "lot sizes must be integers",
    ),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert message in err and "Traceback" not in err
    assert captured.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        EPS_ARGS[:2] + ["abc"] + EPS_ARGS[3:],
        EPS_ARGS + ["--accountant", "opacus"],
        EPS_ARGS[:-2],  # --epochs missing
    ],
)
def test_argparse_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_zero_noise_reports_infinity_as_strict_json(capsys):
    result = _json(capsys, EPS_ARGS[:6] + ["0"] + EPS_ARGS[7:])
    assert result["epsilon"] == "inf" and result["order"] is None


def test_epsilon_with_budget_reports_max_steps_and_epochs(capsys):
    from keras_dpsgd.accounting import compute_epsilon, max_steps_within_budget, steps_for_epochs

    result = _json(capsys, EPS_ARGS + ["--delta", "1e-5", "--target-epsilon", "1.0"])
    k = max_steps_within_budget(target_epsilon=1.0, target_delta=1e-5, sampling_rate=150 / 60000, noise_multiplier=1.3)
    assert result["max_steps"] == k and result["target_epsilon"] == 1.0
    assert steps_for_epochs(60000, 150, result["max_epochs"]) == k
    assert compute_epsilon(PoissonSampledGaussianEvent(150 / 60000, 1.3, k), 1e-5) <= 1.0
    assert main(EPS_ARGS + ["--target-epsilon", "0"]) == 2


def test_noise_plans_the_steps_that_training_runs(capsys):
    """Issue 37.3: N = 1347, L = 128, 5 epochs is 5 · 11 = 55 lots in training (PoissonLots); the plan said 53,
    so WithinLimit at the planned σ stopped 2 lots early. σ now spends the target in exactly those 55."""
    import numpy as np

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.accounting import max_steps_within_budget

    args = ["noise", "--num-examples", "1347", "--lot-size", "128", "--epochs", "5", "--target-epsilon", "1"]
    result = _json(capsys, args)
    lots = PoissonLots(np.zeros((1347, 1)), np.zeros(1347), expected_lot_size=128)
    assert result["steps"] == 5 * lots.lots_per_epoch == 55
    budget = max_steps_within_budget(
        target_epsilon=1.0,
        target_delta=result["delta"],
        sampling_rate=lots.sampling_rate,
        noise_multiplier=result["noise_multiplier"],
    )
    assert budget >= 55
