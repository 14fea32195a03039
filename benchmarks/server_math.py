"""The server's model math at many clients, each in protofl's form beside the numpy form it replaced,
on models of a protofl model's shapes:

- FedAMP's cloud models: every pair's distance from one Gram matrix and every cloud model from one
  matrix of weights, against a difference per pair of models and a weighted sum per client;
- the clients' weighted average (FedAvg's and every parameter-averaging method's): float64 sums over
  blocks of entries in torch, against numpy's ``tensordot`` over each array of all the clients.

    python benchmarks/server_math.py --clients 20 100 --model cnn --dataset fmnist --out runs/server-math

Each client's model is the initial model plus Gaussian noise (the cost depends on the number of
models and their size, not their values). Times each form ``--repeats`` times and keeps the fastest,
prints the largest difference between the two forms' outputs, and writes ``<out>/server_math.json``.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import machine_description  # noqa: E402

from protofl.strategies.fedamp import FedAMPOptions, FedAMPStrategy, attention_weights  # noqa: E402
from protofl.task import models  # noqa: E402
from protofl.task.weights import weighted_average  # noqa: E402

SHAPES = {"fmnist": (1, 10, 28), "cifar10": (3, 10, 32), "cifar100": (3, 100, 32)}  # channels, classes, size


def per_pair_clouds(held: dict[int, list[np.ndarray]], options: FedAMPOptions) -> dict[int, list[np.ndarray]]:
    """u_i = xi_ii w_i + sum_j xi_ij w_j for each held client, a float64 difference per pair."""
    clouds = {}
    for i, own in held.items():
        peers = [w for j, w in sorted(held.items()) if j != i]
        distances = [sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(own, w)) for w in peers]
        xi, xi_own = attention_weights(distances, options.alpha_k, options.sigma, options.peer_weight_bound)
        cloud = [xi_own * a.astype(np.float64) for a in own]
        for weight, w in zip(xi, peers):
            cloud = [c + weight * a for c, a in zip(cloud, w)]
        clouds[i] = [c.astype(a.dtype) for c, a in zip(cloud, own)]
    return clouds


def tensordot_average(clients: list[list[np.ndarray]], weights: np.ndarray) -> list[np.ndarray]:
    """The weighted mean as protofl computed it before: numpy's tensordot over each array stacked."""
    w = weights / weights.sum()
    return [np.tensordot(w, np.stack([c[i] for c in clients]).astype(np.float64), axes=1).astype(clients[0][i].dtype)
            for i in range(len(clients[0]))]


def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))


def fastest(run, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 100])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--dataset", default="fmnist", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    channels, classes, size = SHAPES[args.dataset]
    model = getattr(models, args.model)(channels, classes, size)
    initial = [p.detach().numpy().copy() for p in model.parameters() if p.requires_grad]
    entries = sum(a.size for a in initial)
    options = FedAMPOptions()
    rows = []
    for n in args.clients:
        rng = np.random.default_rng(n)
        held = {p: [(a + rng.normal(0, 0.01, a.shape)).astype(a.dtype) for a in initial] for p in range(n)}
        rule = FedAMPStrategy.__new__(FedAMPStrategy)  # the server's state only: its models and options
        rule.options, rule.initial_model, rule.client_models = options, initial, held
        gram_seconds, batched = fastest(rule.cloud_models, args.repeats)
        pair_seconds, pairs = fastest(lambda: per_pair_clouds(held, options), args.repeats)
        clouds_difference = max(largest_difference(list(batched[p].values()), cloud) for p, cloud in pairs.items())
        clients, sizes = list(held.values()), rng.integers(40, 400, n).astype(np.float64)
        blocked_seconds, blocked = fastest(lambda: weighted_average(clients, sizes), args.repeats)
        tensordot_seconds, dotted = fastest(lambda: tensordot_average(clients, sizes), args.repeats)
        rows.append({"clients": n, "entries": entries,
                     "fedamp_clouds": {"gram_seconds": gram_seconds, "per_pair_seconds": pair_seconds,
                                       "max_abs_difference": clouds_difference},
                     "weighted_average": {"blocked_seconds": blocked_seconds, "tensordot_seconds": tensordot_seconds,
                                          "max_abs_difference": largest_difference(blocked, dotted)}})
        print(f"{n} clients, {entries} entries a model: FedAMP's cloud models from one Gram matrix "
              f"{gram_seconds:.3f} s, per pair {pair_seconds:.3f} s ({pair_seconds / gram_seconds:.1f}x), largest "
              f"difference {clouds_difference:.2e}; the weighted average in blocks {blocked_seconds:.3f} s, by "
              f"tensordot {tensordot_seconds:.3f} s ({tensordot_seconds / blocked_seconds:.1f}x), largest difference "
              f"{largest_difference(blocked, dotted):.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_description(), "command": " ".join(sys.argv), "model": args.model,
              "dataset": args.dataset, "rows": rows}
    (args.out / "server_math.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
