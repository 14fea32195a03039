"""What the edge (deploy/edge.py) costs a round: the TLS + SuperNode-auth federation of
docker-compose.yml's topology, started natively by deploy/native.py, once with the SuperNodes and
the operator dialling the SuperLink directly and once through the edge (the operator through
deploy/operator_tunnel.py), alternating, the same FedProto run each time.

    python benchmarks/edge.py --rounds 5 --repeats 2 --out runs/edge

Prints a table and writes ``edge.json`` / ``edge.md`` to ``--out``: each run's seconds per round
(results.json's ``seconds``, rounds 2 on: round 1 also starts every ClientApp) and the ratio of
their means, edge over direct.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))
import native  # noqa: E402
from make_credentials import make_credentials  # noqa: E402

NODES = 2


def one_run(work: Path, rounds: int, through_edge: bool) -> list[float]:
    """Seconds of rounds 2..``rounds`` of a FedProto run on a fresh federation."""
    credentials = work / "credentials"
    make_credentials(credentials, [], NODES)
    deployment = native.NativeDeployment(work / "services", native.environment(), credentials=credentials)
    link, public, tunnel = (("127.0.0.1", native.free_port()) for _ in range(3))
    nodes = [("127.0.0.1", native.free_port(), None) for _ in range(NODES)]
    try:
        if through_edge:
            home = native.cli_home(work / "cli", f"{tunnel[0]}:{tunnel[1]}")
            native.start_behind_edge(deployment, link, public, tunnel, nodes, home)
        else:
            home = native.cli_home(work / "cli", f"{link[0]}:{link[1]}", credentials / "ca.crt")
            keys = [credentials / f"supernode-{i}.pub" for i in range(1, NODES + 1)]
            native.start_federation(deployment, native.load_compose("tls", "auth"), link, nodes,
                                    before_nodes=lambda: native.register_keys(home, keys))
        run_config = f"method='fedproto' num-server-rounds={rounds} output-dir='{work}' run-name='run'"
        run = native.protofl_run(home, [str(ROOT), "deployment", "--run-config", run_config], 900)
        if run.returncode != 0:
            raise RuntimeError(run.stdout[-3000:] + run.stderr[-3000:])
    finally:
        deployment.stop()
    results = json.loads((work / "run" / "results.json").read_text())
    return [r["seconds"] for r in results["rounds"][1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternating")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "edge")
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"direct": [], "edge": []}
    for repeat in range(args.repeats):
        for kind in ("direct", "edge"):
            with tempfile.TemporaryDirectory() as work:
                rounds = one_run(Path(work), args.rounds, kind == "edge")
            seconds[kind] += rounds
            print(f"repeat {repeat + 1} {kind}: " + " ".join(f"{s:.2f}" for s in rounds) + " s per round", flush=True)
    means = {kind: statistics.mean(values) for kind, values in seconds.items()}
    ratio = means["edge"] / means["direct"]
    table = ["| federation | rounds timed | mean s per round | stdev |", "|---|---|---|---|"]
    table += [f"| {kind} | {len(values)} | {means[kind]:.2f} | {statistics.stdev(values):.2f} |"
              for kind, values in seconds.items()]
    table.append(f"\nedge / direct: {ratio:.3f}")
    print("\n".join(table))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge.json").write_text(json.dumps({"seconds": seconds, "means": means, "ratio": ratio}, indent=1))
    (args.out / "edge.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
