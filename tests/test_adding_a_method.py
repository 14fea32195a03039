"""The steps of docs/adding-a-method.md, done for every registered method; the guide names every hook."""

import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import pytest

from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.settings import MethodOptions
from protofl.strategies import METHODS

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "adding-a-method.md").read_text()
README = (ROOT / "README.md").read_text()  # the method table
RUN_CONFIG = (ROOT / "docs" / "user-guide" / "run-config.md").read_text()  # the per-method tables
TABLES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def option_defaults(options_class) -> dict:
    """The run-config keys of a method's options and their defaults."""
    return {f.name.rstrip("_").replace("_", "-"): f.default for f in dataclasses.fields(options_class)}


@pytest.mark.parametrize("name", METHODS)
def test_a_registered_method_is_one_module_with_options_strategy_and_client(name):
    module = importlib.import_module(f"protofl.strategies.{name}")
    assert module.__doc__, "a method module starts with what it is (paper, equations)"
    assert issubclass(module.STRATEGY, ServerRule) and issubclass(module.CLIENT, PrototypeClient)
    options = module.STRATEGY.options_class
    assert options is module.CLIENT.options_class and issubclass(options, MethodOptions)
    assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen


@pytest.mark.parametrize("name", METHODS)
def test_its_pyproject_table_holds_every_option_with_the_dataclass_default(name):
    options = importlib.import_module(f"protofl.strategies.{name}").STRATEGY.options_class
    assert TABLES[name] == option_defaults(options)


@pytest.mark.parametrize("name", METHODS)
def test_the_docs_document_the_method_and_every_option(name):
    assert f"`protofl/strategies/{name}.py`" in README
    options = importlib.import_module(f"protofl.strategies.{name}").STRATEGY.options_class
    undocumented = [key for key in option_defaults(options) if f"`{name}.{key}`" not in RUN_CONFIG]
    assert undocumented == []


def test_the_guide_names_every_hook_a_method_overrides():
    hooks = set()
    for name in METHODS:
        module = importlib.import_module(f"protofl.strategies.{name}")
        for cls, template in ((module.STRATEGY, ServerRule), (module.CLIENT, PrototypeClient)):
            written = [c for c in cls.__mro__ if issubclass(c, template) and not c.__module__.startswith(
                "protofl.federation")]  # the method's classes and its families'
            hooks |= {attr for c in written for attr in vars(c) if hasattr(template, attr) and not attr.startswith("_")}
        hooks |= {attr for attr in vars(module.STRATEGY.options_class) if hasattr(MethodOptions, attr)
                  and not attr.startswith("_")}
        if hasattr(module, "prepare_model"):
            hooks.add("prepare_model")
    assert {"aggregate_updates", "receive", "batch_loss", "shares", "statistics"} <= hooks
    missing = sorted(hook for hook in hooks if not re.search(rf"`{hook}\b", GUIDE))
    assert missing == []


WALK_THROUGH, OTHER_SHAPES = GUIDE.split("## Hooks for methods of other shapes")


def test_the_guide_walks_through_a_real_method_file():
    source = "".join((ROOT / "protofl" / "strategies" / name).read_text()
                     for name in ("fedproto.py", "families/class_vectors.py"))
    blocks = re.findall(r"```python\n(.*?)```", WALK_THROUGH, re.S)
    assert len(blocks) >= 3
    for block in blocks:  # each excerpt is in the file as it is today (signatures may be shortened)
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("def aggregate_updates"):
                assert line in source, line


def test_each_example_of_the_other_shapes_is_in_the_file_it_names():
    blocks = re.findall(r"```python\n(.*?)```", OTHER_SHAPES, re.S)
    assert len(blocks) >= 6
    for block in blocks:
        first, *lines = block.splitlines()
        path = ROOT / first.removeprefix("# ")
        assert first.startswith("# ") and path.is_file(), first
        source = path.read_text()
        for line in lines:
            assert not line.strip() or line in source, f"{first}: {line}"


def test_the_guides_fedproto_excerpts_are_fedprotos_own_source():
    """The options, server rule and client rule the guide shows are what fedproto.py and its family
    hold."""
    import inspect

    from protofl.strategies import fedproto
    from protofl.strategies.families import class_vectors

    for cls in (fedproto.FedProtoOptions, fedproto.FedProtoStrategy, fedproto.FedProtoClient,
                class_vectors.ClassVectorAveraging, class_vectors.PrototypeLossClient):
        source = inspect.getsource(cls).rstrip("\n")
        blocks = re.findall(r"```python\n(.*?)\n```", GUIDE, re.S)
        assert source in blocks, f"the guide's {cls.__name__} differs from {inspect.getsourcefile(cls)}"


def test_a_new_methods_round_records_are_recorded_without_remaking_the_others():
    """tests/round_records.py --missing records only the cases the fixture lacks; naming a method
    records its cases (``fedsa`` and every ``fedsa.*``), a case name that one case."""
    from round_records import to_record

    generated = {"fedavg": {}, "fedsa": {}, "fedsa.margin=x": {}, "fedsacos": {}, "fedsacos.a=b": {}}
    recorded = {"fedavg": [], "fedsa": [], "fedsa.margin=x": []}
    assert to_record(["--missing"], recorded, generated) == ["fedsacos", "fedsacos.a=b"]
    assert to_record(["fedsa"], recorded, generated) == ["fedsa", "fedsa.margin=x"]
    assert to_record(["fedsa.margin=x", "fedavg"], recorded, generated) == ["fedavg", "fedsa.margin=x"]
    assert to_record([], recorded, generated) == list(generated)
    with pytest.raises(SystemExit, match="no such case or method: fedx"):
        to_record(["fedx"], recorded, generated)
