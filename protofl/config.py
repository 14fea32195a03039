"""The run config, parsed once into a typed object (no flwr imports).

Flower flattens nested tables of ``[tool.flwr.app.config]`` into dotted keys, so the
FedProto table arrives as ``run_config["fedproto.lambda"]``; :func:`method_options`
gives a method its own table back with the prefix stripped.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from protofl.task.partition import PARTITION_SCHEMES, PartitionSpec

EVALUATE_CLIENTS = ("sampled", "all")


@dataclass(frozen=True)
class ExperimentConfig:
    method: str = "fedavg"
    dataset: str = "digits"
    data_dir: str = ""
    partition: str = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.25
    data_fraction: float = 1.0
    scarce_clients: int = 0
    scarce_fraction: float = 0.1
    long_tail: float = 1.0
    num_server_rounds: int = 20
    fraction_fit: float = 1.0
    min_fit_clients: int = 2
    evaluate_clients: str = "sampled"
    eval_every: int = 1
    local_epochs: int = 2
    batch_size: int = 10
    lr: float = 0.05
    lr_decay: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    model: str = "cnn"
    seed: int = 0
    max_payload_mb: float = 64.0
    global_test_pm: bool = True
    global_test_pm_per_class: int = 0
    output_dir: str = "~/protofl-runs"
    run_name: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "ExperimentConfig":
        """Build from Flower's flat run config; unknown top-level keys are an error."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"options"}
        values: dict[str, Any] = {}
        for key, value in run_config.items():
            if "." in key:
                continue
            name = key.replace("-", "_")
            if name not in fields:
                raise ValueError(f"unknown run-config key {key!r}")
            values[name] = value
        method = str(values.get("method", cls.method))
        config = cls(**values, options=method_options(run_config, method))
        config.validate()
        return config

    def validate(self) -> None:
        if self.partition not in PARTITION_SCHEMES:
            raise ValueError(f"partition must be one of {PARTITION_SCHEMES}, got {self.partition!r}")
        if self.evaluate_clients not in EVALUATE_CLIENTS:
            raise ValueError(
                f"evaluate-clients must be one of {EVALUATE_CLIENTS}, got {self.evaluate_clients!r}"
            )
        if not 0.0 < self.fraction_fit <= 1.0:
            raise ValueError(f"fraction-fit must be in (0, 1], got {self.fraction_fit}")
        for name in ("data_fraction", "scarce_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")
        if self.long_tail < 1.0:
            raise ValueError(f"long-tail (rho = n_max / n_min) must be >= 1, got {self.long_tail}")
        if self.scarce_clients < 0:
            raise ValueError(f"scarce-clients must be >= 0, got {self.scarce_clients}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test-fraction must be in (0, 1), got {self.test_fraction}")
        for name in ("num_server_rounds", "local_epochs", "batch_size", "min_fit_clients"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.eval_every < 1:
            raise ValueError("eval-every must be >= 1")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"lr-decay must be in (0, 1], got {self.lr_decay}")
        if self.max_grad_norm < 0 or self.global_test_pm_per_class < 0:
            raise ValueError("max-grad-norm and global-test-pm-per-class must be >= 0")

    def round_lr(self, server_round: int) -> float:
        """The client learning rate of a round: lr * lr-decay^(round - 1)."""
        return self.lr * self.lr_decay ** (max(server_round, 1) - 1)

    def option(self, key: str, default: Any) -> Any:
        """A value from this method's nested run-config table."""
        return self.options.get(key, default)

    def options_as(self, cls: type, choices: dict[str, tuple] | None = None) -> Any:
        """This method's table as the dataclass ``cls`` ("-" in keys read as "_"); unknown keys are an
        error, and so is a field named in ``choices`` whose value is not one of its allowed values."""
        values = {k.replace("-", "_"): v for k, v in self.options.items()}
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {self.method} option(s) {sorted(unknown)}")
        options = cls(**values)
        for name, allowed in (choices or {}).items():
            if getattr(options, name) not in allowed:
                raise ValueError(
                    f"{self.method}.{name.replace('_', '-')} must be one of {allowed}, got {getattr(options, name)!r}"
                )
        return options

    def partition_spec(self, num_partitions: int) -> PartitionSpec:
        return PartitionSpec(
            scheme=self.partition,
            num_partitions=num_partitions,
            alpha=float(self.alpha),
            classes_per_client=int(self.classes_per_client),
            test_fraction=float(self.test_fraction),
            seed=int(self.seed),
            data_fraction=float(self.data_fraction),
            scarce_clients=int(self.scarce_clients),
            scarce_fraction=float(self.scarce_fraction) if self.scarce_clients else 1.0,
            long_tail=float(self.long_tail),
        )

    def is_eval_round(self, server_round: int) -> bool:
        """Evaluate every `eval-every` rounds, and always in the last round."""
        return server_round % self.eval_every == 0 or server_round == self.num_server_rounds

    def run_directory(self) -> Path:
        """Absolute directory for this run's results."""
        name = self.run_name or (
            f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{self.method}-{self.dataset}-s{self.seed}"
        )
        return (Path(self.output_dir).expanduser() / name).resolve()

    def as_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["options"] = dict(self.options)
        return values


def method_options(run_config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The nested ``[tool.flwr.app.config.<method>]`` table, prefix stripped."""
    prefix = f"{method}."
    return {k[len(prefix):]: v for k, v in run_config.items() if k.startswith(prefix)}
