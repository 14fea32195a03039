"""Rooms of a size one can hold in mind, and an import graph that flows one way: no module of
protofl over 450 lines, no class over 250, no import cycle, and ``protofl.task`` importing nothing
of the Flower side (nor Flower itself, tests/test_settings.py)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "protofl"
MAX_MODULE_LINES, MAX_CLASS_LINES = 450, 250


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The protofl modules a module imports, at load time or inside a function (a function-local
    import hides a cycle from the interpreter, not from the design; protofl uses no relative imports)."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {t for t in targets if t in known}


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imported(tree, set(trees)) - {name} for name, tree in trees.items()}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_no_module_or_class_is_larger_than_one_can_hold_in_mind():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_the_import_graph_has_no_cycle_and_task_imports_nothing_of_the_flower_side():
    graph = import_graph()
    assert "protofl.task.data.registry" in graph["protofl.task.data"]  # the graph sees package imports
    assert "protofl.federation.admission" in graph["protofl.federation.server_core"]
    assert "protofl.strategies" in graph["protofl.cli"]  # and imports inside functions
    assert cycle(graph) == []
    task = {name: sorted(t for t in targets if not t.startswith("protofl.task"))
            for name, targets in graph.items() if name.startswith("protofl.task")}
    assert {name: targets for name, targets in task.items() if targets} == {}


def flower_importers(prefix: str) -> list[str]:
    """The protofl modules under ``prefix`` that import Flower (``flwr``, ``flwr_datasets`` aside: a
    data set's loader, not the federation), anywhere in the module."""
    found = []
    for name, tree in modules().items():
        if not name.startswith(prefix):
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "flwr" or n.startswith("flwr.") for n in names):
                found.append(name)
                break
    return found


def test_no_method_file_imports_another_and_what_they_share_lives_in_families_or_task():
    """A method file imports families (protofl.strategies.families) and protofl.task, never another
    method file: what two methods share lives once, where neither owns it."""
    from protofl.strategies import METHODS

    graph = import_graph()
    method_modules = {f"protofl.strategies.{name}" for name in METHODS}
    assert method_modules <= set(graph)
    crossing = {name: sorted(graph[name] & method_modules) for name in method_modules if graph[name] & method_modules}
    assert crossing == {}
    families = {name: sorted(graph[name] & method_modules) for name in graph
                if name.startswith("protofl.strategies.families") and graph[name] & method_modules}
    assert families == {}


def test_the_methods_and_the_task_import_no_flower():
    assert flower_importers("protofl.strategies") == []
    assert flower_importers("protofl.task") == []
    assert "protofl.federation.server" in flower_importers("protofl.federation")  # the finder finds one


# Flower's legacy API: its deprecated packages, and flwr.common's legacy messages and their types
LEGACY_PACKAGES = ("flwr.server", "flwr.client", "flwr.compat")
LEGACY_COMMON = {"Code", "EvaluateIns", "EvaluateRes", "FitIns", "FitRes", "GetParametersIns", "GetParametersRes",
                 "GetPropertiesIns", "GetPropertiesRes", "NDArrays", "Parameters", "Scalar", "Status",
                 "ndarrays_to_parameters", "parameters_to_ndarrays"}
# the modules that hold the legacy front: its Strategy and NumPyClient, and the apps' legacy halves
LEGACY_FRONT = {"protofl.federation.server", "protofl.federation.numpy_front", "protofl.server_app",
                "protofl.client_app", "protofl.flower_compat"}


def legacy_flower_imports(tree: ast.Module) -> set[str]:
    def legacy(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in LEGACY_PACKAGES)  # not flwr.serverapp

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if legacy(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and legacy(node.module):
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flwr.common"):
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name in LEGACY_COMMON}
    return found


def test_only_the_legacy_front_imports_flowers_legacy_api():
    """The server template, discovery, admission, evaluation and the wire read plain replies
    (protofl.federation.wire.Reply) and nodes (protofl.federation.partitions.Nodes): Flower's
    deprecated legacy classes appear only in the legacy front's modules, which each front's edge
    turns into those."""
    found = {name: sorted(legacy_flower_imports(tree)) for name, tree in modules().items()}
    assert "flwr.common.FitRes" in found["protofl.federation.server"]  # the finder finds them
    assert {name: names for name, names in found.items() if names and name not in LEGACY_FRONT} == {}


def test_no_method_class_derives_from_a_flower_class():
    """A method's server rule and client rule, and the templates under them, are plain classes;
    Flower's classes are the fronts over them (protofl.federation.server.legacy_strategy,
    protofl.federation.numpy_front)."""
    import importlib

    from protofl.strategies import METHODS, get_method

    def flower_bases(cls):
        return [c.__module__ + "." + c.__qualname__ for c in cls.__mro__ if c.__module__.startswith("flwr")]

    modules = {name: importlib.import_module(f"protofl.strategies.{name}") for name in METHODS}
    found = {name: flower_bases(m.STRATEGY) + flower_bases(m.CLIENT) for name, m in modules.items()}
    assert {name: bases for name, bases in found.items() if bases} == {}
    assert flower_bases(get_method("fedproto")[0])  # the front the ServerApp builds is Flower's


def test_nothing_below_the_apps_imports_them():
    """The ServerApp and ClientApp modules are the top: no other module of protofl imports them (the
    training worker once took the ClientApp's kept models from it, inside a function)."""
    graph = import_graph()
    importers = {name for name, targets in graph.items() if targets & {"protofl.client_app", "protofl.server_app"}}
    assert importers == set()


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []
