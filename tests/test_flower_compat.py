"""Each Flower name outside its public API that protofl uses (protofl/flower_compat.py) is still
there and means what protofl takes it to mean: a Flower release that renames or reshapes one fails
here, not in a deployment."""

import ast
import contextlib
import inspect
import types

from flwr.app import RecordDict
from flwr.common import Context
from flwr.server import History, Server, ServerApp, ServerAppComponents, ServerConfig, SimpleClientManager
from flwr.supernode import start_client_internal

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
