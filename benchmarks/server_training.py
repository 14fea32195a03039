"""The server training of FedTGP (its prototype model, 100 epochs) and FedGH (the global head), on
the (prototype, class) pairs a round of ``--clients`` clients with every class uploads, at the
feature size of a protofl model, on torch's CPU thread count and on one thread
(task/server_training.py's ``one_cpu_thread``, which protofl's server training runs under):

    python benchmarks/server_training.py --clients 20 --dim 512 --busy 0 1 --out runs/server-training

``--busy N`` runs N processes that keep a core busy each beside the timings (a host whose other work
holds its cores, as CI's sessions or a simulation's ClientApps do). Each form runs ``--repeats`` times
(the fastest kept); the largest difference between the two thread counts' trained weights is
printed. Writes ``<out>/server_training.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import machine_description  # noqa: E402

from protofl.strategies.fedgh import train_head  # noqa: E402
from protofl.strategies.fedtgp import TrainablePrototypes, train_prototypes  # noqa: E402
from protofl.task import server_training  # noqa: E402
from protofl.task.server_training import shuffles  # noqa: E402


def spin() -> None:
    while True:
        pass


def fedtgp(prototypes: torch.Tensor, labels: torch.Tensor, num_classes: int, epochs: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = TrainablePrototypes(num_classes, prototypes.shape[1]).double()
    orders = shuffles(len(labels), torch.Generator().manual_seed(0))
    train_prototypes(module, prototypes, labels, 1.0, epochs, 0.1, 10, orders)
    return [p.detach() for p in module.parameters()]


def fedgh(prototypes: torch.Tensor, labels: torch.Tensor, num_classes: int, epochs: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    head = torch.nn.Linear(prototypes.shape[1], num_classes).double()
    trained = train_head(head, dict(head.named_parameters()), prototypes, labels, epochs, 0.01, 10,
                         shuffles(len(labels), torch.Generator().manual_seed(0)))
    return list(trained.values())


def timed(train, threaded: bool, repeats: int) -> tuple[float, list[torch.Tensor]]:
    """The fastest of ``repeats`` runs of ``train``: on torch's thread count (``threaded``: its
    one_cpu_thread made a no-op), else on one thread as protofl runs it."""
    real = server_training.one_cpu_thread
    if threaded:
        server_training.one_cpu_thread = contextlib.nullcontext
    best, out = float("inf"), []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            out = train()
            best = min(best, time.perf_counter() - start)
    finally:
        server_training.one_cpu_thread = real
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(args.classes).repeat(args.clients)
    prototypes = torch.randn(len(labels), args.dim, generator=generator, dtype=torch.float64)
    rows = []
    for busy in args.busy:
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            for name, train in (("fedtgp", fedtgp), ("fedgh", fedgh)):
                run = lambda: train(prototypes, labels, args.classes, args.epochs)  # noqa: E731
                threaded, a = timed(run, True, args.repeats)
                single, b = timed(run, False, args.repeats)
                difference = max(float((x - y).abs().max()) for x, y in zip(a, b))
                row = {"method": name, "busy": busy, "threads": torch.get_num_threads(), "threaded_s": threaded,
                       "one_thread_s": single, "ratio": threaded / single, "largest_difference": difference}
                rows.append(row)
                print(f"{name}: {len(labels)} pairs, {args.epochs} epochs, {busy} busy processes beside: "
                      f"{torch.get_num_threads()} threads {threaded:.2f} s, one thread {single:.2f} s "
                      f"({threaded / single:.1f}x); largest difference {difference:.1e}", flush=True)
        finally:
            for p in spinners:
                p.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_training.json").write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_description(), "argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
