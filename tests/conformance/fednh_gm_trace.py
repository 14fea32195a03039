"""FedNH's global-model accuracy round by round on Fashion-MNIST's pathological split (issue 38): our
code and the authors' code (Yutong-Dai/FedNH) on the same split, the same initial model and
prototypes, the same hyper-parameters. Not a test: it prints a table (and writes JSON with --out).

    python tests/conformance/fednh_gm_trace.py --checkout <Yutong-Dai/FedNH at 60c3161> [--seeds 0 1 2] [--runs ...]

The setting is presets/fmnist-seeds-pathological.toml's (20 clients, 2 classes each, 15 % of the
data, 12 rounds, 1 local epoch, batch 10, SGD lr 0.05) with FedNH's defaults (simplex W^0, s = 30
fixed, rho 0.9), in one process (tests/inprocess.py) with float32 (amp off). Runs:

- ``ours``: protofl with its defaults (since max-grad-norm="auto", FedNH clips at 10 as its code);
- ``ours-no-clip``: without gradient clipping, as docs/results/seeds.md's table ran it;
- ``ours-as-code``: with the two loop details of the authors' client: gradient clipping at 10 and
  training on the last partial batch (``ours-clip10``: the clipping alone);
- ``theirs``: their ``FedNHClient.training`` / ``upload`` and ``FedNHServer.aggregate`` (made with
  ``__new__``), their server-side client's ``testing`` for the GM, on our clients' data; their
  model class is an adapter (FedAvgCNN's layers with their Conv2CifarNH head: normalised feature,
  s * cos to the frozen prototypes), started from our initial weights and W^0;
- for ``ours``, also the GM scored with W^t (the prototypes the clients trained against) instead of
  W^{t+1}, and ``rho = 1`` (FedUH: the prototypes never move).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

RUN = {"dataset": "fmnist", "data-fraction": 0.15, "partition": "pathological-pfllib", "classes-per-client": 2,
       "num-server-rounds": 12, "local-epochs": 1, "global-test-pm": False, "method": "fednh", "amp": "off",
       "channels-last": False}
NODES = 20
OUR_RUNS = {  # protofl's runs: overrides of RUN
    "ours": {},
    "ours-no-clip": {"max-grad-norm": 0.0},
    "ours-clip10": {"max-grad-norm": 10.0},
    "ours-as-code": {"max-grad-norm": 10.0, "partial-batch": "keep"},
    "ours-rho1": {"fednh.rho": 1.0},
}


def run_ours(seed: int, overrides: dict) -> dict[str, list[float]]:
    """GM per round (with W^{t+1}, as recorded, and with W^t) of protofl in one process, and the
    local steps' gradient norms (before any clipping) per round: the median, the largest, the
    share above 10 and the mean of each client's first step."""
    from inprocess import run_in_process

    import protofl.federation.client as client_module
    from protofl.federation.server import legacy_strategy
    from protofl.strategies.fednh import FedNHStrategy
    from protofl.task.inference import features_and_logits

    with_previous: list[float] = []
    norms: list[tuple[bool, float]] = []  # (first step of a local round, norm) of the round going on
    per_round: dict[str, list[float]] = {"grad_norm_median": [], "grad_norm_max": [], "grad_norm_share_above_10": [],
                                         "first_step_grad_norm_mean": []}
    front = legacy_strategy(FedNHStrategy)  # the class the ServerApp runs
    aggregate, evaluate = front.aggregate_updates, front.evaluate
    clip, train = torch.nn.utils.clip_grad_norm_, client_module.train
    local = threading.local()

    def clip_and_record(parameters, max_norm, *args, **kwargs):
        norm = clip(parameters, max_norm, *args, **kwargs)  # the norm before clipping
        norms.append((getattr(local, "first", False), float(norm)))
        local.first = False
        return norm

    def train_marking_the_first_step(*args, **kwargs):
        local.first = True
        if not kwargs.get("max_grad_norm"):
            kwargs["max_grad_norm"] = 1e30  # clip_grad_norm_ runs and reports the norm; the gradients x 1.0
        return train(*args, **kwargs)

    def aggregate_and_keep(self, server_round, updates):
        values = np.array([n for _, n in norms])
        per_round["grad_norm_median"].append(float(np.median(values)))
        per_round["grad_norm_max"].append(float(values.max()))
        per_round["grad_norm_share_above_10"].append(float((values > 10).mean()))
        per_round["first_step_grad_norm_mean"].append(float(np.mean([n for first, n in norms if first])))
        norms.clear()
        self.previous_prototypes = self.prototypes.copy()
        return aggregate(self, server_round, updates)

    def evaluate_both(self, server_round, parameters):
        result = evaluate(self, server_round, parameters)  # loads the new body into self.model
        if server_round > 0 and result is not None:
            current = self.prototypes.copy()
            self.prototypes = self.previous_prototypes
            x, y = self.global_test
            _, logits = features_and_logits(self.model, x)
            with_previous.append(float((logits.argmax(1) == y).float().mean()))
            self.prototypes = current
        return result

    front.aggregate_updates, front.evaluate = aggregate_and_keep, evaluate_both
    torch.nn.utils.clip_grad_norm_, client_module.train = clip_and_record, train_marking_the_first_step
    try:
        with tempfile.TemporaryDirectory() as directory:
            run_in_process(RUN | {"seed": seed, "output-dir": directory, "run-name": "run"} | overrides, NODES)
            rounds = json.loads((Path(directory) / "run" / "results.json").read_text())["rounds"]
    finally:
        del front.aggregate_updates, front.evaluate  # the inherited ones again
        torch.nn.utils.clip_grad_norm_, client_module.train = clip, train
    return {"gm": [r["global_accuracy"] for r in rounds], "gm_with_w_t": with_previous} | per_round


