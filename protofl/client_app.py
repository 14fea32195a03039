"""ClientApp: the configured method's client of each partition, behind the Flower front the run
config's ``flower-api`` names (:class:`PrototypeClientApp`): Message-API handlers, or a
``NumPyClient`` (:class:`~protofl.federation.numpy_front.NumPyFront`).

The node's ``--node-config`` (in simulation: Flower's own) names the node's data:

- ``partition-id``, ``num-partitions``: which share of the run config's data set this node
  holds, and how many clients the federation has (required);
- ``data-dir``: where this node keeps that data set (overrides the run config's ``data-dir``,
  whose path is the server's);
- ``local-data-dir``: this node's own data, used whole instead of a partition (see
  :func:`protofl.task.data.load_local_client_data`);
- ``cache-dir``: keep this node's data there after its first load (deployments start a process
  per message; see :func:`protofl.task.data.cached_on_disk`);
- ``model``: this node's architecture (e.g. ``tv-resnet18``), instead of the run config's
  ``model`` or its family member; for methods that exchange no model parameters (FedSA, FedProto);
- ``num-threads``: CPU threads for this node's torch work, intra-op and inter-op (default: in a Ray
  simulation the actor's ``client-resources-num-cpus``, else torch's, one per core; set it when
  several SuperNodes share a machine, as they do in the compose demo);
- ``state-dir``: where this node keeps its partition's state across rounds (personal models),
  instead of the run config's ``state-dir``; when neither is set, ``<run directory>/client-state``
  in simulation and ``$FLWR_HOME/protofl-state`` (else ``~/.flwr/protofl-state``) of the process
  that runs the ClientApp in a deployment; ``"memory"``: Flower's in-memory ``context.state``,
  lost when the node restarts (see :mod:`protofl.federation.checkpoint`).

With the run config's ``clients-in-flight`` above 1, in a Ray simulation, a ClientApp forwards its
messages to its GPU's training worker (:mod:`protofl.federation.training_worker`), which builds the
same client.
"""

from __future__ import annotations

import contextlib
import dataclasses
from logging import INFO
from typing import Any, Callable, Mapping

import torch
from flwr.client import Client, ClientApp
from flwr.common import Context, Message
from flwr.common.logger import log

from protofl.federation.client import PrototypeClient
from protofl.federation.client_state import ClientStateStore
from protofl.federation.message_records import (
    CONFIG,
    PARAMETERS,
    evaluate_reply,
    fit_reply,
    properties_reply,
    read_instruction,
)
from protofl.federation.numpy_front import NumPyFront
from protofl.federation.training_worker import training_worker_for
from protofl.settings import ExperimentSettings
from protofl.strategies import build_method_model, get_method
from protofl.task.data import DATASETS, ClientData, cached_on_disk, load_client_data, load_local_client_data
from protofl.task.kept_models import kept_model, release_thread_models
from protofl.task.models import client_architecture
from protofl.task.precision import compute_description, get_device, set_thread_count
from protofl.task.resources import ray_cpus


def client_front(run_config: Mapping[str, Any] | None, context: Context) -> NumPyFront:
    """The front of this message's client: over the client built here, or over its GPU's training
    worker (``clients-in-flight``), which trains it. ``run_config`` replaces ``context.run_config``
    (in-process simulations leave it empty)."""
    settings = ExperimentSettings.from_run_config(run_config if run_config is not None else context.run_config)
    submit = training_worker_for(settings, context.node_config, context.run_id, build_client)
    if submit is not None:  # clients-in-flight: its GPU's training worker trains it
        return NumPyFront(submit)
    # a Ray simulation hands each partition's messages to any of its ClientApps: one would find
    # the partition's last state in its memory about once in as many messages as there are of them
    return NumPyFront.over(build_client(settings, context.node_config, context.state,
                                        keep_state_in_memory=ray_cpus() is None))


def make_client_fn(run_config: Mapping[str, Any] | None = None) -> Callable[[Context], Client]:
    """The legacy front's ``client_fn``: a ``NumPyClient`` (:func:`client_front`)."""

    def client_fn(context: Context) -> Client:
        return client_front(run_config, context).to_client()

    return client_fn


