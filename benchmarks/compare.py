"""Run several methods on the same dataset, partition and seed through `protofl run`, then compare.

    python benchmarks/compare.py --methods fedavg fedproto \
        --run-config "dataset='fmnist' alpha=0.3 num-server-rounds=30" \
        --federation-config "num-supernodes=20" --out runs/fmnist

Each method (or ``--variant LABEL="overrides"``, e.g. an ablation) is one real Flower simulation
(`protofl run .`: `flwr run . --stream`, failed unless the run completed) writing
``<out>/<label>/results.json``, in the federation the command names
(``--federation-config``, else the preset's; what it leaves out: 10 SuperNodes of 1 CPU each, never
what the Flower home happens to hold); the script then writes
``<out>/comparison.md`` (GM and PM final / best / last-10, PM std, traffic, time) and
``<out>/comparison.png`` and prints the table. ``--include DIR`` adds the runs of an earlier
invocation (``DIR/<label>/results.json``) to the table, so runs made apart can be compared.

A table preset (``presets/*-table*.toml``) names its methods on a ``# methods:`` line (and runs of
its own on ``# variant: LABEL=OVERRIDES`` lines): ``--preset`` with neither ``--methods`` nor
``--variant`` runs every one of them, each with the preset's settings and its own method table::

    python benchmarks/compare.py --preset presets/fmnist-fedskc-table1.toml --seeds 0 1 2 --baseline fedavg \
        --sweep "alpha=0.05,0.2" --out runs/fmnist-fedskc-table1

Repeats: ``--seeds 0 1 2`` runs everything once per training seed (``<out>/<label>/seed-<s>/``;
the split stays, it follows ``partition-seed``) and reports mean ± std per run over its seeds,
``--baseline LABEL`` the paired difference of each run to that one with a 95 % interval, and the
plot shows mean curves with ± std bands. ``--sweep KEY=V1,V2`` runs every method or variant once
per value (several sweeps: their product)::

    python benchmarks/compare.py --methods fedavg fedproto --seeds 0 1 2 --baseline fedavg \
        --sweep "lr=0.01,0.05" --run-config "dataset='fmnist'" --out runs/fmnist
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protofl.report import comparison_table, differences_table, plot_bands, plot_curves, repeats_table  # noqa: E402
from protofl.settings import flatten  # noqa: E402


def machine_description() -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, {device}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


DEFAULT_FEDERATION = {"num-supernodes": "10", "client-resources-num-cpus": "1"}  # as ./setup.sh configures


def named_federation(federation_config: str) -> str:
    """``federation_config`` with what it leaves out of :data:`DEFAULT_FEDERATION` added: a run's
    command names its federation, whatever the Flower home's configuration holds (an empty one
    simulates Flower's own default, 2 SuperNodes of 2 CPUs)."""
    given = config_pairs(federation_config)
    return " ".join(f"{key}={value}" for key, value in (given | {k: v for k, v in DEFAULT_FEDERATION.items()
                                                               if k not in given}).items())


def run_with_flower(label: str, run_config: str, federation_config: str, out: Path) -> tuple[dict | None, float]:
    """One `protofl run` (`flwr run --stream`, exiting 0 only for a completed run) of this app in
    the federation ``federation_config`` names (:func:`named_federation`); returns (results.json or
    None on failure, wall seconds)."""
    again = "" if "resume=" in run_config else " overwrite=true"  # a benchmark run again replaces its results
    overrides = merged(f"{run_config} output-dir='{out}' run-name='{label}'{again}")
    command = [sys.executable, "-m", "protofl.cli", "run", str(ROOT), "--run-config", overrides,
               "--federation-config", named_federation(federation_config)]
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
    return json.loads(results_path.read_text()), wall


def config_pairs(text: str) -> dict[str, str]:
    """``key=value ...`` (a run or federation config on the command line) as key -> value as written,
    each key at its last value."""
    return dict(re.findall(r"""([^\s=]+)=('[^']*'|"[^"]*"|\S+)""", text))


def merged(overrides: str) -> str:
    """``key=value ...`` with each key once, at its last value: a preset's `method` and the run's are both
    in one string, and Flower refuses a run config that names a key twice."""
    return " ".join(f"{key}={value}" for key, value in config_pairs(overrides).items())


def finished(results: dict) -> bool:
    """Whether a results.json holds every round its run asked for."""
    rounds, wanted = results["rounds"], results["run_config"].get("num_server_rounds")
    return bool(rounds) and rounds[-1]["round"] == wanted


def included_results(directories: list[Path]) -> dict[str, dict[int, dict]]:
    """label -> seed -> results.json of every finished run saved under the given directories, as
    ``DIR/<label>/results.json`` (one seed) or ``DIR/<label>/seed-<s>/results.json`` (repeats)."""
    groups: dict[str, dict[int, dict]] = {}
    for directory in directories:
        paths = sorted(directory.expanduser().glob("*/results.json")) + sorted(
            directory.expanduser().glob("*/seed-*/results.json")
        )
        if not paths:
            raise SystemExit(f"--include {directory}: no <label>/results.json or <label>/seed-<s>/results.json there")
        for path in paths:
            label = (path.parent.parent if path.parent.name.startswith("seed-") else path.parent).name
            results = json.loads(path.read_text())
            if not finished(results):  # results.json is written every round: a run still going, or killed
                print(f"--include: skipped {path}: {len(results['rounds'])} rounds of "
                      f"{results['run_config'].get('num_server_rounds')}", flush=True)
                continue
            groups.setdefault(label, {})[int(results["run_config"].get("seed", 0))] = results
    return groups


