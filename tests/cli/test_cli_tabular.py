"""``keras-dpsgd train --data table.csv`` with the defaults: small real tables train well, honestly (issue 27).

The lot size comes from N, and features without a public range are scaled privately (asinh, then a DP mean
by DPNormalization); both are announced, and ε composes the scaling's release with the DP-SGD steps.
"""

import json

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_wine

from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.cli import main


def _write_table(path, loader):
    data = loader()
    header = ",".join([name.replace(" ", "_") for name in data.feature_names] + ["label"])
    np.savetxt(path, np.column_stack([data.data, data.target]), delimiter=",", header=header, comments="", fmt="%.6g")
    return str(path)


@pytest.mark.parametrize(
    "loader, target, n, lot",
    [(load_breast_cancer, 0.90, 455, 64), (load_wine, 0.85, 142, 16)],
    ids=["breast_cancer", "wine"],
)
def test_defaults_train_small_real_tables(capsys, tmp_path, loader, target, n, lot):
    path = _write_table(tmp_path / "table.csv", loader)
    code = main(["train", "--json", "--data", path, "--label-column", "label", "--seed", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    result = json.loads(out)
    assert result["num_examples"] == n and result["lot_size"] == lot
    assert result["test_accuracy"] >= target
    notes = " | ".join(result["data_notes"])
    assert f"lot size L = {lot}: the default for N = {n}" in notes
    assert "mapped by asinh" in notes and "DPNormalization" in notes and "in ε" in notes
    assert "lot size L =" in err and "mapped by asinh" in err  # announced while it runs, too

    # ε is the composition of the scaling's release and the DP-SGD steps, within the default budget.
    release = result["dp_normalize"]
    assert release["public_transform"] == "asinh" and release["noise_multiplier"] == 3.0
    assert release["event"] == GaussianEvent(3.0, label="dp-normalization").to_dict()
    steps = PoissonSampledGaussianEvent(lot / n, result["noise_multiplier"], result["steps"])
    composed = compute_epsilon([GaussianEvent(3.0), steps], result["delta"])
    assert result["epsilon"] == pytest.approx(composed, rel=1e-9)
    assert result["epsilon"] <= result["target_epsilon"] + 1e-9
    assert compute_epsilon([steps], result["delta"]) < result["epsilon"] - 0.05  # the scaling is not free


def test_default_lot_size():
    from keras_dpsgd.cli.train import default_lot_size

    assert [default_lot_size(n) for n in (1, 9, 10, 142, 455, 1347, 60000)] == [1, 1, 2, 16, 64, 256, 256]
    with pytest.raises(ValueError, match="num_examples must be an integer >= 1, got 0"):
        default_lot_size(0)
