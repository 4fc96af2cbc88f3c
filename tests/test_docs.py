"""The documentation site builds with ``mkdocs build --strict``: every page in the nav, no broken link or anchor."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "refusals" / "index.html").is_file()


def _read(relpath: str) -> str:
    with open(os.path.join(ROOT, relpath), encoding="utf-8") as f:
        return f.read()


def test_one_version_everywhere():
    import configparser

    import keras_dpsgd

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", _read("CHANGELOG.md"), flags=re.M)
    assert config["metadata"]["version"] == keras_dpsgd.__version__ == released[0]


def test_changelog_opens_with_unreleased_and_keeps_one_line_entries():
    """Keep a Changelog: [Unreleased] first (entries of the work since the last release, or none), then
    the latest release; both hold one-line entries under the standard headings only."""
    text = _read("CHANGELOG.md")
    sections = re.split(r"^## ", text, flags=re.M)
    assert sections[1].splitlines()[0].strip() == "[Unreleased]"
    assert re.match(r"\[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}$", sections[2].splitlines()[0].strip())
    for section in sections[1:3]:
        entries = [line for line in section.splitlines() if line.startswith("- ")]
        continuation = [line for line in section.splitlines() if line.startswith("  ")]
        assert not continuation, continuation[:3]
        for heading in re.findall(r"^### (.+)$", section, flags=re.M):
            assert heading in ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"), heading
        assert entries or "###" not in section, "a heading without entries"
    assert [line for line in sections[2].splitlines() if line.startswith("- ")], "the latest release lists no entry"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", "CONTRIBUTING.md"])
def test_links_of_the_root_pages_resolve(page):
    """Every relative link of the root pages names a file of the tree, and an anchor of a docs page exists
    (mkdocs's own slugs, the ones GitHub makes for these headings too)."""
    from markdown.extensions.toc import slugify

    for target in _LINK.findall(_read(page)):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert os.path.exists(os.path.join(ROOT, path)), f"{page}: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _read(path), flags=re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"{page}: {target}"


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_nav_holds_every_page_and_the_readme_links_every_guide():
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = _nav_pages(yaml.safe_load(f)["nav"])
    on_disk = {
        os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs"))
        for folder, _, files in os.walk(os.path.join(ROOT, "docs"))
        for name in files
        if name.endswith(".md")
    }
    assert sorted(nav) == sorted(on_disk)
    linked = {t.removeprefix("docs/").partition("#")[0] for t in _LINK.findall(_read("README.md"))}
    assert set(nav) - linked <= {"design/changes-0.2.0.md", "design/certified-norms.md"}, set(nav) - linked
