"""MkDocs hook: the API reference's strategies page lists one module per registered method.

``protofl/strategies/__init__.py``'s ``METHODS`` (read from the source, not imported: no torch in the
docs build) expands the page's ``<!-- every registered method -->`` line into a ``:::`` block per
method, so a method added to the registry is in the reference without another step.
"""

import ast
from pathlib import Path

PAGE = "reference/strategies.md"
MARKER = "<!-- every registered method -->"


def registered_methods(root: Path) -> list[str]:
    tree = ast.parse((root / "protofl" / "strategies" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "METHODS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError("protofl/strategies/__init__.py defines no METHODS")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    root = Path(config.config_file_path).parent
    blocks = "\n\n".join(f"::: protofl.strategies.{name}" for name in registered_methods(root))
    return markdown.replace(MARKER, blocks)