def make_message_app(run_config: Mapping[str, Any] | None = None) -> ClientApp:
    """The Message-API front: a ClientApp whose ``query``, ``train`` and ``evaluate`` handlers read
    the instruction's records, call the same client (:func:`client_front`) and reply in records
    (:mod:`protofl.federation.message_records`)."""
    app = ClientApp(mods=[release_worker_models])

    @app.query()
    def query(message: Message, context: Context) -> Message:
        config = dict(message.content.config_records.get(CONFIG, {}))
        return Message(properties_reply(client_front(run_config, context).get_properties(config)), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        parameters, config = read_instruction(message.content)
        names = list(message.content.array_records[PARAMETERS])  # the server's names of the shared entries
        trained, num_examples, metrics = client_front(run_config, context).fit(parameters, config)
        if len(names) != len(trained):
            names = [str(i) for i in range(len(trained))]  # the server drops it: not what it sent
        return Message(fit_reply(names, trained, num_examples, metrics), reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        parameters, config = read_instruction(message.content)
        loss, num_examples, metrics = client_front(run_config, context).evaluate(parameters, config)
        return Message(evaluate_reply(loss, num_examples, metrics), reply_to=message)

    return app


class PrototypeClientApp(ClientApp):
    """protofl's ClientApp: the run config's ``flower-api`` picks the front, as the ServerApp's
    does. ``"message"``: :func:`make_message_app`'s handlers; ``"legacy"``: Flower's ``client_fn``
    app of :func:`make_client_fn`. Both free the thread's models after each message."""

    def __init__(self, run_config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.run_config = run_config
        self.legacy = ClientApp(client_fn=make_client_fn(run_config), mods=[release_worker_models])
        self.message = make_message_app(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        run_config = self.run_config if self.run_config is not None else context.run_config
        api = run_config.get("flower-api", ExperimentSettings.flower_api)
        return (self.message if api == "message" else self.legacy)(message, context)


def build_client(settings: ExperimentSettings, node_config: Mapping[str, Any], state: Any,
                 keep_state_in_memory: bool = True) -> PrototypeClient:
    """The configured method's client of this node's partition (``state``: the node's
    ``context.state``, read with ``state-dir = "memory"`` only; ``keep_state_in_memory``: this
    process keeps the state it saves and reads, up to ``kept-state-mb``, for the partition's next
    message, see :class:`~protofl.federation.client_state.KeptStates`)."""
    # the run config's data-dir is the server's path: this node reads the data set (its
    # partition and the global test set) from its own
    settings = dataclasses.replace(settings, data_dir=str(node_config.get("data-dir", settings.data_dir)))
    use_threads(node_config)
    device = get_device()
    data = node_data(settings, node_config, str(device))
    model = worker_model(settings, data, str(node_config.get("model", "")) or None)
    _, client_class = get_method(settings.method)
    num_partitions = int(node_config["num-partitions"])
    state_dir = str(node_config.get("state-dir", settings.state_dir))
    kept_bytes = int(settings.kept_state_mb * 2**20) if keep_state_in_memory else 0
    store = ClientStateStore(state, data.partition_id, state_dir, kept_bytes)
    client = client_class(settings, data, model, num_partitions, store)
    announce(client.precision, device, model)
    return client


def worker_model(settings: ExperimentSettings, data: ClientData, architecture: str | None) -> torch.nn.Module:
    """The method's model for this message's client, as :func:`build_method_model` builds it: the
    thread's kept one of its kind (architecture, shapes, settings), set back to its initial values
    (:func:`~protofl.task.kept_models.kept_model`), freed when the message ends
    (:func:`release_worker_models`, a mod of :data:`app`)."""
    name = architecture or client_architecture(settings.model, data.partition_id)
    key = (name, data.in_channels, data.num_classes, data.image_size, repr(settings))
    return kept_model(key, lambda: build_method_model(settings, data, architecture))


def release_worker_models(message: Message, context: Context,
                          call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: after each message, this thread's models are free for the next one."""
    try:
        return call_next(message, context)
    finally:
        release_thread_models()


def use_threads(node_config: Mapping[str, Any]) -> None:
    """Torch's intra-op and inter-op threads: the node config's ``num-threads``, else in a Ray
    simulation the CPUs of the actor (``client-resources-num-cpus``), else torch's count; set on
    the thread that trains (:func:`~protofl.task.precision.set_thread_count`)."""
    if "num-threads" in node_config:
        threads = int(node_config["num-threads"])
        if threads < 1:
            raise ValueError(f"num-threads must be >= 1, got {threads}")
    else:
        threads = ray_cpus()
    set_thread_count(threads)
    if threads is not None and torch.get_num_interop_threads() != threads:
        with contextlib.suppress(RuntimeError):  # settable once, before the first inter-op work
            torch.set_num_interop_threads(threads)


_announced: set[tuple] = set()


def announce(precision: Mapping[str, Any], device: torch.device, model: torch.nn.Module) -> None:
    """Log once per process how this ClientApp computes: device, threads, precision, memory format,
    training step (``precision``: the client's ``amp``, ``channels_last``, ``cuda_graphs``)."""
    described = compute_description(device=device, model=model, **precision)
    key = tuple(sorted(described.items()))
    if key not in _announced:
        _announced.add(key)
        log(INFO, "protofl ClientApp: %s", ", ".join(f"{k} {v}" for k, v in described.items()))


def node_data(settings: ExperimentSettings, node_config: Mapping[str, Any], device: str) -> ClientData:
    """This node's data: its own directory (``local-data-dir``), else its partition."""
    missing = [key for key in ("partition-id", "num-partitions") if key not in node_config]
    if missing:
        raise ValueError(f"the node config lacks {', '.join(missing)} (flower-supernode --node-config)")
    partition_id = int(node_config["partition-id"])
    spec = settings.partition_spec(int(node_config["num-partitions"]))
    local_dir = str(node_config.get("local-data-dir", ""))
    data_dir = local_dir or str(node_config.get("data-dir", settings.data_dir))
    loader = load_local_client_data if local_dir else load_client_data

    def load() -> ClientData:
        return loader(settings.dataset, data_dir, spec, partition_id, device)

    cache_dir = str(node_config.get("cache-dir", ""))
    if not cache_dir or settings.dataset not in DATASETS:  # an unknown data set: the loader says so
        return load()
    key = (settings.dataset, data_dir, bool(local_dir), spec, partition_id)
    # what this node knows its data to be: the cache file must agree
    return cached_on_disk(cache_dir, key, data_dir, load, device, partition_id=partition_id,
                          num_classes=DATASETS[settings.dataset][0])


app = PrototypeClientApp()
