"""ServerApp: builds the method's Strategy from the run config."""

from __future__ import annotations

from logging import INFO
from typing import Any, Callable, Mapping

from flwr.common import Context
from flwr.common.logger import log
from flwr.server import ServerApp, ServerAppComponents, ServerConfig, SimpleClientManager

from protofl.config import ExperimentConfig
from protofl.strategies import build_method_model, get_method
from protofl.strategies.base import PrototypeServer
from protofl.task.data import load_dataset, load_global_test
from protofl.task.train import get_device


def make_server_fn(run_config: Mapping[str, Any] | None = None) -> Callable[[Context], ServerAppComponents]:
    """``run_config`` replaces ``context.run_config`` (in-process simulations leave it empty)."""

    def server_fn(context: Context) -> ServerAppComponents:
        config = ExperimentConfig.from_run_config(run_config if run_config is not None else context.run_config)
        strategy_class, _ = get_method(config.method)
        dataset = load_dataset(config.dataset, config.data_dir)
        model = build_method_model(config, dataset)
        global_test = load_global_test(config.dataset, config.data_dir, str(get_device()))
        strategy = strategy_class(config, model, dataset.num_classes, global_test)
        log(
            INFO, "protofl: %s on %s (%s partition), %d rounds; results go to %s",
            config.method, config.dataset, config.partition, config.num_server_rounds, strategy.recorder.directory,
        )
        server = PrototypeServer(client_manager=SimpleClientManager(), strategy=strategy)
        return ServerAppComponents(server=server, config=ServerConfig(num_rounds=config.num_server_rounds))

    return server_fn


app = ServerApp(server_fn=make_server_fn())
