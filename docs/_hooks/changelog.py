"""MkDocs hook: the site's changelog page is CHANGELOG.md from the repository root.

The file stays where packagers and GitHub expect it; the page ``changelog.md`` holds a fallback text
for a checkout without it. ``mkdocs build --strict`` checks the links of the included file like any
page's.
"""

from pathlib import Path

PAGE = "changelog.md"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    changelog = Path(config.config_file_path).parent / "CHANGELOG.md"
    return changelog.read_text(encoding="utf-8") if changelog.is_file() else markdown