def preset_overrides(path: Path) -> str:
    """A preset file (``presets/*.toml``) as ``--run-config`` overrides: ``key=value ...``, flat."""
    def literal(value: object) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f"'{value}'" if isinstance(value, str) else repr(value)

    return " ".join(f"{key}={literal(value)}" for key, value in flatten(tomllib.loads(path.read_text())).items())


def preset_federation(path: Path) -> str:
    """A preset file's ``# federation-config:`` line ("" without one)."""
    found = re.search(r"^# federation-config:(.*)$", path.read_text(), re.M)
    return found.group(1).strip() if found else ""


def preset_runs(path: Path) -> list[tuple[str, str]]:
    """A table preset's runs: (label, overrides) of each method its ``# methods:`` lines name and of
    each ``# variant: LABEL=OVERRIDES`` line ([] for a preset of one run)."""
    text = path.read_text()
    methods = [m for line in re.findall(r"^# methods:(.*)$", text, re.M) for m in line.split()]
    variants = [line.strip().partition("=") for line in re.findall(r"^# variant:(.*)$", text, re.M)]
    return [(m, f"method='{m}'") for m in methods] + [(label, overrides) for label, _, overrides in variants]


def swept(runs: list[tuple[str, str]], sweeps: list[str]) -> list[tuple[str, str]]:
    """Every run once per value of every ``KEY=V1,V2,...`` (their product); labels get ``_KEY=V``."""
    for sweep in sweeps:
        key, _, values = sweep.partition("=")
        if not key or not values:
            raise SystemExit(f"--sweep {sweep!r}: expected KEY=V1,V2,...")
        runs = [(f"{label}_{key}={value.strip(chr(39) + chr(34))}", f"{overrides} {key}={value}")
                for label, overrides in runs for value in values.split(",")]
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="*", default=[], help="methods to run with the shared run config")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=OVERRIDES",
                        help="extra run with its own run-config overrides, e.g. \"fedproto-avg=method='fedproto' "
                             "fedproto.average-parameters=true\"")
    parser.add_argument("--preset", type=Path, help="a preset file (presets/*.toml): every run starts from it; "
                        "without --methods and --variant, a table preset's runs (its # methods: and # variant: lines)")
    parser.add_argument("--run-config", default="", help="run-config overrides shared by every run (after --preset)")
    parser.add_argument("--federation-config", default="", help="e.g. \"num-supernodes=20\" (default: the preset's "
                        "`# federation-config:` line; what it leaves out: 10 SuperNodes of 1 CPU)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[],
                        help="repeat every run with each of these training seeds (the split stays: partition-seed)")
    parser.add_argument("--baseline", metavar="LABEL", help="report each run's paired difference to this one")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="run every method / variant once per value (repeatable: the product of the values)")
    parser.add_argument("--include", action="append", default=[], type=Path, metavar="DIR",
                        help="also compare the runs saved under DIR by an earlier invocation (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)

    runs = [(m, f"method='{m}'") for m in args.methods]
    for variant in args.variant:
        label, _, overrides = variant.partition("=")
        runs.append((label, overrides))
    if not runs and args.preset:  # a table preset: every run it names
        runs = preset_runs(args.preset)
    runs = swept(runs, args.sweep)
    if not runs and not args.include:
        parser.error("give --methods, --variant and/or --include")
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    groups, failed = included_results(args.include), []
    shared = f"{preset_overrides(args.preset) if args.preset else ''} {args.run_config}"
    federation = args.federation_config or (preset_federation(args.preset) if args.preset else "")
    for label, overrides in runs:
        for seed in args.seeds or [None]:
            name, directory = (label, out) if seed is None else (f"seed-{seed}", out / label)
            extra = "" if seed is None else f" seed={seed}"
            result, wall = run_with_flower(name, f"{shared} {overrides}{extra}", federation, directory)
            if result is None:
                failed.append(label if seed is None else f"{label} seed {seed}")
            else:
                result["wall_seconds"] = wall
                groups.setdefault(label, {})[int(result["run_config"].get("seed", 0))] = result
    if not groups:
        return 1
    if args.baseline and args.baseline not in groups:
        raise SystemExit(f"--baseline {args.baseline!r} is not among the runs ({', '.join(groups)})")

    command = shlex.join([Path(sys.executable).name, "benchmarks/compare.py", *(argv or sys.argv[1:])])
    repeated = any(len(runs) > 1 for runs in groups.values())
    flat = {f"{label} s{seed}" if repeated else label: r for label, runs in groups.items() for seed, r in runs.items()}
    walls = ", ".join(f"{k} {v['wall_seconds']:.0f} s" for k, v in flat.items() if "wall_seconds" in v)
    report = (
        f"# Comparison\n\n- command: `{command}`\n- date: {datetime.date.today()}\n"
        f"- machine: {machine_description()}\n- wall time per run (incl. start-up): {walls}\n"
        + (f"- failed: {', '.join(failed)}\n" if failed else "")
    )
    if repeated:
        report += f"\n## Mean ± std over seeds\n\n{repeats_table(groups)}"
        if args.baseline:
            report += (f"\n## Paired difference to {args.baseline} (points, same seeds; 95 % CI, Student t)\n\n"
                       f"{differences_table(groups, args.baseline)}")
        report += "\n## Every run\n\n"
        plot_bands(groups, out / "comparison.png")
    else:
        plot_curves(flat, out / "comparison.png")
    report += f"\n{comparison_table(flat)}"
    (out / "comparison.md").write_text(report)
    print("\n" + report)
    print(f"written: {out / 'comparison.md'}, {out / 'comparison.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
