"""An example that needs an optional package says so in its docstring and, without it, exits before any work
with one line naming the install (``pip install "keras-dpsgd[hub]"``) and code 2, as the CLI does."""

import importlib.util
import sys
from pathlib import Path

import pytest

from keras_dpsgd.cli import install_line

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# (example, argv, the optional module, its extra, names the example would call first to start its work)
_CASES = [
    ("finetune_lora.py", ["--smoke"], "keras_hub", "hub", ("generated_texts",)),
    ("adaptive_clipping.py", ["--smoke", "--plot", "bounds.png"], "matplotlib", "plot", ("tools.load_digits",)),
    ("large_lots.py", ["--smoke", "--plot", "lots.png"], "matplotlib", "plot", ("tools.load_digits",)),
    ("mnist_dpsgd.py", ["--smoke"], "tensorflow_datasets", "tfds", ()),
    ("cifar10_alexnet.py", ["--smoke"], "tensorflow_datasets", "tfds", ()),
]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name[:-3]}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, argv, module, extra, work", _CASES, ids=[c[0] for c in _CASES])
def test_an_example_without_its_extra_names_the_install(name, argv, module, extra, work, capsys, monkeypatch):
    import keras_dpsgd.tools

    example = _load(name)
    assert install_line(extra) in example.__doc__, f"{name}'s docstring does not name its extra"

    def no_work(*args, **kwargs):
        raise AssertionError(f"{name} started its work before checking for {module}")

    for target in work:
        owner, _, attr = target.rpartition(".")
        monkeypatch.setattr(keras_dpsgd.tools if owner == "tools" else example, attr, no_work)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(SystemExit) as exited:
        example.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert module in err and f'pip install "keras-dpsgd[{extra}]"' in err, err


def test_every_example_that_imports_an_optional_package_is_checked():
    """keras_hub, matplotlib, dp_accounting, tensorboard, tensorflow_datasets: an example importing one is in the
    table above."""
    optional = ("keras_hub", "matplotlib", "dp_accounting", "tensorboard", "tensorflow_datasets")
    importing = {
        path.name
        for path in EXAMPLES.glob("*.py")
        if any(f"import {m}" in path.read_text(encoding="utf-8") for m in optional)
    }
    assert importing <= {case[0] for case in _CASES}, importing
