"""The per-GPU training worker (run config ``clients-in-flight``): several clients' messages at once
in one process, each on a thread of its own, with the results a ClientApp gives one message at a
time; and the gate that keeps a CUDA graph's capture alone in its process."""

import json
import logging
import os
import sys
import threading

import pytest
import torch
from flwr.client import NumPyClient
from inprocess import SHORT_RUN_OPTIONS, TEMPLATE_METHODS, run_in_process
from test_capture import float32_on_cuda, gpu  # noqa: F401 (a fixture)

from protofl import client_app
from protofl.client_app import build_client
from protofl.federation import training_worker
from protofl.federation.numpy_front import NumPyFront
from protofl.federation.training_worker import TrainingWorker, training_worker_for
from protofl.settings import ExperimentSettings
from protofl.strategies import METHODS
from protofl.task.capture import CaptureGate


def test_a_capture_waits_for_the_other_threads_work_and_new_work_waits_for_it():
    gate, events = CaptureGate(), []
    other_inside, capture_waiting, release_other = threading.Event(), threading.Event(), threading.Event()

    def other():  # a client on another thread, in the middle of its message
        with gate.work():
            other_inside.set()
            release_other.wait(5)
            events.append("other's work ends")

    def capturing():  # a client whose message reaches a capture
        with gate.work():
            other_inside.wait(5)
            capture_waiting.set()
            with gate.capture():
                events.append("capture")
            events.append("capturing thread's work goes on")

    def late():  # a message that arrives while the capture waits
        capture_waiting.wait(5)
        with gate.work():
            events.append("late work")

    threads = [threading.Thread(target=f) for f in (other, capturing, late)]
    for thread in threads:
        thread.start()
    capture_waiting.wait(5)
    assert not events  # the capture waits for the other thread's work, and the late work for the capture
    release_other.set()
    for thread in threads:
        thread.join(5)
    assert events[:2] == ["other's work ends", "capture"]
    assert set(events[2:]) == {"capturing thread's work goes on", "late work"}


