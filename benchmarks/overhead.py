"""Flower overhead: the same FedAvg local work through the Flower simulation and as a bare loop.

    python benchmarks/overhead.py --num-clients 20 \
        --run-config "dataset='fmnist' num-server-rounds=5 local-epochs=1" --out runs/overhead

Both sides train the same clients (same seeded sampling), for the same epochs, batch size, model,
per-client seeds and learning-rate schedule (``lr * lr-decay^(round - 1)``), with the same
`protofl.task` training loop. This script imports no Flower module: the Flower side runs as a
subprocess. Flower side: `flwr run` with
``num-supernodes = --num-clients``, timed per round from the strategy's ``fit_seconds``
(configure_fit -> aggregate_fit). Bare side: one process, clients one after the other, timed per
round around the same work (load global weights, train, read weights, average). Round 1 is
warm-up on both sides and left out of the means. Evaluation is off except in the final round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import machine_description, run_with_flower  # noqa: E402

from protofl.settings import ExperimentSettings, default_run_config, parse_overrides  # noqa: E402
from protofl.task.data import load_client_data, load_dataset  # noqa: E402
from protofl.task.models import build_model  # noqa: E402
from protofl.task.sampling import client_seed, sample_partitions  # noqa: E402
from protofl.task.precision import get_device  # noqa: E402
from protofl.task.train import train  # noqa: E402
from protofl.task.weights import get_weights, set_weights, weighted_average  # noqa: E402


def bare_loop(settings: ExperimentSettings, num_clients: int) -> list[float]:
    """Seconds per round of FedAvg's local work in one process, no Flower."""
    device = str(get_device())
    dataset = load_dataset(settings.dataset, settings.data_dir)
    spec = settings.partition_spec(num_clients)
    clients = [load_client_data(settings.dataset, settings.data_dir, spec, p, device) for p in range(num_clients)]
    model = build_model(settings.model, dataset.in_channels, dataset.num_classes, dataset.image_size, settings.seed)
    model.to(device)
    global_weights = get_weights(model)
    seconds = []
    for server_round in range(1, settings.num_server_rounds + 1):
        started = time.perf_counter()
        sampled = sample_partitions(
            range(num_clients), settings.fraction_fit, settings.min_fit_clients, settings.seed, server_round
        )
        updates, sizes = [], []
        for p in sampled:
            set_weights(model, global_weights)
            train(
                model, clients[p].train_x, clients[p].train_y, epochs=settings.local_epochs,
                batch_size=settings.batch_size, lr=settings.round_lr(server_round), momentum=settings.momentum,
                weight_decay=settings.weight_decay,
                max_grad_norm=0.0 if settings.max_grad_norm == "auto" else settings.max_grad_norm,  # FedAvg's "auto"
                partial_batch=settings.partial_batch,
                seed=client_seed(settings.seed, server_round, p),
            )
            updates.append(get_weights(model))
            sizes.append(clients[p].num_train)
        global_weights = weighted_average(updates, sizes)
        seconds.append(time.perf_counter() - started)
        print(f"bare loop round {server_round}: {seconds[-1]:.2f} s", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-clients", type=int, default=20)
    parser.add_argument("--run-config", default="", help="run-config overrides (method is forced to fedavg)")
    parser.add_argument("--federation-config", default="", help="extra simulation options, e.g. client resources")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    out = args.out.expanduser().resolve()

    defaults = default_run_config(ROOT / "pyproject.toml")
    overrides = parse_overrides(args.run_config) | {"method": "fedavg"}
    rounds = int((defaults | overrides)["num-server-rounds"])
    overrides["eval-every"] = rounds  # evaluate only once, at the end
    settings = ExperimentSettings.from_run_config(defaults | overrides)
    if rounds < 2:
        parser.error("need at least 2 rounds (round 1 is warm-up)")

    run_config = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())  # JSON scalars are TOML
    federation = f"num-supernodes={args.num_clients} {args.federation_config}".strip()
    flower_results, flower_wall = run_with_flower("flower", run_config, federation, out)
    if flower_results is None:
        return 1
    flower_rounds = [r["fit_seconds"] for r in flower_results["rounds"]]
    bare_rounds = bare_loop(settings, args.num_clients)

    flower_mean, bare_mean = float(np.mean(flower_rounds[1:])), float(np.mean(bare_rounds[1:]))
    summary = {
        "command": " ".join(["python", "benchmarks/overhead.py", *(argv or sys.argv[1:])]),
        "date": str(datetime.date.today()),
        "machine": machine_description(),
        "num_clients": args.num_clients,
        "run_config": settings.as_dict(),
        "federation_config": federation,
        "flower_seconds_per_round": flower_rounds,
        "bare_seconds_per_round": bare_rounds,
        "flower_mean_seconds": flower_mean,
        "bare_mean_seconds": bare_mean,
        "ratio": flower_mean / bare_mean,
        "flower_wall_seconds": flower_wall,
    }
    (out / "overhead.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\nFlower round {flower_mean:.2f} s | bare PyTorch loop {bare_mean:.2f} s | ratio {summary['ratio']:.3f} "
        f"(rounds 2-{rounds}; `flwr run` wall time incl. start-up {flower_wall:.0f} s)\n"
        f"written: {out / 'overhead.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
