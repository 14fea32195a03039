"""BatchNorm clients after one local epoch (issue 23): class-mean norms and local test accuracy.

    python benchmarks/batchnorm.py --dataset cifar10 --data-dir /path/to/generated \
        --model tv-resnet18 --clients 20 --alpha 0.1 --out runs/batchnorm-cifar

Each client of a seed-0 Dirichlet split trains the seeded model for one epoch (batch 10, lr 0.005
unless given), once for each ``partial-batch`` rule. Per client it reports the largest class-mean
norm of an eval-mode pass with the running BatchNorm statistics, of a training-mode pass (batches
of the batch size), and of an eval-mode pass after ``recompute_batchnorm_stats``; and the local
test accuracy of the head with the running and with the recomputed statistics. Prints a table and
writes ``<out>/batchnorm.json`` and ``<out>/batchnorm.md``. No Flower: the client's own loop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import machine_description  # noqa: E402
from protofl.task.data import load_client_data  # noqa: E402
from protofl.task.models import build_model  # noqa: E402
from protofl.task.inference import features_and_logits, head_loss_and_correct  # noqa: E402
from protofl.task.partition import PartitionSpec  # noqa: E402
from protofl.task.precision import get_device  # noqa: E402
from protofl.task.statistics import class_means  # noqa: E402
from protofl.task.train import recompute_batchnorm_stats, train  # noqa: E402


def largest_class_mean(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    means, counts = class_means(features, labels, num_classes)
    return float(np.linalg.norm(means[counts > 0].astype(np.float64), axis=1).max())


def test_accuracy(model, data) -> float:
    _, logits = features_and_logits(model, data.test_x)
    return head_loss_and_correct(logits, data.test_y)[1] / max(data.num_test, 1)


def measure_client(args, spec: PartitionSpec, partition_id: int, partial_batch: str) -> dict:
    data = load_client_data(args.dataset, args.data_dir, spec, partition_id, str(get_device()))
    model = build_model(args.model, data.in_channels, data.num_classes, data.image_size, args.seed)
    model.to(data.train_x.device)
    started = time.perf_counter()
    loss = train(model, data.train_x, data.train_y, epochs=1, batch_size=args.batch_size, lr=args.lr,
                 seed=args.seed, partial_batch=partial_batch)
    train_seconds = time.perf_counter() - started
    x, y, c = data.train_x, data.train_y, data.num_classes
    row = {
        "partition": partition_id, "partial_batch": partial_batch, "num_train": data.num_train,
        "remainder": data.num_train % args.batch_size, "train_loss": loss,
        "eval_running": largest_class_mean(features_and_logits(model, x)[0], y, c),
        "accuracy_running": test_accuracy(model, data),
    }
    model.train()
    with torch.no_grad():
        chunks = x.split(args.batch_size)
        if len(chunks) > 1 and len(chunks[-1]) == 1:  # a training-mode batch needs two samples
            chunks = x[: len(x) - 1].split(args.batch_size)
            y = y[: len(x) - 1]
        training = torch.cat([model(chunk)[0] for chunk in chunks])
    row["training_mode"] = largest_class_mean(training, y, c)
    started = time.perf_counter()
    recompute_batchnorm_stats(model, data.train_x, args.seed)
    row["recompute_seconds"], row["train_seconds"] = time.perf_counter() - started, train_seconds
    row["eval_recomputed"] = largest_class_mean(features_and_logits(model, data.train_x)[0], data.train_y, c)
    row["accuracy_recomputed"] = test_accuracy(model, data)
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| client | n (remainder) | partial-batch | loss | eval (running) | training mode | eval (recomputed) "
        "| acc running | acc recomputed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['partition']} | {r['num_train']} ({r['remainder']}) | {r['partial_batch']} | {r['train_loss']:.3f} "
            f"| {r['eval_running']:.3g} | {r['training_mode']:.3g} | {r['eval_recomputed']:.3g} "
            f"| {r['accuracy_running']:.3f} | {r['accuracy_recomputed']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--model", default="tv-resnet18")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--partitions", type=int, nargs="*", help="the clients measured (default: all)")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partial-batch", nargs="+", default=["keep", "drop"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = PartitionSpec("dirichlet", args.clients, alpha=args.alpha, seed=args.seed)
    rows = []
    for partition_id in args.partitions if args.partitions is not None else range(args.clients):
        for partial_batch in args.partial_batch:
            rows.append(measure_client(args, spec, partition_id, partial_batch))
            r = rows[-1]
            print(f"client {partition_id} ({r['num_train']}, remainder {r['remainder']}) {partial_batch}: "
                  f"eval {r['eval_running']:.3g} | training {r['training_mode']:.3g} | recomputed "
                  f"{r['eval_recomputed']:.3g} | acc {r['accuracy_running']:.3f} -> {r['accuracy_recomputed']:.3f} "
                  f"| train {r['train_seconds']:.1f} s, recompute {r['recompute_seconds']:.2f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    header = {"command": " ".join(sys.argv), "machine": machine_description(),
              "date": datetime.date.today().isoformat()}
    (args.out / "batchnorm.json").write_text(json.dumps(header | {"rows": rows}, indent=2))
    table = markdown(rows)
    title = f"`{header['command']}` on {header['machine']}, {header['date']}"
    (args.out / "batchnorm.md").write_text(f"{title}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
