"""The CLI docstrings' JSON claims match the output: every key printed is named where the keys are documented."""

import json
import re

import pytest

from keras_dpsgd.cli import accounting as cli_accounting
from keras_dpsgd.cli import main
from keras_dpsgd.cli import tools as cli_tools

_DATA = ["--num-examples", "1000", "--epochs", "1"]
RUNS = [
    (cli_accounting, ["epsilon", *_DATA, "--lot-size", "10", "--noise-multiplier", "1.1", "--target-epsilon", "5"]),
    (cli_accounting, ["noise", *_DATA, "--lot-size", "10", "--target-epsilon", "2"]),
    (cli_accounting, ["batch-table", *_DATA, "--target-epsilon", "3", "--lot-sizes", "10", "--max-batch-size", "4"]),
    (cli_tools, ["large-lots", *_DATA, "--target-epsilon", "3", "--lot-sizes", "10"]),
    (
        cli_tools,
        [
            "adaptive-clipping-noise",
            "--num-layers",
            "2",
            "--norm-noise-multiplier",
            "5",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.01",
            "--steps",
            "10",
            "--target-epsilon",
            "3",
        ],
    ),
]


def _keys(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


@pytest.mark.parametrize("module,argv", RUNS, ids=[r[1][0] for r in RUNS])
def test_every_json_key_is_documented(module, argv, capsys):
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    documented = module.__doc__.split("``--json`` keys.")[1]
    words = set(re.findall(r"[a-z_]+", documented))
    missing = sorted(set(_keys(out)) - words)
    assert not missing, f"{argv[0]} prints keys its docstring does not name: {missing}"
