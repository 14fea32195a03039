"""What FedSKC's GPR as printed does to a trained model when the knowledge does not change (rho = 0):
w <- beta w + (1 - beta) rho (w_prev - w) = beta w, once per round.

    python benchmarks/gpr_shrink.py --models cnn resnet8-x4 --out /tmp/gpr_shrink.json

Each model is trained centrally on a seeded subset of Fashion-MNIST (SGD, one pass), then shrunk
k times by beta (beta^k, as k rounds of GPR at rho = 0) on the trainable parameters only
(``fedskc.gpr-entries="trainable"``, protofl's default) or on every floating state entry, BatchNorm
running statistics too (``"all"``, the authors' code). For each it prints the test accuracy and the
share of test predictions that differ from the unshrunk model's: what the server's GM would see
right after a GPR step. A network without normalisation is not scale-invariant (biases and ReLU
layers in series), so the shrink changes its predictions; with BatchNorm the convolutions are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protofl.strategies.fedskc import period_review  # noqa: E402
from protofl.task.data.registry import DEBIAN_FMNIST_DIR, load_dataset  # noqa: E402
from protofl.task.models import build_model  # noqa: E402
from protofl.task.inference import features_and_logits  # noqa: E402
from protofl.task.train import train  # noqa: E402


def shrunk(model: torch.nn.Module, beta: float, times: int, entries: str) -> dict[str, torch.Tensor]:
    """The model's state after ``times`` GPR steps at rho = 0 (protofl's period_review)."""
    state = model.state_dict()
    parameters = {name for name, _ in model.named_parameters()}
    reviewed = [name in parameters or (entries == "all" and value.is_floating_point()) for name, value in state.items()]
    arrays = [value.numpy().copy() for value in state.values()]
    for _ in range(times):
        arrays = period_review(arrays, arrays, 0.0, beta, "paper", reviewed)
    return {name: torch.from_numpy(a) for name, a in zip(state, arrays)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet8-x4"])
    parser.add_argument("--train-images", type=int, default=4800)
    parser.add_argument("--test-images", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--betas", nargs="+", type=float, default=[0.95, 0.99])
    parser.add_argument("--rounds", nargs="+", type=int, default=[1, 12])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = load_dataset("fmnist", str(DEBIAN_FMNIST_DIR))
    rng = np.random.default_rng(args.seed)
    train_idx = torch.from_numpy(rng.choice(len(data.train.labels), args.train_images, replace=False))
    test_idx = torch.from_numpy(rng.choice(len(data.test.labels), args.test_images, replace=False))
    x, y = torch.as_tensor(data.train.images)[train_idx], torch.as_tensor(data.train.labels)[train_idx].long()
    tx, ty = torch.as_tensor(data.test.images)[test_idx], torch.as_tensor(data.test.labels)[test_idx].long()
    rows = []
    for name in args.models:
        model = build_model(name, data.in_channels, data.num_classes, data.image_size, args.seed)
        train(model, x, y, epochs=1, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        reference = features_and_logits(model, tx)[1].argmax(dim=1)
        base = float((reference == ty).float().mean())
        rows.append({"model": name, "beta": 1.0, "rounds": 0, "entries": "-", "accuracy": base, "changed": 0.0})
        for beta in args.betas:
            for times in args.rounds:
                for entries in ("trainable", "all"):
                    model.load_state_dict(trained)
                    model.load_state_dict(shrunk(model, beta, times, entries))
                    predicted = features_and_logits(model, tx)[1].argmax(dim=1)
                    rows.append({"model": name, "beta": beta, "rounds": times, "entries": entries,
                                 "accuracy": float((predicted == ty).float().mean()),
                                 "changed": float((predicted != reference).float().mean())})
        model.load_state_dict(trained)
    print("| model | beta^k | GPR on | test accuracy | predictions changed |")
    print("|---|---|---|---|---|")
    for r in rows:
        shrink = "none" if r["rounds"] == 0 else f"{r['beta']}^{r['rounds']} = {r['beta'] ** r['rounds']:.3f}"
        print(f"| {r['model']} | {shrink} | {r['entries']} | {r['accuracy']:.4f} | {100 * r['changed']:.1f} % |")
    if args.out:
        args.out.write_text(json.dumps({"arguments": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
