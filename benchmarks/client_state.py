"""What keeping client state on disk (the default) costs a round, against keeping it in memory.

    python benchmarks/client_state.py --models cnn tv-resnet18 --out runs/client-state

For each model, a FedProto client (its state: the whole personal model) of partition 0 fits once
per round for ``--rounds`` rounds, twice over, alternating: with the state in memory
(``state-dir="memory"``) and on disk (the default, a state dir as in simulation), each fit the whole
client (``client_fn``, restore, one local epoch, the prototype pass, the upload, the save). The
table gives the median fit time of each; the times of the save alone (``ClientStateStore.save``:
an array blob, a temporary file fsynced and renamed, the directory fsynced, old versions deleted)
and of the load (the newest version read back), and their share of the disk fit; the bytes of one
version and what the partition's directory holds after the last round (``checkpoint-every=1``: two
versions). Round 1 of each side is left out (warm-up). Writes ``<out>/client_state.json`` and
``<out>/client_state.md`` and prints the table.

``--formats N``: instead, one version of each model's state saved and read back N times in each
file format, taking turns: ``.npz`` (what state files were until 2026-11-26) and the array blob
(``protofl.task.storage``), with the same atomic, fsynced write; and the blob written and renamed
with its fsync on the background thread (``durable=False``: a simulated client's save), whose
fsync may still run during the next format's turn. The model's tensors as the client hands them
over. Medians; writes ``<out>/state_formats.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import machine_description  # noqa: E402
from flwr.app import RecordDict  # noqa: E402
from flwr.common import Context, FitIns, ndarrays_to_parameters  # noqa: E402

from protofl.client_app import make_client_fn  # noqa: E402
from protofl.federation import client_state  # noqa: E402
from protofl.federation.wire import round_config  # noqa: E402
from protofl.settings import default_run_config, parse_overrides  # noqa: E402
from protofl.task import storage  # noqa: E402
from protofl.task.models import build_model  # noqa: E402
from protofl.task.weights import all_tensors  # noqa: E402


def measure(model: str, args: argparse.Namespace) -> dict:
    run_config = default_run_config(ROOT / "pyproject.toml") | parse_overrides(args.run_config) | {
        "method": "fedproto", "model": model}
    node_config = {"partition-id": 0, "num-partitions": args.num_partitions}
    timings: dict[str, list[float]] = {"save": [], "load": []}
    originals = {name: getattr(client_state.ClientStateStore, name) for name in timings}

    def timed(name):
        def call(self, *a, **kw):
            started = time.perf_counter()
            result = originals[name](self, *a, **kw)
            if self.directory is not None:
                timings[name].append(time.perf_counter() - started)
            return result
        return call

    for name in timings:
        setattr(client_state.ClientStateStore, name, timed(name))
    fits: dict[str, list[float]] = {"memory": [], "disk": []}
    with tempfile.TemporaryDirectory(prefix="protofl-state-") as state_dir:
        contexts = {"memory": RecordDict(), "disk": RecordDict()}
        functions = {"memory": make_client_fn(run_config | {"state-dir": "memory"}), "disk": make_client_fn(run_config)}
        for server_round in range(1, args.rounds + 1):
            config = round_config(server_round, server_round, "bench", "ab", server_round - 1, state_dir)
            for side in ("memory", "disk") if server_round % 2 else ("disk", "memory"):
                context = Context(run_id=1, node_id=1, node_config=node_config, state=contexts[side], run_config={})
                started = time.perf_counter()
                functions[side](context).fit(FitIns(ndarrays_to_parameters([]), config))
                fits[side].append(time.perf_counter() - started)
        folder = Path(state_dir) / "bench" / "partition-0"
        versions = sorted(folder.glob("*.state"))
        version_bytes = versions[-1].stat().st_size
        on_disk = sum(p.stat().st_size for p in versions)
    for name, original in originals.items():
        setattr(client_state.ClientStateStore, name, original)
    memory_fit, disk_fit = statistics.median(fits["memory"][1:]), statistics.median(fits["disk"][1:])
    save, load = statistics.median(timings["save"][1:]), statistics.median(timings["load"][1:])
    return {
        "model": model, "rounds": args.rounds, "fit_memory_s": round(memory_fit, 3), "fit_disk_s": round(disk_fit, 3),
        "save_s": round(save, 4), "load_s": round(load, 4), "save_load_share": round((save + load) / disk_fit, 4),
        "version_mib": round(version_bytes / 2**20, 2), "on_disk_mib": round(on_disk / 2**20, 2),
        "versions_kept": len(versions),
    }


def format_timings(model: str, repeats: int) -> dict:
    tensors = all_tensors(build_model(model, 3, 10, 32, 0))  # CIFAR-10's shapes
    arrays = {name: t.detach().to("cpu", copy=True).numpy() for name, t in tensors.items()}
    formats = {  # name: (write, read)
        "npz": (lambda p: storage.atomic_write(p, storage.arrays_to_bytes(arrays)),
                lambda p: storage.arrays_from_bytes(p.read_bytes())),
        "blob": (lambda p: storage.atomic_write(p, storage.array_blob_parts(arrays)),
                 lambda p: storage.arrays_from_blob(storage.read_file(p))),
        "blob, fsync in the background": (  # a simulated client's save (the server syncs before its checkpoint)
            lambda p: storage.atomic_write(p, storage.array_blob_parts(arrays), durable=False),
            lambda p: storage.arrays_from_blob(storage.read_file(p))),
    }
    seconds = {f"{name} {step}": [] for name in formats for step in ("save", "load")}
    with tempfile.TemporaryDirectory(prefix="protofl-formats-") as directory:
        for _ in range(repeats):
            for name, (write, read) in formats.items():
                path = Path(directory) / name
                for step, action in (("save", write), ("load", read)):
                    started = time.perf_counter()
                    action(path)
                    seconds[f"{name} {step}"].append(time.perf_counter() - started)
    return {"model": model, "mib": round(sum(a.nbytes for a in arrays.values()) / 2**20, 1)} | {
        k: round(statistics.median(v), 4) for k, v in seconds.items()}


def table(rows: list[dict]) -> str:
    lines = ["| model | fit, memory (s) | fit, disk (s) | save (s) | load (s) | (save + load) / fit | "
             "one version (MiB) | on disk per client (MiB, versions) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['fit_memory_s']} | {r['fit_disk_s']} | {r['save_s']} | {r['load_s']} | "
                     f"{100 * r['save_load_share']:.1f} % | {r['version_mib']} | "
                     f"{r['on_disk_mib']} ({r['versions_kept']}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "tv-resnet18"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-partitions", type=int, default=20)
    parser.add_argument("--run-config", default="dataset='fmnist' local-epochs=1 batch-size=10 lr=0.005",
                        help="run-config overrides (flwr's form)")
    parser.add_argument("--formats", type=int, default=0, metavar="N")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "client-state")
    args = parser.parse_args()
    if args.formats:
        rows = [format_timings(model, args.formats) for model in args.models]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "state_formats.json").write_text(json.dumps(rows, indent=2))
        print(f"{datetime.date.today()}, {machine_description()}, `{' '.join(sys.argv)}`")
        for row in rows:
            print(row)
        return
    rows = []
    for model in args.models:
        rows.append(measure(model, args))
        print(rows[-1], flush=True)
    text = table(rows)
    header = f"{datetime.date.today()}, {machine_description()}, `{' '.join(sys.argv)}`\n\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_state.md").write_text(header + text)
    (args.out / "client_state.json").write_text(json.dumps(rows, indent=2))
    print("\n" + header + text)


if __name__ == "__main__":
    main()
