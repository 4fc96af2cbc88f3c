"""The CLI speaks one language: --target-epsilon, --lot-size, --model mlp|cnn; old spellings deprecated.

And TensorFlow's start-up log lines stay off the terminal (here the quiet import; end to end, a `train`
process: tests/keras3/test_keras3_cli.py).
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from keras_dpsgd.cli import build_parser, main
from keras_dpsgd.cli._quiet import is_tensorflow_log_line
from tests._cli_helpers import ADAPTIVE_NOISE, DATA, EPSILON, LARGE_LOTS, NOISE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (current argv, the same with the deprecated spelling, the option name, the deprecated spelling)
SPELLINGS = [
    (EPSILON, "--lot-size", "--batch-size"),
    (NOISE, "--lot-size", "--batch-size"),
    (["memorization-test", "--lot-size", "10"], "--lot-size", "--batch-size"),
    (LARGE_LOTS, "--target-epsilon", "--epsilon"),
    (ADAPTIVE_NOISE, "--target-epsilon", "--epsilon"),
]


@pytest.mark.parametrize("argv,new,old", SPELLINGS, ids=[f"{a[0]} {o}" for a, _, o in SPELLINGS])
def test_deprecated_spelling_parses_the_same_and_warns_once(argv, new, old, capsys):
    current = vars(build_parser().parse_args(argv))
    assert capsys.readouterr().err == ""
    legacy = vars(build_parser().parse_args([old if a == new else a for a in argv]))
    err = capsys.readouterr().err
    assert legacy == current
    assert err.count("\n") == 1 and f"{old} is deprecated, use {new}" in err


@pytest.mark.parametrize("command", ["epsilon", "noise", "memorization-test", "large-lots", "adaptive-clipping-noise"])
def test_help_shows_only_the_current_spellings(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "--batch-size" not in text and "--epsilon " not in text and not re.search(r"\bconv\b", text)
    assert "--lot-size" in text or "--target-epsilon" in text


def test_model_conv_means_cnn_with_a_warning(capsys):
    args = build_parser().parse_args(["memorization-test", "--model", "conv"])
    assert args.model == "cnn"
    assert "--model conv is deprecated, use --model cnn" in capsys.readouterr().err
    assert build_parser().parse_args(["memorization-test", "--model", "cnn"]).model == "cnn"
    assert build_parser().parse_args(["train", "--model", "cnn"]).model == "cnn"


def test_missing_required_option_names_the_current_spelling(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["epsilon", *DATA, "--noise-multiplier", "1"])
    err = capsys.readouterr().err
    assert "--lot-size" in err and "--batch-size" not in err


def _json(argv, capsys):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_keys_match_the_documentation(capsys):
    eps = _json([*EPSILON, "--target-epsilon", "5"], capsys)
    assert set(eps) == {
        "epsilon",
        "order",
        "noise_multiplier",
        "num_examples",
        "lot_size",
        "batch_size",
        "epochs",
        "steps",
        "sampling_rate",
        "delta",
        "accountant",
        "target_epsilon",
        "max_steps",
        "max_epochs",
    }
    assert eps["lot_size"] == eps["batch_size"] == 10
    noise = _json(NOISE, capsys)
    assert set(noise) == set(eps) - {"max_steps", "max_epochs"}
    table = _json(["batch-table", *DATA, "--target-epsilon", "3", "--lot-sizes", "10,20"], capsys)
    assert set(table) == {"rows", "num_examples", "epochs", "target_epsilon", "delta", "accountant", "plot"}
    assert table["plot"] is None
    assert set(table["rows"][0]) == {"lot_size", "sampling_rate", "steps", "noise_multiplier", "noise_per_example"}
    lots = _json(LARGE_LOTS, capsys)
    assert set(lots) == set(table) | {"epsilon"} and lots["plot"] is None
    assert set(lots["rows"][0]) == set(table["rows"][0]) | {"learning_rate"}
    adaptive = _json(ADAPTIVE_NOISE, capsys)
    assert set(adaptive) == {
        "noise_multiplier",
        "effective_noise_multiplier",
        "norm_noise_multiplier",
        "num_layers",
        "target_epsilon",
        "epsilon",
        "delta",
        "sampling_rate",
        "steps",
    }
    assert adaptive["target_epsilon"] == adaptive["epsilon"] == 3.0


# Lines TensorFlow 2.21 printed at start-up of `keras-dpsgd train` on a CPU-only machine.
TF_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796119175.294750    1048 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results",
    "I0000 00:00:1796119175.295579    1048 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.",
    "I0000 00:00:1796119176.179860    1048 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the "
    "appropriate compiler flags.",
    "E0000 00:00:1796119227.665781    1048 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error",
    "I0000 00:00:1796119232.832725    1048 generator_dataset_op.cc:213] Memory patch applied",
]


@pytest.mark.parametrize("line", TF_LINES)
def test_tensorflow_log_lines_are_recognized(line):
    assert is_tensorflow_log_line(line)


@pytest.mark.parametrize(
    "line",
    [
        "keras-dpsgd train: error: --save 'x' is an existing file: give a directory",
        "Traceback (most recent call last):",
        "Epoch 1/10",
        "UserWarning: something real",
    ],
)
def test_other_lines_are_kept(line):
    assert not is_tensorflow_log_line(line)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(extra)
    return env


_FAKE_TF = textwrap.dedent("""
    import os
    os.write(2, ("\\n".join(%r) + "\\nkept: a real message\\n").encode())
    os.environ["SEEN_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset")
    class config:
        @staticmethod
        def list_physical_devices():
            os.write(2, b"E0000 00:00:1796119227.665781    1048 cuda_platform.cc:52] failed call to cuInit\\n")
            return []
""") % (TF_LINES[:5],)


@pytest.mark.parametrize("level,shown", [(None, False), ("1", False), ("0", True)])
def test_quiet_import_drops_only_tensorflow_lines_and_keeps_the_users_level(tmp_path, level, shown):
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(_FAKE_TF)
    code = (
        "import os; from keras_dpsgd.cli._quiet import import_tensorflow_quietly; import_tensorflow_quietly(); "
        "print(os.environ['SEEN_LEVEL'])"
    )
    env = _env(
        PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), **({} if level is None else {"TF_CPP_MIN_LOG_LEVEL": level})
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (level or "2")  # set before TensorFlow is imported; a user's value kept
    assert "kept: a real message" in out.stderr
    assert ("oneDNN" in out.stderr) == shown
    if not shown:
        assert "cuInit" not in out.stderr and "absl::InitializeLog" not in out.stderr


# End to end (a TensorFlow subcommand in a fresh process prints none of TensorFlow's start-up lines): the
# `train` runs of tests/keras3/test_keras3_cli.py, on both Kerases, which run without TF_CPP_MIN_LOG_LEVEL.
