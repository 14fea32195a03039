"""protofl's FedProto on a preset in one process (tests/inprocess.py's federation, no Ray), with
HtFLlib's behaviour put in one piece at a time, to find which piece moves the accuracy curve
(benchmarks/htfllib_compare.sh compares the two libraries).

    python benchmarks/fedproto_probe.py --preset presets/fmnist-fedsa-table2.toml --seed 0 \\
        --probe seen-only --run-config "amp='off'" --out /tmp/probe

Probes (``--probe``, repeatable; none: protofl as it is), each a patch of this process only:

- ``seen-only``: only the prototypes of the classes a client saw in training
  (``prototype-pass = "during-train"``) enter the global ones, as in HtFLlib's FedProto, where
  protofl fills a class whose samples all fell in a dropped partial batch (all of a 6-sample
  client's classes, with batch 10) from an eval pass after training (``FeatureSums.means_filled``
  through ``LocalTraining.local_prototypes``) and counts it as held.

- ``drop-last``: every batch smaller than ``batch-size`` is dropped, as HtFLlib's
  ``DataLoader(drop_last=True)`` does, also when it is the split's only one: a client with fewer
  samples than one batch (6, with batch 10) does not train and, with ``seen-only``, uploads nothing,
  where protofl trains it on one batch of all its samples (``protofl.task.train._skipped``).

Run-config overrides (``--run-config``) reach protofl's own switches, e.g. ``batchnorm-stats='running'``
(HtFLlib keeps the running averages; protofl's "auto" recomputes them after a short round) or
``amp='off' channels-last=false`` (HtFLlib computes in float32). Writes
``<out>/<label>/seed-<s>/results.json`` as a real run (label: the probes and overrides, or ``--label``).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from compare import config_pairs, merged, preset_federation, preset_overrides  # noqa: E402

from protofl.settings import default_run_config, parse_overrides  # noqa: E402

PROBES = ("seen-only", "drop-last")


def seen_only():
    """Patch: a client's classes that no counted training batch held go up as zero rows (no eval-pass
    fill), and the server leaves a client's zero rows out of the class's mean (the counts themselves
    must stay the partition's: the server checks them)."""
    import numpy as np

    from protofl.federation import client_training
    from protofl.strategies.families import class_vectors

    def local_prototypes(self, seen=None):
        return original_local(self, seen) if seen is None else seen.means()

    def aggregate_prototypes(prototypes, counts, *args, **kwargs):
        counts = np.where(np.abs(prototypes).sum(axis=-1) > 0, counts, 0)
        return original_aggregate(prototypes, counts, *args, **kwargs)

    original_local = client_training.LocalTraining.local_prototypes
    original_aggregate = class_vectors.aggregate_prototypes
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(client_training.LocalTraining, "local_prototypes", local_prototypes))
    stack.enter_context(mock.patch.object(class_vectors, "aggregate_prototypes", aggregate_prototypes))
    return stack


def drop_last():
    """Patch: with ``partial-batch = "drop"``, every batch smaller than ``batch-size`` is dropped,
    also a split's only one (protofl trains a split smaller than one batch as one batch)."""
    from protofl.task import train

    def skipped(batch, n, batch_size, partial_batch):
        return batch != batch_size and (partial_batch == "drop" or batch == 1)

    return mock.patch.object(train, "_skipped", skipped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", action="append", default=[], choices=PROBES)
    parser.add_argument("--run-config", default="", help="overrides after the preset's and method='fedproto'")
    parser.add_argument("--label", help="the run's folder (default: from the probes and overrides)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    label = args.label or "-".join(args.probe + re.findall(r"[\w.-]+=[^\s']+|[\w.-]+='[^']*'", args.run_config)
                                   ).replace("'", "").replace("=", "_") or "protofl"
    directory = (args.out / label).expanduser().resolve()
    overrides = merged(f"{preset_overrides(args.preset)} method='fedproto' {args.run_config} seed={args.seed} "
                       f"output-dir='{directory}' run-name='seed-{args.seed}' overwrite=true")
    run_config = default_run_config(ROOT / "pyproject.toml") | parse_overrides(overrides)
    nodes = int(config_pairs(preset_federation(args.preset)).get("num-supernodes", 10))
    from inprocess import run_in_process

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for probe in args.probe:
            stack.enter_context({"seen-only": seen_only, "drop-last": drop_last}[probe]())
        run_in_process(run_config, num_nodes=nodes)
    print(f"{label} seed {args.seed}: {time.perf_counter() - started:.0f} s, {directory / f'seed-{args.seed}' / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