def test_a_capture_outside_any_work_goes_at_once_and_two_captures_take_turns():
    gate, inside, most = CaptureGate(), [], []

    def capture():
        with gate.capture():
            inside.append(1)
            most.append(len(inside))
            threading.Event().wait(0.05)
            inside.pop()

    threads = [threading.Thread(target=capture) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert most == [1, 1, 1]


RUN_CONFIG = {"dataset": "digits", "num-server-rounds": 2, "method": "fedproto", "batch-size": 32, **SHORT_RUN_OPTIONS}


def through_a_worker(monkeypatch, worker, settings, in_flight):
    """The in-process federation's ClientApps forward their messages to ``worker`` from the threads
    Flower gives them, as each does to its GPU's worker; ``in_flight`` gets the most calls seen at once."""
    lock, inside = threading.Lock(), []

    def call(node_config, method, *args):
        with lock:
            inside.append(1)
            in_flight.append(len(inside))
        try:
            return worker.call(settings, node_config, method, *args)
        finally:
            with lock:
                inside.pop()

    def the_worker(settings, node_config, run_id, build):
        node_config = dict(node_config)
        return lambda method, *args: call(node_config, method, *args)

    monkeypatch.setattr(client_app, "training_worker_for", the_worker)


def one_at_a_time_and_at_once(tmp_path, monkeypatch, run_config):
    """results.json of the run one message at a time, and of the same run with three clients at once
    in a training worker (on Flower's threads, as a worker's callers); the most calls at once."""
    plain = run_config | {"output-dir": str(tmp_path), "run-name": "plain"}
    run_in_process(plain, one_at_a_time=True)
    forwarded = run_config | {"output-dir": str(tmp_path), "run-name": "worker", "clients-in-flight": 3}
    in_flight, worker = [], TrainingWorker(build_client, None, torch.get_num_threads(), 3)
    with monkeypatch.context() as patched:
        through_a_worker(patched, worker, ExperimentSettings.from_run_config(forwarded), in_flight)
        run_in_process(forwarded, one_at_a_time=False)
    return *(json.loads((tmp_path / name / "results.json").read_text()) for name in ("plain", "worker")), max(in_flight)


def assert_same_results(one_at_a_time, at_once):
    for before, again in zip(one_at_a_time["rounds"], at_once["rounds"], strict=True):
        for key in ("clients", "train_loss", "global_accuracy", "personalized_accuracy", "personalized_std"):
            assert again[key] == before[key], key
    assert {c["clients_in_flight"] for c in at_once["client_compute"].values()} == {3}
    assert all("clients_in_flight" not in c for c in one_at_a_time["client_compute"].values())


@pytest.mark.parametrize("method, front", [(m, "message") if m == "fedproto" else
                                           pytest.param(m, "message", marks=pytest.mark.slow) for m in sorted(METHODS)]
                         + [pytest.param(m, "legacy", marks=pytest.mark.slow) for m in TEMPLATE_METHODS])
def test_clients_trained_at_once_in_one_worker_give_the_results_of_one_at_a_time(tmp_path, monkeypatch, method,
                                                                                  front):
    """Every method on the Message API (a method's client may hold state that clients at once would
    share), a method of each family on the legacy front (the worker runs either front's clients)."""
    one_at_a_time, at_once, most_in_flight = one_at_a_time_and_at_once(
        tmp_path, monkeypatch, RUN_CONFIG | {"method": method, "flower-api": front})
    assert_same_results(one_at_a_time, at_once)
    assert most_in_flight > 1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_clients_captured_at_once_on_streams_of_their_own_give_the_results_of_one_at_a_time(tmp_path, monkeypatch,
                                                                                             float32_on_cuda, amp):
    """Deterministic kernels (float32_on_cuda): the same numbers whichever stream and thread runs them."""
    one_at_a_time, at_once, most_in_flight = one_at_a_time_and_at_once(tmp_path, monkeypatch, RUN_CONFIG | {
        "amp": amp, "num-server-rounds": 3})
    assert_same_results(one_at_a_time, at_once)
    assert most_in_flight > 1
    assert {c["training_step"] for c in at_once["client_compute"].values()} == {"captured"}


def test_the_proxy_forwards_each_call_and_raises_what_the_client_raised():
    calls = []

    def submit(method, *args):
        calls.append((method, *args))
        if method == "evaluate":
            raise ValueError("the client's own error")
        return {"fit": ([], 3, {}), "get_properties": {"a": 1}, "get_parameters": []}[method]

    proxy = NumPyFront(submit)
    assert isinstance(proxy, NumPyClient)
    assert proxy.fit([1], {"c": 2}) == ([], 3, {})
    assert proxy.get_properties({"p": 1}) == {"a": 1}
    assert proxy.get_parameters({}) == []
    with pytest.raises(ValueError, match="the client's own error"):
        proxy.evaluate([2], {})
    assert calls == [("fit", [1], {"c": 2}), ("get_properties", {"p": 1}), ("get_parameters", {}),
                     ("evaluate", [2], {})]


class RayStarted:
    """What the worker's choice reads of a Ray simulation: Ray imported and started."""

    @staticmethod
    def is_initialized():
        return True


@pytest.mark.parametrize("run_config, node_config, in_ray, why", [
    ({"clients-in-flight": 0}, {}, True, None),
    ({"clients-in-flight": 1}, {}, True, None),
    ({"clients-in-flight": 4}, {}, False, "not in a Ray simulation"),
    ({"clients-in-flight": 4, "state-dir": "memory"}, {}, True, "state-dir"),
    ({"clients-in-flight": 4}, {"state-dir": "memory"}, True, "state-dir"),
])
def test_no_worker_without_ray_with_memory_state_or_one_client_in_flight(caplog, monkeypatch, run_config, node_config,
                                                                          in_ray, why):
    monkeypatch.setattr(training_worker, "_not_engaged", set())
    if in_ray:
        monkeypatch.setitem(sys.modules, "ray", RayStarted)
    else:
        monkeypatch.delitem(sys.modules, "ray", raising=False)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            settings = ExperimentSettings.from_run_config(RUN_CONFIG | run_config)
            assert training_worker_for(settings, node_config | {"num-partitions": 2}, 1, build_client) is None
    said = [r.getMessage() for r in caplog.records if "clients-in-flight" in r.getMessage()]
    assert len(said) == (1 if why else 0)  # once per process
    assert all(why in line for line in said)


def test_the_client_app_trains_in_its_own_process_when_no_worker_is_engaged(tmp_path):
    run_in_process(RUN_CONFIG | {"output-dir": str(tmp_path), "run-name": "r", "clients-in-flight": 4,
                                 "num-server-rounds": 1})
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert all("clients_in_flight" not in c for c in results["client_compute"].values())


class ShowsItsGPUs(NumPyClient):
    def get_properties(self, config):
        return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}


def shows_its_gpus(settings, node_config, state):
    """A client that tells which GPUs its process sees."""
    return ShowsItsGPUs()


@pytest.mark.slow
def test_the_worker_sees_the_gpu_of_the_client_apps_that_made_it_though_ray_hides_it():
    """Ray empties CUDA_VISIBLE_DEVICES in an actor that asks for no GPU (ray 2.55's default), as
    the worker does so as not to take a share from Flower's ClientApps; it sees theirs instead."""
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    @ray.remote(num_cpus=0, num_gpus=0.5)
    class ClientAppOnAGPU:  # a ClientApp actor of Flower's pool, with half the pretend GPU
        def forwarded(self):
            settings = ExperimentSettings.from_run_config(RUN_CONFIG | {"clients-in-flight": 2})
            submit = training_worker_for(settings, {"num-partitions": 2}, 7, shows_its_gpus)
            return os.environ.get("CUDA_VISIBLE_DEVICES"), submit("get_properties", {})

    @ray.remote(num_cpus=0, num_gpus=0)
    def sees():
        return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")

    ray.init(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)  # a pretend GPU
    try:
        assert ray.get(sees.remote(), timeout=60) == ""  # what an actor without a GPU share sees
        apps = [ClientAppOnAGPU.remote() for _ in range(2)]
        (devices, shown), again = ray.get([a.forwarded.remote() for a in apps], timeout=60)
        assert devices == "0" and shown == {"visible": "0"} and again == (devices, shown)
        assert ray.get_actor(f"{training_worker.WORKER_NAME}-7-gpus-0")  # one worker, both apps' GPU
    finally:
        ray.shutdown()
