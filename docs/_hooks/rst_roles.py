"""Griffe extension for the API reference: protofl's docstrings cross-reference in Sphinx's roles
(:class:`ExperimentSettings`, :mod:`.wire`, :func:`~protofl.task.train.train`), which Markdown would
print as they are. Each role becomes an optional cross-reference: a link where the target is on a
page of the reference, the name in code where it is not (a private helper, a Flower class), never a
warning.
"""

from __future__ import annotations

import re
from html import escape

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(?P<target>[^`]+)`")


def identifier(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring, as far as it can be resolved."""
    target = target.lstrip("~")
    if target.startswith("."):  # relative to the module (or package) the object is in
        module = obj if obj.is_module else obj.module
        base = module.path if module.is_init_module else module.parent.path
        dots = len(target) - len(target.lstrip("."))
        for _ in range(dots - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{target.lstrip('.')}"
    head, _, rest = target.partition(".")
    try:
        resolved = obj.resolve(head)
    except (griffe.NameResolutionError, AttributeError, KeyError):
        return target
    return f"{resolved}.{rest}" if rest else resolved


def link_roles(obj: griffe.Object) -> None:
    if obj.docstring is None:
        return

    def replace(match: re.Match) -> str:
        written = match["target"]
        shown = written.lstrip("~").rpartition(".")[2] if written.startswith("~") else written
        return (f'<autoref identifier="{escape(identifier(obj, written))}" optional>'
                f"<code>{escape(shown)}</code></autoref>")

    obj.docstring.value = ROLE.sub(replace, obj.docstring.value)


def walk(obj: griffe.Object) -> None:
    link_roles(obj)
    for member in obj.members.values():
        if not member.is_alias:
            walk(member)


class RstRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        walk(pkg)
