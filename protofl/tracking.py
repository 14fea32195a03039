"""Experiment tracking: a run's rounds, settings and files in TensorBoard, MLflow or Weights & Biases.

The run-config key ``tracker`` names the trackers, comma-separated (``tracker="tensorboard,mlflow"``;
empty: none). Each is an optional extra (``pip install 'protofl[tensorboard]'``, ``[mlflow]``,
``[wandb]``, ``[tracking]`` for all three), imported only when a run asks for it.

The ServerApp's :class:`~protofl.report.RunRecorder` feeds them (no flwr imports here):

- when the run starts, the run config as hyper-parameters, by run-config key (``num-server-rounds``,
  ``fedproto.lambda``);
- after each round, every earlier round's record not sent yet, as scalars at step = round: every
  number of the record, under its metrics.csv column's name (``global_accuracy``,
  ``personalized_accuracy``, ``train_loss``, ``bytes_up``, ``rejected``, ``seconds``, ...), lists
  as their lengths (``clients``: the partitions sampled, ``dropped``: the replies rejected). A
  round is complete one round later (its clients score its model in the next round's fit message),
  so each round is sent once, whole, and in order;
- when the run ends, its last rounds, results.json, metrics.csv and accuracy.png.

Where they write: TensorBoard in ``<run dir>/tensorboard``; MLflow in a SQLite store
``<run dir>/mlflow.db`` with artifacts in ``<run dir>/mlflow-artifacts`` (MLflow 3 refuses new
``file:`` stores), or to the tracking URI of ``mlflow-uri``, experiment ``protofl``; W&B offline in
``<run dir>/wandb`` (``WANDB_MODE`` and ``WANDB_PROJECT`` in the ServerApp's environment change
the mode and project).

A resumed run continues its tracked runs: their identities are kept in results.json (and so in
the checkpoint) under ``tracking``. TensorBoard writes on in the same directory and drops what it
holds from the first round the resumed run sends again; MLflow reopens the run by id and skips the
points it holds already; W&B resumes the same run id (``resume="allow"``; offline, each start is a
directory of its own, which ``wandb sync`` joins).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

LOGGER = logging.getLogger(__name__)  # the standard library's: protofl.tracking imports no Flower

TRACKERS = ("tensorboard", "mlflow", "wandb")
# the pip package each tracker needs (its extra: protofl[<tracker>])
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny (or mlflow)", "wandb": "wandb"}
MLFLOW_EXPERIMENT = "protofl"


def tracker_names(text: str) -> tuple[str, ...]:
    """The trackers a ``tracker`` value names: comma-separated, spaces and repeats ignored, in
    order; empty: none. An unknown name is a ``ValueError`` that lists the known ones."""
    names: list[str] = []
    for name in (part.strip().lower() for part in text.split(",")):
        if name and name not in names:
            names.append(name)
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(
            f"tracker: unknown {', '.join(map(repr, unknown))}; the trackers are {', '.join(TRACKERS)}, "
            "comma-separated (tracker='tensorboard,mlflow'), or '' for none"
        )
    return tuple(names)


def require(module: str, tracker: str) -> Any:
    """Import ``module`` for ``tracker``; missing, an ``ImportError`` that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"tracker '{tracker}' needs {PACKAGES[tracker]}, which is not installed: "
            f"pip install 'protofl[{tracker}]'"
        ) from err


def hyper_parameters(run_config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The run config (``ExperimentSettings.as_dict()``) by run-config key: ``num_server_rounds``
    as ``num-server-rounds``, the method's options as ``<method>.<option>``."""
    method = run_config.get("method", "")
    parameters = {key.replace("_", "-"): value for key, value in run_config.items() if key != "options"}
    parameters |= {f"{method}.{key}": value for key, value in (run_config.get("options") or {}).items()}
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in parameters.items()}


