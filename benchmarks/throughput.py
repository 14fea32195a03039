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
weight decay, clipping, partial batch, augmentation, amp and channels-last; no method's extra loss,
no BatchNorm recomputation: FedAvg's local work), then `features_and_logits` over the client's test
data. One warm-up round, then ``--rounds`` timed rounds, per batch size. Training samples/s = the
clients' training samples (one epoch's worth per round; a dropped partial batch still counts) / the
seconds spent in ``train``; evaluation samples/s likewise. Writes ``throughput.json`` and
``throughput.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import machine_description, preset_overrides  # noqa: E402

from protofl.settings import ExperimentSettings, default_run_config, parse_overrides  # noqa: E402
from protofl.task.augment import make_augment  # noqa: E402
from protofl.task.data import DATASETS, SHAPES, black_level  # noqa: E402
from protofl.task.models import build_model, client_architecture  # noqa: E402
from protofl.task.partition import client_split, partition_indices  # noqa: E402
from protofl.task.sampling import client_seed  # noqa: E402
from protofl.task.train import features_and_logits, get_device, resolve_amp, train  # noqa: E402
from protofl.task.weights import get_weights, set_weights  # noqa: E402


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


def measure(settings: ExperimentSettings, clients: list[tuple], batch_size: int, rounds: int,
            device: torch.device) -> dict:
    """One warm-up round and ``rounds`` timed rounds of every client's local epoch and evaluation."""
    channels, size, _, _ = SHAPES[settings.dataset]
    num_classes = DATASETS[settings.dataset][0]
    architectures = [client_architecture(settings.model, p) for p in range(len(clients))]
    models = {a: build_model(a, channels, num_classes, size, settings.seed).to(device) for a in set(architectures)}
    global_weights = {a: get_weights(model) for a, model in models.items()}
    fill = torch.from_numpy(black_level(settings.dataset, settings.normalisation)).expand(channels)
    augment = make_augment(settings.augment, fill)
    train_seconds, eval_seconds, round_seconds = [], [], []
    for server_round in range(rounds + 1):  # round 0: warm-up
        train_time = eval_time = 0.0
        started = time.perf_counter()
        for p, (train_x, train_y, test_x, _) in enumerate(clients):
            model = models[architectures[p]]
            set_weights(model, global_weights[architectures[p]])
            sync(device)
            t0 = time.perf_counter()
            train(model, train_x, train_y, epochs=1, batch_size=batch_size, lr=settings.lr, seed=client_seed(
                settings.seed, server_round, p), momentum=settings.momentum, weight_decay=settings.weight_decay,
                max_grad_norm=settings.max_grad_norm, partial_batch=settings.partial_batch, augment=augment,
                amp=settings.amp, channels_last=settings.channels_last)
            sync(device)
            t1 = time.perf_counter()
            features_and_logits(model, test_x, amp=settings.amp, channels_last=settings.channels_last)
            sync(device)
            train_time, eval_time = train_time + t1 - t0, eval_time + time.perf_counter() - t1
        if server_round > 0:
            train_seconds.append(train_time)
            eval_seconds.append(eval_time)
            round_seconds.append(time.perf_counter() - started)
        print(f"batch {batch_size} round {server_round}{' (warm-up)' if server_round == 0 else ''}: "
              f"train {train_time:.2f} s, eval {eval_time:.2f} s", flush=True)
    train_samples = sum(len(c[1]) for c in clients)
    eval_samples = sum(len(c[3]) for c in clients)
    return {
        "batch_size": batch_size,
        "train_samples_per_round": train_samples,
        "eval_samples_per_round": eval_samples,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "seconds_per_round": round_seconds,
        "train_samples_per_second": train_samples * rounds / sum(train_seconds),
        "eval_samples_per_second": eval_samples * rounds / sum(eval_seconds),
        "mean_seconds_per_round": float(np.mean(round_seconds)),
    }


def preset_clients(preset: Path | None) -> int | None:
    """``num-supernodes`` on a preset's ``# federation-config:`` line, if any."""
    found = re.search(r"^# federation-config:.*\bnum-supernodes=(\d+)", preset.read_text(), re.M) if preset else None
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
    parser.add_argument("--device", help="default: cuda when there is a GPU, else cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (a Ray ClientApp gets its num-cpus)")
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
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    clients = stand_in_clients(base_settings, num_clients, device)
    results = []
    for model in models:
        for batch_size in batch_sizes:
            for label, overrides in variants.items():  # side by side: each model's variants one after the other
                settings = ExperimentSettings.from_run_config(
                    defaults | parse_overrides(base) | {"model": model} | parse_overrides(overrides))
                print(f"{model}, {label}:", flush=True)
                results.append({"model": model, "variant": label, "overrides": overrides, "amp": settings.amp,
                                "autocast": resolve_amp(settings.amp, device),
                                "channels_last": settings.channels_last,
                                **measure(settings, clients, batch_size, args.rounds, device)})
    channels, size, _, _ = SHAPES[base_settings.dataset]
    summary = {
        "command": shlex.join(["python", "benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": str(datetime.date.today()),
        "machine": machine_description(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({torch.get_num_threads()} threads)",
        "num_clients": num_clients,
        "rounds": args.rounds,
        "data": {"dataset": base_settings.dataset, "shape": [channels, size, size], "clients": [
            {"num_train": len(c[1]), "num_test": len(c[3])} for c in clients]},
        "run_config": base_settings.as_dict(),
        "results": results,
    }
    lines = [
        f"- command: `{summary['command']}`", f"- date: {summary['date']}", f"- machine: {summary['machine']}",
        f"- device: {summary['device']}; {base_settings.dataset} {channels}x{size}x{size}, {num_clients} clients, "
        f"mean of {args.rounds} rounds after a warm-up; speed-up: training samples/s over the first variant's",
        "",
        "| model | variant | autocast | channels-last | batch size | train samples/s | eval samples/s | "
        "seconds per round | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first = {}
    for r in results:
        reference = first.setdefault((r["model"], r["batch_size"]), r["train_samples_per_second"])
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['autocast']} | {str(r['channels_last']).lower()} | "
            f"{r['batch_size']} | {r['train_samples_per_second']:,.0f} | {r['eval_samples_per_second']:,.0f} | "
            f"{r['mean_seconds_per_round']:.2f} | {r['train_samples_per_second'] / reference:.2f}x |")
    (out / "throughput.json").write_text(json.dumps(summary, indent=2))
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines) + f"\n\nwritten: {out / 'throughput.json'}, {out / 'throughput.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
