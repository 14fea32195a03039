"""The experiment's settings: Flower's run config, parsed once into typed objects (no flwr imports).

Two words, two things: *settings* are the experiment's (:class:`ExperimentSettings`, built from the
run config, the same in every round); Flower's *config* is the per-round dict a server sends with
each instruction (:mod:`protofl.federation.wire`).

Flower flattens the nested tables of ``[tool.flwr.app.config]`` into dotted keys, so the FedProto
table arrives as ``run_config["fedproto.lambda"]``. A method reads its own table as a
:class:`MethodOptions` subclass: one typed mechanism for top-level keys and method options alike
(:func:`~protofl.typed_fields.parse_fields`): unknown keys are errors, each value must have its
field's type, and a ``Literal[...]`` field lists its allowed values.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from protofl.task.augment import Augmentation
from protofl.task.partition import PartitionScheme, PartitionSpec
from protofl.task.robust import RobustRule
from protofl.task.capture import CudaGraphs
from protofl.task.precision import Amp, ChannelsLast
from protofl.task.train import BatchNormStats, PartialBatch
from protofl.tracking import tracker_names
from protofl.typed_fields import parse_fields

EvaluateClients = Literal["sampled", "all"]
# where clients score a round's model: in the next round's fit message, before training (one message
# per client and round; the last round's, and every round's with fraction-fit < 1, in an evaluate
# message), or in an evaluate message after each evaluated round
EvaluationMessage = Literal["fit", "evaluate"]
FlowerApi = Literal["legacy", "message"]
Pool = Literal["train", "train+test"]
Normalisation = Literal["half", "dataset"]
# Settings a resumed run may change: extend the run, checkpoint at another interval, accept clients
# that lost their state, track it elsewhere (a tracker new to the run gets every round), train
# more or fewer clients at once, keep more or less state in memory (the same numbers).
RESUMABLE = frozenset({"num_server_rounds", "checkpoint_every", "resume", "overwrite", "resume_fresh_clients",
                       "tracker", "mlflow_uri", "clients_in_flight", "kept_state_mb", "flower_api"})


# How a client keeps its model across rounds (MethodOptions.keeps_model), stored after each fit
# in its local state: "trains", it is restored before each round's receive and before scoring, the
# shared entries then loaded over it; "scores", the client trains from what the server sends, and
# its model after training is scored; "kept", only the method reads it (MOON's previous model); None.
KeptModel = Literal["trains", "scores", "kept"] | None


@dataclass(frozen=True)
class MethodOptions:
    """A method's options: subclass it as a frozen dataclass whose fields are the keys of the
    method's run-config table (``[tool.flwr.app.config.<method>]``, "-" for "_"), typed, with
    ``Literal[...]`` for enumerations; range checks go in :meth:`check`.

    These declarations are the method's contract with the templates:

    - ``statistics``: the class statistics each client uploads every round (per-class means and
      counts): of its ``"feature"`` vectors (C x d), of its ``"logit"`` vectors (C x C), or None;
    - :meth:`shares`: which model entries (``state_dict`` names) travel as parameters;
    - :attr:`keeps_model`: whether and how each client keeps its model across rounds;
    - :attr:`keeps_client_state`: whether clients keep state across rounds;
    - :attr:`capturable`: whether the client's training step may be captured as a CUDA graph;
    - ``shares_across_architectures``: whether the shared entries are the same whatever a client's
      architecture (a head of the feature size; a second model of one architecture), so a model
      family (``htfe2`` ...) may run it.

    ``max_grad_norm`` is what ``max-grad-norm = "auto"`` clips each step's gradient at for the
    method (0: no clipping), where its published form clips.
    """

    statistics: ClassVar[Literal["feature", "logit"] | None] = "feature"
    max_grad_norm: ClassVar[float] = 0.0
    keeps_model: ClassVar[KeptModel] = None
    shares_across_architectures: ClassVar[bool] = False

    @property
    def keeps_client_state(self) -> bool:
        """Whether each client keeps state for its partition across rounds (a personal model, ...),
        which a resumed run must find again (default: when it keeps its model)."""
        return self.keeps_model is not None

    @property
    def capturable(self) -> bool:
        """Whether the client's training step, with the method's ``batch_loss``, may be captured as
        a CUDA graph (``cuda-graphs``): the loss never waits for the host (``.item()``, shapes that
        depend on the data) and keeps no Python state per batch (``record_loss`` does not).
        Default: no; a method that meets both says so."""
        return False

    @classmethod
    def from_settings(cls, settings: "ExperimentSettings") -> "MethodOptions":
        if settings.dp_noise > 0 and cls.statistics is None:
            raise ValueError(f"dp-noise adds noise to the class vectors a client uploads, but {settings.method} "
                             "uploads none (its model parameters would travel without any noise): set dp-noise=0, "
                             "or use a method that uploads class vectors")
        options = cls(**parse_fields(cls, settings.options, f"{settings.method}.", f"{settings.method} option"))
        options.check()
        return options

    @classmethod
    def run_config_defaults(cls) -> dict[str, Any]:
        """Each option's key in the method's run-config table, and its default."""
        return {f.name.rstrip("_").replace("_", "-"): f.default for f in dataclasses.fields(cls)}

    def check(self) -> None:
        """Raise ``ValueError`` for values out of range."""

    def shares(self, name: str) -> bool:
        """Whether the model entry ``name`` is exchanged with the server (default: all of them)."""
        return True

    def resolved(self, settings: "ExperimentSettings") -> dict[str, Any]:
        """The value each ``"auto"`` option resolves to in a run of ``settings``, by its key (recorded
        in results.json). Default: none."""
        return {}

    @classmethod
    def statistics_dim(cls, num_classes: int, feature_dim: int) -> int:
        """The length of each class's vector in the class statistics."""
        return num_classes if cls.statistics == "logit" else feature_dim


