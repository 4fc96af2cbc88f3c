"""The one public surface: every name in keras_dpsgd.__all__ imports (optax's habit)."""

import subprocess
import sys

import keras_dpsgd


def test_every_public_name_imports():
    missing = [name for name in keras_dpsgd.__all__ if getattr(keras_dpsgd, name, None) is None]
    assert missing == []


def test_the_one_call_entry_point_is_public():
    assert {"make_private_with_epsilon", "PrivateTraining"} <= set(keras_dpsgd.__all__)
    assert callable(keras_dpsgd.make_private_with_epsilon)


def test_unknown_name_is_an_attribute_error():
    try:
        keras_dpsgd.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("expected AttributeError")


# Imports without TensorFlow: tests/test_keras_switch.py::test_keras_neutral_modules_import_without_tensorflow.


def test_cli_help_lists_every_subcommand():
    from keras_dpsgd.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == {
        "epsilon",
        "noise",
        "batch-table",
        "train",
        "memorization-test",
        "large-lots",
        "adaptive-clipping-noise",
        "audit",
    }
    for command, sub in commands.items():
        assert command in text
        assert sub.description and "--json" in sub.format_help(), command


def test_serializable_classes_are_registered_whichever_module_brings_tf_keras_in():
    """`import keras_dpsgd.keras3` imports tf_keras half way through our own imports: the registration
    must wait for them instead of importing the optimizer modules in a circle (it failed, with a warning)."""
    code = (
        "import keras_dpsgd.keras3, tf_keras; get = tf_keras.saving.get_registered_object; "
        "print(get('keras_dpsgd>DPSGDOptimizer') is not None, get('keras_dpsgd>DPPCA') is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["True", "True"]
    assert "could not register" not in out.stderr
