import re
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict, parse_config_args
from fresh_process import imported_by

from protofl.settings import ExperimentSettings, default_run_config, parse_overrides
from protofl.strategies import METHODS, get_method
from protofl.strategies.fedproto import FedProtoOptions

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUN_CONFIG = flatten_dict(PYPROJECT["tool"]["flwr"]["app"]["config"])


def test_every_default_run_config_key_is_understood():
    config = ExperimentSettings.from_run_config(RUN_CONFIG)
    assert (config.method, config.dataset, config.partition) == ("fedavg", "digits", "dirichlet")
    assert config.options == {"weighted": True, "personal-model": "global"}
    for name in METHODS:  # every method's table, as shipped, is valid
        settings = ExperimentSettings.from_run_config(RUN_CONFIG | {"method": name})
        get_method(name)[0].options_class.from_settings(settings)


def test_fednh_defaults_are_the_papers_and_unknown_options_are_errors():
    from protofl.strategies.fednh import FedNHOptions

    options = FedNHOptions.from_settings(ExperimentSettings.from_run_config(RUN_CONFIG | {"method": "fednh"}))
    assert (options.rho, options.prototype_init, options.prototype_means) == (0.9, "simplex", "normalized")
    assert (options.scale, options.learnable_scale, options.weighted) == (30.0, False, False)
    with pytest.raises(ValueError, match="unknown fednh option"):
        FedNHOptions.from_settings(ExperimentSettings(method="fednh", options={"roh": 0.5}))
    with pytest.raises(ValueError, match="prototype-init"):
        FedNHOptions.from_settings(ExperimentSettings(method="fednh", options={"prototype-init": "random"}))


def test_learning_rate_decays_per_round():
    config = ExperimentSettings(lr=0.01, lr_decay=0.99)
    assert [config.round_lr(r) for r in (1, 3)] == [0.01, pytest.approx(0.01 * 0.99**2)]
    assert ExperimentSettings(lr=0.05).round_lr(40) == 0.05


def test_issue_mandated_keys_exist():
    for key in ("method", "dataset", "partition", "alpha", "num-server-rounds", "fraction-fit", "local-epochs",
                "batch-size", "lr", "model", "seed", "data-dir", "output-dir"):
        assert key in RUN_CONFIG, key


def test_method_tables_reach_their_method_only():
    config = ExperimentSettings.from_run_config(RUN_CONFIG | {"method": "fedproto", "fedproto.lambda": 0.5})
    assert FedProtoOptions.from_settings(config).lambda_ == 0.5 and "weighted" not in config.options


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("fednh.learnable-scale", "false", "fednh.learnable-scale must be a bool"),
        ("fednh.rho", True, "fednh.rho must be a finite number"),
        ("fedproto.lamda", 0.5, "unknown fedproto option 'fedproto.lamda'"),
        ("fedproto.prototype-pass", "eval", "fedproto.prototype-pass must be one of"),
        ("fedsc.neighbours", 2.0, "fedsc.neighbours must be an integer"),
        ("fedsa.lambda-mcl", "big", "fedsa.lambda-mcl must be a finite number or one of .'auto',."),
        ("fedprox.mu", float("nan"), "fedprox.mu must be a finite number"),  # TOML has nan and inf
        ("fedopt.eta", float("inf"), "fedopt.eta must be a finite number"),
    ],
)
def test_every_method_reads_typed_options_and_names_the_bad_key(key, value, message):
    method = key.split(".")[0]
    strategy, client = get_method(method)
    config = ExperimentSettings.from_run_config(RUN_CONFIG | {"method": method, key: value})
    with pytest.raises(ValueError, match=message):
        strategy.options_class.from_settings(config)


def test_numbers_are_read_as_the_fields_type():
    config = ExperimentSettings.from_run_config(RUN_CONFIG | {"method": "fedsa", "fedsa.lambda-mcl": 1, "lr": 1})
    options = get_method("fedsa")[0].options_class.from_settings(config)
    assert options.lambda_mcl == 1.0 and isinstance(options.lambda_mcl, float) and isinstance(config.lr, float)


@pytest.mark.parametrize(
    "override,message",
    [({"global-test-pm": "false"}, "global-test-pm must be a bool"),
     ({"num-server-rounds": 2.5}, "num-server-rounds must be an integer"),
     ({"seed": True}, "seed must be an integer"),
     ({"lr": float("inf")}, "lr must be a finite number"),
     ({"lr": 0.0}, "lr must be > 0"),  # SCAFFOLD divides by it
     ({"momentum": 1.0}, "momentum must be in .0, 1."),  # SCAFFOLD's step sum divides by 1 - momentum
     ({"weight-decay": -1e-4}, "weight-decay must be >= 0")],
)
def test_top_level_keys_are_typed_too(override, message):
    with pytest.raises(ValueError, match=message):
        ExperimentSettings.from_run_config(RUN_CONFIG | override)


