"""The README's commands and code: the quick start runs, the CI command matches, the CLI lines parse."""

import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_two_commands_come_first_and_match_ci():
    text = _readme()
    bash = _blocks(text, "bash")
    first, second = bash[0], bash[1]
    assert text.index(first) < text.index(second) < text.index("## ")
    assert first.strip().splitlines()[-1].endswith("keras-dpsgd train")
    test_command = second.strip().splitlines()[-1]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci_lines = [line.strip() for line in f]
    assert test_command in ci_lines


# The Keras 3 quick start (first) and the tf_keras one below it: (marker, index of its diff block).
_QUICKSTARTS = [("<!-- readme-quickstart -->", 0), ("<!-- readme-quickstart-tf-keras -->", 1)]


def _snippet(text: str, marker: str) -> str:
    return _blocks(text[text.index(marker) :], "python")[0]


@pytest.mark.parametrize("marker", [m for m, _ in _QUICKSTARTS])
def test_quickstart_snippet_runs_and_stays_within_budget(marker, capsys):
    code = _snippet(_readme(), marker)
    namespace = {"__name__": "readme_quickstart"}
    exec(compile(code, "README.md quickstart", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    match = re.search(r"test accuracy ([0-9.]+) at epsilon = ([0-9.]+), delta = 1e-05", out)
    assert match, out[-2000:]
    accuracy, epsilon = float(match[1]), float(match[2])
    assert epsilon <= 3.0 + 1e-9
    # The Keras 3 quick start is the one call (make_private_with_epsilon); the tf_keras one is step by step.
    run = namespace.get("run")
    optimizer, lots = (run.optimizer, run.lots) if run is not None else (namespace["optimizer"], namespace["lots"])
    assert optimizer.noised_steps.numpy() == 10 * lots.lots_per_epoch
    assert (run is not None) == (marker == _QUICKSTARTS[0][0])
    assert accuracy > 0.5  # chance is 0.1; typically about 0.9


@pytest.mark.parametrize("marker, diff_index", _QUICKSTARTS)
def test_diff_block_matches_the_runnable_snippet(marker, diff_index):
    text = _readme()
    diff = _blocks(text, "diff")[diff_index]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    flat = " ".join(_snippet(text, marker).split())
    for line in added:
        if line.startswith(("model.fit(", "callbacks=", "run.fit(")):
            continue  # the runnable version adds verbose=2
        assert " ".join(line.split()) in flat, line


def _cli_lines() -> list[list[str]]:
    section = _readme().split("## Command line", 1)[1]
    block = _blocks(section, "bash")[0]
    lines = []
    for raw in block.splitlines():
        command = raw.split("#", 1)[0].strip()
        if command:
            lines.append(shlex.split(command))
    return lines


def test_cli_lines_parse():
    from keras_dpsgd.cli import build_parser

    parser = build_parser()
    lines = _cli_lines()
    assert {argv[1] for argv in lines} >= {"train", "epsilon", "noise", "batch-table", "memorization-test"}
    for argv in lines:
        assert argv[0] == "keras-dpsgd"
        args = parser.parse_args(argv[1:])
        assert callable(args.func)


@pytest.mark.parametrize("name", ["epsilon", "noise", "batch-table"])
def test_cheap_cli_lines_run(name, capsys):
    from keras_dpsgd.cli import main

    argv = next(a for a in _cli_lines() if a[1] == name)
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.strip()
