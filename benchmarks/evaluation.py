"""What clients' evaluation costs a round: the same run under each evaluation protocol, side by side.

    python benchmarks/evaluation.py --run-config "method='fedproto' dataset='fmnist' partition='dirichlet' \\
        alpha=0.1 local-epochs=1 batch-size=10" --federation-config "num-supernodes=20 client-resources-num-cpus=1" \\
        --out runs/evaluation

Each protocol is one `flwr run` of ``--rounds`` rounds (default 3) with every client in every round.
The steady round is round 2: it trains, and (but in "no scoring") scores one model: in "fit"
protocols round 1's, inside round 2's fit message; in "evaluate" protocols round 2's, in its own
message. Its ``seconds`` (results.json) are compared with the same round in "no scoring", where
clients score only in the last round. Prints a table and writes evaluation.json / evaluation.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from compare import machine_description, run_with_flower  # noqa: E402

PROTOCOLS = {  # label -> run-config overrides
    "no scoring": "eval-every=1000",
    "fit message (default)": "",
    "fit message, global-test-pm": "global-test-pm=true",
    "evaluate message": "evaluation-message='evaluate'",
    "evaluate message, global-test-pm (the old default)": "evaluation-message='evaluate' global-test-pm=true",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default="")
    parser.add_argument("--federation-config", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("need 3 rounds: round 2 is the steady one, the last round scores on its own")
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for index, (label, overrides) in enumerate(PROTOCOLS.items()):
        run_config = f"{args.run_config} num-server-rounds={args.rounds} fraction-fit=1.0 {overrides}"
        results, wall = run_with_flower(f"protocol-{index}", run_config, args.federation_config, out)
        if results is None:
            return 1
        steady = results["rounds"][1]
        rows.append({"protocol": label, "overrides": overrides, "round_2_seconds": steady["seconds"],
                     "round_seconds": [r["seconds"] for r in results["rounds"]], "wall_seconds": wall,
                     "personalized_accuracy_final": results["summary"]["personalized_accuracy"]["final"]})
        print(rows[-1], flush=True)
    base = rows[0]["round_2_seconds"]
    for row in rows:
        row["ratio"] = row["round_2_seconds"] / base
    lines = ["| protocol | round 2 (s) | ratio to no scoring | seconds per round | PM final |", "|---|---|---|---|---|"]
    lines += [f"| {r['protocol']} | {r['round_2_seconds']:.1f} | {r['ratio']:.2f} | "
              f"{', '.join(f'{s:.1f}' for s in r['round_seconds'])} | {r['personalized_accuracy_final']:.4f} |"
              for r in rows]
    summary = {"command": " ".join(["python", "benchmarks/evaluation.py", *(argv or sys.argv[1:])]),
               "date": str(datetime.date.today()), "machine": machine_description(), "rows": rows}
    (out / "evaluation.json").write_text(json.dumps(summary, indent=2))
    (out / "evaluation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
