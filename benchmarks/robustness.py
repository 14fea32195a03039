"""Hostile clients against every method and defence (issue 18), and DP prototypes (accuracy vs epsilon).

    python benchmarks/robustness.py --out runs/robustness            # the attack table
    python benchmarks/robustness.py --out runs/dp --dp 0 0.5 1 2 4   # the DP table

A federation in one process (tests/inprocess.py: protofl's ServerApp and ClientApp factories,
no Ray). The last ``--attackers`` partitions train honestly, then lie in every fit reply:

- ``scaled``: class vectors x 100, and the parameter change x 100 where the method shares parameters;
- ``sign-flip``: class vectors negated, and the parameter change negated;
- ``label-swap``: the class vectors of the classes they hold rotated among those classes (counts
  unchanged, so every count check passes); parameters honest (FedAvg: no such attack).

Attackers do not report evaluations, so PM is the honest clients' accuracy. Defences: ``none``
(screen off, the method's rule), ``screen`` (the default screen), and ``median``,
``trimmed-mean``, ``norm-clip`` (for parameters and class vectors, screen off: each rule alone).
Prints and writes ``<out>/robustness.md`` and ``<out>/robustness.json``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from flwr.common import FitRes, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from inprocess import InProcessProxy, run_in_process  # noqa: E402

from benchmarks.compare import machine_description  # noqa: E402
from protofl.federation.wire import CLASS_COUNTS, CLASS_MEANS, encode_array  # noqa: E402
from protofl.strategies import METHODS  # noqa: E402

ATTACKS = ("scaled", "sign-flip", "label-swap")
DEFENCES = {
    "none": {"screen-factor": 0.0},
    "screen": {},
    "median": {"screen-factor": 0.0, "aggregation": "median", "prototype-aggregation": "median"},
    "trimmed-mean": {"screen-factor": 0.0, "aggregation": "trimmed-mean", "prototype-aggregation": "trimmed-mean"},
    "norm-clip": {"screen-factor": 0.0, "aggregation": "norm-clip", "prototype-aggregation": "norm-clip"},
}
SETTING = {  # Fashion-MNIST, Dirichlet 0.3, 20 clients; a tenth of the data, scored once at the end (CPU budget)
    "dataset": "fmnist", "alpha": 0.3, "data-fraction": 0.1, "local-epochs": 1, "batch-size": 10,
    "global-test-pm": False, "fedsa.ema": 0.99,
}


def poisoned(kind: str, sent, reply: FitRes) -> FitRes:
    """An honest fit reply turned into the ``kind`` attack."""
    metrics = dict(reply.metrics)
    if CLASS_MEANS in metrics:
        means = np.load(io.BytesIO(metrics[CLASS_MEANS]))
        held = np.flatnonzero(np.load(io.BytesIO(metrics[CLASS_COUNTS])) > 0)
        if kind == "scaled":
            means = means * 100.0
        elif kind == "sign-flip":
            means = -means
        else:
            means[held] = means[np.roll(held, 1)]
        metrics[CLASS_MEANS] = encode_array(means.astype(np.float32))
    parameters = reply.parameters
    if parameters.tensors and kind != "label-swap":
        factor = 100.0 if kind == "scaled" else -1.0
        own, start = parameters_to_ndarrays(parameters), parameters_to_ndarrays(sent)
        parameters = ndarrays_to_parameters([
            (s + factor * (o - s)).astype(o.dtype) if o.dtype.kind == "f" else o for o, s in zip(own, start)
        ])
    return FitRes(reply.status, parameters, reply.num_examples, metrics)


def attacker_class(kind: str):
    class Attacker(InProcessProxy):
        def fit(self, ins, timeout, group_id):
            return poisoned(kind, ins.parameters, super().fit(ins, timeout, group_id))

        def evaluate(self, ins, timeout, group_id):
            raise RuntimeError("attackers do not report evaluations")

    return Attacker


def run(label: str, run_config: dict, clients: int, attackers: int, attack: str | None, out: Path) -> dict:
    config = SETTING | run_config | {"output-dir": str(out), "run-name": label, "overwrite": True}
    hostile = attacker_class(attack) if attack else None
    started = time.perf_counter()
    node_class = (lambda p: hostile if p >= clients - attackers else InProcessProxy) if hostile else None
    run_in_process(config, clients, node_class)
    results = json.loads((out / label / "results.json").read_text())
    last = results["rounds"][-1]
    row = {
        "label": label, "pm": last.get("personalized_accuracy"), "gm": last.get("global_accuracy"),
        "dropped": sum(len(r.get("dropped") or []) for r in results["rounds"]),
        "kept_previous": sum(1 for r in results["rounds"] if r.get("kept_previous")),
        "dp_epsilon": last.get("dp_epsilon"), "stopped": results.get("stopped"),
        "seconds": time.perf_counter() - started,
    }
    print(json.dumps(row), flush=True)
    return row


def cell(row: dict) -> str:
    if row.get("stopped"):
        return "stopped"
    text = f"{row['pm']:.3f}" if row["pm"] is not None else "-"
    return text + (f" / {row['gm']:.3f}" if row["gm"] is not None else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=list(DEFENCES))
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--attackers", nargs="+", type=int, default=[4])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dp", nargs="+", type=float, help="DP table instead: these dp-noise values")
    parser.add_argument("--dp-clip", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (run several of these side by side)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = {"num-server-rounds": args.rounds, "eval-every": args.rounds}
    torch.set_num_threads(args.threads)
    rows, lines = [], []
    header = (f"{datetime.date.today()}, {machine_description()}, {args.threads} torch thread(s); "
              f"{args.clients} clients, {args.rounds} rounds, {SETTING}")
    if args.dp:
        lines += ["| method | dp-noise | epsilon (delta 1e-5) | PM | GM |", "|---|---|---|---|---|"]
        for method in args.methods:
            for noise in args.dp:
                dp = {"dp-noise": noise, "dp-clip": args.dp_clip} if noise > 0 else {}
                row = run(f"{method}-dp{noise:g}", common | {"method": method} | dp, args.clients, 0, None, args.out)
                rows.append(row | {"method": method, "dp_noise": noise})
                eps = "inf (no noise)" if noise == 0 else f"{row['dp_epsilon']:.1f}"
                gm = f"{row['gm']:.3f}" if row["gm"] is not None else "-"
                lines.append(f"| {method} | {noise:g} | {eps} | {row['pm']:.3f} | {gm} |")
    else:
        scenarios = [(0, None)] + [(n, a) for a in args.attacks for n in args.attackers if n > 0]
        names = ["honest"] + [f"{n} x {a}" for n, a in scenarios[1:]]
        lines += ["| method | defence | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for method in args.methods:
            for defence in args.defences:
                cells = []
                for attackers, attack in scenarios:
                    if method == "fedavg" and attack == "label-swap":
                        cells.append("n/a")
                        continue
                    label = f"{method}-{defence}-{attackers}-{attack or 'honest'}"
                    config = common | {"method": method} | DEFENCES[defence]
                    row = run(label, config, args.clients, attackers, attack, args.out)
                    rows.append(row | {"method": method, "defence": defence, "attackers": attackers, "attack": attack})
                    cells.append(cell(row) + (f" ({row['dropped']} dropped)" if row["dropped"] else ""))
                lines.append(f"| {method} | {defence} | " + " | ".join(cells) + " |")
    table = "\n".join([header, "", *lines])
    print(table)
    (args.out / "robustness.md").write_text(table + "\n")
    (args.out / "robustness.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
