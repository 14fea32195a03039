"""Run several methods on the same dataset, partition and seed through `flwr run`, then compare.

    python benchmarks/compare.py --methods fedavg fedproto \
        --run-config "dataset='fmnist' alpha=0.3 num-server-rounds=30" \
        --federation-config "num-supernodes=20" --out runs/fmnist

Each method (or ``--variant LABEL="overrides"``, e.g. an ablation) is one real Flower simulation
(`flwr run . --stream`) writing ``<out>/<label>/results.json``; the script then writes
``<out>/comparison.md`` (GM and PM final / best / last-10, PM std, traffic, time) and
``<out>/comparison.png`` and prints the table. ``--include DIR`` adds the runs of an earlier
invocation (``DIR/<label>/results.json``) to the table, so runs made apart can be compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protofl.report import comparison_table, plot_curves  # noqa: E402


def machine_description() -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, {device}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def flwr_executable() -> str:
    candidate = Path(sys.executable).parent / "flwr"
    return str(candidate) if candidate.exists() else "flwr"


def run_with_flower(label: str, run_config: str, federation_config: str, out: Path) -> tuple[dict | None, float]:
    """One `flwr run` of this app; returns (results.json or None on failure, wall seconds)."""
    again = "" if "resume=" in run_config else " overwrite=true"  # a benchmark run again replaces its results
    overrides = f"{run_config} output-dir='{out}' run-name='{label}'{again}".strip()
    command = [flwr_executable(), "run", str(ROOT), "--stream", "--run-config", overrides]
    if federation_config:
        command += ["--federation-config", federation_config]
    env = os.environ | {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    print(f"\n=== {label}: {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    returncode = subprocess.run(command, env=env, cwd=ROOT).returncode
    wall = time.perf_counter() - started
    results_path = out / label / "results.json"
    if returncode != 0 or not results_path.exists():
        print(f"=== {label} failed (exit code {returncode}, no {results_path})", flush=True)
        return None, wall
    results = json.loads(results_path.read_text())
    rounds, wanted = results["rounds"], results["run_config"]["num_server_rounds"]
    if not rounds or rounds[-1]["round"] != wanted:  # `flwr run` can exit 0 when its run was killed
        print(f"=== {label} failed: {len(rounds)} of {wanted} rounds in {results_path}", flush=True)
        return None, wall
    return results, wall


def included_results(directories: list[Path]) -> dict[str, dict]:
    """label -> results.json of every finished run saved under the given directories."""
    results = {}
    for directory in directories:
        paths = sorted(directory.expanduser().glob("*/results.json"))
        if not paths:
            raise SystemExit(f"--include {directory}: no <label>/results.json there")
        for path in paths:
            results[path.parent.name] = json.loads(path.read_text())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=[], help="methods to run with the shared run config")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=OVERRIDES",
                        help="extra run with its own run-config overrides, e.g. \"fedproto-avg=method='fedproto' "
                             "fedproto.average-parameters=true\"")
    parser.add_argument("--run-config", default="", help="run-config overrides shared by every run")
    parser.add_argument("--federation-config", default="", help="e.g. \"num-supernodes=20\"")
    parser.add_argument("--include", action="append", default=[], type=Path, metavar="DIR",
                        help="also compare the runs saved under DIR by an earlier invocation (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)

    runs = [(m, f"method='{m}'") for m in args.methods]
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        runs.append((label, overrides))
    if not runs and not args.include:
        parser.error("give --methods, --variant and/or --include")
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    results, failed = included_results(args.include), []
    for label, overrides in runs:
        result, wall = run_with_flower(label, f"{args.run_config} {overrides}", args.federation_config, out)
        if result is None:
            failed.append(label)
        else:
            result["wall_seconds"] = wall
            results[label] = result
    if not results:
        return 1

    command = shlex.join([Path(sys.executable).name, "benchmarks/compare.py", *(argv or sys.argv[1:])])
    table = comparison_table(results)
    walls = ", ".join(f"{k} {v['wall_seconds']:.0f} s" for k, v in results.items() if "wall_seconds" in v)
    report = (
        f"# Comparison\n\n- command: `{command}`\n- date: {datetime.date.today()}\n"
        f"- machine: {machine_description()}\n- wall time per run (incl. start-up): {walls}\n"
        + (f"- failed: {', '.join(failed)}\n" if failed else "")
        + f"\n{table}"
    )
    (out / "comparison.md").write_text(report)
    plot_curves(results, out / "comparison.png")
    print("\n" + report)
    print(f"written: {out / 'comparison.md'}, {out / 'comparison.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
