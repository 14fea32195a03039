"""ServerApp: builds the method's Strategy from the run config, and runs Flower's server loop with
protofl's summary at the end."""

from __future__ import annotations

import time
from logging import ERROR, INFO
from typing import Any, Callable, Mapping

from flwr.common import Context
from flwr.common.logger import log
from flwr.server import History, Server, ServerApp, ServerAppComponents, ServerConfig, SimpleClientManager

from protofl.federation.server import RunStopped
from protofl.report import summary_text
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.task.data import load_dataset, load_global_test, partition_sizes
from protofl.task.train import get_device


class RunSummary(History):
    """Flower's History, printed in the [SUMMARY] log as protofl's summary instead of every metric."""

    summary = ""

    def __str__(self) -> str:
        return self.summary


class PrototypeServer(Server):
    """Flower's Server loop, plus the strategy's final files and summary once all rounds are done,
    or once a round stops the run (:class:`RunStopped`: one error line, no traceback)."""

    def fit(self, num_rounds: int, timeout: float | None) -> tuple[History, float]:
        started = time.perf_counter()
        recorder = self.strategy.recorder
        try:
            history, elapsed = super().fit(num_rounds, timeout)
        except RunStopped as stop:
            log(ERROR, "protofl: the run stopped. %s", stop)
            history, elapsed = History(), time.perf_counter() - started
            recorder.extra["stopped"] = str(stop)
        recorder.extra["total_seconds"] = elapsed
        summary = RunSummary()
        summary.__dict__.update(history.__dict__)
        summary.summary = summary_text(recorder.write(plot=True), recorder.directory)
        return summary, elapsed


def make_server_fn(run_config: Mapping[str, Any] | None = None) -> Callable[[Context], ServerAppComponents]:
    """``run_config`` replaces ``context.run_config`` (in-process simulations leave it empty)."""

    def server_fn(context: Context) -> ServerAppComponents:
        settings = ExperimentSettings.from_run_config(run_config if run_config is not None else context.run_config)
        strategy_class, _ = get_method(settings.method)
        dataset = load_dataset(settings.dataset, settings.data_dir)
        model = build_method_model(settings, dataset)
        global_test = load_global_test(settings.dataset, settings.data_dir, str(get_device()))
        sizes = None
        if settings.verify_partitions:  # the server's copy of the data set says what each partition holds

            def sizes(num_partitions: int, partition_id: int):
                spec = settings.partition_spec(num_partitions)
                return partition_sizes(settings.dataset, settings.data_dir, spec, partition_id)

        strategy = strategy_class(settings, model, dataset.num_classes, global_test, partition_sizes=sizes)
        log(
            INFO, "protofl: %s on %s (%s partition), %d rounds; results go to %s",
            settings.method, settings.dataset, settings.partition, settings.num_server_rounds,
            strategy.recorder.directory,
        )
        server = PrototypeServer(client_manager=SimpleClientManager(), strategy=strategy)
        return ServerAppComponents(server=server, config=ServerConfig(num_rounds=settings.num_server_rounds))

    return server_fn


app = ServerApp(server_fn=make_server_fn())
