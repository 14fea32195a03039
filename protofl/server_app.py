"""ServerApp: builds the method's Strategy from the run config, on the Flower front its
``flower-api`` names, and runs its rounds with protofl's summary at the end; in a deployment, it
collects the clients' replies within a fraction of a second of their arrival
(:class:`PromptReplies`). A run that stopped ends failed (:class:`RunFailed`)."""

from __future__ import annotations

import functools
import logging
import time
from logging import ERROR, INFO
from typing import Any, Callable, Iterable, Mapping

from flwr.common import Context, Message, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import FLOWER_LOGGER, log
from flwr.server import Grid, History, Server, ServerApp, ServerAppComponents, ServerConfig, SimpleClientManager
from flwr.superlink.grid import HttpGrid

from protofl.federation.checkpoint import CLIENT_STATE, Checkpoint, open_run
from protofl.federation.message_front import message_strategy
from protofl.federation.server import legacy_strategy
from protofl.flower_compat import replace_server_fn, server_of
from protofl.report import RunRecorder
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, method_rule
from protofl.task.data import load_dataset, load_global_test, partition_sizes
from protofl.task.models import client_architecture, model_bytes
from protofl.task.precision import compute_description, get_device, set_thread_count
from protofl.tracking import Tracking


class RunFailed(Exception):
    """Raised by the ServerApp after a run that stopped
    (:class:`~protofl.federation.server_core.RunStopped`) has saved its results and logged its one
    line: Flower then marks the run failed (`flwr ls`: ``finished:failed``, this reason in its
    details) and its process exits non-zero."""


class _NoTracebackForRunFailed(logging.Filter):
    """Drops Flower's "ServerApp (or Simulation) raised an exception" record, and its traceback,
    for :class:`RunFailed`: the run has said why in one line already."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RunFailed))


FLOWER_LOGGER.addFilter(_NoTracebackForRunFailed())


class RunSummary(History):
    """Flower's History, printed in the [SUMMARY] log as protofl's summary instead of every metric."""

    summary = ""

    def __str__(self) -> str:
        return self.summary


class PrototypeServer(Server):
    """Flower's Server loop, from the round after ``checkpoint`` when the run resumes, with a
    checkpoint after each complete round (and the rounds before it sent to the trackers); then the
    strategy's final files and summary once all rounds are done, or once a round stops the run
    (:class:`~protofl.federation.server_core.RunStopped`: one error line, no traceback, the reason
    kept in ``stopped``)."""

    def __init__(self, *, client_manager, strategy, checkpoint: Checkpoint | None = None) -> None:
        super().__init__(client_manager=client_manager, strategy=strategy)
        self.checkpoint = checkpoint
        self.stopped: str | None = None

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        started, history = time.perf_counter(), History()
        summary = RunSummary()
        summary.summary = self.strategy.run_rounds(lambda: self._rounds(num_rounds, timeout, history))
        self.stopped = self.strategy.stopped
        summary.__dict__.update(history.__dict__)
        return summary, time.perf_counter() - started

    def _rounds(self, num_rounds: int, timeout: float | None, history: History) -> None:
        """Server.fit's loop (without its round-0 evaluation, which nothing records)."""
        if self.checkpoint is None:
            self.parameters, first = self._get_initial_parameters(server_round=0, timeout=timeout), 1
        else:
            self.parameters = ndarrays_to_parameters(self.checkpoint.parameters)
            first = self.checkpoint.server_round + 1
        for server_round in range(first, num_rounds + 1):
            log(INFO, "[ROUND %s]", server_round)
            fitted = self.fit_round(server_round=server_round, timeout=timeout)
            if fitted is not None:
                parameters, metrics, _ = fitted
                if parameters is not None:
                    self.parameters = parameters
                history.add_metrics_distributed_fit(server_round=server_round, metrics=metrics)
            central = self.strategy.evaluate(server_round, parameters=self.parameters)
            if central is not None:
                history.add_loss_centralized(server_round=server_round, loss=central[0])
                history.add_metrics_centralized(server_round=server_round, metrics=central[1])
            federated = self.evaluate_round(server_round=server_round, timeout=timeout)
            if federated is not None and federated[0] is not None:
                history.add_loss_distributed(server_round=server_round, loss=federated[0])
                history.add_metrics_distributed(server_round=server_round, metrics=federated[1])
            self.strategy.recorder.track(server_round)  # the rounds before it, which are complete
            self.strategy.checkpoints.save(server_round, parameters_to_ndarrays(self.parameters),
                                           self.strategy.server_state)


