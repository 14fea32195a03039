"""Local training and evaluation throughput (samples per second) on a preset's shapes, offline.

    python benchmarks/throughput.py --preset presets/fednh-cifar10-dir0.3.toml --num-clients 100 \
        --batch-sizes 10,64 --rounds 3 --out runs/throughput

No data files and no Flower: the images are random tensors of the data set's shape
(``protofl.task.data.SHAPES``: channels, image size, training and test images), made on the device,
with labels spread evenly over the classes, as in CIFAR, EMNIST Balanced or Tiny-ImageNet. They are
split over ``--num-clients`` clients by the run config's own partitioner and local train/test split
(``partition``, ``alpha``, ``test-fraction``, ``pool``, ...), so each client holds as many samples
of each class as it would of such a class-balanced data set. With ``test-fraction=0`` every client
scores the global test set.

Each round, for every client in turn (all of them, whatever ``fraction-fit``): load the global
weights, train one local epoch with `protofl.task.train.train` (the run config's lr, momentum,
weight decay, clipping, partial batch, augmentation, amp, channels-last and cuda-graphs; no
method's extra loss, no BatchNorm recomputation: FedAvg's local work), then `features_and_logits` over the client's test
data. One warm-up round, then ``--rounds`` timed rounds, per model and batch size; the
``--variant``s (run-config overrides, e.g. precision and memory format) take turns on each
client's work, so that they are measured side by side. Training samples/s = the clients' training samples
(one epoch's worth per round; a dropped partial batch still counts) / the seconds spent in
``train``; evaluation samples/s likewise. Writes ``throughput.json`` and ``throughput.md`` under
``--out``.

``--in-flight K1,K2,...`` measures instead K clients' local training at once in this process: each
on a thread and CUDA stream of its own, with its own model (and captured steps kept on its thread),
client p on thread p mod K; training samples/s = the clients' training samples / the round's wall
time (each client's weights loaded and its epoch trained). Its warm-up round runs the threads one
after the other, so that each captures its steps while no other CUDA work runs.

``--processes N`` runs N such measurements at once, each in a process of its own with
``--threads`` torch threads, as N simulation actors share a machine; the table then gives their
summed samples/s (e.g. 2 processes x 1 thread against 2 x 2 on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import machine_description, preset_federation, preset_overrides  # noqa: E402

from protofl.settings import ExperimentSettings, default_run_config, parse_overrides  # noqa: E402
from protofl.strategies import get_method  # noqa: E402
from protofl.task.augment import make_augment  # noqa: E402
from protofl.task import capture  # noqa: E402
from protofl.task.capture import resolve_cuda_graphs  # noqa: E402
from protofl.task.data import DATASETS, SHAPES, black_level  # noqa: E402
from protofl.task.models import build_model, client_architecture  # noqa: E402
from protofl.task.partition import client_split, partition_indices  # noqa: E402
from protofl.task.sampling import client_seed  # noqa: E402
from protofl.task.inference import features_and_logits  # noqa: E402
from protofl.task.precision import get_device, resolve_amp, uses_channels_last  # noqa: E402
from protofl.task.train import train  # noqa: E402
from protofl.task.weights import get_weights, set_weights  # noqa: E402


def train_arguments(settings: ExperimentSettings, seed: int) -> dict:
    """The training loop's arguments of a round-1 client of ``settings``' method (its clipping)."""
    options = get_method(settings.method)[0].options_class.from_settings(settings)
    return settings.train_arguments(1, seed, options)


def stand_in_clients(settings: ExperimentSettings, num_clients: int, device: torch.device) -> list[tuple]:
    """Per client (train_x, train_y, test_x, test_y) of random images on ``device``, split as the
    run config splits the real data set (labels: every class equally often, in a seeded order)."""
    channels, size, num_train, num_test = SHAPES[settings.dataset]
    num_classes = DATASETS[settings.dataset][0]
    pool = num_train + (num_test if settings.pool == "train+test" else 0)
    labels = np.random.default_rng(settings.partition_seed).permutation(np.arange(pool) % num_classes)
    spec = settings.partition_spec(num_clients)
    generator = torch.Generator(device).manual_seed(settings.seed)

    def images(count: int) -> torch.Tensor:
        return torch.randn(count, channels, size, size, generator=generator, device=device)

    def split(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return images(len(indices)), torch.from_numpy(labels[indices]).to(device)

    global_test = None  # with test-fraction=0 every client scores the global test set (the same tensors)
    if spec.test_fraction == 0:
        global_test = images(num_test), torch.arange(num_test, device=device) % num_classes
    clients = []
    for p, part in enumerate(partition_indices(labels, spec)):
        train_idx, test_idx = client_split(labels, part, spec, p)
        clients.append((*split(train_idx), *(split(test_idx) if global_test is None else global_test)))
    return clients


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def client_models(settings: ExperimentSettings, num_clients: int) -> tuple:
    """(channels, image size, classes, each client's architecture, the augmentation) of a run."""
    channels, size, _, _ = SHAPES[settings.dataset]
    fill = torch.from_numpy(black_level(settings.dataset, settings.normalisation)).expand(channels)
    architectures = [client_architecture(settings.model, p) for p in range(num_clients)]
    return channels, size, DATASETS[settings.dataset][0], architectures, make_augment(settings.augment, fill)


def measure(variants: dict[str, ExperimentSettings], clients: list[tuple], batch_size: int, rounds: int,
            device: torch.device) -> dict[str, dict]:
    """One warm-up round and ``rounds`` timed rounds of every client's local epoch and evaluation,
    for each variant (label -> settings of one model): the variants take turns on each client's
    work, so that what else runs on the machine slows them alike. A round's seconds: its training
    and scoring."""
    some = next(iter(variants.values()))
    channels, size, num_classes, architectures, augment = client_models(some, len(clients))
    models = {label: {a: build_model(a, channels, num_classes, size, some.seed).to(device) for a in set(architectures)}
              for label in variants}
    global_weights = {a: get_weights(model) for a, model in next(iter(models.values())).items()}
    timings = {label: {"train": [], "eval": [], "round": []} for label in variants}
    for server_round in range(rounds + 1):  # round 0: warm-up
        spent = {label: {"train": 0.0, "eval": 0.0} for label in variants}
        for p, (train_x, train_y, test_x, _) in enumerate(clients):
            for label, settings in variants.items():  # each client's work in every variant, in turn
                model = models[label][architectures[p]]
                set_weights(model, global_weights[architectures[p]])
                sync(device)
                t0 = time.perf_counter()
                train(model, train_x, train_y, augment=augment, **train_arguments(
                    settings, client_seed(settings.seed, server_round, p)) | {"epochs": 1, "batch_size": batch_size})
                sync(device)
                t1 = time.perf_counter()
                features_and_logits(model, test_x, **settings.precision)
                sync(device)
                spent[label]["train"] += t1 - t0
                spent[label]["eval"] += time.perf_counter() - t1
        for label, t in spent.items():
            if server_round > 0:
                timings[label]["train"].append(t["train"])
                timings[label]["eval"].append(t["eval"])
                timings[label]["round"].append(t["train"] + t["eval"])
            print(f"{some.model} {label} batch {batch_size} round {server_round}"
                  f"{' (warm-up)' if server_round == 0 else ''}: train {t['train']:.2f} s, eval {t['eval']:.2f} s",
                  flush=True)
    train_samples = sum(len(c[1]) for c in clients)
    eval_samples = sum(len(c[3]) for c in clients)
    return {label: {
        "memory_format": "channels-last" if uses_channels_last(
            models[label][architectures[0]], variants[label].channels_last, device, variants[label].cuda_graphs)
        else "NCHW",
        "batch_size": batch_size,
        "train_samples_per_round": train_samples,
        "eval_samples_per_round": eval_samples,
        "train_seconds": t["train"],
        "eval_seconds": t["eval"],
        "seconds_per_round": t["round"],
        "train_samples_per_second": train_samples * rounds / sum(t["train"]),
        "eval_samples_per_second": eval_samples * rounds / sum(t["eval"]),
        "mean_seconds_per_round": float(np.mean(t["round"])),
    } for label, t in timings.items()}


def preset_clients(preset: Path | None) -> int | None:
    """``num-supernodes`` on a preset's ``# federation-config:`` line, if any."""
    found = re.search(r"\bnum-supernodes=(\d+)", preset_federation(preset)) if preset else None
    return int(found.group(1)) if found else None


OLD_DEFAULTS = "amp='off' channels-last=false"  # float32, NCHW: the defaults before issue 35


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", type=Path, help="a preset file (presets/*.toml) to start from")
    parser.add_argument("--run-config", default="", help="run-config overrides (after --preset)")
    parser.add_argument("--num-clients", type=int, help="default: the preset's num-supernodes, else 10")
    parser.add_argument("--batch-sizes", default="", help="comma-separated, e.g. 10,64 (default: batch-size)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--models", default="", help="comma-separated backbones, each measured in turn "
                        "(default: the run config's model)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=OVERRIDES",
                        help="run-config overrides measured side by side with the others, per model and batch "
                        f"size, e.g. \"fp32-nchw={OLD_DEFAULTS}\" \"defaults=\" (default: the run config)")
    parser.add_argument("--kept-steps", type=int, help="captured steps kept for the next clients (default: "
                        f"protofl's, {capture.KEPT_STEPS}; 0: each client's training captures its own)")
    parser.add_argument("--in-flight", default="", help="comma-separated K: K clients trained at once, "
                        "each on a thread and CUDA stream of its own (training only)")
    parser.add_argument("--device", help="default: cuda when there is a GPU, else cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (a Ray ClientApp gets its num-cpus)")
    parser.add_argument("--processes", type=int, default=1, help="measurements at once, one process each")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    base = f"{preset_overrides(args.preset) if args.preset else ''} {args.run_config}"
    variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant) or {"run config": ""}
    defaults = default_run_config(ROOT / "pyproject.toml")
    base_settings = ExperimentSettings.from_run_config(defaults | parse_overrides(base))
    models = [m.strip() for m in args.models.split(",") if m.strip()] or [base_settings.model]
    if base_settings.dataset not in SHAPES:
        parser.error(f"no shapes for dataset {base_settings.dataset!r}")
    num_clients = args.num_clients or preset_clients(args.preset) or 10
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()] or [base_settings.batch_size]
    device = torch.device(args.device) if args.device else get_device()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kept_steps is not None:
        capture.KEPT_STEPS = args.kept_steps
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)])
    if args.processes > 1:
        return report(at_once(argv if argv is not None else sys.argv[1:], args.processes, out) | {"command": command},
                      out)

    clients = stand_in_clients(base_settings, num_clients, device)
    results = []
    for model in models:
        for batch_size in batch_sizes:
            settings = {label: ExperimentSettings.from_run_config(
                defaults | parse_overrides(base) | {"model": model} | parse_overrides(overrides))
                for label, overrides in variants.items()}
            in_flight = [int(k) for k in args.in_flight.split(",") if k.strip()]
            measured = ([(f" x{k} in flight", measure_in_flight(settings, clients, batch_size, args.rounds, device, k))
                         for k in in_flight] or [("", measure(settings, clients, batch_size, args.rounds, device))])
            results += [{"model": model, "variant": label + suffix, "overrides": variants[label], "amp": s.amp,
                         "autocast": resolve_amp(s.amp, device, s.cuda_graphs), "channels_last": s.channels_last,
                         "step": resolve_cuda_graphs(s.cuda_graphs, device), **rows[label]}
                        for suffix, rows in measured for label, s in settings.items()]
    channels, size, _, _ = SHAPES[base_settings.dataset]
    return report({
        "command": command,
        "date": str(datetime.date.today()),
        "machine": machine_description(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({torch.get_num_threads()} threads)",
        "processes": 1,
        "num_clients": num_clients,
        "rounds": args.rounds,
        "kept_steps": capture.KEPT_STEPS,
        "data": {"dataset": base_settings.dataset, "shape": [channels, size, size], "clients": [
            {"num_train": len(c[1]), "num_test": len(c[3])} for c in clients]},
        "run_config": base_settings.as_dict(),
        "results": results,
    }, out)


def at_once(argv: list[str], processes: int, out: Path) -> dict:
    """This benchmark run ``processes`` times at once, one process each (``argv`` without
    ``--processes``); the summary with each result's samples/s summed over the processes."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--processes" or arg.startswith("--processes="):
            skip = arg == "--processes"
            continue
        kept.append(arg)
    children = [subprocess.Popen([sys.executable, __file__, *kept, "--out", str(out / f"process-{i}")])
                for i in range(processes)]
    if any(child.wait() != 0 for child in children):
        raise SystemExit("a measuring process failed")
    summaries = [json.loads((out / f"process-{i}" / "throughput.json").read_text()) for i in range(processes)]
    summary = summaries[0] | {"processes": processes, "device": f"{processes} x {summaries[0]['device']}"}
    summary["results"] = [same[0] | {
        "train_samples_per_second": sum(r["train_samples_per_second"] for r in same),
        "eval_samples_per_second": sum(r["eval_samples_per_second"] for r in same),
        "mean_seconds_per_round": max(r["mean_seconds_per_round"] for r in same),
    } for same in zip(*(s["results"] for s in summaries))]
    return summary


def measure_in_flight(variants: dict[str, ExperimentSettings], clients: list[tuple], batch_size: int, rounds: int,
                      device: torch.device, in_flight: int) -> dict[str, dict]:
    """``in_flight`` clients' local epochs at once (see ``--in-flight``), each variant in turn."""
    some = next(iter(variants.values()))
    channels, size, num_classes, architectures, augment = client_models(some, len(clients))
    global_weights = {a: get_weights(build_model(a, channels, num_classes, size, some.seed))
                      for a in set(architectures)}
    workers = [ThreadPoolExecutor(max_workers=1) for _ in range(in_flight)]  # one lasting thread each
    streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(in_flight)]
    results = {}
    for label, settings in variants.items():
        models = [{a: build_model(a, channels, num_classes, size, some.seed).to(device) for a in set(architectures)}
                  for _ in range(in_flight)]

        def work(k: int, server_round: int) -> None:
            with torch.cuda.stream(streams[k]) if streams[k] is not None else contextlib.nullcontext():
                for p in range(k, len(clients), in_flight):
                    model = models[k][architectures[p]]
                    set_weights(model, global_weights[architectures[p]])
                    train(model, clients[p][0], clients[p][1], augment=augment, **train_arguments(
                        settings, client_seed(settings.seed, server_round, p)) | {"epochs": 1, "batch_size": batch_size})

        seconds = []
        for server_round in range(rounds + 1):  # round 0: warm-up, the threads one after the other
            sync(device)
            t0 = time.perf_counter()
            if server_round == 0:
                for k, worker in enumerate(workers):
                    worker.submit(work, k, server_round).result()
            else:
                for future in [worker.submit(work, k, server_round) for k, worker in enumerate(workers)]:
                    future.result()
            sync(device)
            if server_round > 0:
                seconds.append(time.perf_counter() - t0)
            print(f"{some.model} {label} batch {batch_size} x{in_flight} in flight round {server_round}: "
                  f"{time.perf_counter() - t0:.2f} s", flush=True)
        train_samples = sum(len(c[1]) for c in clients)
        results[label] = {
            "memory_format": "channels-last" if uses_channels_last(
                models[0][architectures[0]], settings.channels_last, device, settings.cuda_graphs) else "NCHW",
            "batch_size": batch_size, "in_flight": in_flight, "train_samples_per_round": train_samples,
            "seconds_per_round": seconds, "train_samples_per_second": train_samples * rounds / sum(seconds),
            "eval_samples_per_second": None, "mean_seconds_per_round": float(np.mean(seconds))}
    for worker in workers:
        worker.shutdown()
    return results


def report(summary: dict, out: Path) -> int:
    """Writes throughput.json and throughput.md, and prints the table."""
    channels, size, _ = summary["data"]["shape"]
    lines = [
        f"- command: `{summary['command']}`", f"- date: {summary['date']}", f"- machine: {summary['machine']}",
        f"- device: {summary['device']}; {summary['data']['dataset']} {channels}x{size}x{size}, "
        f"{summary['num_clients']} clients, mean of {summary['rounds']} rounds after a warm-up"
        + (f", {summary['processes']} processes at once (samples/s: their sum)" if summary["processes"] > 1 else "")
        + "; speed-up: training samples/s over the first variant's",
        "",
        "| model | variant | autocast | memory format | training step | batch size | train samples/s | "
        "eval samples/s | seconds per round | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = {}
    for r in summary["results"]:
        reference = first.setdefault((r["model"], r["batch_size"]), r["train_samples_per_second"])
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['autocast']} | {r['memory_format']} | {r['step']} | "
            f"{r['batch_size']} | {r['train_samples_per_second']:,.0f} | "
            f"{'-' if r['eval_samples_per_second'] is None else format(r['eval_samples_per_second'], ',.0f')} | "
            f"{r['mean_seconds_per_round']:.2f} | {r['train_samples_per_second'] / reference:.2f}x |")
    (out / "throughput.json").write_text(json.dumps(summary, indent=2))
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\nwritten: {out / 'throughput.json'}, {out / 'throughput.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
