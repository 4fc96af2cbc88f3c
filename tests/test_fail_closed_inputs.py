"""Fail closed on inputs (issue 12, hole 7 and "Also").

* ``keras-dpsgd train --save``: a bad destination is refused before training
  (exit 2, one line); a write that fails after training (full disk) leaves
  nothing partial and still prints the JSON result, with the error (exit 1).
* δ >= 1/N and σ = ∞ are refused by every subcommand that takes them.
* Every real scalar type (numpy included) is accepted where a Python float or
  int is; bool, str, NaN and ∞ are refused.
* ``fit(lots.dataset())`` without ``steps_per_epoch`` is refused before any
  step; ``fit(lots.dataset(k), epochs=2)`` ends after 2·k lots with the right ε.
"""

import errno
import json
import os

import numpy as np
import pytest
import keras as keras3  # keras-dpsgd train runs on Keras 3 by default
import tf_keras as keras

from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledGaussianEvent,
    compute_epsilon,
    compute_noise_multiplier,
    max_steps_within_budget,
)
from keras_dpsgd.cli import main
from keras_dpsgd.ledger import model_epsilon
from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer
from keras_dpsgd.step.lots import PoissonLots

TRAIN = ["train", "--epochs", "1", "--lot-size", "512", "--json"]


def _one_line_error(capsys, argv, code=2):
    assert main(argv) == code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err
    return captured.out, err.splitlines()[-1], err


# ------------------------------------------------------------------ hole 7: --save
def test_save_to_an_existing_file_is_refused_before_training(capsys, tmp_path):
    target = tmp_path / "run"
    target.write_text("not a directory")
    out, line, err = _one_line_error(capsys, TRAIN + ["--save", str(target)])
    assert "is an existing file" in line and str(target) in line
    assert len(err.splitlines()) == 1 and out == ""  # before training: no progress, no plan
    assert target.read_text() == "not a directory"


def test_save_under_a_file_is_refused_before_training(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out, line, err = _one_line_error(capsys, TRAIN + ["--save", str(blocker / "sub" / "run")])
    assert "which is not a directory" in line
    assert len(err.splitlines()) == 1 and out == ""


def test_save_refused_when_the_probe_cannot_write(capsys, tmp_path, monkeypatch):
    import tempfile

    def unwritable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", unwritable)
    out, line, err = _one_line_error(capsys, TRAIN + ["--save", str(tmp_path / "run")])
    assert "is not writable: Permission denied" in line and len(err.splitlines()) == 1 and out == ""


def test_full_disk_after_training_prints_the_result_and_leaves_nothing_partial(capsys, tmp_path, monkeypatch):
    """model.save writes half a file then fails with ENOSPC: no model.keras, no temporary file."""
    out_dir = tmp_path / "run"

    def full_disk(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"PK\x03\x04 truncated")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(keras3.Model, "save", full_disk)
    code = main(TRAIN + ["--save", str(out_dir)])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1] == (
        f"keras-dpsgd train: error: cannot save to {str(out_dir)!r}: No space left on device; nothing was written"
    )
    result = json.loads(captured.out)  # the run's result is printed anyway
    assert result["steps"] >= 1 and result["epsilon"] > 0 and "saved_to" not in result
    assert "No space left on device" in result["save_error"]
    assert sorted(os.listdir(out_dir)) == []  # nothing partial, no temporary file


