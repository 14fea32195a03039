"""Many clients: memory, seconds per round and checkpoint cost of `flwr run` simulations.

    python benchmarks/scale.py --methods fedproto fedsa --clients 100 1000 --rounds 6 --out runs/scale

Each (method, clients, client-state) cell is one `protofl run .` (`flwr run . --stream`; Ray simulation, its own
Flower home and ports) on Fashion-MNIST with ``fraction-fit`` 0.1. While it runs, the resident
memory of every process it started (the managed SuperLink, the simulation, Ray and its workers) is
sampled twice a second: ``peak RSS`` sums RSS (pages shared between processes counted in each),
``peak PSS`` sums proportional set sizes (shared pages split between their processes: the memory
the run really takes). The clients keep their state where they do by default (on disk, in the run
directory); ``--memory`` adds the runs whose clients keep it in Flower's memory (``context.state``,
``state-dir="memory"``). Writes ``<out>/scale.json`` and
``<out>/scale.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "deploy"))

import native  # noqa: E402
from compare import machine_description  # noqa: E402


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB; zeros when it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


class MemorySampler(threading.Thread):
    """Peak summed RSS and PSS of the processes whose command lines name ``marker``, and of their
    descendants (Ray's workers name nothing of ours)."""

    def __init__(self, marker: str, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.marker, self.roots = marker, roots
        self.peak_rss = self.peak_pss = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            pids = native.descendants(self.roots + native.pids_with_argument(self.marker))
            totals = [memory_kib(pid) for pid in pids]
            self.peak_rss = max(self.peak_rss, sum(r for r, _ in totals))
            self.peak_pss = max(self.peak_pss, sum(p for _, p in totals))


def kill_everything(marker: str) -> None:
    import signal

    for pid in native.descendants(native.pids_with_argument(marker)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_run(method: str, clients: int, on_disk: bool, rounds: int, out: Path, extra: str) -> dict:
    label = f"{method}-{clients}-{'disk' if on_disk else 'memory'}"
    with tempfile.TemporaryDirectory(prefix="protofl-scale-") as home:
        run_config = (
            f"method='{method}' dataset='fmnist' num-server-rounds={rounds} fraction-fit=0.1 "
            f"global-test-pm=false output-dir='{out}' run-name='{label}' overwrite=true {extra}"
        )
        if not on_disk:
            run_config += " state-dir='memory'"
        bin_dir = Path(sys.executable).parent
        env = os.environ | {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FLWR_HOME": home,
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(native.free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(native.free_port()),
        }
        command = [str(bin_dir / "protofl"), "run", str(ROOT), "--run-config", run_config,
                   "--federation-config", f"num-supernodes={clients} client-resources-num-cpus=1"]
        print(f"\n=== {label}: {' '.join(command)}", flush=True)
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, cwd=ROOT)
        sampler = MemorySampler(home, [process.pid])
        sampler.start()
        try:
            process.wait(timeout=3600)
        finally:
            sampler.done.set()
            sampler.join()
            kill_everything(home)
        wall = time.perf_counter() - started
    results = json.loads((out / label / "results.json").read_text())
    records = results["rounds"]
    later = records[1:] or records  # round 1 also discovers the nodes' partitions
    row = {
        "label": label, "method": method, "clients": clients, "client_state": "disk (default)" if on_disk else "memory",
        "rounds": len(records), "wall_s": round(wall, 1),
        "peak_rss_mib": round(sampler.peak_rss / 1024), "peak_pss_mib": round(sampler.peak_pss / 1024),
        "round1_s": round(records[0]["seconds"], 2),
        "round_s": round(sum(r["seconds"] for r in later) / len(later), 2),
        "checkpoint_s": round(max(r.get("checkpoint_seconds") or 0 for r in records), 3),
        "checkpoint_mib": round(max(r.get("checkpoint_bytes") or 0 for r in records) / 2**20, 2),
        "pm_final": records[-1].get("personalized_accuracy"),
    }
    print(row, flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| method | clients | client state | peak PSS (MiB) | peak RSS sum (MiB) | s / round (round 1) | "
        "checkpoint s (max) | checkpoint MiB | PM final |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['clients']} | {r['client_state']} | {r['peak_pss_mib']} | {r['peak_rss_mib']} | "
            f"{r['round_s']} ({r['round1_s']}) | {r['checkpoint_s']} | {r['checkpoint_mib']} | "
            f"{r['pm_final']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["fedproto", "fedsa"])
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--memory", action="store_true", help="also run with client state in memory")
    parser.add_argument("--run-config", default="", help="more run-config overrides")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scale")
    args = parser.parse_args()
    args.out = args.out.resolve()
    rows = []
    for method in args.methods:
        for clients in args.clients:
            for on_disk in (True, False) if args.memory else (True,):
                rows.append(one_run(method, clients, on_disk, args.rounds, args.out, args.run_config))
    text = table(rows)
    header = f"{datetime.date.today()}, {machine_description()}, `{' '.join(sys.argv)}`\n\n"
    (args.out / "scale.md").write_text(header + text)
    (args.out / "scale.json").write_text(json.dumps(rows, indent=2))
    print("\n" + header + text)


if __name__ == "__main__":
    main()
