import re
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict

from protofl.config import ExperimentConfig
from protofl.strategies import METHODS, get_method

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
RUN_CONFIG = flatten_dict(PYPROJECT["tool"]["flwr"]["app"]["config"])


def test_every_default_run_config_key_is_understood():
    config = ExperimentConfig.from_run_config(RUN_CONFIG)
    assert (config.method, config.dataset, config.partition) == ("fedavg", "digits", "dirichlet")
    assert config.options == {"weighted": True, "personal-model": "global"}


def test_fednh_defaults_are_the_papers_and_unknown_options_are_errors():
    from protofl.strategies.fednh import FedNHOptions

    options = FedNHOptions.from_config(ExperimentConfig.from_run_config(RUN_CONFIG | {"method": "fednh"}))
    assert (options.rho, options.prototype_init, options.prototype_means) == (0.9, "simplex", "normalized")
    assert (options.scale, options.learnable_scale, options.weighted) == (30.0, False, False)
    with pytest.raises(ValueError, match="unknown fednh option"):
        FedNHOptions.from_config(ExperimentConfig(method="fednh", options={"roh": 0.5}))
    with pytest.raises(ValueError, match="prototype-init"):
        FedNHOptions.from_config(ExperimentConfig(method="fednh", options={"prototype-init": "random"}))


def test_learning_rate_decays_per_round():
    config = ExperimentConfig(lr=0.01, lr_decay=0.99)
    assert [config.round_lr(r) for r in (1, 3)] == [0.01, pytest.approx(0.01 * 0.99**2)]
    assert ExperimentConfig(lr=0.05).round_lr(40) == 0.05


def test_issue_mandated_keys_exist():
    for key in ("method", "dataset", "partition", "alpha", "num-server-rounds", "fraction-fit", "local-epochs",
                "batch-size", "lr", "model", "seed", "data-dir", "output-dir"):
        assert key in RUN_CONFIG, key


def test_method_tables_reach_their_method_only():
    config = ExperimentConfig.from_run_config(RUN_CONFIG | {"method": "fedproto", "fedproto.lambda": 0.5})
    assert config.option("lambda", 1.0) == 0.5 and "weighted" not in config.options


def test_every_registered_method_has_a_strategy_and_client():
    for name in METHODS:
        strategy, client = get_method(name)
        assert strategy.__module__ == client.__module__ == f"protofl.strategies.{name}"


@pytest.mark.parametrize(
    "override,message",
    [({"lr-typo": 1}, "unknown run-config key"), ({"partition": "shards"}, "partition must be"),
     ({"fraction-fit": 0.0}, "fraction-fit"), ({"evaluate-clients": "some"}, "evaluate-clients"),
     ({"lr-decay": 0.0}, "lr-decay"), ({"max-grad-norm": -1.0}, "max-grad-norm"),
     ({"long-tail": 0.5}, "long-tail")],
)
def test_bad_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig.from_run_config(RUN_CONFIG | override)


def test_fedsc_and_fedskc_defaults_are_the_papers_and_bad_switches_are_errors():
    from protofl.strategies.fedsc import FedSCOptions
    from protofl.strategies.fedskc import FedSKCOptions

    def options(cls, method, **overrides):
        return cls.from_config(ExperimentConfig.from_run_config(RUN_CONFIG | {"method": method} | overrides))

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
    config = ExperimentConfig.from_run_config(RUN_CONFIG | {"run-name": "x"})
    assert config.run_directory().is_absolute() and config.run_directory().name == "x"


def test_task_package_does_not_import_flower():
    task = Path(__file__).resolve().parents[1] / "protofl" / "task"
    pattern = re.compile(r"^\s*(from|import)\s+flwr(\.|\s|$)", re.MULTILINE)
    offenders = [p.name for p in task.glob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
