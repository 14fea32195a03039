"""The docs site builds strictly (every link and anchor checked, the API reference without a warning),
and the README stays a short page whose links lead somewhere."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREEN_LINES = 40  # a page longer than this needs ## sections
README = ROOT / "README.md"
# [text](target) and ![alt](target), with an optional "title"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_link_targets(markdown: str) -> list[str]:
    """The targets of a Markdown text's inline links that name a file of this repository."""
    without_code = re.sub(r"```.*?```|`[^`\n]*`", "", markdown, flags=re.S)
    targets = [match.group(1) for match in LINK.finditer(without_code)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", t, re.I)]


def test_relative_link_targets_finds_file_links_only():
    text = (
        "[a](docs/x.md) ![img](docs/img/y.png \"title\") [web](https://flower.ai) [mail](mailto:a@b)\n"
        "[anchor](#quick-start) [deep](docs/z.md#part) `[code](not/a/link.md)`\n"
        "```\n[fenced](not/either.md)\n```\n"
    )
    assert relative_link_targets(text) == ["docs/x.md", "docs/img/y.png", "docs/z.md#part"]


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into a page under docs/"


def test_every_relative_link_in_the_readme_points_at_a_file():
    targets = relative_link_targets(README.read_text(encoding="utf-8"))
    assert len(targets) >= 10  # the README's links to the site's pages
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).is_file()]
    assert missing == []


@pytest.mark.slow  # about 4-5 s of the fast suite's budget; CI runs it in the slow suite
def test_the_docs_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is missing: ./setup.sh installs it (the test extra includes the docs extra)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's banner about its successor
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    # the pages exist, the API reference was generated, the drafts were left out
    assert (site / "index.html").is_file() and (site / "user-guide" / "run-config" / "index.html").is_file()
    reference = (site / "reference" / "settings" / "index.html").read_text(encoding="utf-8")
    assert 'id="protofl.settings.ExperimentSettings"' in reference
    assert not (site / "incoming").exists() and not (site / "_hooks").exists()
    # the home page took the method table and the quick start from the README
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "protofl/strategies/fedskc.py" in home and "Dirichlet(0.5) label skew" in home
    assert "--8&lt;--" not in home and "--8<--" not in home
    # the changelog page is CHANGELOG.md where the checkout has one, else its own fallback text
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert ("this text appears only" in changelog) == (not (ROOT / "CHANGELOG.md").is_file())


def test_the_reference_lists_every_registered_method_module():
    """The strategies page names no method by hand: the hook expands its marker into one ``:::``
    block per entry of ``METHODS``, so a method added to the registry is in the reference."""
    from types import SimpleNamespace

    from protofl.strategies import METHODS

    spec = importlib.util.spec_from_file_location("methods_hook", ROOT / "docs" / "_hooks" / "methods.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = SimpleNamespace(file=SimpleNamespace(src_uri=hook.PAGE))
    config = SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"))
    expanded = hook.on_page_markdown((ROOT / "docs" / hook.PAGE).read_text(), page, config, None)
    assert re.findall(r"^::: protofl\.strategies\.(\w+)$", expanded, re.M) == list(METHODS)
    assert "docs/_hooks/methods.py" in (ROOT / "mkdocs.yml").read_text()


def test_every_page_longer_than_a_screen_has_sections():
    """A reader finds their way by the ``##`` headings (the site's table of contents)."""
    long_without = [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").rglob("*.md"))
                    if len(page.read_text().splitlines()) > SCREEN_LINES
                    and not re.search(r"^## ", page.read_text(), re.M)]
    assert long_without == []
