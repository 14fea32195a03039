"""What each tracker costs the ServerApp: a finished run's rounds (its results.json) sent the way
the ServerApp sends them, in a fresh process per tracker: import and start, one round (mean),
finish (the files, close); wall and CPU seconds.

    python benchmarks/tracking.py ~/protofl-runs/<run>/results.json [--trackers tensorboard mlflow wandb]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILES = ("results.json", "metrics.csv", "accuracy.png")


def measure(tracker: str, results_path: Path) -> str:
    import torch  # noqa: F401: the ServerApp has torch loaded already

    from protofl.tracking import Tracking

    results = json.loads(results_path.read_text())
    rounds = {r["round"]: r for r in results["rounds"]}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch) / "run"
        directory.mkdir()
        for name in FILES:
            if (results_path.parent / name).is_file():
                (directory / name).write_bytes((results_path.parent / name).read_bytes())
        clock = [(time.perf_counter(), time.process_time())]
        tracking = Tracking.from_settings(tracker, directory)
        tracking.start(directory.name, results["run_config"], {}, None)
        clock.append((time.perf_counter(), time.process_time()))
        for server_round in sorted(rounds):
            tracking.log(rounds, before=server_round + 1)
        clock.append((time.perf_counter(), time.process_time()))
        tracking.finish(rounds, [directory / name for name in FILES], False)
        clock.append((time.perf_counter(), time.process_time()))
    (start, log, finish) = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock, clock[1:])]
    n = len(rounds)
    return (f"{tracker}: import+start {start[0]:.2f} s wall / {start[1]:.2f} s CPU | per round "
            f"{1000 * log[0] / n:.1f} ms wall / {1000 * log[1] / n:.1f} ms CPU | finish {finish[0]:.2f} s wall / "
            f"{finish[1]:.2f} s CPU ({n} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--trackers", nargs="+", default=["tensorboard", "mlflow", "wandb"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's tracker
    args = parser.parse_args()
    if args.one:
        print(measure(args.one, args.results.resolve()))
        return
    for tracker in args.trackers:
        with tempfile.TemporaryDirectory() as home:  # W&B's own config, cache and data dirs
            env = os.environ | {name: f"{home}/{name}" for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
            child = subprocess.run([sys.executable, __file__, str(args.results), "--one", tracker],
                                   capture_output=True, text=True, env=env | {"WANDB_MODE": "offline"})
        lines = [line for line in child.stdout.splitlines() if line.startswith(f"{tracker}:")]
        print(lines[-1] if lines else f"{tracker}: failed\n{child.stderr[-2000:]}")


if __name__ == "__main__":
    main()
