"""Every use protofl makes of Flower names outside its public API, in one place (Flower 1.42).

Each is pinned by tests/test_flower_compat.py, which fails when a Flower release renames or
reshapes it: fix it here, and nowhere else. Imports Flower only (the SuperNode image carries this
module and protofl/supernode.py, without torch).

- :func:`wrap_supernode_connection`: the SuperNode's connection factory
  (``flwr.supernode.start_client_internal._init_connection``) and the 8-item tuple it yields;
- :func:`replace_server_fn` and :func:`server_of`: a ``ServerApp``'s ``_server_fn`` (what builds
  the components of a run, set at construction) and ``_server`` (the ``Server`` it built);
- :func:`start_local_superlink`: the CLI's managed local SuperLink (``flwr.cli.local_superlink``:
  ``_is_local_superlink_started``, ``_start_local_superlink`` and the startup timeout it reads).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from flwr.server import Server, ServerApp

# the names of what the SuperNode's connection yields, in order
CONNECTION = ("node_id", "receive", "send", "get_run", "get_fab", "pull_object", "push_object",
              "confirm_message_received")


def wrap_supernode_connection(wraps: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> None:
    """Make the SuperNode's connection yield each call of ``wraps`` (by its :data:`CONNECTION` name)
    through its wrapper; once per process."""
    from flwr.supernode import start_client_internal

    connect = start_client_internal._init_connection
    if getattr(connect, "protofl_fixed", False):
        return

    @contextlib.contextmanager
    def init_connection(*args: Any, **kwargs: Any) -> Iterator[tuple]:
        with connect(*args, **kwargs) as connection:
            if len(connection) != len(CONNECTION):
                raise RuntimeError(f"Flower's SuperNode connection yields {len(connection)} items, protofl knows "
                                   f"{len(CONNECTION)} ({', '.join(CONNECTION)}): "
                                   "protofl/flower_compat.py needs an update")
            yield tuple(wraps[name](call) if name in wraps else call for name, call in zip(CONNECTION, connection))

    init_connection.protofl_fixed = True
    start_client_internal._init_connection = init_connection


def replace_server_fn(app: "ServerApp", server_fn: Callable[..., Any]) -> None:
    """What builds the components of ``app``'s next run."""
    app._server_fn = server_fn


def server_of(app: "ServerApp") -> "Server | None":
    """The ``Server`` that ``app``'s last run built (None before it ran)."""
    return app._server


def start_local_superlink(in_memory: bool, patience: float) -> str | None:
    """Start the managed local SuperLink that `flwr run` starts for a ``:local:`` connection
    (``:local-in-memory:``: ``in_memory``), as Flower starts it (its command, its log file, this
    process's environment), unless one answers on the port already; wait up to ``patience`` seconds
    for it to answer, where Flower waits 15 s and then kills it: on two cores shared with other work
    its start has taken longer. None once it answers, else Flower's reason."""
    import click
    from flwr.cli import local_superlink as managed

    if managed._is_local_superlink_started():
        return None
    managed.LOCAL_SUPERLINK_STARTUP_TIMEOUT = patience
    try:
        managed._start_local_superlink(in_memory)
    except click.ClickException as error:
        return error.format_message()
    return None
