"""The magnitude screen on honest runs: what it dropped (it must drop nothing) and how close honest
clients came to its bounds, over every method of every table preset.

    python benchmarks/screen.py --seeds 0 1 2 --out runs/screen     # run every table, then the tally
    python benchmarks/screen.py --tally-only --out runs/screen      # the tally of runs already made

Each table preset runs through benchmarks/compare.py (`flwr run`, the preset's federation; every
method and ``# variant:`` line it names), in each half its results page runs: FedCoSR's practical and
pathological splits, FedSKC's and FedSC's Dirichlet 0.05 and 0.2. ``--tables`` runs some of them.
The tally reads every results.json under ``--out`` (so runs of other settings made there, e.g. with
compare.py ``--methods scaffold``, count too) and writes ``<out>/screen.md`` and ``<out>/screen.json``:
per run group, the runs, the rounds they completed, the runs that stopped early, the replies the
screen dropped, the replies admission dropped (a method's own check among its checks), and the
largest ratio to its bound that each kind of upload reached (the screen drops above ``screen-factor``, 10).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import machine_description  # noqa: E402

TABLES = {  # label: (preset, the half's run config)
    "fedcosr-practical": ("fmnist-fedcosr-table2", ""),
    "fedcosr-pathological": ("fmnist-fedcosr-table2", "partition='pathological-pfllib'"),
    "fednh": ("fmnist-fednh-table1", ""),
    "fedsa-table1": ("fmnist-fedsa-table1", ""),
    "fedsa-table2": ("fmnist-fedsa-table2", ""),
    "fedskc-dir0.05": ("fmnist-fedskc-table1", "alpha=0.05"),
    "fedskc-dir0.2": ("fmnist-fedskc-table1", "alpha=0.2"),
    "fedsc-dir0.05": ("fmnist-fedsc-table1", "alpha=0.05"),
    "fedsc-dir0.2": ("fmnist-fedsc-table1", "alpha=0.2"),
}
RATIOS = ("screen_parameter_ratio", "screen_prototype_ratio", "screen_upload_ratio")


def run_tables(labels: list[str], seeds: list[int], out: Path) -> None:
    for label in labels:
        preset, half = TABLES[label]
        command = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--preset", f"presets/{preset}.toml",
                   "--out", str(out / label), "--seeds", *map(str, seeds)] + (["--run-config", half] if half else [])
        print("$", " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=False)


def tally(out: Path) -> list[dict]:
    """One row per directory holding runs: ``<group>/<label>`` (a run, or its seeds' runs)."""
    groups: dict[str, list[dict]] = {}
    for path in sorted(out.rglob("results.json")):
        relative = path.parent.relative_to(out).parts
        key = "/".join(p for p in relative if not p.startswith("seed-"))
        groups.setdefault(key, []).append(json.loads(path.read_text()))
    rows = []
    for key, runs in groups.items():
        rounds = [r for run in runs for r in run["rounds"]]
        dropped = [d for r in rounds for d in r.get("dropped", [])]
        rows.append({
            "runs": key, "count": len(runs), "rounds": sum(len(run["rounds"]) for run in runs),
            "stopped": [run["stopped"] for run in runs if run.get("stopped")],
            "screen_dropped": sum(d["stage"] == "screen" for d in dropped),
            "admission_dropped": sum(d["stage"] == "fit" for d in dropped),
            "reasons": sorted({d["reason"] for d in dropped}),
            **{key: max((r[key] for r in rounds if r.get(key) is not None), default=None) for key in RATIOS},
        })
    return rows


def markdown(rows: list[dict]) -> str:
    def ratio(value):
        return "–" if value is None else f"{value:.2f}"

    lines = ["| runs | n | rounds | stopped | screen drops | admission drops | parameters | class vectors | uploads |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['runs']} | {row['count']} | {row['rounds']} | {len(row['stopped'])} | "
                     f"{row['screen_dropped']} | {row['admission_dropped']} | "
                     + " | ".join(ratio(row[key]) for key in RATIOS) + " |")
    total = sum(row["screen_dropped"] for row in rows)
    lines += ["", f"{sum(row['count'] for row in rows)} runs, {sum(row['rounds'] for row in rows)} rounds: "
              f"{total} replies dropped by the screen, {sum(row['admission_dropped'] for row in rows)} by admission, "
              f"{sum(len(row['stopped']) for row in rows)} runs stopped early."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--tables", nargs="*", choices=sorted(TABLES), default=sorted(TABLES))
    parser.add_argument("--tally-only", action="store_true", help="tally the runs under --out, run nothing")
    args = parser.parse_args(argv)
    if not args.tally_only:
        run_tables(args.tables, args.seeds, args.out)
    rows = tally(args.out)
    text = markdown(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "screen.md").write_text(f"{datetime.date.today()}, {machine_description()}\n\n{text}")
    (args.out / "screen.json").write_text(json.dumps({"machine": machine_description(), "rows": rows}, indent=1))
    return 0 if all(row["screen_dropped"] == 0 and not row["stopped"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
