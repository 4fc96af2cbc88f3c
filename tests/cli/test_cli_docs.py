"""The CLI docstrings' JSON claims match the output: every key printed is named where the keys are documented."""

import json
import re

import pytest

from keras_dpsgd.cli import accounting as cli_accounting
from keras_dpsgd.cli import main
from keras_dpsgd.cli import tools as cli_tools
from tests._cli_helpers import ADAPTIVE_NOISE, DATA, EPSILON, LARGE_LOTS, NOISE

RUNS = [
    (cli_accounting, [*EPSILON, "--target-epsilon", "5"]),
    (cli_accounting, NOISE),
    (cli_accounting, ["batch-table", *DATA, "--target-epsilon", "3", "--lot-sizes", "10", "--max-batch-size", "4"]),
    (cli_tools, LARGE_LOTS),
    (cli_tools, ADAPTIVE_NOISE),
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