def round_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A round's record as scalars: each number (not ``round``), each list as its length; text
    (why a round kept the previous state) and quantities not measured (None) are left out."""
    scalars = {}
    for key, value in record.items():
        if key == "round" or value is None or isinstance(value, str):
            continue
        if isinstance(value, (list, tuple)):
            scalars[key] = float(len(value))
        elif isinstance(value, (bool, int, float)):
            scalars[key] = float(value)
    return scalars


# ---------------------------------------------------------------------------------------
# One class per tracker
# ---------------------------------------------------------------------------------------


class Tracker:
    """One tracking tool's run. Built when the run starts (its library imported then, so that a
    missing extra stops the run before its first round); :meth:`start` opens or reopens the
    tracked run, :meth:`log` sends a round, :meth:`finish` sends the files and closes it."""

    name: ClassVar[str]

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)  # the run's directory
        self.state: dict[str, Any] = {}  # what reopens this tracked run (kept in results.json)

    def start(self, run_name: str, parameters: Mapping[str, Any], saved: Mapping[str, Any] | None,
              replay_from: int | None) -> bool:
        """Open the tracked run; whether it continues ``saved`` (the state of this tracker when the
        run last stopped). A continued run first drops (or skips) what it holds from round
        ``replay_from`` on, which the resumed run sends again; a new one takes ``parameters``."""
        raise NotImplementedError

    def log(self, server_round: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def finish(self, files: Sequence[Path], failed: bool) -> None:
        """Send the run's files (those that exist) and close; ``failed``: the run stopped early."""
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``<run dir>/tensorboard``, written by torch's SummaryWriter: scalars by round,
    the run config as hparams and as a text table, accuracy.png as an image and results.json as text."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.tensorboard = require("torch.utils.tensorboard", self.name)
        self.summaries = require("torch.utils.tensorboard.summary", self.name)
        self.log_dir = self.directory / "tensorboard"
        self.writer: Any = None
        self.last_round = 0

    def start(self, run_name, parameters, saved, replay_from):
        continued = saved is not None and replay_from is not None and self.log_dir.is_dir()
        self.state = {"log_dir": str(self.log_dir)}
        if continued:  # TensorBoard drops the older files' events from this step on
            self.writer = self.tensorboard.SummaryWriter(str(self.log_dir), purge_step=replay_from)
            return True
        shutil.rmtree(self.log_dir, ignore_errors=True)  # a run started again from round 1
        self.writer = self.tensorboard.SummaryWriter(str(self.log_dir))
        for summary in self.summaries.hparams(
            dict(parameters), {"global_accuracy": 0.0, "personalized_accuracy": 0.0}
        ):
            self.writer.file_writer.add_summary(summary)
        rows = "\n".join(f"| {key} | {value} |" for key, value in parameters.items())
        self.writer.add_text("run_config", f"| key | value |\n|---|---|\n{rows}", 0)
        self.writer.flush()
        return False

    def log(self, server_round, scalars):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, server_round)
        self.writer.flush()  # a crash loses no round that was sent
        self.last_round = server_round

    def finish(self, files, failed):
        import matplotlib.image

        for path in files:
            if path.suffix == ".png":
                self.writer.add_image(path.stem, matplotlib.image.imread(path)[..., :3], self.last_round,
                                      dataformats="HWC")
            elif path.suffix == ".json":
                self.writer.add_text(path.name, "```\n" + path.read_text() + "\n```", self.last_round)
        self.writer.close()


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``protofl``, through ``MlflowClient`` (no global active run):
    metrics by step = round, the run config as params, the files as artifacts."""

    name = "mlflow"

    def __init__(self, directory: Path, tracking_uri: str = "") -> None:
        super().__init__(directory)
        require("mlflow", self.name)
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self.MlflowClient, self.Metric, self.Param = MlflowClient, Metric, Param
        self.default_store = not tracking_uri
        self.tracking_uri = tracking_uri or f"sqlite:///{self.directory / 'mlflow.db'}"
        self.client: Any = None  # opened by start (a SQLite store is created then)
        self.run_id = ""
        self.held: set[tuple[str, int]] = set()  # (metric, step) the reopened run holds from replay_from on

    def start(self, run_name, parameters, saved, replay_from):
        run = None
        if saved and saved.get("tracking_uri") == self.tracking_uri and replay_from is not None:
            self.client = self.MlflowClient(tracking_uri=self.tracking_uri)
            try:
                run = self.client.get_run(saved["run_id"])
            except Exception as err:  # noqa: BLE001: the store lost it; a new run gets every round
                LOGGER.warning("protofl: MLflow run %s is not in %s (%s); a new run starts",
                               saved["run_id"], self.tracking_uri, err)
        if run is not None:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.held = {(key, m.step) for key in run.data.metrics
                         for m in self.client.get_metric_history(self.run_id, key) if m.step >= replay_from}
            self.client.set_tag(self.run_id, "protofl.resumed_after", str(replay_from))
            self.state = dict(saved)
            return True
        if self.default_store and self.client is None:  # a run started again from round 1 replaces its store
            (self.directory / "mlflow.db").unlink(missing_ok=True)
            shutil.rmtree(self.directory / "mlflow-artifacts", ignore_errors=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = self.client or self.MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment()
        run = self.client.create_run(experiment_id, run_name=run_name,
                                     tags={"protofl.run_directory": str(self.directory)})
        self.run_id = run.info.run_id
        params = [self.Param(key, str(value)) for key, value in parameters.items()]
        for first in range(0, len(params), 100):  # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=params[first:first + 100])
        self.state = {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "experiment_id": experiment_id}
        return False

    def _experiment(self) -> str:
        experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        if experiment is not None:
            return experiment.experiment_id
        location = (self.directory / "mlflow-artifacts").as_uri() if self.default_store else None
        try:
            return self.client.create_experiment(MLFLOW_EXPERIMENT, artifact_location=location)
        except Exception:  # another run created it first
            experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log(self, server_round, scalars):
        now = int(time.time() * 1000)
        metrics = [self.Metric(key, value, now, server_round) for key, value in scalars.items()
                   if (key, server_round) not in self.held]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, files, failed):
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """A W&B run, offline by default (``WANDB_MODE`` sets another mode), in ``<run dir>/wandb``:
    metrics against the step metric ``round``, the run config as its config, the files as an
    artifact; no console capture."""

    name = "wandb"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.wandb = require("wandb", self.name)
        self.run: Any = None

    def start(self, run_name, parameters, saved, replay_from):
        continued = bool(saved and saved.get("id")) and replay_from is not None
        if not continued:
            shutil.rmtree(self.directory / "wandb", ignore_errors=True)
        run_id = saved["id"] if continued else secrets.token_hex(4)
        self.run = self.wandb.init(
            id=run_id, resume="allow", name=run_name, dir=str(self.directory),
            project=os.environ.get("WANDB_PROJECT") or "protofl", mode=os.environ.get("WANDB_MODE") or "offline",
            settings=self.wandb.Settings(console="off"),
        )
        self.run.config.update(dict(parameters), allow_val_change=True)
        self.run.define_metric("round")
        self.run.define_metric("*", step_metric="round")
        self.state = {"id": run_id, "project": self.run.project}
        return continued

    def log(self, server_round, scalars):
        self.run.log({"round": server_round, **scalars})

    def finish(self, files, failed):
        if files:
            artifact = self.wandb.Artifact(f"results-{self.state['id']}", type="protofl-results")
            for path in files:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=1 if failed else 0)


def build_tracker(name: str, directory: Path, mlflow_uri: str = "") -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(directory)
    if name == "mlflow":
        return MlflowTracker(directory, mlflow_uri)
    if name == "wandb":
        return WandbTracker(directory)
    raise ValueError(f"no tracker {name!r}; the trackers are {', '.join(TRACKERS)}")


# ---------------------------------------------------------------------------------------
# A run's trackers
# ---------------------------------------------------------------------------------------


class Tracking:
    """The run's trackers, and the last round each has been sent (rounds go out once, in order)."""

    def __init__(self, trackers: Iterable[Tracker]) -> None:
        self.trackers = list(trackers)
        self.sent_through = {tracker.name: 0 for tracker in self.trackers}

    @classmethod
    def from_settings(cls, tracker: str, directory: Path, mlflow_uri: str = "") -> "Tracking | None":
        """The trackers ``tracker`` names (None for none), their libraries imported."""
        names = tracker_names(tracker)
        return cls(build_tracker(name, directory, mlflow_uri) for name in names) if names else None

    def start(self, run_name: str, run_config: Mapping[str, Any], saved: Mapping[str, Any],
              resumed_after: int | None) -> dict[str, Any]:
        """Open every tracker: continue its run from ``saved`` (results.json's ``tracking``) when
        the run resumed after round ``resumed_after``, else a new one. A continued tracker has every
        round up to ``resumed_after - 1`` already (sent before the checkpoint was written); one new
        to the run gets every round again. Returns the state to keep in results.json."""
        parameters = hyper_parameters(run_config)
        states = {}
        for tracker in self.trackers:
            continued = tracker.start(run_name, parameters, saved.get(tracker.name), resumed_after)
            self.sent_through[tracker.name] = resumed_after - 1 if continued and resumed_after else 0
            states[tracker.name] = tracker.state
            LOGGER.info("protofl: tracking with %s%s", tracker.name, " (continued)" if continued else "")
        return states

    def log(self, rounds: Mapping[int, Mapping[str, Any]], before: int | None = None) -> None:
        """Send each tracker the rounds it lacks, before round ``before`` (None: all). A tracker that
        fails is warned about and dropped: results.json keeps everything, the run goes on."""
        for tracker in list(self.trackers):
            due = [r for r in sorted(rounds) if r > self.sent_through[tracker.name] and (before is None or r < before)]
            try:
                for server_round in due:
                    tracker.log(server_round, round_scalars(rounds[server_round]))
                    self.sent_through[tracker.name] = server_round
            except Exception as err:  # noqa: BLE001: tracking must not end a run
                LOGGER.warning("protofl: tracker %s failed (%s: %s); the run goes on without it",
                               tracker.name, type(err).__name__, err)
                self.trackers.remove(tracker)

    def finish(self, rounds: Mapping[int, Mapping[str, Any]], files: Sequence[Path], failed: bool,
               last_round_complete: bool = True) -> None:
        """Send the last rounds (not the last one, when a crash cut it short) and the files that
        exist, and close every tracker."""
        self.log(rounds, before=None if last_round_complete or not rounds else max(rounds))
        existing = [Path(path) for path in files if Path(path).is_file()]
        for tracker in self.trackers:
            try:
                tracker.finish(existing, failed)
            except Exception as err:  # noqa: BLE001
                LOGGER.warning("protofl: tracker %s could not finish (%s: %s)", tracker.name, type(err).__name__, err)