def build_strategy(settings: ExperimentSettings, deployment: bool = False,
                   front: Callable[[type], type] | None = None) -> tuple[Any, Checkpoint | None]:
    """The method's strategy on ``front`` (default: the one ``flower-api`` names), set up for this
    run (resumed from its checkpoint, when there is one), and that checkpoint. In a simulation (not
    ``deployment``) the clients share the server's disk: those without a ``state-dir`` keep their
    state in the run directory's ``client-state``."""
    set_thread_count()  # on the thread the server computes on
    directory = settings.run_directory()
    tracking = Tracking.from_settings(settings.tracker, directory, settings.mlflow_uri)  # a missing extra fails here
    if front is None:
        front = message_strategy if settings.flower_api == "message" else legacy_strategy
    strategy_class = front(method_rule(settings.method))
    option_defaults = strategy_class.options_class.run_config_defaults()
    try:
        checkpoint = open_run(settings, directory, option_defaults)
    except ValueError as refused:  # the run directory holds another run, or one this cannot resume
        log(ERROR, "protofl: the run cannot start. %s", refused)
        raise RunFailed(str(refused)) from None
    dataset = load_dataset(settings.dataset, settings.data_dir, settings.normalisation)
    model = build_method_model(settings, dataset)
    global_test = None  # pool='train+test': the test set is in the partitions, no GM
    if settings.pool == "train":
        global_test = load_global_test(settings.dataset, settings.data_dir, str(get_device()),
                                       normalisation=settings.normalisation)
    # the server's copy of the data set says what each partition holds
    sizes = functools.partial(server_partition_sizes, settings) if settings.verify_partitions else None
    recorder = RunRecorder(directory, settings.as_dict(option_defaults), tracking)

    @functools.cache
    def architecture_bytes(name: str) -> int:
        return model_bytes(name, dataset.in_channels, dataset.num_classes, dataset.image_size)

    def state_bytes(partition_id: int) -> int:  # its whole model: what a personal state holds
        return architecture_bytes(client_architecture(settings.model, partition_id))

    strategy = strategy_class(settings, model, dataset.num_classes, global_test, recorder, partition_sizes=sizes,
                              client_state_dir="" if deployment else str(directory / CLIENT_STATE),
                              state_bytes=state_bytes)
    recorder.extra["compute"] = compute_description(device=get_device(), model=model,
                                                    **settings.method_precision(strategy.options))
    recorder.extra["resolved"] = settings.resolved(strategy.options, recorder.extra["compute"])
    log(INFO, "protofl: the server computes with %s (each ClientApp logs its own)",
        ", ".join(f"{k} {v}" for k, v in recorder.extra["compute"].items()))
    if checkpoint is not None:
        strategy.resume_from(checkpoint)
    recorder.start_tracking()
    log(
        INFO, "protofl: %s on %s (%s partition), %d rounds, Flower's %s API; results go to %s",
        settings.method, settings.dataset, settings.partition, settings.num_server_rounds,
        "message" if front is message_strategy else "legacy", strategy.recorder.directory,
    )
    return strategy, checkpoint


def server_partition_sizes(settings: ExperimentSettings, num_partitions: int, partition_id: int):
    """What partition ``partition_id`` of ``num_partitions`` holds, in the server's copy of the data set."""
    spec = settings.partition_spec(num_partitions)
    return partition_sizes(settings.dataset, settings.data_dir, spec, partition_id)


def make_server_fn(
    run_config: Mapping[str, Any] | None = None, deployment: bool = False
) -> Callable[[Context], ServerAppComponents]:
    """The legacy front's components of a run (:func:`build_strategy`). ``run_config`` replaces
    ``context.run_config`` (in-process simulations leave it empty)."""

    def server_fn(context: Context) -> ServerAppComponents:
        settings = ExperimentSettings.from_run_config(run_config if run_config is not None else context.run_config)
        strategy, checkpoint = build_strategy(settings, deployment, legacy_strategy)
        server = PrototypeServer(client_manager=SimpleClientManager(), strategy=strategy, checkpoint=checkpoint)
        return ServerAppComponents(server=server, config=ServerConfig(
            num_rounds=settings.num_server_rounds, round_timeout=settings.round_timeout or None,
        ))

    return server_fn


class PromptReplies(Grid):
    """A deployment's grid whose ``send_and_receive`` asks the SuperLink for the replies every
    ``elapsed / 20`` seconds, from 0.1 s up to 3 s, instead of the fixed 3 s of Flower 1.41 and 1.42
    (``HttpGrid.send_and_receive``): a reply waits at most 5% of the time its message took (or
    0.1 s), so a short message no longer costs a three-second round, and a long one is polled
    about as often as before. Everything else is the grid's own."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        waiting = set(self.push_messages(messages))
        started, replies = time.monotonic(), []
        while True:
            pulled = list(self.pull_messages(waiting))
            replies += pulled
            waiting -= {message.metadata.reply_to_message_id for message in pulled}
            elapsed = time.monotonic() - started
            left = float("inf") if timeout is None else timeout - elapsed
            if not waiting or left <= 0:
                return replies
            time.sleep(min(max(elapsed / 20, 0.1), 3.0, left))


class PrototypeServerApp(ServerApp):
    """protofl's ServerApp: the run config's ``flower-api`` picks the front. ``"message"``: the
    method's Message-API strategy (:func:`~protofl.federation.message_front.message_strategy`) runs
    its rounds on the grid; ``"legacy"``: Flower's ServerApp of :func:`make_server_fn`, the legacy
    server loop. Either is told whether it runs a deployment (whose nodes keep their state on their
    own disks), with :class:`PromptReplies` around a deployment's grid (simulation's in-memory grid
    already polls every 0.1 s). A run that stopped raises :class:`RunFailed` at its end.
    ``run_config`` replaces ``context.run_config``, as :class:`~protofl.client_app.PrototypeClientApp`'s
    does (``flwr.simulation.run_simulation`` leaves it empty)."""

    def __init__(self, run_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(server_fn=make_server_fn(run_config))
        self.run_config = run_config

    def __call__(self, grid: Grid, context: Context) -> None:
        deployment = isinstance(grid, HttpGrid)
        if deployment:
            grid = PromptReplies(grid)
        settings = ExperimentSettings.from_run_config(
            self.run_config if self.run_config is not None else context.run_config)
        if settings.flower_api == "message":
            strategy, _ = build_strategy(settings, deployment)
            strategy.start(grid)
            stopped = strategy.stopped
        else:
            if deployment:
                replace_server_fn(self, make_server_fn(self.run_config, deployment=True))
            super().__call__(grid, context)
            stopped = server_of(self).stopped  # the PrototypeServer the server_fn made for this run
        if stopped:
            raise RunFailed(stopped)


app = PrototypeServerApp()