def test_save_replaces_earlier_files_atomically(capsys, tmp_path):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "privacy_report.json").write_text("old")
    assert main(TRAIN + ["--save", str(out_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert sorted(os.listdir(out_dir)) == ["model.keras", "privacy_report.json"]
    report = json.loads((out_dir / "privacy_report.json").read_text())
    assert report["epsilon"] == result["epsilon"]
    keras3.saving.load_model(out_dir / "model.keras", compile=False)


# ------------------------------------------------------------------ δ >= 1/N, σ = ∞ on the command line
ACCOUNTING = [
    ["epsilon", "--num-examples", "1000", "--lot-size", "10", "--epochs", "1", "--noise-multiplier", "1"],
    ["noise", "--num-examples", "1000", "--lot-size", "10", "--epochs", "1", "--target-epsilon", "1"],
    ["batch-table", "--num-examples", "1000", "--epochs", "1", "--target-epsilon", "1", "--lot-sizes", "10"],
    ["large-lots", "--num-examples", "1000", "--epochs", "1", "--target-epsilon", "1", "--lot-sizes", "10"],
    ["memorization-test", "--num-examples", "1000", "--epochs", "1"],
    ["train", "--epochs", "1"],  # digits: N = 1347
    ["audit", "--epochs", "1"],  # digits: N = 1347
]


@pytest.mark.parametrize("argv", ACCOUNTING, ids=lambda a: a[0])
@pytest.mark.parametrize("delta", ["0.5", "0.001"])  # 0.001 >= 1/1000 and >= 1/1347
def test_delta_at_least_one_over_n_is_refused(capsys, argv, delta):
    out, line, err = _one_line_error(capsys, argv + ["--delta", delta, "--json"])
    assert "delta must be < 1/num_examples" in line and f"got {float(delta)!r}" in line
    assert len(err.splitlines()) == 1 and out == ""


@pytest.mark.parametrize("argv", [ACCOUNTING[0][:-2], ["train", "--epochs", "1"]], ids=["epsilon", "train"])
def test_infinite_noise_multiplier_is_refused(capsys, argv):
    out, line, err = _one_line_error(capsys, argv + ["--noise-multiplier", "inf", "--json"])
    assert "noise_multiplier must be" in line and "finite" in line and "inf" in line
    assert len(err.splitlines()) == 1 and out == ""


# ------------------------------------------------------------------ every real scalar type
def test_optimizer_accepts_numpy_scalars_like_python_numbers():
    numpy_args = dict(
        l2_norm_clip=np.float32(1.5),
        noise_multiplier=np.float64(1.1),
        seed=np.int64(7),
        gradient_accumulation_steps=np.int64(2),
        expected_lot_size=np.float32(8.0),
        sampling_rate=np.float32(0.25),
        learning_rate=0.1,
    )
    python_args = dict(
        l2_norm_clip=1.5,
        noise_multiplier=1.1,
        seed=7,
        gradient_accumulation_steps=2,
        expected_lot_size=8.0,
        sampling_rate=float(np.float32(0.25)),
        learning_rate=0.1,
    )
    config = DPSGDOptimizer(**numpy_args).get_config()
    assert config == DPSGDOptimizer(**python_args).get_config()
    for key in ("l2_norm_clip", "noise_multiplier", "expected_lot_size", "sampling_rate"):
        assert type(config[key]) is float, key  # plain Python numbers: JSON-serializable config
    assert type(config["seed"]) is int and type(config["gradient_accumulation_steps"]) is int
    per_layer = DPSGDOptimizer(l2_norm_clip=[np.float32(1.0), 2], noise_multiplier=[np.float16(1.0), 1.0])
    assert per_layer.l2_norm_clip == [1.0, 2.0]
    assert DPSGDOptimizer(l2_norm_clip={"dense/kernel": np.float32(1.0)}, noise_multiplier=1.0).l2_norm_clip == {
        "dense/kernel": 1.0
    }


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"l2_norm_clip": True}, "l2_norm_clip must be a finite number > 0, got True"),
        ({"l2_norm_clip": "1.0"}, "l2_norm_clip must be a finite number > 0, got '1.0'"),
        ({"l2_norm_clip": np.float32("nan")}, "l2_norm_clip must be a finite number > 0"),
        ({"l2_norm_clip": np.inf}, "l2_norm_clip must be a finite number > 0"),
        ({"noise_multiplier": np.float32("inf")}, "noise_multiplier must be a finite number >= 0"),
        ({"noise_multiplier": np.bool_(True)}, "noise_multiplier must be a finite number >= 0"),
        ({"seed": np.float64(3.0)}, "seed must be an integer in"),
        ({"seed": True}, "seed must be an integer in"),
        ({"gradient_accumulation_steps": np.float32(2.0)}, "gradient_accumulation_steps must be an integer >= 1"),
        ({"gradient_accumulation_steps": np.int32(0)}, "gradient_accumulation_steps must be an integer >= 1"),
        ({"sampling_rate": "0.5"}, "sampling_rate must be in (0, 1]"),
        ({"sampling_rate": np.float64("nan")}, "sampling_rate must be in (0, 1]"),
        ({"expected_lot_size": np.float32("inf")}, "expected_lot_size must be a finite number > 0"),
    ],
)
def test_optimizer_still_refuses_bool_str_nan_inf(kwargs, fragment):
    args = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        DPSGDOptimizer(**args)
    assert fragment in str(info.value)


def _xy(n=20):
    return np.zeros((n, 2), np.float32), np.zeros(n, np.float32)


