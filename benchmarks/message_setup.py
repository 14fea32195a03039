"""A ClientApp message's client set-up (``client_fn``): the model built anew against the thread's
kept model set back to its initial values (``protofl.client_app.worker_model``), side by side.

    python benchmarks/message_setup.py --run-config "model='tv-resnet18'" --repeats 10 --out runs/setup

Each repeat times ``client_fn`` once each way, in turn: "built" while the kept model is still in use
(as for a second client alive at once), "kept" after a message has ended. Data: the run config's
data set, loaded once before timing (it is cached per process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import machine_description  # noqa: E402
from flwr.app import RecordDict  # noqa: E402
from flwr.common import Context  # noqa: E402

from protofl.client_app import make_client_fn, release_worker_models  # noqa: E402
from protofl.settings import default_run_config, parse_overrides  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-config", default="")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_config = default_run_config(ROOT / "pyproject.toml") | parse_overrides(args.run_config)
    client_fn = make_client_fn(run_config)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 10},
                      state=RecordDict(), run_config={})
    release_worker_models(None, context, lambda _, c: client_fn(c))  # loads the data, keeps a model
    seconds = {"built": [], "kept": []}
    for _ in range(args.repeats):
        held = client_fn(context)  # outside a message: the kept model stays in use
        t0 = time.perf_counter()
        client_fn(context)
        seconds["built"].append(time.perf_counter() - t0)
        del held
        release_worker_models(None, context, lambda _, c: None)
        t0 = time.perf_counter()
        release_worker_models(None, context, lambda _, c: client_fn(c))
        seconds["kept"].append(time.perf_counter() - t0)
    summary = {"command": "python benchmarks/message_setup.py " + " ".join(sys.argv[1:]),
               "date": str(datetime.date.today()), "machine": machine_description(), "run_config": args.run_config,
               "median_seconds": {k: statistics.median(v) for k, v in seconds.items()}, "seconds": seconds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "message_setup.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["median_seconds"]), f"written: {args.out / 'message_setup.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
