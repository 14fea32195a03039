"""Accuracy parity: run-config variants against a reference, per method, paired by seed.

    python benchmarks/parity.py --preset presets/fmnist-seeds-dir0.1.toml \
        --methods fedavg fedproto fednh fedsa fedsc fedskc fedcosr --seeds 0 1 2 \
        --reference "fp32-nchw=amp='off' channels-last=false" --variant "bf16-cl=amp='bf16' channels-last=true" \
        --federation-config "num-supernodes=20 client-resources-num-cpus=1" --out runs/parity-fmnist

Each method x (reference, variants) x seed is one real `flwr run` (benchmarks/compare.py's),
written to ``<out>/<method>/<label>/seed-<s>/results.json``; the reference and the variants of one
method and seed run one after the other. A run already finished there is not run again, so an
interrupted invocation continues where it stopped. Writes ``<out>/parity.md`` and
``parity.json``: per method and variant, the paired difference of GM and PM (final and last-10)
to the reference, in points, with a 95 % Student-t interval over the seeds, and the mean seconds
per round of both; a mean difference beyond ``--tolerance`` points is flagged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import finished, machine_description, preset_overrides, run_with_flower  # noqa: E402

from protofl.report import REPEATED_METRICS, paired_difference, seed_values  # noqa: E402

STATISTICS = {"final": "final", "last10_mean": "last-10"}


def labelled(text: str) -> tuple[str, str]:
    label, _, overrides = text.partition("=")
    if not label:
        raise SystemExit(f"expected LABEL=OVERRIDES, got {text!r}")
    return label, overrides


def seconds_per_round(runs: dict[int, dict]) -> float:
    return float(np.mean([r["seconds"] for results in runs.values() for r in results["rounds"] if r.get("seconds")]))


def parity_rows(groups: dict[str, dict[str, dict[int, dict]]], reference: str, tolerance: float) -> list[dict]:
    """Per method and variant: the paired differences to ``reference`` (points) and the speeds."""
    rows = []
    for method, labels in groups.items():
        for label, runs in labels.items():
            if label == reference or reference not in labels:
                continue
            row = {"method": method, "variant": label, "pairs": 0, "flagged": False,
                   "seconds_per_round": seconds_per_round(runs),
                   "reference_seconds_per_round": seconds_per_round(labels[reference])}
            for metric, name in REPEATED_METRICS.items():
                for statistic, statistic_name in STATISTICS.items():
                    difference = paired_difference(seed_values(runs, metric, statistic),
                                                   seed_values(labels[reference], metric, statistic))
                    if difference is None:
                        continue
                    mean, low, high, row["pairs"] = difference
                    row[f"{name} {statistic_name}"] = [100 * v if v is not None else None for v in (mean, low, high)]
                    row["flagged"] |= abs(100 * mean) > tolerance
            rows.append(row)
    return rows


def parity_table(rows: list[dict], reference: str, tolerance: float) -> str:
    columns = [f"{m} {s}" for m in REPEATED_METRICS.values() for s in STATISTICS.values()]
    lines = ["| method | variant | pairs | " + " | ".join(f"Δ{c}" for c in columns) +
             f" | s / round ({reference} → variant) | beyond {tolerance} points |",
             "|" + "---|" * (len(columns) + 5)]
    for row in rows:
        cells = []
        for column in columns:
            if column not in row:
                cells.append("–")
                continue
            mean, low, high = row[column]
            cells.append(f"{mean:+.2f}" + ("" if low is None else f" [{low:+.2f}, {high:+.2f}]"))
        speed = f"{row['reference_seconds_per_round']:.2f} → {row['seconds_per_round']:.2f}"
        lines.append(f"| {row['method']} | {row['variant']} | {row['pairs']} | " + " | ".join(cells) +
                     f" | {speed} | {'**yes**' if row['flagged'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--reference", required=True, metavar="LABEL=OVERRIDES", help="what the variants are paired with")
    parser.add_argument("--variant", action="append", required=True, metavar="LABEL=OVERRIDES")
    parser.add_argument("--seeds", nargs="+", type=int, required=True)
    parser.add_argument("--preset", type=Path, help="a preset file (presets/*.toml): every run starts from it")
    parser.add_argument("--run-config", default="", help="overrides shared by every run (after --preset)")
    parser.add_argument("--federation-config", default="")
    parser.add_argument("--tolerance", type=float, default=0.5, help="points of mean difference to flag")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    reference, _ = labelled(args.reference)
    settings = dict([labelled(args.reference), *map(labelled, args.variant)])
    out = args.out.expanduser().resolve()
    shared = f"{preset_overrides(args.preset) if args.preset else ''} {args.run_config}"
    groups: dict[str, dict[str, dict[int, dict]]] = {}
    failed = []
    for seed in args.seeds:
        for method in args.methods:
            for label, overrides in settings.items():
                directory = out / method / label
                saved = directory / f"seed-{seed}" / "results.json"
                results = json.loads(saved.read_text()) if saved.exists() else None
                if results is None or not finished(results):
                    results, _ = run_with_flower(f"seed-{seed}", f"{shared} method='{method}' {overrides} seed={seed}",
                                                 args.federation_config, directory)
                if results is None:
                    failed.append(f"{method} {label} seed {seed}")
                else:
                    groups.setdefault(method, {}).setdefault(label, {})[seed] = results
    rows = parity_rows(groups, reference, args.tolerance)
    command = shlex.join(["python", "benchmarks/parity.py", *(sys.argv[1:] if argv is None else argv)])
    report = (f"# Parity against {reference}\n\n- command: `{command}`\n- date: {datetime.date.today()}\n"
              f"- machine: {machine_description()}\n" + (f"- failed: {', '.join(failed)}\n" if failed else "") +
              f"\nPaired difference to {reference} (points; 95 % CI, Student t over the seeds):\n\n" +
              parity_table(rows, reference, args.tolerance))
    (out / "parity.json").write_text(json.dumps({"command": command, "date": str(datetime.date.today()),
                                                 "reference": reference, "settings": settings, "rows": rows}, indent=2))
    (out / "parity.md").write_text(report)
    print("\n" + report)
    return 1 if failed or any(r["flagged"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
