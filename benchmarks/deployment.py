"""The same short run in Flower's simulation and on real processes (docker-compose.yml's topology,
started natively by deploy/native.py), with and without the SuperNodes' data cache.

    python benchmarks/deployment.py --rounds 2 --out runs/deployment

Prints a table and writes ``deployment.json`` / ``deployment.md`` to ``--out``. "wall" is the
``flwr run --stream`` command from start to exit; the deployment's processes are started (and
their ports open) before it. Round times come from each run's results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
import native  # noqa: E402


def flwr_run(home: Path, args: list[str], timeout: int, env: dict[str, str] | None = None) -> float:
    """Seconds that ``protofl run <ROOT> <args>`` took; raises with its output if the run failed."""
    started = time.perf_counter()
    run = native.protofl_run(home, [str(ROOT), *args], timeout, env)
    if run.returncode != 0:
        raise RuntimeError(run.stdout[-3000:] + run.stderr[-3000:])
    return time.perf_counter() - started


def simulation(work: Path, run_config: str, nodes: int, timeout: int) -> float:
    home = work / "flwr-home"
    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(native.free_port()),
             "FLWR_LOCAL_CONTROL_API_PORT": str(native.free_port())}
    federation = f"num-supernodes={nodes} client-resources-num-cpus=1"
    try:
        return flwr_run(home, ["--run-config", run_config, "--federation-config", federation], timeout, ports)
    finally:
        native.kill_trees(native.pids_with_argument(str(home)))  # the managed local SuperLink


def _without_cache_dir(command: list[str]) -> list[str]:
    return [" ".join(p for p in token.split() if not p.startswith("cache-dir=")) if previous == "--node-config"
            else token for previous, token in zip([None, *command], command)]


def deployment(work: Path, run_config: str, nodes: int, cache: bool, timeout: int) -> float:
    compose = native.load_compose()
    if nodes != len([s for s in compose["services"] if s.startswith("supernode-")]):
        raise SystemExit("the compose file defines a different number of SuperNodes")
    if not cache:
        for service in compose["services"].values():
            service["command"] = _without_cache_dir(service["command"])
    started = native.NativeDeployment(work / "services", native.environment())
    try:
        link = ("127.0.0.1", native.free_port())
        native.start_federation(started, compose, link, [("127.0.0.1", native.free_port(), None) for _ in range(nodes)])
        home = native.cli_home(work / "cli-home", f"{link[0]}:{link[1]}")
        return flwr_run(home, ["deployment", "--run-config", run_config], timeout)
    finally:
        started.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="fedproto")
    parser.add_argument("--run-config", default="", help="more run-config overrides")
    parser.add_argument("--nodes", type=int, default=2, help="SuperNodes (the compose file has 2)")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "deployment")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    paths = [
        ("simulation", "simulation (Ray, flwr run)", lambda work, rc: simulation(work, rc, args.nodes, args.timeout)),
        ("deployment", "deployment, node cache",
         lambda work, rc: deployment(work, rc, args.nodes, True, args.timeout)),
        ("deployment-nocache", "deployment, no cache",
         lambda work, rc: deployment(work, rc, args.nodes, False, args.timeout)),
    ]
    for name, label, run in paths:
        run_config = (f"method='{args.method}' num-server-rounds={args.rounds} output-dir='{args.out}' "
                      f"run-name='{name}' overwrite=true {args.run_config}")
        with tempfile.TemporaryDirectory() as work:
            wall = run(Path(work), run_config)
        results = json.loads((args.out / name / "results.json").read_text())
        rounds = [r["seconds"] for r in results["rounds"]]
        rows.append({"path": label, "wall_s": round(wall, 1), "run_s": round(results["total_seconds"], 1),
                     "round_s": [round(s, 1) for s in rounds],
                     "pm_final": results["summary"]["personalized_accuracy"]["final"]})
        print(rows[-1], flush=True)
    lines = ["| path | wall (s) | run (s) | seconds per round | PM final |", "|---|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['wall_s']} | {r['run_s']} | {', '.join(map(str, r['round_s']))} | "
              f"{r['pm_final']:.4f} |" for r in rows]
    (args.out / "deployment.md").write_text("\n".join(lines) + "\n")
    (args.out / "deployment.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows},
                                                         indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
