"""The README's and the docs' commands and code: the quick starts run, the CI command matches, the CLI lines
parse, and every python block of docs/ runs (or is marked, with a reason, as one that cannot run here).

Conventions of the pages (README.md, docs/**/*.md):

* ``<!-- readme-quickstart -->`` (README.md and docs/quickstart.md) and ``<!-- docs-quickstart-tf-keras -->``
  (docs/tf_keras.md) mark the runnable quick starts: the first python block after the marker runs in its own
  test, which checks its accuracy and ε.
* ``<!-- prelude ... -->`` (a page's hidden set-up, e.g. the data a fragment trains on) runs before the page's
  python blocks, which then run in order in one namespace.
* ``<!-- no-run: REASON -->`` right before a python block: it needs what the tests cannot have (a cluster,
  weights on disk, names the reader supplies) and is only compiled.
"""

import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _read(relpath: str) -> str:
    with open(os.path.join(ROOT, relpath), encoding="utf-8") as f:
        return f.read()


def _readme() -> str:
    return _read("README.md")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _doc_pages() -> list[str]:
    pages = []
    for folder, _, files in os.walk(DOCS):
        pages += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")]
    return sorted(pages)


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


def test_readme_stays_short():
    assert _readme().count("\n") <= 300


# The runnable quick starts: (page, marker, index of the diff block it shows in code).
_QUICKSTARTS = [
    ("README.md", "<!-- readme-quickstart -->", 0),
    ("docs/tf_keras.md", "<!-- docs-quickstart-tf-keras -->", 0),
]
_QUICKSTART_MARKERS = ("<!-- readme-quickstart -->", "<!-- docs-quickstart-tf-keras -->")


def _snippet(text: str, marker: str) -> str:
    return _blocks(text[text.index(marker) :], "python")[0]


@pytest.mark.parametrize("page, marker", [(p, m) for p, m, _ in _QUICKSTARTS])
def test_quickstart_snippet_runs_and_stays_within_budget(page, marker, capsys):
    code = _snippet(_read(page), marker)
    namespace = {"__name__": "readme_quickstart"}
    exec(compile(code, f"{page} quickstart", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    match = re.search(r"test accuracy ([0-9.]+) at epsilon = ([0-9.]+), delta = 1e-05", out)
    assert match, out[-2000:]
    accuracy, epsilon = float(match[1]), float(match[2])
    assert epsilon <= 3.0 + 1e-9
    # The Keras 3 quick start is the one call (make_private_with_epsilon); the tf_keras one is step by step.
    run = namespace.get("run")
    optimizer, lots = (run.optimizer, run.lots) if run is not None else (namespace["optimizer"], namespace["lots"])
    assert optimizer.noised_steps.numpy() == 10 * lots.lots_per_epoch
    assert (run is not None) == (page == "README.md")
    assert accuracy > 0.5  # chance is 0.1; typically about 0.9


@pytest.mark.parametrize("page, marker, diff_index", _QUICKSTARTS)
def test_diff_block_matches_the_runnable_snippet(page, marker, diff_index):
    text = _read(page)
    diff = _blocks(text, "diff")[diff_index]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+")]
    flat = " ".join(_snippet(text, marker).split())
    for line in added:
        if line.startswith(("model.fit(", "callbacks=", "run.fit(")):
            continue  # the runnable version adds verbose=2
        assert " ".join(line.split()) in flat, line


def test_docs_quickstart_is_the_readmes():
    """docs/quickstart.md shows the README's quick start: the same diff and the same code."""
    readme = _readme().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    page = _read("docs/quickstart.md")
    for lang in ("diff", "python"):
        assert _blocks(page, lang) == _blocks(readme, lang), lang
    assert len(_blocks(page, "python")) == 2


def _cli_lines(relpath: str, heading: str | None = None) -> list[list[str]]:
    text = _read(relpath)
    if heading is not None:
        text = text.split(heading, 1)[1]
    lines = []
    for block in _blocks(text, "bash")[: 1 if heading is not None else None]:
        for raw in block.splitlines():
            command = raw.split("#", 1)[0].strip()
            if command.startswith("keras-dpsgd"):
                lines.append(shlex.split(command))
    return lines


def test_cli_lines_parse():
    from keras_dpsgd.cli import build_parser

    parser = build_parser()
    lines = _cli_lines("docs/cli.md", "# Command line")
    assert {argv[1] for argv in lines} >= {"train", "epsilon", "noise", "batch-table", "memorization-test"}
    for page in _doc_pages():
        lines += _cli_lines(page)
    assert "audit" in {argv[1] for argv in lines}
    for argv in lines:
        assert argv[0] == "keras-dpsgd"
        args = parser.parse_args(argv[1:])
        assert callable(args.func)


@pytest.mark.parametrize("name", ["epsilon", "noise", "batch-table"])
def test_cheap_cli_lines_run(name, capsys):
    from keras_dpsgd.cli import main

    argv = next(a for a in _cli_lines("docs/cli.md", "# Command line") if a[1] == name)
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.strip()


_FENCE = re.compile(r"(?:<!--(?P<marker>[^\n]*?)-->\n)?```python\n(?P<code>.*?)```", flags=re.S)
_PRELUDE = re.compile(r"<!-- prelude[^\n]*\n(?P<code>.*?)-->", flags=re.S)


def _python_blocks(text: str) -> list[tuple[str, str]]:
    """Each python block with the HTML comment on the line right before its fence ('' if none)."""
    return [(m["marker"].strip() if m["marker"] else "", m["code"]) for m in _FENCE.finditer(text)]


def _pages_with_code() -> list[str]:
    return [p for p in _doc_pages() if "```python" in _read(p)]


def test_every_block_is_run_or_marked_with_a_reason():
    seen = set()
    for page in _pages_with_code():
        for marker, code in _python_blocks(_read(page)):
            seen.add(marker.split(":", 1)[0])
            if marker.startswith("no-run"):
                assert marker.split(":", 1)[1].strip(), f"{page}: a no-run block without a reason"
            else:
                assert marker == "" or f"<!-- {marker} -->" in _QUICKSTART_MARKERS, (page, marker)
    assert "no-run" in seen and "" in seen  # the test reads the markers it claims to read


@pytest.mark.parametrize("page", _pages_with_code())
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    """A page's blocks run in order, after its prelude, in one namespace; marked ones only compile (the quick
    starts run in their own test above)."""
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    text = _read(page)
    namespace = {"__name__": "docs_snippet"}
    for prelude in _PRELUDE.finditer(text):
        exec(compile(prelude["code"], f"{page} prelude", "exec"), namespace)  # noqa: S102
    for i, (marker, code) in enumerate(_python_blocks(text)):
        compiled = compile(code, f"{page} block {i}", "exec")
        if marker:
            continue
        exec(compiled, namespace)  # noqa: S102


def test_saving_shows_load_make_private_continue_in_a_block_that_runs():
    """Issue 40.9: docs/saving.md shows how a loaded model continues privately, in a block run above (unmarked)."""
    run = [code for marker, code in _python_blocks(_read("docs/saving.md")) if not marker]
    assert any("make_private(keras.saving.load_model(" in code and ".fit(" in code for code in run)


def test_readme_links_work_on_the_package_page():
    """The package index renders README.md away from the tree: every link is absolute (the docs site, the
    repository); tests/test_docs.py checks that each names a page or file that exists."""
    targets = re.findall(r"\]\(([^)\s]+)\)", _readme())
    assert targets
    assert [t for t in targets if not t.startswith("https://")] == []
