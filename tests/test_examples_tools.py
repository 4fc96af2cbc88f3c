"""The three tools' examples run offline with --smoke, as ``python examples/NAME.py`` runs them, one after another
in ONE fresh process (``tests/_one_process.py``: TensorFlow and Keras imported once, not three times).

Sharing the process, an example's random draws (initial weights, hence accuracies and clip bounds) can differ from
those of a run in a process of its own with the same --seed; no assertion here reads them.
"""

import json
import os
from pathlib import Path

import pytest

from tests._one_process import run_scripts

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The examples run on Keras 3 unless TF_USE_LEGACY_KERAS=1 (inherited by the subprocess); their "keras"
# key is the label of `keras-dpsgd train --json`: "3.15.1" or "tf_keras 2.21.0".
_LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True")


def _keras_label():
    if _LEGACY:
        import tf_keras

        return f"tf_keras {tf_keras.__version__}"
    import keras

    return keras.__version__


KERAS = _keras_label()


class _Run:
    """One example's outcome: ``result()`` is its last stdout line's JSON, or raises with its error."""

    def __init__(self, run):
        self.run = run

    def result(self):
        assert self.run["code"] == 0, self.run["error"][-3000:] + self.run["stdout"][-2000:]
        return json.loads(self.run["stdout"].strip().splitlines()[-1])


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """The three examples' --smoke runs (one process): each one's outcome, and the adaptive run's log dir."""
    log_dir = tmp_path_factory.mktemp("adaptive_logs")
    jobs = {"memorization_test.py": (), "adaptive_clipping.py": ("--log-dir", str(log_dir)), "large_lots.py": ()}
    runs = run_scripts(
        [[EXAMPLES / name, "--smoke", "--json", "--seed", "0", *args] for name, args in jobs.items()], timeout=600
    )
    return dict(zip(jobs, map(_Run, runs))), log_dir


def test_memorization_example(examples):
    reports = examples[0]["memorization_test.py"].result()
    assert len(reports) == 1 and reports[0]["mode"] == "noise"
    assert reports[0]["verdict"].split(":")[0] in {"PASS", "FAIL", "INCONCLUSIVE"}
    assert reports[0]["touches_real_data"] is False
    assert reports[0]["keras"] == KERAS


def test_adaptive_clipping_example(examples):
    runs, log_dir = examples
    out = runs["adaptive_clipping.py"].result()
    # The ledger charges the composed sigma_eff: the calibrated run spends exactly (at most) the target.
    assert out["epsilon"] <= out["target_epsilon"] * (1 + 1e-9)
    assert out["epsilon"] > 0.99 * out["target_epsilon"]
    assert len(out["bounds_per_epoch"]) == out["epochs"]
    assert list(log_dir.glob("events.out.tfevents*"))
    assert out["keras"] == KERAS


def test_large_lots_example(examples):
    out = examples[0]["large_lots.py"].result()
    table, runs = out["table"], out["runs"]
    assert [r["noise_per_example"] for r in table] == sorted((r["noise_per_example"] for r in table), reverse=True)
    assert runs[-1]["learning_rate"] < runs[-2]["learning_rate"]  # base lr vs scaled lr
    assert out["keras"] == KERAS
    assert any(r["accumulation_steps"] > 1 for r in runs)  # a lot larger than a physical batch, on both Kerases
    for r in runs:
        assert r["steps"] == table[[t["lot_size"] for t in table].index(r["lot_size"])]["steps"]  # lots, not batches
        assert r["epsilon"] <= out["target_epsilon"] * (1 + 1e-9)


def test_tfds_loader_with_mock_data_and_offline_error(tmp_path, monkeypatch):
    """--dataset cifar10 goes through load_tfds: numpy in [0, 1]; offline, an error naming the fix."""
    tfds = pytest.importorskip("tensorflow_datasets")
    from keras_dpsgd.tools import load_tfds

    with tfds.testing.mock_data(num_examples=6):
        (x, y), (xt, yt) = load_tfds("cifar10")
    assert x.shape == (6, 32, 32, 3) and x.dtype.name == "float32" and 0.0 <= x.min() and x.max() <= 1.0
    assert y.dtype.name == "int64" and xt.shape[1:] == (32, 32, 3)

    def offline(*args, **kwargs):
        raise OSError("no internet")

    monkeypatch.setattr(tfds, "load", offline)
    with pytest.raises(ValueError, match="Fix: run once with internet access.*digits"):
        load_tfds("cifar10", data_dir=str(tmp_path))
