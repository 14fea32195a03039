"""``protofl-supernode``: Flower's ``flower-supernode`` (same arguments) with one fix, for the
SuperNodes of a federation whose runs may be resumed.

Flower 1.42's SuperNode takes a message from the SuperLink, makes a task for it, then pulls the
message's content. If the run stops in between (its ServerApp died), the SuperLink answers
``RunNotRunningException``, a ``BaseException`` that passes the handler which, for every other
failed pull, deletes the message and ends its task. The half-received message and its task stay:
a ClientApp later runs it, and its reply is sent where the SuperNode waits for the reply to the
next message it takes. From then on the node sends every reply one message late, and the server
never sees them: a run resumed after its ServerApp died goes on without that node.

The fix: the two calls that pull a message's content raise an ordinary error for a run that
stopped, so the SuperNode's own handler for failed pulls removes the message and ends its task.
Imports Flower and :mod:`protofl.flower_compat` only (the SuperNode image has no torch).
"""

from __future__ import annotations

from typing import Any, Callable

from flwr.supercore.run import RunNotRunningException

from protofl.flower_compat import wrap_supernode_connection


class RunStoppedWhileReceiving(RuntimeError):
    """The run of a message stopped while the SuperNode pulled the message's content."""


def stopped_run_as_error(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, raising ``RunStoppedWhileReceiving`` where it raised ``RunNotRunningException``."""

    def pull(*args: Any) -> Any:
        try:
            return call(*args)
        except RunNotRunningException as stopped:
            raise RunStoppedWhileReceiving("the message's run stopped while it was received") from stopped

    return pull


def patch_supernode() -> None:
    """Wrap the SuperNode's connection so that its object pulls and receipts raise ordinary errors."""
    wrap_supernode_connection({"pull_object": stopped_run_as_error, "confirm_message_received": stopped_run_as_error})


def main() -> None:
    from flwr.supernode.cli import flower_supernode

    patch_supernode()
    flower_supernode()


if __name__ == "__main__":
    main()