def test_poisson_lots_accepts_numpy_scalars():
    x, y = _xy()
    a = PoissonLots(
        x,
        y,
        sampling_rate=np.float32(0.5),
        physical_batch_size=np.int64(4),
        seed=np.int64(3),
        overflow_probability=np.float64(1e-6),
        max_lot_size=np.int32(12),
    )
    b = PoissonLots(
        x,
        y,
        sampling_rate=float(np.float32(0.5)),
        physical_batch_size=4,
        seed=3,
        overflow_probability=1e-6,
        max_lot_size=12,
    )
    assert (a.sampling_rate, a.gradient_accumulation_steps, a.max_lot_size) == (
        b.sampling_rate,
        b.gradient_accumulation_steps,
        b.max_lot_size,
    )
    np.testing.assert_array_equal(a.sample_indices(), b.sample_indices())
    assert PoissonLots(x, y, expected_lot_size=np.int64(5)).sampling_rate == 0.25
    assert len(list(a.lots(np.int64(2)))) == 2 * a.gradient_accumulation_steps


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"sampling_rate": True}, "sampling_rate must be in (0, 1], got True"),
        ({"sampling_rate": "0.5"}, "sampling_rate must be in (0, 1], got '0.5'"),
        ({"sampling_rate": float("nan")}, "sampling_rate must be in (0, 1]"),
        ({"expected_lot_size": "5"}, "expected_lot_size must be in (0, 20], got '5'"),
        ({"expected_lot_size": np.inf}, "expected_lot_size must be in (0, 20]"),
        ({"sampling_rate": 0.5, "physical_batch_size": 4.0}, "physical_batch_size must be an integer >= 1"),
        ({"sampling_rate": 0.5, "physical_batch_size": True}, "physical_batch_size must be an integer >= 1"),
        ({"sampling_rate": 0.5, "max_lot_size": 5.0}, "max_lot_size must be an integer in [1, 20]"),
        ({"sampling_rate": 0.5, "seed": 3.0}, "seed must be an integer >= 0"),
        ({"sampling_rate": 0.5, "seed": -1}, "seed must be an integer >= 0"),
        ({"sampling_rate": 0.5, "overflow_probability": "0.1"}, "overflow_probability must be in (0, 1)"),
    ],
)
def test_poisson_lots_refuses_bool_str_nan_inf(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        PoissonLots(*_xy(), **kwargs)
    assert fragment in str(info.value)


def test_events_and_planning_accept_numpy_scalars_and_refuse_the_rest():
    e = PoissonSampledGaussianEvent(np.float32(0.5), np.float64(1.5), np.int64(3))
    assert e == PoissonSampledGaussianEvent(float(np.float32(0.5)), 1.5, 3)
    assert type(e.sampling_rate) is float and type(e.count) is int
    assert GaussianEvent(np.float32(2.0), count=np.int32(2)) == GaussianEvent(2.0, count=2)
    sigma = compute_noise_multiplier(
        target_epsilon=np.float32(2.0),
        target_delta=np.float64(1e-5),
        sampling_rate=np.float32(0.01),
        steps=np.int64(100),
    )
    assert sigma == compute_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sampling_rate=float(np.float32(0.01)), steps=100
    )
    assert (
        max_steps_within_budget(
            target_epsilon=np.float64(1.0),
            target_delta=1e-5,
            sampling_rate=np.float32(0.01),
            noise_multiplier=np.float32(1.0),
        )
        > 0
    )
    bad = [
        (lambda: PoissonSampledGaussianEvent("0.5", 1.0), "sampling_rate must be in (0, 1], got '0.5' (str)"),
        (lambda: PoissonSampledGaussianEvent(True, 1.0), "sampling_rate must be in (0, 1], got True (bool)"),
        (lambda: PoissonSampledGaussianEvent(0.5, "1"), "noise_multiplier must be a finite number >= 0, got '1' (str)"),
        (
            lambda: PoissonSampledGaussianEvent(0.5, float("inf")),
            "noise_multiplier must be a finite number >= 0, got inf",
        ),
        (lambda: GaussianEvent(float("inf")), "noise_multiplier must be a finite number >= 0, got inf"),
        (lambda: GaussianEvent(1.0, count=2.5), "count must be an integer >= 0, got 2.5"),
        (lambda: GaussianEvent(1.0, count=True), "count must be an integer >= 0, got True"),
        (
            lambda: max_steps_within_budget(
                target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.01, noise_multiplier=np.inf
            ),
            "noise_multiplier must be a finite number >= 0, got inf",
        ),
    ]
    for make, fragment in bad:
        with pytest.raises(ValueError) as info:
            make()
        assert fragment in str(info.value)


# ------------------------------------------------------------------ fit(lots.dataset()) and epochs
def _dp_model(lots):
    opt = lots.configure(
        DPSGDOptimizer(
            l2_norm_clip=1.0,
            noise_multiplier=1.3,
            learning_rate=0.1,
            gradient_accumulation_steps=lots.gradient_accumulation_steps,
        )
    )
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError(reduction="none"))
    return model, opt


def test_fit_on_the_endless_dataset_without_steps_per_epoch_is_refused_before_any_step():
    lots = PoissonLots(*_xy(40), sampling_rate=0.25)
    model, opt = _dp_model(lots)
    with pytest.raises(ValueError, match="infinite dataset"):
        model.fit(lots.dataset(), epochs=2, verbose=0)
    assert int(opt.noised_steps.numpy()) == 0


def test_fit_on_one_epoch_of_lots_ends_and_its_epsilon_is_right():
    lots = PoissonLots(*_xy(40), sampling_rate=0.25, physical_batch_size=16)
    assert lots.gradient_accumulation_steps == 2  # capacity 27 rows: two physical batches per lot
    model, opt = _dp_model(lots)
    history = model.fit(lots.dataset(lots.lots_per_epoch), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert lots.lots_per_epoch == 4 and int(opt.noised_steps.numpy()) == 2 * 4
    epsilon, _ = model_epsilon(model, target_delta=1e-3)
    assert epsilon == pytest.approx(compute_epsilon(PoissonSampledGaussianEvent(0.25, 1.3, 8), 1e-3), rel=1e-12)
