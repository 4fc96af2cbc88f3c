"""The ``keras-dpsgd`` command line.

Each subcommand lives in its own module of this package and exposes
``register(subparsers)``, which adds a parser whose ``func(args)`` runs it and
returns a dict (printed as one JSON object under ``--json``) or None.
Bad input raises ``ValueError`` (a missing optional extra ``ImportError``): printed as one
line, exit code 2. A command that did its work but failed at the end (e.g. ``train --save``
on a full disk) raises :class:`CommandFailed`: its result is still printed (``--json``),
then its one-line error, exit code 1.

One vocabulary across subcommands: the budget is ``--target-epsilon``, the
expected Poisson lot size ``--lot-size``, the models ``mlp`` and ``cnn``. Older
spellings (``--epsilon``, ``--batch-size``, ``--model conv``) still parse, are
not shown in ``--help``, and print one deprecation line on stderr.

A subcommand that sets ``uses_tensorflow=True`` gets TensorFlow imported before
it runs, without TensorFlow's start-up log lines (:mod:`keras_dpsgd.cli._quiet`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys

from keras_dpsgd._which_keras import ENV_VAR, TF_KERAS, TF_KERAS_EXTRA, active_front_end
from keras_dpsgd.cli._quiet import import_tensorflow_quietly

__all__ = [
    "CommandFailed",
    "add_json_flag",
    "add_option",
    "build_parser",
    "exit_unless_installed",
    "fit_verbosity",
    "import_tensorflow_quietly",
    "install_line",
    "main",
    "model_choice",
    "positive_float",
    "positive_int",
    "require_extras",
    "warn_deprecated",
]

# Modules of this package that define subcommands, in help order.
_SUBCOMMAND_MODULES = [
    "accounting",
    "train",
    "tools",
    "audit",
]


class CommandFailed(Exception):
    """A command's work is done but its last step failed; `result` is still reported (exit 1)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dpsgd",
        description="Differentially private training for Keras 3 and tf_keras: accounting, planning, training, audits.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(f"keras_dpsgd.cli.{name}").register(subparsers)
    return parser


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


class _StoreWithDeprecatedSpellings(argparse.Action):
    """Stores the value; used under a deprecated spelling, says so on stderr (once per use)."""

    def __init__(self, option_strings, dest, deprecated=(), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.deprecated = tuple(deprecated)
        self.current = option_strings[0]

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.deprecated:
            warn_deprecated(parser.prog, option_string, self.current)
        setattr(namespace, self.dest, values)


def warn_deprecated(prog: str, old: str, new: str) -> None:
    """One line on stderr: `old` is deprecated, use `new`."""
    print(f"{prog}: warning: {old} is deprecated, use {new}", file=sys.stderr)


def add_option(parser: argparse.ArgumentParser, name: str, *deprecated: str, **kwargs) -> argparse.Action:
    """Adds option `name`; each spelling in `deprecated` parses too, hidden from help, with a warning."""
    action = parser.add_argument(
        name, *deprecated, action=_StoreWithDeprecatedSpellings, deprecated=deprecated, **kwargs
    )
    action.option_strings = [name]  # the parser still knows the old spellings; help and errors show the new
    return action


def model_choice(prog: str):
    """argparse type for ``--model``: ``mlp`` or ``cnn``; the old ``conv`` means ``cnn``, with a warning."""

    def parse(text: str) -> str:
        if text == "conv":
            warn_deprecated(prog, "--model conv", "--model cnn")
            return "cnn"
        return text

    return parse


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def fit_verbosity(json_output: bool) -> int:
    """Keras's `fit(verbose=...)` for a command that trains: the progress bar (1) only on a terminal.

    Keras 3's progress bar writes ANSI colour codes and backspaces whatever stdout is, so output
    redirected to a file (or read by a program, or under ``--json``) gets one plain line per epoch (2).
    """
    isatty = getattr(sys.stdout, "isatty", None)
    return 1 if not json_output and callable(isatty) and isatty() else 2


# Options that need an optional package: (option's dest, value that needs it or None for any
# value, module, extra of setup.cfg, the option as the user spells it).
_OPTIONAL_PACKAGES = (
    ("plot", None, "matplotlib", "plot", "--plot"),
    ("accountant", "pld", "dp_accounting", "pld", "--accountant pld"),
)


def _importable(module: str) -> bool:
    if module in sys.modules:  # None there: a blocked import
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def install_line(extra: str) -> str:
    """The command that installs an extra of setup.cfg, quoted for every shell: ``pip install "keras-dpsgd[hub]"``."""
    return f'pip install "keras-dpsgd[{extra}]"'


def exit_unless_installed(module: str, extra: str, *, needed_by: str) -> None:
    """Before any work (a script's, as the examples'): exits with code 2 and one line naming the install.

    Args:
      module: the optional package to import (``"keras_hub"``).
      extra: the extra of setup.cfg that installs it (``"hub"``).
      needed_by: what needs it, as the user spells it (``"examples/finetune_lora.py"``, ``"--plot"``).

    Raises:
      SystemExit: code 2 (as the CLI's bad input) after ``needed_by needs module: pip install ...`` on stderr.
    """
    if not _importable(module):
        print(f"{needed_by} needs {module}: {install_line(extra)}", file=sys.stderr)
        raise SystemExit(2)


def require_extras(args: argparse.Namespace) -> None:
    """Before any work: every optional package that the parsed options need is importable.

    Raises:
      ImportError: one line naming the option, the package and the extra to install.
    """
    for dest, value, module, extra, option in _OPTIONAL_PACKAGES:
        given = getattr(args, dest, None)
        if not given or (value is not None and given != value):
            continue
        if not _importable(module):
            raise ImportError(f"{option} needs {module}: {install_line(extra)}")
    if getattr(args, "uses_tensorflow", False) and active_front_end() == TF_KERAS and not _importable("tf_keras"):
        raise ImportError(
            f"{ENV_VAR}={os.environ.get(ENV_VAR)} trains with tf_keras, which is not installed: {TF_KERAS_EXTRA} "
            f"(or unset {ENV_VAR} to train with Keras 3)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code, failure = 0, None
    try:
        require_extras(args)
        if getattr(args, "uses_tensorflow", False):
            import_tensorflow_quietly()
        result = args.func(args)
    except (ValueError, ImportError) as err:  # ImportError: a missing optional extra, named in the message
        print(f"keras-dpsgd {args.command}: error: {err}", file=sys.stderr)
        return 2
    except CommandFailed as failed:
        result, code, failure = failed.result, 1, str(failed)
    if getattr(args, "json", False) and result is not None:
        print(json.dumps(_strict_json(result), sort_keys=True, allow_nan=False))
    if code:
        print(f"keras-dpsgd {args.command}: error: {failure}", file=sys.stderr)
    return code


def _strict_json(value):
    """Replaces non-finite floats (ε = ∞ when σ = 0) by the strings "inf"/"-inf"/"nan".

    Strict JSON has no Infinity; a string keeps the value honest (null could be
    misread as "no privacy cost") and parseable by every JSON reader.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
