"""Each Flower name outside its public API that protofl uses (protofl/flower_compat.py) is still
there and means what protofl takes it to mean: a Flower release that renames or reshapes one fails
here, not in a deployment."""

import ast
import contextlib
import inspect
import os
import signal
import sys
import types

from flwr.app import RecordDict
from flwr.cli import local_superlink as managed
from flwr.common import Context
from flwr.server import History, Server, ServerApp, ServerAppComponents, ServerConfig, SimpleClientManager
from flwr.supernode import start_client_internal

from native import free_port

from protofl import flower_compat


def test_the_supernode_unpacks_its_connection_into_the_names_protofl_wraps():
    """Flower's SuperNode loop opens ``_init_connection(...)`` and unpacks what it yields in the
    order of ``CONNECTION``: the wrapper replaces the calls by those names."""
    tree = ast.parse(inspect.getsource(start_client_internal))
    opened = [item for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items
              if isinstance(item.context_expr, ast.Call)
              and getattr(item.context_expr.func, "id", "") == "_init_connection"]
    assert len(opened) == 1 and callable(start_client_internal._init_connection)
    connection = opened[0].optional_vars.id
    unpacked = [node.targets[0] for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Name) and node.value.id == connection]
    assert [element.id for element in unpacked[0].elts] == list(flower_compat.CONNECTION)


def test_the_wrapped_connection_passes_each_call_through_its_wrapper(monkeypatch):
    calls = [lambda name=name: name for name in flower_compat.CONNECTION]

    @contextlib.contextmanager
    def connection(*_, **__):
        yield tuple(calls)

    monkeypatch.setattr(start_client_internal, "_init_connection", connection)
    flower_compat.wrap_supernode_connection({"send": lambda call: lambda: "wrapped " + call()})
    flower_compat.wrap_supernode_connection({"send": lambda call: lambda: "twice " + call()})  # once per process
    with start_client_internal._init_connection() as yielded:
        assert [call() for call in yielded] == ["wrapped send" if n == "send" else n for n in flower_compat.CONNECTION]


def test_a_connection_of_another_shape_is_a_clear_error(monkeypatch):
    @contextlib.contextmanager
    def connection(*_, **__):
        yield (1, 2, 3)

    monkeypatch.setattr(start_client_internal, "_init_connection", connection)
    flower_compat.wrap_supernode_connection({})
    try:
        with start_client_internal._init_connection():
            raise AssertionError("a 3-item connection passed")
    except RuntimeError as error:
        assert "flower_compat.py needs an update" in str(error)


def test_a_server_app_runs_the_server_fn_put_in_its_place_and_keeps_the_server_it_built():
    built = []

    class Finished(Server):
        def fit(self, num_rounds, timeout):
            return History(), 0.0

    def server_fn(context):
        built.append(Finished(client_manager=SimpleClientManager(), strategy=None))
        return ServerAppComponents(server=built[-1], config=ServerConfig(num_rounds=1))

    def never(context):
        raise AssertionError("the replaced server_fn ran")

    class Grid:  # what Flower's legacy loop asks of a grid when it has no nodes
        run = types.SimpleNamespace(run_id=1)

        def set_run(self, run_id):
            pass

        def get_node_ids(self):
            return []

    app = ServerApp(server_fn=never)
    assert flower_compat.server_of(app) is None
    flower_compat.replace_server_fn(app, server_fn)
    app(Grid(), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert len(built) == 1 and flower_compat.server_of(app) is built[0]


FAKE_SUPERLINK = """#!{python}
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.path.join(os.environ["FLWR_HOME"], "started"), "a") as started:
    started.write(f"{{os.getpid()}}\\n")
time.sleep(float(os.environ["FAKE_SUPERLINK_DELAY"]))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_the_local_superlink_is_waited_for_as_long_as_protofl_says_not_flowers_15_s(tmp_path, monkeypatch):
    """A ``flower-superlink`` (here a stand-in that answers ``/health`` after 1.5 s) gets the
    patience given: 1 s is too short, and Flower's reason comes back (its process ended); 30 s is
    enough, and one that answers is not started again."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "flower-superlink").write_text(FAKE_SUPERLINK.format(python=sys.executable))
    (bin_dir / "flower-superlink").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setenv("FAKE_SUPERLINK_DELAY", "1.5")
    monkeypatch.setattr(managed, "LOCAL_SUPERLINK_HTTP_API_PORT", str(free_port()))
    monkeypatch.setattr(managed, "LOCAL_SUPERLINK_STARTUP_TIMEOUT", managed.LOCAL_SUPERLINK_STARTUP_TIMEOUT)
    started = tmp_path / "started"
    try:
        reason = flower_compat.start_local_superlink(in_memory=False, patience=1.0)
        assert reason is not None and "within 1s" in reason and not managed._is_local_superlink_started()
        assert flower_compat.start_local_superlink(in_memory=False, patience=30.0) is None
        assert managed._is_local_superlink_started()
        assert flower_compat.start_local_superlink(in_memory=False, patience=30.0) is None
    finally:  # this process's children (Flower killed the first): ended and reaped
        for pid in map(int, started.read_text().split() if started.exists() else []):
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    assert len(started.read_text().split()) == 2