# ---------------------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExperimentSettings:
    method: str = "fedavg"
    dataset: str = "digits"
    data_dir: str = ""
    partition: PartitionScheme = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 2
    test_fraction: float = 0.25
    data_fraction: float = 1.0
    scarce_clients: int = 0
    scarce_fraction: float = 0.1
    long_tail: float = 1.0
    pool: Pool = "train"
    normalisation: Normalisation = "half"
    augment: Augmentation = "none"
    num_server_rounds: int = 20
    fraction_fit: float = 1.0
    min_fit_clients: int = 2
    round_timeout: float = 0.0
    evaluate_clients: EvaluateClients = "sampled"
    evaluation_message: EvaluationMessage = "fit"
    flower_api: FlowerApi = "message"
    eval_every: int = 1
    local_epochs: int = 2
    batch_size: int = 10
    partial_batch: PartialBatch = "drop"
    batchnorm_stats: BatchNormStats = "auto"
    lr: float = 0.05
    lr_decay: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | Literal["auto"] = "auto"  # "auto": the method's (MethodOptions.max_grad_norm)
    amp: Amp = "auto"
    channels_last: ChannelsLast = "auto"
    cuda_graphs: CudaGraphs = "auto"
    clients_in_flight: int = 0  # > 1: a training worker per GPU (protofl.federation.training_worker)
    model: str = "cnn"
    seed: int = 0
    partition_seed: int = 0
    max_payload_mb: float = 64.0
    num_partitions: int = 0
    verify_partitions: bool = True
    screen_factor: float = 10.0
    aggregation: RobustRule = "method"
    prototype_aggregation: RobustRule = "method"
    trim_fraction: float = 0.2
    dp_clip: float = 0.0
    dp_noise: float = 0.0
    dp_delta: float = 1e-5
    global_test_pm: bool = False
    global_test_pm_per_class: int = 0
    output_dir: str = "~/protofl-runs"
    run_name: str = ""
    checkpoint_every: int = 1
    resume: bool = False
    overwrite: bool = False
    state_dir: str = ""
    kept_state_mb: float = 1024.0  # per process: clients' state kept in memory (client_state.KeptStates)
    resume_fresh_clients: bool = False
    tracker: str = ""  # comma-separated: tensorboard, mlflow, wandb (protofl.tracking)
    mlflow_uri: str = ""  # empty: a SQLite store in the run directory
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the method's table, raw

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "ExperimentSettings":
        """Build from Flower's flat run config; unknown or mistyped top-level keys are errors."""
        if "options" in run_config:  # a field, but not a key: the method's table arrives as dotted keys
            raise ValueError("unknown run-config key 'options'")
        top_level = {k: v for k, v in run_config.items() if "." not in k}
        values = parse_fields(cls, top_level, unknown="run-config key")
        method = str(values.get("method", cls.method))
        settings = cls(**values, options=method_options(run_config, method))
        settings.validate()
        return settings

    def validate(self) -> None:
        if not 0.0 < self.fraction_fit <= 1.0:
            raise ValueError(f"fraction-fit must be in (0, 1], got {self.fraction_fit}")
        for name in ("data_fraction", "scarce_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")
        if self.long_tail < 1.0:
            raise ValueError(f"long-tail (rho = n_max / n_min) must be >= 1, got {self.long_tail}")
        if self.scarce_clients < 0:
            raise ValueError(f"scarce-clients must be >= 0, got {self.scarce_clients}")
        if not 0.0 <= self.test_fraction < 1.0:
            raise ValueError(f"test-fraction must be in [0, 1), got {self.test_fraction}")
        if self.test_fraction == 0 and (self.pool != "train" or self.global_test_pm_per_class):
            raise ValueError("test-fraction=0 scores every client on the whole global test set: it needs "
                             "pool='train' and global-test-pm-per-class=0")
        if self.pool != "train" and self.global_test_pm:
            raise ValueError("pool='train+test' partitions the test set too, so there is no global test set: "
                             "set global-test-pm=false")
        for name in ("num_server_rounds", "local_epochs", "batch_size", "min_fit_clients", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"lr must be > 0 and weight-decay must be >= 0, got {self.lr} and {self.weight_decay}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"lr-decay must be in (0, 1], got {self.lr_decay}")
        if self.max_grad_norm != "auto" and self.max_grad_norm < 0 or self.global_test_pm_per_class < 0:
            raise ValueError("max-grad-norm and global-test-pm-per-class must be >= 0")
        if self.clients_in_flight < 0:
            raise ValueError(f"clients-in-flight must be >= 0, got {self.clients_in_flight}")
        if self.num_partitions < 0 or self.screen_factor < 0 or self.dp_clip < 0 or self.dp_noise < 0:
            raise ValueError("num-partitions, screen-factor, dp-clip and dp-noise must be >= 0")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.dp_noise > 0 and self.dp_clip <= 0:
            raise ValueError("dp-noise needs dp-clip > 0: the norm bound that the noise is scaled to")
        if not 0.0 < self.dp_delta < 1.0:
            raise ValueError(f"dp-delta must be in (0, 1), got {self.dp_delta}")
        if self.round_timeout < 0:
            raise ValueError(f"round-timeout must be >= 0 seconds (0: none), got {self.round_timeout}")
        if self.kept_state_mb < 0:
            raise ValueError(f"kept-state-mb must be >= 0 (0: none kept), got {self.kept_state_mb}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint-every must be >= 0 (0: no checkpoints), got {self.checkpoint_every}")
        tracker_names(self.tracker)
        if self.resume and (self.overwrite or not self.run_name):
            raise ValueError("resume=true continues the run named by run-name: set run-name, and not overwrite")

    def round_lr(self, server_round: int) -> float:
        """The client learning rate of a round: lr * lr-decay^(round - 1)."""
        return self.lr * self.lr_decay ** (max(server_round, 1) - 1)

    def train_arguments(self, server_round: int, seed: int, options: MethodOptions) -> dict[str, Any]:
        """The training loop's arguments (:func:`protofl.task.train.train`) in a round of the method
        whose ``options`` these are, but the data, the model and the augmentation."""
        return {
            "epochs": self.local_epochs,
            "batch_size": self.batch_size,
            "partial_batch": self.partial_batch,
            "lr": self.round_lr(server_round),
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "max_grad_norm": options.max_grad_norm if self.max_grad_norm == "auto" else self.max_grad_norm,
            "seed": seed,
            **self.precision,
        }

    def resolved(self, options: MethodOptions, compute: Mapping[str, Any]) -> dict[str, Any]:
        """What each ``"auto"`` setting of this run resolved to, by its run-config key: the method's
        options', ``max-grad-norm``, and ``amp``, ``channels-last`` and ``cuda-graphs`` on the device
        ``compute`` describes (:func:`~protofl.task.precision.compute_description`; each client's, and
        its ``batchnorm-stats``, are in its own description, results.json's ``client_compute``)."""
        values: dict[str, Any] = {}
        if self.max_grad_norm == "auto":
            values["max-grad-norm"] = options.max_grad_norm
        on_device = {"amp": compute.get("autocast"), "channels-last": compute.get("memory_format") == "channels-last",
                     "cuda-graphs": compute.get("training_step")}
        values |= {key: value for key, value in on_device.items() if getattr(self, key.replace("-", "_")) == "auto"}
        if self.batchnorm_stats == "auto":  # each client's choice, by its model and steps
            values["batchnorm-stats"] = "per client: client_compute's batchnorm_stats"
        return values | {f"{self.method}.{key}": value for key, value in options.resolved(self).items()}

    @property
    def precision(self) -> dict[str, Any]:
        """``amp``, ``channels_last`` and ``cuda_graphs`` (on CUDA, "auto" depends on whether training
        steps are captured), as every forward pass of the run takes them (training, the prototype
        and scoring passes, BatchNorm recomputation, the server's global model)."""
        return {"amp": self.amp, "channels_last": self.channels_last, "cuda_graphs": self.cuda_graphs}

    def method_precision(self, options: MethodOptions) -> dict[str, Any]:
        """:attr:`precision` as the method's clients and server compute: no captured training steps
        (``cuda_graphs`` off, and on CUDA the "auto" precision and memory format that go with
        eager steps) unless its ``options`` are :attr:`~MethodOptions.capturable`."""
        return self.precision | ({} if options.capturable else {"cuda_graphs": "off"})

    def partition_spec(self, num_partitions: int) -> PartitionSpec:
        return PartitionSpec(
            scheme=self.partition,
            num_partitions=num_partitions,
            alpha=float(self.alpha),
            classes_per_client=int(self.classes_per_client),
            test_fraction=float(self.test_fraction),
            seed=int(self.partition_seed),
            data_fraction=float(self.data_fraction),
            scarce_clients=int(self.scarce_clients),
            scarce_fraction=float(self.scarce_fraction) if self.scarce_clients else 1.0,
            long_tail=float(self.long_tail),
            pool=self.pool,
            normalisation=self.normalisation,
        )

    def is_eval_round(self, server_round: int) -> bool:
        """Evaluate every `eval-every` rounds, and always in the last round."""
        return server_round % self.eval_every == 0 or server_round == self.num_server_rounds

    def evaluates_in_next_fit(self, server_round: int) -> bool:
        """Whether the clients score this eval round's model in the next round's fit message:
        ``evaluation-message="fit"``, not the last round, and every client trains in every round
        (``fraction-fit=1``), so that the next round's fit message reaches the very clients the
        evaluate message would (with fewer, the two rounds' samples differ)."""
        return self.evaluation_message == "fit" and server_round < self.num_server_rounds and self.fraction_fit == 1.0

    def run_directory(self) -> Path:
        """Absolute directory for this run's results."""
        name = self.run_name or (
            f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{self.method}-{self.dataset}-s{self.seed}"
        )
        return (Path(self.output_dir).expanduser() / name).resolve()

    def resume_conflicts(self, saved: Mapping[str, Any], option_defaults: Mapping[str, Any] | None = None) -> list[str]:
        """The run-config keys whose values differ from a checkpoint's settings (``saved``: its
        :meth:`as_dict`), except those a resumed run may change (``RESUMABLE``). A key the
        checkpoint lacks (written before the key existed) counts as its default, the method's
        options' from ``option_defaults`` (:meth:`MethodOptions.run_config_defaults`)."""

        def keyed(values: Mapping[str, Any]) -> dict[str, Any]:
            options = {f"{values.get('method')}.{k}": v for k, v in (values.get("options") or {}).items()}
            top = {k.replace("_", "-"): v for k, v in values.items() if k != "options" and k not in RESUMABLE}
            return top | options

        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}

        def filled(values: Mapping[str, Any]) -> dict[str, Any]:  # each key absent from values at its default
            return keyed(defaults | {"method": values.get("method"), "options": option_defaults or {}}) | keyed(values)

        now, then = filled(self.as_dict()), filled(saved)
        return [f"{key} ({then.get(key)!r} -> {now.get(key)!r})"
                for key in sorted(set(now) | set(then)) if now.get(key) != then.get(key)]

    def as_dict(self, option_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every setting; ``options``: the method's, each at its value in this run (``option_defaults``,
        :meth:`MethodOptions.run_config_defaults`, for those the run config leaves out)."""
        values = dataclasses.asdict(self)
        values["options"] = dict(option_defaults or {}) | dict(self.options)
        return values


def method_options(run_config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The nested ``[tool.flwr.app.config.<method>]`` table, prefix stripped."""
    prefix = f"{method}."
    return {k[len(prefix):]: v for k, v in run_config.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------
# Run configs outside Flower (benchmarks, tests)
# ---------------------------------------------------------------------------------------


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables -> dotted keys, as Flower flattens ``[tool.flwr.app.config]``."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def default_run_config(pyproject: Path) -> dict[str, Any]:
    """The app's default run config, flat, from its ``pyproject.toml``."""
    return flatten(tomllib.loads(Path(pyproject).read_text())["tool"]["flwr"]["app"]["config"])


def parse_overrides(text: str) -> dict[str, Any]:
    """``"key=value key2='text'"`` (``flwr run --run-config``'s form; values are TOML) -> a flat dict."""
    pairs = re.findall(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", text)
    return flatten(tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs)))
