"""FedKD's bandwidth: the mentee's bytes per round as protofl sends them, at full rank, and in
HtFLlib's form, from a FedKD run's results.json.

    python benchmarks/fedkd_bandwidth.py runs/fedkd-digits/fedkd --out runs/fedkd-digits/bandwidth

Each round records the rank of every compressed entry of the mentee that went down and of each
accepted upload's (``mentee_ranks``). From those ranks and the model's shapes, for each m x n
matrix of rank r (a convolution: every kernel's, one rank for the layer):

- protofl: min(r (m + n), m n) numbers (factors where they are fewer: ``fedkd.factor_form``);
- full rank: m n;
- HtFLlib (e959261, ``clientkd.decomposition``): U_r, S_r and V_r^T, r (m + n + 1), always. Where only
  every singular value reaches the energy (r = min(m, n)), HtFLlib's code finds no truncation and
  sends empty factors (zeros); it is counted at that rank here.

Biases and buffers travel as they are in all three. Down: the mentee each sampled client of the
round receives (the previous round's aggregate; round 1's initial model whole); up: each accepted
upload. Only the parameters are counted (4 bytes a float32 number); the measured
``bytes_up`` and ``bytes_down`` (each array's ``.npy`` header and every metric included) are printed
beside protofl's. Writes ``<out>/fedkd-bandwidth.json`` and ``.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protofl.settings import ExperimentSettings  # noqa: E402
from protofl.strategies import build_method_model, get_method  # noqa: E402
from protofl.task.data import load_dataset  # noqa: E402


def compressed_shapes(run_config: dict) -> tuple[list[tuple[int, ...]], int, int]:
    """(the shapes of the mentee's compressed entries in order, the numbers of the others, the
    bytes of a number) for the run's settings."""
    with tempfile.TemporaryDirectory() as directory:
        settings = ExperimentSettings(**run_config | {"output_dir": directory})  # results.json's: the fields
        dataset = load_dataset(settings.dataset, settings.data_dir, settings.normalisation)
        strategy = get_method("fedkd")[0](settings, build_method_model(settings, dataset), dataset.num_classes)
        entries = strategy.shared_weights()
        shapes = [a.shape for i, a in enumerate(entries) if strategy.compressed(i)]
        others = sum(a.size for i, a in enumerate(entries) if not strategy.compressed(i))
        return shapes, others, entries[0].dtype.itemsize


def numbers(shapes: list[tuple[int, ...]], ranks: list[int], form: str) -> int:
    """The numbers ``form`` (protofl, full, htfllib) sends for the compressed entries at ``ranks``."""
    total = 0
    for (*batch, m, n), r in zip(shapes, ranks):
        per_matrix = {"protofl": min(r * (m + n), m * n), "full": m * n, "htfllib": r * (m + n + 1)}[form]
        per_matrix = per_matrix if r else m * n  # a zero matrix travels whole in both
        total += math.prod(batch) * per_matrix
    return total


def bandwidth(results: dict) -> list[dict]:
    shapes, others, itemsize = compressed_shapes(results["run_config"])
    rows, sent = [], None  # the ranks of the mentee the round sends: the previous round's aggregate
    for record in results["rounds"]:
        ranks = record.get("mentee_ranks")
        if not ranks:
            continue
        row = {"round": record["round"], "clients_down": len(record["clients"]), "clients_up": len(ranks["up"])}
        for form in ("protofl", "full", "htfllib"):
            down = numbers(shapes, sent, form) if sent else sum(math.prod(shape) for shape in shapes)
            row[f"{form}_down"] = (down + others) * itemsize * row["clients_down"]
            row[f"{form}_up"] = sum(numbers(shapes, r, form) + others for r in ranks["up"]) * itemsize
        row["measured_down"], row["measured_up"] = record.get("bytes_down"), record.get("bytes_up")
        row["sent_ranks"], row["upload_ranks"] = sent, ranks["up"]
        rows.append(row)
        sent = ranks["down"]
    return rows


def table(rows: list[dict]) -> str:
    def mb(value):
        return f"{value / 1e6:.3f}"

    lines = ["| round | ranks sent | up: protofl | full | HtFLlib | protofl / full | down: protofl | full | HtFLlib "
             "| protofl / full | measured up | measured down |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['round']} | {r['sent_ranks'] or 'initial'} | {mb(r['protofl_up'])} | {mb(r['full_up'])} | "
                     f"{mb(r['htfllib_up'])} | {r['protofl_up'] / r['full_up']:.3f} | {mb(r['protofl_down'])} | "
                     f"{mb(r['full_down'])} | {mb(r['htfllib_down'])} | {r['protofl_down'] / r['full_down']:.3f} | "
                     f"{mb(r['measured_up'])} | {mb(r['measured_down'])} |")
    totals = {f"{form}_{way}": sum(r[f"{form}_{way}"] for r in rows)
              for form in ("protofl", "full", "htfllib", "measured") for way in ("up", "down")}
    lines.append(f"| all | | {mb(totals['protofl_up'])} | {mb(totals['full_up'])} | {mb(totals['htfllib_up'])} | "
                 f"{totals['protofl_up'] / totals['full_up']:.3f} | {mb(totals['protofl_down'])} | "
                 f"{mb(totals['full_down'])} | {mb(totals['htfllib_down'])} | "
                 f"{totals['protofl_down'] / totals['full_down']:.3f} | {mb(totals['measured_up'])} | "
                 f"{mb(totals['measured_down'])} |")
    return "MB of the mentee's parameters a round (measured: everything on the wire)\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a FedKD run's directory (its results.json)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = bandwidth(json.loads((args.run / "results.json").read_text()))
    if not rows:
        sys.exit(f"{args.run / 'results.json'} has no round with mentee_ranks (a FedKD run of this version)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedkd-bandwidth.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (args.out / "fedkd-bandwidth.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
