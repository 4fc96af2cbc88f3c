"""Hygiene as habit: ruff's error rules (pyproject.toml [tool.ruff]) hold on the whole tree."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_no_errors():
    pytest.importorskip("ruff")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--output-format",
            "concise",
            "keras_dpsgd",
            "tests",
            "examples",
            "benchmarks",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    pytest.importorskip("ruff")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "keras_dpsgd", "tests", "examples", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, "run `ruff format .`:\n" + out.stdout + out.stderr