def run_theirs(checkout: Path, seed: int) -> dict[str, list[float]]:
    """GM per round of the authors' client and server code on our clients' data."""
    sys.path.insert(0, str(checkout))
    from src.flbase.model import Model
    from src.flbase.strategies import FedNH, FedUH

    from conformance.fednh import _Images, _server
    from protofl.strategies import build_method_model
    from protofl.task.data import load_client_data, load_dataset

    settings = _settings(seed)
    dataset = load_dataset("fmnist")
    ours = build_method_model(settings, dataset)  # our initial body and W^0 (simplex, seed)
    num_classes = dataset.num_classes

    class FedAvgCNNNH(Model):
        """Adapter: FedAvgCNN's layers; the head as their Conv2CifarNH's (unit feature, s cos to W)."""

        def __init__(self, config):
            super().__init__(config)
            self.return_embedding = config["FedNH_return_embedding"]
            self.body = copy.deepcopy(ours.body)
            self.prototype = nn.Parameter(torch.zeros(num_classes, ours.feature_dim))
            self.scaling = nn.Parameter(torch.tensor([1.0]))

        def forward(self, x):
            feature = self.body(x)
            feature = feature / feature.norm(dim=1, keepdim=True).clamp(min=1e-12)
            logits = self.scaling * (feature @ self.prototype.T)
            return (feature, logits) if self.return_embedding else logits

    FedUH.FedAvgCNNNH = FedAvgCNNNH  # their client builds eval(f"{model}NH") in FedUH's namespace
    config = {"model": "FedAvgCNN", "num_classes": num_classes, "FedNH_return_embedding": False,
              "FedNH_head_init": "orthogonal", "FedNH_fix_scaling": True, "FedNH_client_adv_prototype_agg": False,
              "num_epochs": settings.local_epochs, "batch_size": settings.batch_size, "optimizer": "SGD",
              "client_lr": settings.lr, "client_lr_scheduler": "diminishing", "lr_decay_per_round": 1.0,
              "sgd_momentum": 0.0, "sgd_weight_decay": 0.0, "num_rounds": settings.num_server_rounds,
              "global_seed": seed}
    spec = settings.partition_spec(NODES)
    criterion = nn.CrossEntropyLoss()
    clients = {}
    for p in range(NODES):
        data = load_client_data("fmnist", "", spec, p)
        clients[p] = FedNH.FedNHClient(criterion, _Images(data.train_x, data.train_y.numpy()), None, config, p, "cpu")
    state = copy.deepcopy(clients[0].get_params())
    state.update({f"body.{k}": v.clone() for k, v in ours.body.state_dict().items()})
    state["prototype"] = ours.head.prototypes.clone()  # W^0; scaling stays 30 (FedNH_fix_scaling)
    server = _server(FedNH.FedNHServer, state, clients)
    server.server_config["num_classes"] = num_classes
    test = _Images(torch.from_numpy(dataset.test.images), dataset.test.labels)
    scorer = FedNH.FedNHClient(criterion, clients[0].trainset, test, config, -1, "cpu")
    gm = []
    for server_round in range(1, settings.num_server_rounds + 1):
        uploads = []
        for client in clients.values():
            client.set_params(server.server_model_state_dict, server.exclude_layer_keys)
            client.training(server_round, config["num_epochs"])
            state, shared = client.upload()
            uploads.append((copy.deepcopy(state), shared))
        server.aggregate(uploads, server_round)
        scorer.set_params(server.server_model_state_dict, set())
        scorer.testing(server_round)
        gm.append(float(scorer.test_acc_dict[server_round]["acc_by_criteria"]["uniform"]))
    return {"gm": gm}


def _settings(seed: int):
    """RUN's settings, as the app reads them (the run config's defaults under RUN)."""
    from protofl.settings import ExperimentSettings, default_run_config

    defaults = default_run_config(TESTS.parent / "pyproject.toml")
    return ExperimentSettings.from_run_config(defaults | RUN | {"seed": seed, "num-partitions": NODES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, required=True, help="Yutong-Dai/FedNH at 60c3161")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runs", nargs="+", default=[*OUR_RUNS, "theirs"], choices=[*OUR_RUNS, "theirs"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    traces = {}
    for seed in args.seeds:
        for name in args.runs:
            traces[f"{name}/{seed}"] = (run_theirs(args.checkout, seed) if name == "theirs"
                                        else run_ours(seed, OUR_RUNS[name]))
        for name, trace in traces.items():
            if name.endswith(f"/{seed}"):
                for key, values in trace.items():
                    print(f"{name:18s} {key:12s} " + " ".join(f"{v:.3f}" for v in values), flush=True)
    if args.out:
        args.out.write_text(json.dumps(traces, indent=1))


if __name__ == "__main__":
    main()
