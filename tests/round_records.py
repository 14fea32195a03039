"""Every method with each of its own switches, a family's switches on the family's template method
(tests/inprocess.py's TEMPLATE_METHODS), and the template's server-side switches, three rounds in
one process (tests/inprocess.py): the round records a refactoring must leave unchanged, traffic
included. ``tests/fixtures/round_records.json`` holds them as the code gave them when it was last
regenerated; ``tests/test_round_records.py`` compares today's runs with it.

The runs compute in float64 (torch's default dtype, the data and the models; the wire's arrays
stay float32, rounded as protofl rounds them): float32 training amplifies the last bits in which
one CPU's kernels differ from another's into other accuracies within three rounds, float64's
differ 10^9 times less, so the records hold on any CPU.

Regenerate (only when a change is meant to change the numbers, and say so in its note):
    python tests/round_records.py                 # every case
    python tests/round_records.py fedproto fedavg.average-parameters=true   # these methods' cases, or cases
    python tests/round_records.py --missing       # the cases the fixture lacks (a new method's, a new option's)
Recording some cases keeps the others' records as they are; cases no longer generated are dropped.
"""

import contextlib
import dataclasses
import json
import sys
import tempfile
import typing
from pathlib import Path
from unittest import mock

from inprocess import SHORT_RUN_OPTIONS, TEMPLATE_METHODS

from protofl.report import rounds_without_timing

TESTS = Path(__file__).resolve().parent
FIXTURE = TESTS / "fixtures" / "round_records.json"
# no autocast (bfloat16 where a CPU has it natively) and NCHW: the computation is the same everywhere;
# batches of 32 (the other template runs' size): 9-16 float64 steps a client and epoch, not 27-51
RUN = {"dataset": "digits", "num-server-rounds": 3, "local-epochs": 1, "global-test-pm-per-class": 10,
       "batch-size": 32, "amp": "off", "channels-last": False, **SHORT_RUN_OPTIONS}
NODES = 3
# the template's switches on the server side (discovery, admission, aggregation, evaluation)
TEMPLATE_SWITCHES = {
    "evaluation-message=evaluate": {"method": "fedproto", "evaluation-message": "evaluate"},
    "fraction-fit=0.5,evaluate-clients=all": {"method": "fedavg", "fraction-fit": 0.5, "evaluate-clients": "all"},
    "global-test-pm": {"method": "fedproto", "global-test-pm": True},
    "screen-factor=0": {"method": "fedproto", "screen-factor": 0.0},
    **{f"aggregation={rule}": {"method": "fedavg", "aggregation": rule}
       for rule in ("median", "trimmed-mean", "norm-clip")},
    **{f"prototype-aggregation={rule}": {"method": "fedproto", "prototype-aggregation": rule}
       for rule in ("median", "trimmed-mean", "norm-clip")},
}

# a switch whose form needs other run settings: FedDistill's raw-logit targets (a loss unbounded below)
# diverge within three rounds at the default lr 0.05; FedSA's scripts run it at 0.01
CASE_SETTINGS = {"feddistill.target=logits": {"lr": 0.01}}


def switch_values(options_class, only_from: str | None = None) -> list[tuple[str, object]]:
    """(run-config key, value) for every value but the default of each bool or ``Literal`` option;
    ``only_from``: of the options that module declares (a method's own, not its family's: a family's
    switch, such as averaging's ``weighted``, is the family's math, which its template method records)."""
    hints = typing.get_type_hints(options_class)
    switches = []
    for f in dataclasses.fields(options_class):
        declared_by = next(c for c in options_class.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
        if only_from is not None and declared_by.__module__ != only_from:
            continue
        annotation = hints[f.name]
        values = (True, False) if annotation is bool else typing.get_args(annotation)
        if annotation is bool or typing.get_origin(annotation) is typing.Literal:
            key = f.name.rstrip("_").replace("_", "-")
            switches += [(key, value) for value in values if value != f.default]
    return switches


def cases() -> dict[str, dict]:
    """Case name -> its run config, besides ``RUN``: each method's plain case and its own switches,
    the switches of its family too for a template method."""
    from protofl.strategies import METHODS, get_method

    found = {}
    for method in METHODS:
        found[method] = {"method": method}
        strategy_class = get_method(method)[0]
        own = None if method in TEMPLATE_METHODS else strategy_class.__module__
        for key, value in switch_values(strategy_class.options_class, only_from=own):
            found[f"{method}.{key}={value}"] = {"method": method, f"{method}.{key}": value}
            found[f"{method}.{key}={value}"] |= CASE_SETTINGS.get(f"{method}.{key}={value}", {})
    return found | TEMPLATE_SWITCHES


@contextlib.contextmanager
def float64_federation():
    """Torch's default dtype float64 (the models' parameters), and the data sets' images in float64
    where the ClientApp and the ServerApp load them."""
    import torch

    import protofl.client_app
    import protofl.federation.scoring
    import protofl.server_app

    def in_float64(tensors):
        return tuple(t.double() if t.is_floating_point() else t for t in tensors)

    node_data, server_test, scoring_test = (protofl.client_app.node_data, protofl.server_app.load_global_test,
                                            protofl.federation.scoring.load_global_test)

    def node_data_in_float64(*args, **kwargs):
        data = node_data(*args, **kwargs)
        return dataclasses.replace(data, **{f.name: getattr(data, f.name).double() for f in dataclasses.fields(data)
                                            if isinstance(getattr(data, f.name), torch.Tensor)
                                            and getattr(data, f.name).is_floating_point()})

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with (mock.patch.object(protofl.client_app, "node_data", node_data_in_float64),
              mock.patch.object(protofl.server_app, "load_global_test", lambda *a, **k: in_float64(server_test(*a, **k))),
              mock.patch.object(protofl.federation.scoring, "load_global_test",
                                lambda *a, **k: in_float64(scoring_test(*a, **k)))):
            yield
    finally:
        torch.set_default_dtype(before)


def round_records(case: dict, output_dir: Path) -> list[dict]:
    """The case's results.json rounds, without what varies between two runs of the same code."""
    from inprocess import run_in_process

    with float64_federation():
        run_in_process(RUN | case | {"output-dir": str(output_dir), "run-name": "run"}, num_nodes=NODES)
    results = json.loads((output_dir / "run" / "results.json").read_text())
    assert "stopped" not in results, results["stopped"]
    return rounds_without_timing(results)


def to_record(names: list[str], recorded: dict, generated: dict) -> list[str]:
    """The generated cases to (re)record: all without ``names``; with ``--missing``, those
    ``recorded`` lacks; else each case named, or of a method named (``fedsa`` covers ``fedsa.*``)."""
    if not names:
        return list(generated)
    if names == ["--missing"]:
        return [name for name in generated if name not in recorded]
    unknown = [n for n in names if not any(c == n or c.startswith(f"{n}.") for c in generated)]
    if unknown:
        raise SystemExit(f"no such case or method: {', '.join(unknown)}")
    return [c for c in generated if any(c == n or c.startswith(f"{n}.") for n in names)]


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    generated = cases()
    kept = json.loads(FIXTURE.read_text())["cases"] if FIXTURE.is_file() else {}
    records = {name: record for name, record in kept.items() if name in generated}
    for name in to_record(sys.argv[1:], kept, generated):
        with tempfile.TemporaryDirectory() as directory:
            records[name] = round_records(generated[name], Path(directory))
        print(name, flush=True)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({"cases": records}, indent=1, sort_keys=True) + "\n")
    print(f"{len(records)} cases -> {FIXTURE}")
