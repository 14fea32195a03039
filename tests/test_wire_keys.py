"""Every key on the wire is spelled in one place, and the class statistics every method uploads are
checked by its server. Each method runs two rounds in one process (no Ray) on digits: the slow suite."""

import ast
import functools
import io
from pathlib import Path

import numpy as np
import pytest
from flwr.common import FitRes
from fakes import uploads_class_statistics
from inprocess import run_in_process

from protofl.federation.server import RunStopped
from protofl.federation.wire import CLASS_COUNTS, encode_array
from protofl.strategies import METHODS

pytestmark = pytest.mark.slow  # every method's two rounds: about 13 s

ROOT = Path(__file__).resolve().parents[1] / "protofl"
FIELDS = ("metrics", "config", "properties")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every method's run on the legacy front, whose fit replies the tests tamper with (Flower's
    ``FitRes``); the keys are the same on the Message API's (tests/test_round_records.py)."""
    out = tmp_path_factory.mktemp("runs")
    return {
        name: run_in_process({"method": name, "num-server-rounds": 2, "local-epochs": 1, "output-dir": str(out),
                              "run-name": name, "global-test-pm-per-class": 10, "batch-size": 32,
                              "flower-api": "legacy"})
        for name in METHODS
    }


def spelled_in(key: str) -> set[str]:
    """The protofl modules holding ``key`` as a string literal."""
    return {module for module, literals in string_literals().items() if key in literals}


@functools.cache
def string_literals() -> dict[str, set]:
    """Each protofl module's string literals."""
    return {str(path.relative_to(ROOT)): {node.value for node in ast.walk(ast.parse(path.read_text()))
                                          if isinstance(node, ast.Constant) and isinstance(node.value, str)}
            for path in ROOT.rglob("*.py")}


def test_no_method_module_spells_a_wire_key_that_another_module_spells(runs):
    keys = set()
    for _, messages in runs.values():
        for _, ins, reply in messages:
            for message in (ins, reply):
                keys |= {k for field in FIELDS for k in getattr(message, field, {}) or {}}
    assert {"server-round", "class-means", "class-counts", "global-prototypes", "anchors"} <= keys
    shared = {key: places for key in keys if len(places := spelled_in(key)) > 1}
    in_methods = {key: places for key, places in shared.items() if any(p.startswith("strategies/") for p in places)}
    assert in_methods == {}


@pytest.mark.parametrize("name", [m for m in METHODS if uploads_class_statistics(m)])
def test_every_method_that_uploads_class_statistics_has_them_checked(runs, name, caplog):
    strategy, messages = runs[name]
    reply = [reply for kind, _, reply in messages if kind == "fit"][-1]
    proxy = next(p for p in strategy.discovery.nodes.values() if p.context.node_config["partition-id"]
                 == reply.metrics["partition-id"])
    counts = np.load(io.BytesIO(reply.metrics[CLASS_COUNTS]))
    counts[int(np.argmax(counts))] += 1  # one more sample than the client reports it trained on
    tampered = FitRes(reply.status, reply.parameters, reply.num_examples,
                      reply.metrics | {CLASS_COUNTS: encode_array(counts)})
    strategy.sampled = [reply.metrics["partition-id"]]
    strategy.admission.asked = {proxy.cid: reply.metrics["partition-id"]}
    with pytest.raises(RunStopped, match="0 of 1 client updates usable"):
        strategy.aggregate_fit(3, [(proxy, tampered)], [])
    assert "class counts do not add up" in caplog.text
