"""Every CLI option that needs an optional package is checked before any work: one line naming the
extra (``pip install "keras-dpsgd[plot]"``), exit code 2 (issue 27, item 5)."""

import sys

import pytest

from keras_dpsgd.data import datasets as _datasets
from keras_dpsgd.cli import main

_CASES = [
    (["audit", "--plot", "audit.png"], "matplotlib", "keras-dpsgd[plot]"),
    (["train", "--accountant", "pld"], "dp_accounting", "keras-dpsgd[pld]"),
]


@pytest.mark.parametrize("argv, module, extra", _CASES)
def test_missing_optional_package_is_refused_before_any_work(argv, module, extra, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError

    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work before checking its optional packages")

    monkeypatch.setattr(_datasets, "load_dataset", no_work)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert module in err and f'pip install "{extra}"' in err, err


def test_the_description_names_both_kerases():
    from keras_dpsgd.cli import build_parser

    description = build_parser().description
    assert "Keras 3 and tf_keras" in description and "for tf_keras:" not in description
