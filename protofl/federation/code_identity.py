"""Which protofl a process runs: a digest of the package's Python files as this process imported
them. In a simulation the ServerApp, loaded from the app ``flwr run`` sent, sends its digest with
every instruction, and a ClientApp that runs other code refuses it. Flower's Ray workers import
protofl from the directory the local SuperLink was started in: a SuperLink that another checkout
started serves this checkout's ServerApp with that checkout's clients."""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path
from typing import Mapping

from protofl.federation import wire

PACKAGE = Path(__file__).resolve().parents[1]


class OtherCode(RuntimeError):
    """A ClientApp whose protofl is not the ServerApp's."""


def source_digest(package: Path) -> str:
    """SHA-256 over the package's ``*.py`` files (their paths in it and their bytes), 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def running_digest() -> str:
    """:func:`source_digest` of the protofl this process imported."""
    return source_digest(PACKAGE)


def check_same_code(config: Mapping[str, object]) -> None:
    """Raises :class:`OtherCode` when ``config`` carries the ServerApp's digest and this process's
    protofl differs from it."""
    sent = wire.code_digest(config)
    if sent and sent != running_digest():
        raise OtherCode(
            f"this ClientApp runs protofl from {PACKAGE} (Python {sys.prefix}), which is not the code of the "
            "ServerApp it serves: the SuperLink that runs this simulation was started from another checkout or "
            "environment. Run from this checkout's environment (source .venv/bin/activate: its own SuperLink "
            "ports), or stop that SuperLink (docs/troubleshooting.md)")
