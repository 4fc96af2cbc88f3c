"""Large lots (Three Tools Sec. 4): learning-rate scaling, accumulation plan, table vs the accountant, CLI."""

import json

import pytest

from keras_dpsgd import accounting
from keras_dpsgd.cli import main
from keras_dpsgd.tools.large_lots import (
    large_lot_table,
    plan_gradient_accumulation,
    plot_noise_per_example,
    scale_learning_rate,
)


def test_scale_learning_rate_is_linear_from_the_paper_base():
    assert scale_learning_rate(128) == pytest.approx(0.01)
    assert scale_learning_rate(512) == pytest.approx(0.04)
    assert scale_learning_rate(1024) == pytest.approx(0.08)
    assert scale_learning_rate(64, base_learning_rate=0.1, base_lot_size=256) == pytest.approx(0.025)
    for lot in (1, 7, 300, 4096):
        assert scale_learning_rate(2 * lot) == pytest.approx(2 * scale_learning_rate(lot))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lot_size=0), "lot_size"),
        (dict(lot_size=-5), "lot_size"),
        (dict(lot_size=float("nan")), "lot_size"),
        (dict(lot_size="big"), "lot_size"),
        (dict(lot_size=128, base_learning_rate=0), "base_learning_rate"),
        (dict(lot_size=128, base_lot_size=float("inf")), "base_lot_size"),
    ],
)
def test_scale_learning_rate_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        scale_learning_rate(**kwargs)


def test_plan_gradient_accumulation_splits_exactly():
    assert plan_gradient_accumulation(1024, 256) == {
        "lot_size": 1024,
        "physical_batch_size": 256,
        "accumulation_steps": 4,
    }
    assert plan_gradient_accumulation(100, 1000)["accumulation_steps"] == 1
    for lot in range(1, 200):
        for cap in (1, 7, 32, 64):
            plan = plan_gradient_accumulation(lot, cap)
            assert plan["physical_batch_size"] * plan["accumulation_steps"] == lot
            assert plan["physical_batch_size"] <= cap
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_gradient_accumulation(10, 0)
    with pytest.raises(ValueError, match="lot_size"):
        plan_gradient_accumulation(2.5, 4)


def test_table_is_the_accountants_batch_table_plus_learning_rate():
    kw = dict(num_examples=50000, epochs=60, target_epsilon=20.0, target_delta=1e-5, lot_sizes=[128, 512, 1024])
    rows = large_lot_table(**kw, max_batch_size=256)
    ref = accounting.batch_table(**kw)
    assert [r["lot_size"] for r in rows] == [128, 512, 1024]
    for row, r in zip(rows, ref):
        for key in ("lot_size", "sampling_rate", "steps", "noise_multiplier", "noise_per_example"):
            assert row[key] == r[key]
        assert row["learning_rate"] == pytest.approx(0.01 * row["lot_size"] / 128)
        assert row["physical_batch_size"] * row["accumulation_steps"] == row["lot_size"]
    # The point of the tool: less noise per example on larger lots at the same (ε, δ).
    noise = [r["noise_per_example"] for r in rows]
    assert noise[0] > noise[1] > noise[2]
    # σ meets the budget for its own (q, steps).
    for r in rows:
        eps = accounting.compute_epsilon(
            [accounting.PoissonSampledGaussianEvent(r["sampling_rate"], r["noise_multiplier"], r["steps"])], 1e-5
        )
        assert eps <= 20.0


def test_plot_writes_a_file(tmp_path):
    pytest.importorskip("matplotlib")
    rows = large_lot_table(num_examples=10000, epochs=10, target_epsilon=2.0, target_delta=1e-5, lot_sizes=[64, 256])
    path = tmp_path / "lots.png"
    plot_noise_per_example(rows, str(path))
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="rows"):
        plot_noise_per_example([])


def test_cli_large_lots_json(capsys, tmp_path):
    plot = tmp_path / "p.png"
    code = main(
        [
            "large-lots",
            "--num-examples",
            "50000",
            "--epochs",
            "60",
            "--target-epsilon",
            "20",
            "--lot-sizes",
            "128",
            "1024",
            "--max-batch-size",
            "512",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["delta"] == pytest.approx(accounting.default_delta(50000))
    assert [r["learning_rate"] for r in out["rows"]] == pytest.approx([0.01, 0.08])
    assert out["rows"][1]["accumulation_steps"] == 2
    assert plot.exists()


# large-lots on 1000 examples, 5 epochs, ε = 3, lots of 50
_LARGE_LOTS = ["large-lots", "--num-examples", "1000", "--epochs", "5", "--target-epsilon", "3", "--lot-sizes", "50"]


def test_cli_large_lots_text_and_bad_input(capsys):
    assert main(_LARGE_LOTS) == 0
    assert "learning_rate" in capsys.readouterr().out
    assert main([*_LARGE_LOTS, "--delta", "0.01"]) == 2
    assert "delta must be < 1/num_examples" in capsys.readouterr().err
    assert main([*_LARGE_LOTS, "--lot-sizes", "2000"]) == 2


def test_cli_large_lots_plot_without_matplotlib_is_one_line_exit_2(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    code = main([*_LARGE_LOTS, "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert code == 2
    assert "matplotlib" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
