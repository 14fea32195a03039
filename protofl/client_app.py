"""ClientApp: one NumPyClient of the configured method per partition."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from flwr.client import Client, ClientApp
from flwr.common import Context

from protofl.config import ExperimentConfig
from protofl.strategies import build_method_model, get_method
from protofl.task.data import load_client_data, load_dataset
from protofl.task.train import get_device


def make_client_fn(run_config: Mapping[str, Any] | None = None) -> Callable[[Context], Client]:
    """``run_config`` replaces ``context.run_config`` (in-process simulations leave it empty)."""

    def client_fn(context: Context) -> Client:
        config = ExperimentConfig.from_run_config(run_config if run_config is not None else context.run_config)
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
        dataset = load_dataset(config.dataset, config.data_dir)
        spec = config.partition_spec(num_partitions)
        data = load_client_data(config.dataset, config.data_dir, spec, partition_id, str(get_device()))
        model = build_method_model(config, dataset)
        _, client_class = get_method(config.method)
        return client_class(config, data, model, num_partitions, context.state).to_client()

    return client_fn


app = ClientApp(client_fn=make_client_fn())