def test_run_config_helpers_read_as_flower_does():
    assert default_run_config(ROOT / "pyproject.toml") == RUN_CONFIG
    text = "dataset='fmnist' alpha=0.3 fedproto.lambda=1 run-name=\"a b\" global-test-pm=false"
    assert parse_overrides(text) == parse_config_args([text])


def test_every_registered_method_has_a_strategy_and_client_with_one_options_class():
    for name in METHODS:
        strategy, client = get_method(name)
        assert strategy.__module__ == client.__module__ == f"protofl.strategies.{name}"
        assert strategy.options_class is client.options_class
        assert strategy.options_class.__module__ == strategy.__module__


@pytest.mark.parametrize(
    "override,message",
    [({"lr-typo": 1}, "unknown run-config key"), ({"partition": "shards"}, "partition must be"),
     ({"fraction-fit": 0.0}, "fraction-fit"), ({"evaluate-clients": "some"}, "evaluate-clients"),
     ({"lr-decay": 0.0}, "lr-decay"), ({"max-grad-norm": -1.0}, "max-grad-norm"),
     ({"long-tail": 0.5}, "long-tail")],
)
def test_bad_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        ExperimentSettings.from_run_config(RUN_CONFIG | override)


def test_fedsc_and_fedskc_defaults_are_the_papers_and_bad_switches_are_errors():
    from protofl.strategies.fedsc import FedSCOptions
    from protofl.strategies.fedskc import FedSKCOptions

    def options(cls, method, **overrides):
        return cls.from_settings(ExperimentSettings.from_run_config(RUN_CONFIG | {"method": method} | overrides))

    sc = options(FedSCOptions, "fedsc")
    assert (sc.temperature, sc.neighbours, sc.neighbour_metric) == (0.05, 2, "angle")
    assert sc.similarity_norm == "mean-distance"
    skc = options(FedSKCOptions, "fedskc")
    assert (skc.temperature, skc.neighbours, skc.beta, skc.silu, skc.lcl_warmup_rounds) == (0.08, 1, 0.95, True, 0)
    with pytest.raises(ValueError, match="fedsc.neighbour-metric must be one of .*, got .euclid."):
        options(FedSCOptions, "fedsc", **{"fedsc.neighbour-metric": "euclid"})
    with pytest.raises(ValueError, match="fedskc.gda-mode must be one of .*, got .fancy."):
        options(FedSKCOptions, "fedskc", **{"fedskc.gda-mode": "fancy"})


def test_output_directory_is_absolute():
    config = ExperimentSettings.from_run_config(RUN_CONFIG | {"run-name": "x"})
    assert config.run_directory().is_absolute() and config.run_directory().name == "x"


@pytest.mark.slow  # fresh Python processes, 2.5 s
def test_task_settings_report_and_the_overhead_benchmark_import_no_flower():
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import overhead, protofl.task.data, protofl.task.prototypes, "
        "protofl.task.sampling, protofl.task.weights, protofl.task.models, protofl.settings, protofl.report"
    )
    assert imported_by(code, ("flwr",), cwd=ROOT) == []
    pattern = re.compile(r"^\s*(from|import)\s+flwr(\.|\s|$)", re.MULTILINE)
    offenders = [p.name for p in (ROOT / "protofl" / "task").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_split_follows_partition_seed_not_the_training_seed():
    spec = ExperimentSettings(seed=0).partition_spec(4)
    assert ExperimentSettings(seed=5).partition_spec(4) == spec
    assert ExperimentSettings(partition_seed=5).partition_spec(4) != spec


@pytest.mark.parametrize("values, message", [
    ({"test-fraction": 0.0, "global-test-pm-per-class": 100}, "whole global test set"),
    ({"pool": "train+test", "global-test-pm": True}, "no global test set"),
    ({"pool": "train+test", "global-test-pm": False, "test-fraction": 0.0}, "whole global test set"),
    ({"test-fraction": 1.0}, r"in \[0, 1\)"),
])
def test_evaluation_protocols_that_cannot_hold_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        ExperimentSettings.from_run_config(values)


def test_field_types_are_evaluated_once_per_class_not_on_every_clients_thread(monkeypatch):
    """typing.get_type_hints compiles string annotations; CPython 3.11's compiler fails when the
    clients of an in-process federation compile on several threads at once."""
    import typing

    from protofl import typed_fields

    calls = []
    real = typing.get_type_hints
    monkeypatch.setattr(typed_fields, "_type_hints", {})
    monkeypatch.setattr(typed_fields.typing, "get_type_hints", lambda cls: calls.append(cls) or real(cls))
    for _ in range(3):
        ExperimentSettings.from_run_config({"method": "fedproto", "lr": 0.1})
    assert calls.count(ExperimentSettings) == 1
