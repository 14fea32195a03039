"""Several clients' local training at once behind one GPU (run config ``clients-in-flight = K``).

Flower's Ray simulation hands each ClientApp one message at a time, and ClientApps sharing a GPU
take turns on it: their training never overlaps, and a captured step leaves the GPU idle most of
the time. With ``clients-in-flight = K`` (K > 1), a ClientApp forwards each message to the training
worker of its GPU (:class:`TrainingWorker`, a Ray actor per run and set of visible GPUs, made by the
first ClientApp that needs it): one process that runs up to K messages at once, each on a thread
with its own CUDA stream, kept model and kept captured steps, and builds the same client a
ClientApp would. The ClientApps only forward (:class:`~protofl.federation.numpy_front.NumPyFront`);
give a GPU at least K of them (``client-resources-num-gpus``). Captures wait for the other threads'
messages (:data:`protofl.task.capture.CAPTURE_GATE`).

Only in a Ray simulation, and not with ``state-dir = "memory"`` (that state lives in the ClientApp's
``context.state``, which the worker does not see); otherwise each message trains in its ClientApp
as before, and the ClientApp logs why once. A client's results are its ClientApp's; its compute
description in results.json says ``clients_in_flight``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from logging import INFO
from typing import Any, Callable, Mapping

import numpy as np
import torch
from flwr.common.logger import log

from protofl.federation.client_state import MEMORY
from protofl.federation.numpy_front import Submit
from protofl.federation.wire import COMPUTE, decode_compute, encode_compute
from protofl.settings import ExperimentSettings
from protofl.task.capture import CAPTURE_GATE
from protofl.task.kept_models import release_thread_models

WORKER_NAME = "protofl-training-worker"
CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"


class TrainingWorker:
    """Runs clients' calls (``fit``, ``evaluate``, ``get_properties``, ``get_parameters``), as
    many at once as its callers' threads (Ray's ``max_concurrency``). ``build_client(settings,
    node_config, state)``: the client a ClientApp would build (:func:`protofl.client_app.build_client`);
    ``visible_devices``: the GPUs to use (``CUDA_VISIBLE_DEVICES``, which Ray empties in an actor
    that asks for no GPU), None: as this process sees them; ``threads``: torch's CPU threads."""

    def __init__(self, build_client: Callable[..., Any], visible_devices: str | None, threads: int,
                 clients_in_flight: int) -> None:
        if visible_devices is not None:  # before CUDA starts in this process, which reads it once
            os.environ[CUDA_DEVICES] = visible_devices
            if torch.cuda.is_available():
                torch.cuda.init()
        self.build_client, self.clients_in_flight = build_client, clients_in_flight
        torch.set_num_threads(threads)
        self._streams = threading.local()

    def call(self, settings: ExperimentSettings, node_config: Mapping[str, Any], method: str, *args: Any) -> Any:
        if method in ("fit", "evaluate"):  # Ray hands large arrays over read-only, in its object store
            args = ([np.array(array) for array in args[0]], *args[1:])
        with CAPTURE_GATE.work(), self._own_stream():
            try:
                client = self.build_client(settings, node_config, None)
                reply = getattr(client, method)(*args)
            finally:
                release_thread_models()
        if method == "fit":
            parameters, num_examples, metrics = reply
            described = decode_compute(metrics.get(COMPUTE)) or {}
            metrics = {**metrics, COMPUTE: encode_compute(described | {"clients_in_flight": self.clients_in_flight})}
            reply = parameters, num_examples, metrics
        return reply

    def _own_stream(self) -> contextlib.AbstractContextManager:
        """This thread's CUDA stream, so that the messages in flight overlap on the GPU."""
        if not torch.cuda.is_available():
            return contextlib.nullcontext()
        if not hasattr(self._streams, "stream"):
            self._streams.stream = torch.cuda.Stream()
        return torch.cuda.stream(self._streams.stream)


_not_engaged: set[str] = set()  # why not, each logged once per process
_handles: dict[str, Any] = {}  # worker name -> Ray actor handle, this process's


def training_worker_for(settings: ExperimentSettings, node_config: Mapping[str, Any], run_id: int,
                        build_client: Callable[..., Any]) -> Submit | None:
    """How this ClientApp submits its calls to its GPU's training worker, or None when it trains
    them itself (``clients-in-flight`` 0 or 1, no Ray simulation, a state in memory)."""
    in_flight = settings.clients_in_flight
    if in_flight <= 1:
        return None
    ray = sys.modules.get("ray")
    state_dir = str(node_config.get("state-dir", settings.state_dir))
    why = ("not in a Ray simulation" if ray is None or not ray.is_initialized()
           else "state-dir='memory' keeps each node's state in its own ClientApp" if state_dir == MEMORY else "")
    if why:
        if why not in _not_engaged:
            _not_engaged.add(why)
            log(INFO, "protofl ClientApp: clients-in-flight=%d has no effect here (%s): "
                "each message trains in its ClientApp", in_flight, why)
        return None
    devices = os.environ.get(CUDA_DEVICES)  # this ClientApp's GPU share, as Ray set it
    name = f"{WORKER_NAME}-{run_id}-gpus-{devices or 'none'}"
    handle = _handles.get(name) or _start_worker(ray, name, build_client, devices, in_flight)
    _handles[name] = handle

    def submit(method: str, *args: Any) -> Any:
        try:
            return ray.get(handle.call.remote(settings, dict(node_config), method, *args))
        except ray.exceptions.RayTaskError as error:
            raise error.as_instanceof_cause() from None  # the client's own exception
        except ray.exceptions.RayActorError:
            _handles.pop(name, None)  # gone (its creator ended): the next message starts another
            raise

    return submit


def _start_worker(ray: Any, name: str, build_client: Callable[..., Any], devices: str | None,
                  in_flight: int) -> Any:
    """The run's worker of this GPU, made if no ClientApp made it yet. It asks Ray for no CPU and no
    GPU (Flower's pool of ClientApps may hold them all) and uses the GPUs its maker sees."""
    log(INFO, "protofl ClientApp: training through %s, up to %d clients in flight", name, in_flight)
    worker = ray.remote(TrainingWorker).options(name=name, get_if_exists=True, max_concurrency=in_flight,
                                                num_cpus=0, num_gpus=0)
    return worker.remote(build_client, devices, torch.get_num_threads(), in_flight)
