"""Where a client message's time goes: a federation in one process (protofl's ServerApp and
ClientApp factories, no Ray: ``tests/inprocess.py``), one client at a time as on a GPU, each phase
of every message timed.

    python benchmarks/message_profile.py --num-nodes 6 --run-config "method='fedproto' \
        model='tv-resnet18' dataset='cifar10' num-server-rounds=3" --out runs/profile

Every message runs on one thread, as a ClientApp runs them (Flower's in-process server would start
each round on new threads, whose first messages then build their model and capture their step
anew). Phases (inclusive; a phase inside another counts in both): the whole message, the client's data
(from the process cache) and model (kept, set back to its initial values), reading and saving the
client's state (the personal model), loading what the server sent, the model copied out and back
around a score that rides in a fit message (where it is not the model training starts from),
training, the BatchNorm statistics recomputed (``batchnorm-stats``), the class statistics, the
shared arrays going up. On
CUDA each phase starts and ends with ``torch.cuda.synchronize()``, so that the GPU work it queued
counts in it. Round 1 (data loading, CUDA set-up, the first capture) is left out of the means.
Writes ``message_profile.json`` under ``--out``. ``--cprofile N`` and ``--torch-profile N`` also
print where the host's time goes (cProfile) and which operators take the device's (torch.profiler,
one fit message of round 2).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import cProfile
import datetime
import json
import pstats
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from compare import machine_description  # noqa: E402
from inprocess import CALLS, InProcessGrid, InProcessProxy, run_in_process  # noqa: E402

from protofl import client_app  # noqa: E402
from protofl.federation import client as client_module  # noqa: E402
from protofl.federation import client_training  # noqa: E402
from protofl.federation.client_state import ClientStateStore  # noqa: E402
from protofl.settings import ExperimentSettings, default_run_config, parse_overrides  # noqa: E402
from protofl.strategies import get_method  # noqa: E402
from protofl.task import storage  # noqa: E402

# where the harness hands a client its message, on each Flower front: (object, attribute, its kind)
MESSAGE = {"legacy": (InProcessProxy, "_call", lambda kind, ins: kind),
           "message": (InProcessGrid, "answer", lambda message: CALLS[message.metadata.message_type])}
PHASES = {  # name: (object, attribute) wrapped; None: the method's client class, "message": the front's
    "message": None,
    "data (process cache)": (client_app, "node_data"),
    "model (kept, reset)": (client_app, "worker_model"),
    "state read": (ClientStateStore, "load"),
    "state save": (ClientStateStore, "save"),
    "receive": (None, "receive"),
    "model copied out": (client_module, "tensor_copies"),
    "model copied back": (client_module, "copy_tensors"),
    "train": (client_training, "train"),
    "batchnorm recompute": (client_module, "recompute_batchnorm_stats"),
    "statistics": (None, "local_statistics"),
    "shared arrays up": (client_module.PrototypeClient, "shared_arrays"),
    "evaluate": (client_module.PrototypeClient, "score"),
}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, function, seconds: dict[str, list[float]]):
    def wrapper(*args, **kwargs):
        synchronize()
        t0 = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            synchronize()
            seconds[name].append(time.perf_counter() - t0)

    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default="")
    parser.add_argument("--num-nodes", type=int, default=6)
    parser.add_argument("--no-fsync", action="store_true",
                        help="the state files written without fsync (to measure what fsync costs)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N functions with the most own time (cProfile)")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N",
                        help="also trace round 2's first fit message with torch.profiler and print the N "
                             "operators with the most own device time (CPU time without CUDA)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_config = default_run_config(ROOT / "pyproject.toml") | parse_overrides(args.run_config)
    run_config |= {"output-dir": str(args.out / "run"), "overwrite": True}
    rounds: list[dict[str, list[float]]] = []
    patches = contextlib.ExitStack()
    current: dict[str, list[float]] = collections.defaultdict(list)
    settings = ExperimentSettings.from_run_config(run_config)
    method_client = get_method(settings.method)[1]
    message_owner, message_attribute, kind_of = MESSAGE[settings.flower_api]
    for name, phase in PHASES.items():
        owner, attribute = phase or (message_owner, message_attribute)
        owner = method_client if owner is None else owner
        original = getattr(owner, attribute)
        patches.enter_context(mock.patch.object(owner, attribute, timed(name, original, current)))
    if args.no_fsync:
        patches.enter_context(mock.patch.object(storage.os, "fsync", lambda fd: None))
    original_message = getattr(message_owner, message_attribute)
    messages = {"count": 0}
    profiler = cProfile.Profile() if args.cprofile else None
    traced: list[torch.profiler.profile] = []

    # Flower's in-process server runs each round's messages on a new thread pool; a ClientApp (a Ray
    # actor, a SuperNode's process) runs all of its messages on one thread, which keeps its model and
    # captured steps across rounds. So does this profile.
    client_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="clientapp")

    def each_message(self, *call):
        return client_thread.submit(one_message, self, *call).result()

    def one_message(self, *call):  # every num_nodes-th fit message starts a round
        kind = kind_of(*call)
        if kind == "fit":
            messages["count"] += 1
            if messages["count"] % args.num_nodes == 1 or args.num_nodes == 1:
                rounds.append(collections.defaultdict(list))
        if profiler:  # the clients run on client_thread
            profiler.enable()
        trace = (kind == "fit" and args.torch_profile and len(rounds) == 2 and not traced)
        try:
            if trace:
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                with torch.profiler.profile(activities=activities) as tracer:
                    reply = original_message(self, *call)
                traced.append(tracer)
            else:
                reply = original_message(self, *call)
        finally:
            if profiler:
                profiler.disable()
        if rounds:
            for name, values in current.items():
                rounds[-1][name].extend(values)
        current.clear()
        return reply

    t0 = time.perf_counter()
    with patches, mock.patch.object(message_owner, message_attribute, each_message):
        run_in_process(run_config, num_nodes=args.num_nodes, one_at_a_time=True)
    wall = time.perf_counter() - t0
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    for tracer in traced:
        device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(tracer.key_averages().table(sort_by=device, row_limit=args.torch_profile))
    later = rounds[1:] or rounds
    summary = {name: {"calls_per_round": sum(len(r.get(name, [])) for r in later) / len(later),
                      "ms_per_call": 1000 * sum(sum(r.get(name, [])) for r in later)
                      / max(sum(len(r.get(name, [])) for r in later), 1),
                      "seconds_per_round": sum(sum(r.get(name, [])) for r in later) / len(later)}
               for name in PHASES}
    print(f"{len(rounds)} rounds, {args.num_nodes} clients, {wall:.1f} s in all; rounds 2.. (means):")
    print("| phase | calls per round | ms per call | seconds per round |\n|---|---|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['calls_per_round']:.0f} | {row['ms_per_call']:.1f} | {row['seconds_per_round']:.3f} |")
    record = {"command": "python benchmarks/message_profile.py " + " ".join(sys.argv[1:]),
              "date": str(datetime.date.today()), "machine": machine_description(), "wall_seconds": wall,
              "phases": summary, "rounds": [dict(r) for r in rounds]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "message_profile.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
