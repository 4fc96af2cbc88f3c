"""The documentation site builds with ``mkdocs build --strict``: every page in the nav, no broken link or anchor."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once for the module's tests (a few seconds: the API reference reads the sources)."""
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return site_dir


def test_docs_build_strict(site):
    assert (site / "refusals" / "index.html").is_file()


# The public modules (CONTRIBUTING.md, "The package layout") with a page of the API reference; the CLI's is
# docs/cli.md. The top level's own names are on reference/index.md.
_PUBLIC_MODULES = ("keras3", "tf_keras", "accounting", "ledger", "callbacks", "per_example_rules", "tools", "audit")


def _public_names(relpath: str, lazy_table: str) -> list[str]:
    """A module's public names, read from its source without importing it: a literal ``__all__``, or the keys
    of the table its lazy ``__getattr__`` imports from (``__all__ = sorted(_LAZY)``)."""
    import ast

    tables = {}
    for node in ast.parse(_read(relpath)).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            tables[node.targets[0].id] = node.value
    if isinstance(tables.get("__all__"), ast.List):
        return ast.literal_eval(tables["__all__"])
    return list(ast.literal_eval(tables[lazy_table]))


def _module_source(name: str) -> str:
    package = os.path.join("keras_dpsgd", name, "__init__.py")
    return package if os.path.exists(os.path.join(ROOT, package)) else os.path.join("keras_dpsgd", name + ".py")


def _documented(html_path) -> set[str]:
    """The last part of every object the page documents (mkdocstrings's heading ids are full paths)."""
    with open(html_path, encoding="utf-8") as f:
        return {i.rsplit(".", 1)[-1] for i in re.findall(r'id="keras_dpsgd\.([\w.]+)"', f.read())}


@pytest.mark.parametrize("module", _PUBLIC_MODULES)
def test_the_api_reference_documents_every_public_name(site, module):
    """Each public module has its page under Reference, generated from the docstrings, with every name of its
    ``__all__`` on it (a name the module re-exports from another public module may sit on that one's page)."""
    page = site / "reference" / module / "index.html"
    assert page.is_file(), f"no API reference page for keras_dpsgd.{module}"
    everywhere = set().union(*(_documented(p) for p in (site / "reference").rglob("index.html")))
    names = _public_names(_module_source(module), "_LAZY")
    assert names
    assert not set(names) - everywhere, sorted(set(names) - everywhere)
    assert len(set(names) & _documented(page)) >= len(names) / 2, "most of the module's names are on its page"
    roles = re.findall(r":(?:class|func|meth|mod|attr|data):(?:`|<code>)", page.read_text(encoding="utf-8"))
    assert roles == [], "a Sphinx role shown as written (docs/_ext/sphinx_roles.py rewrites them)"


def test_the_api_reference_documents_every_top_level_name(site):
    names = _public_names("keras_dpsgd/__init__.py", "_NEUTRAL")
    assert "make_private_with_epsilon" in names
    everywhere = set().union(*(_documented(p) for p in (site / "reference").rglob("index.html")))
    assert not set(names) - everywhere, sorted(set(names) - everywhere)


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


def _mkdocs_config() -> dict:
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def _local_target(target: str) -> str | None:
    """The file of the tree a link names (relative, or an address on the docs site or in the repository,
    as the README's are: the package page renders it away from the tree), or None for another site."""
    config = _mkdocs_config()
    site, blob = config["site_url"], config["repo_url"] + "/blob/main/"
    if target.startswith(blob):
        return target.removeprefix(blob)
    if target.startswith(site):
        path, hash_, anchor = target.removeprefix(site).partition("#")
        path = path.rstrip("/")
        page = "index.md" if not path else path + ".md"
        if not os.path.exists(os.path.join(ROOT, "docs", page)):
            page = path + "/index.md"
        return "docs/" + page + hash_ + anchor
    return None if "://" in target else target


def test_project_urls_name_the_docs_site_and_the_repository():
    """The package page links the docs site, the source, the changelog and the issues: the addresses of
    mkdocs.yml, one base for all."""
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    urls = dict(line.split("=", 1) for line in config["metadata"]["project_urls"].strip().splitlines() if "=" in line)
    urls = {key.strip(): value.strip() for key, value in urls.items()}
    docs = _mkdocs_config()
    assert set(urls) == {"Documentation", "Source", "Changelog", "Issues"}
    assert urls["Documentation"] == docs["site_url"]
    assert urls["Source"] == docs["repo_url"]
    assert urls["Changelog"] == docs["repo_url"] + "/blob/main/CHANGELOG.md"
    assert urls["Issues"] == docs["repo_url"] + "/issues"
    assert all(url.startswith("https://") for url in urls.values())


def test_the_built_site_is_ignored_by_git():
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        assert {"site/", "/site/"} & {line.strip() for line in f}


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", "CONTRIBUTING.md"])
def test_links_of_the_root_pages_resolve(page):
    """Every link of the root pages to the tree, the docs site or the repository names a file of the tree,
    and an anchor of a docs page exists (mkdocs's own slugs, the ones GitHub makes for these headings too)."""
    from markdown.extensions.toc import slugify

    for target in _LINK.findall(_read(page)):
        local = _local_target(target)
        if local is None:
            continue
        path, _, anchor = local.partition("#")
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
    nav = _nav_pages(_mkdocs_config()["nav"])
    on_disk = {
        os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs"))
        for folder, _, files in os.walk(os.path.join(ROOT, "docs"))
        for name in files
        if name.endswith(".md")
    }
    assert sorted(nav) == sorted(on_disk)
    linked = {
        (_local_target(t) or "").removeprefix("docs/").partition("#")[0] for t in _LINK.findall(_read("README.md"))
    }
    unlinked = set(nav) - linked
    # The design notes and the API reference are linked from their index pages, which the README links.
    assert unlinked <= {
        page
        for page in nav
        if page.startswith(("design/", "reference/")) and page not in ("design/index.md", "reference/index.md")
    }, unlinked
