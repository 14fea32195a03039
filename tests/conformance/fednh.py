"""FedNH's fixtures, from the authors' code (Yutong-Dai/FedNH).

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64. The arrays that cross
protofl's float32 wire are given to both sides as float32 values (fed to their code as float64
tensors): the server's prototypes W (the server step's W, ``input.prototypes``, and the rounds'
W^0: their orthogonal init rounded to float32, as our server broadcasts it) and the clients'
uploaded class means (``input.client_means``). That rounding is the only adaptation of their
inputs besides those below.

What of theirs is called (``src/flbase/...``), on seeded inputs:

- ``fednh-orthogonal-init``: ``FedUHClient._initialize_model`` with ``FedNH_head_init =
  "orthogonal"`` (their only init), after ``setup_seed(2022)`` as ``setup_clients`` does; a spy on
  ``torch.linalg.qr`` records the matrix ``torch.nn.init.orthogonal_`` factorises (their uniform
  draw is discarded by ``orthogonal_``, which draws a standard normal of its own).
- ``fednh-server-aggregate``: ``FedNHServer.aggregate`` (the object made without its
  constructor, which needs a whole federation) on three uploads of a small state dict: the
  unweighted body mean and the prototype step W <- normalise(rho W + (1 - rho) normalise(m)).
- ``fednh-round-learnable-scale`` / ``fednh-round-fixed-scale``: one whole round on their
  Conv2CifarNH (192-d, 5 classes), their code's default (a learnable scale starting at 1) and
  ``FedNH_fix_scaling = True`` (s = 30, the paper's constant): two real ``FedNHClient`` objects
  (seeded with 2022, each on its own images of two classes; classes 2 and 4 held by nobody; their
  W^0 rounded to float32) take the server's model, train (``training``: SGD with momentum 0.9,
  weight decay 1e-5, clipping at 10, lr 0.01 * 0.99^(round - 1), round 2, two epochs of one full
  batch, so that the batch order cannot differ), upload (``upload`` -> ``_estimate_prototype``),
  the server aggregates, and the server-side client scores the global model on a probe set
  (``testing``); client A's trained model is scored on the same probe set (PM(L), PM(V)). Also
  the loss, logits and gradients of client A's first step. The weights, too large to store, are
  kept as ``common.fingerprint``s.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from conformance.common import Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded

SNAPSHOTS = {"fednh": Snapshot("Yutong-Dai/FedNH", "60c3161412d576cddc8187af318cdc8a91a8709f")}

INIT_SEED = 2022  # their setup_clients seeds every client's model with it: all start equal
NUM_CLASSES = 5
ROUND = 2
EPOCHS = 2
CLIENT_LR, LR_DECAY, MOMENTUM, WEIGHT_DECAY, MAX_GRAD_NORM = 0.01, 0.99, 0.9, 1e-5, 10.0
RHO = 0.9
# client A: 5 images of class 0 and 3 of class 1; client B: 2 of class 1 and 4 of class 3
CLIENT_LABELS = {"a": [0] * 5 + [1] * 3, "b": [1] * 2 + [3] * 4}
PROBE_LABELS = [0, 1, 2, 3, 4] * 2
# their Conv2CifarNH's entries -> ours (protofl.task.models.fednh_cnn with FedNH's CosineHead)
OUR_NAMES = {
    "conv1.weight": "body.0.0.weight", "conv1.bias": "body.0.0.bias",
    "conv2.weight": "body.0.3.weight", "conv2.bias": "body.0.3.bias",
    "linear1.weight": "body.1.weight", "linear1.bias": "body.1.bias",
    "linear2.weight": "body.3.weight", "linear2.bias": "body.3.bias",
}



# --- calling their code --------------------------------------------------------------------


class _Images(torch.utils.data.Dataset):
    """What their Client reads: ``.targets`` (a tensor) and (image, label) items."""

    def __init__(self, x: torch.Tensor, y: np.ndarray) -> None:
        self.x, self.targets = x, torch.as_tensor(y, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        return self.x[i], self.targets[i]


def _client_config(fix_scaling: bool) -> dict:
    """Their client_config (experiments/*.yaml, FedNH_dir.sh) for Conv2Cifar, 5 classes."""
    return {
        "model": "Conv2Cifar", "num_classes": NUM_CLASSES, "input_size": (3, 32, 32), "dim": 192,
        "FedNH_return_embedding": False, "FedNH_head_init": "orthogonal", "FedNH_fix_scaling": fix_scaling,
        "FedNH_client_adv_prototype_agg": False, "num_epochs": EPOCHS, "batch_size": 64, "optimizer": "SGD",
        "client_lr": CLIENT_LR, "client_lr_scheduler": "diminishing", "lr_decay_per_round": LR_DECAY,
        "sgd_momentum": MOMENTUM, "sgd_weight_decay": WEIGHT_DECAY, "num_rounds": 200, "global_seed": 0,
    }


def _server(server_cls, state: dict, clients: dict):
    """Their FedNHServer with only what ``aggregate`` reads (its constructor needs a federation)."""
    server = server_cls.__new__(server_cls)
    server.server_config = {
        "learning_rate": 1.0, "lr_decay_per_round": 1.0, "num_classes": NUM_CLASSES,
        "FedNH_server_adv_prototype_agg": False, "FedNH_smoothing": RHO,
    }
    server.clients_dict = clients
    server.exclude_layer_keys = set()
    server.server_model_state_dict = state
    return server


def _tensor(values: np.ndarray) -> torch.Tensor:
    """An array for their code: in torch's default dtype (float64)."""
    return torch.from_numpy(values).to(torch.get_default_dtype())


def _import(checkout: Path):
    sys.path.insert(0, str(checkout))
    from src.flbase.strategies import FedNH, FedUH

    return FedNH, FedUH


def _orthogonal_init(FedUH) -> dict:
    recorded = []
    qr = torch.linalg.qr

    def spy(matrix, *args, **kwargs):
        recorded.append(matrix.detach().clone())
        return qr(matrix, *args, **kwargs)

    holder = SimpleNamespace(client_config=_client_config(False) | {"num_classes": 10}, device="cpu",
                             criterion=nn.CrossEntropyLoss())
    torch.manual_seed(INIT_SEED)
    torch.linalg.qr = spy
    try:
        FedUH.FedUHClient._initialize_model(holder)
    finally:
        torch.linalg.qr = qr
    (draw,) = recorded
    return {"qr_input": draw.numpy(), "prototypes": holder.model.prototype.detach().numpy().copy()}


def _server_aggregate(FedNH) -> tuple[dict, dict]:
    """Three uploads of a 2-entry state dict, 4 classes in 6-d; class 3 held by nobody. W (the
    server's) and the class means (the clients' uploads) are float32, as on our wire; the model
    entries float64 (our wire carries them in the model's dtype)."""
    rng = seeded(11)
    classes, dim = 4, 6
    prototypes = np.linalg.qr(rng.standard_normal((dim, classes)))[0].T.astype(np.float32)
    server_state = {"body.weight": rng.standard_normal((3, 2)), "body.bias": rng.standard_normal(3)}
    counts = np.array([[6, 2, 0, 0], [1, 0, 5, 0], [3, 3, 3, 0]])
    # what a client sends: its class means of unit features (norm <= 1), zero for absent classes
    means = rng.uniform(-1, 1, size=(3, classes, dim))
    means *= (rng.uniform(0.2, 0.9, size=(3, classes, 1)) / np.linalg.norm(means, axis=2, keepdims=True))
    means[counts == 0] = 0
    means = means.astype(np.float32)
    client_states = [{k: v + rng.standard_normal(v.shape) for k, v in server_state.items()} for _ in range(3)]
    uploads = []
    for k in range(3):
        unit = torch.nn.functional.normalize(_tensor(means[k]), dim=1)
        held = _tensor(counts[k])
        state = {n: _tensor(v) for n, v in client_states[k].items()} | {"prototype": _tensor(prototypes)}
        # _estimate_prototype's upload: count x normalised class mean, counts with 1e-12 for absent classes
        uploads.append((state, {"scaled_prototype": unit * held[:, None],
                                "count_by_class_full": torch.where(held > 0, held, torch.tensor(1e-12))}))
    server = _server(FedNH.FedNHServer, {n: _tensor(v) for n, v in server_state.items()}
                     | {"prototype": _tensor(prototypes)},
                     {0: SimpleNamespace(device="cpu")})
    server.server_config["num_classes"] = classes
    server.aggregate(uploads, round=1)
    new = server.server_model_state_dict
    inputs = {"prototypes": prototypes, "client_means": means, "client_counts": counts, "rho": np.float64(RHO),
              "server_body_weight": server_state["body.weight"], "server_body_bias": server_state["body.bias"],
              "client_body_weight": np.stack([s["body.weight"] for s in client_states]),
              "client_body_bias": np.stack([s["body.bias"] for s in client_states])}
    outputs = {"prototypes": new["prototype"].numpy(), "body_weight": new["body.weight"].numpy(),
               "body_bias": new["body.bias"].numpy()}
    return inputs, outputs


def _fingerprints(state: dict, prefix: str) -> dict:
    return {f"{prefix}.{name}": fingerprint(state[name].detach().numpy()) for name in OUR_NAMES}


def _round(FedNH, fix_scaling: bool) -> tuple[dict, dict]:
    config = _client_config(fix_scaling)
    client_pixels = {k: pixels(seed, len(labels), (3, 32, 32))
                     for seed, (k, labels) in enumerate(CLIENT_LABELS.items(), start=1)}
    probe = pixels(9, len(PROBE_LABELS), (3, 32, 32))
    data = {k: _Images(pixels_to_input(client_pixels[k]), np.array(CLIENT_LABELS[k])) for k in CLIENT_LABELS}
    probe_set = _Images(pixels_to_input(probe), np.array(PROBE_LABELS))
    criterion = nn.CrossEntropyLoss()
    clients = {}
    for cid, k in enumerate(CLIENT_LABELS):
        torch.manual_seed(INIT_SEED)
        clients[k] = FedNH.FedNHClient(criterion, data[k], None, config, cid, "cpu")
        prototype = clients[k].model.prototype
        prototype.data = prototype.data.float().to(prototype.dtype)  # W^0 as our server broadcasts it
    server = _server(FedNH.FedNHServer, copy.deepcopy(clients["a"].get_params()), dict(enumerate(clients.values())))
    initial = copy.deepcopy(server.server_model_state_dict)
    outputs = _fingerprints(initial, "initial") | {
        "initial.prototype": initial["prototype"].numpy(), "initial.scaling": initial["scaling"].numpy()}

    # client A's first step: loss, logits and gradients at the server's weights
    model = clients["a"].model
    model.train()
    logits = model(data["a"].x)
    loss = criterion(logits, data["a"].targets)
    loss.backward()
    outputs |= {"first_step.logits": logits.detach().numpy(), "first_step.loss": loss.detach().numpy()}
    outputs |= {f"first_step.grad.{n}": fingerprint(p.grad.numpy()) for n, p in model.named_parameters()
                if n in OUR_NAMES}
    if model.scaling.grad is not None:
        outputs["first_step.grad.scaling"] = model.scaling.grad.numpy().copy()
    model.zero_grad(set_to_none=True)

    uploads = []
    for k, client in clients.items():
        client.set_params(server.server_model_state_dict, server.exclude_layer_keys)
        client.training(ROUND, EPOCHS)
        state, shared = client.upload()
        uploads.append((state, shared))
        client.model.eval()
        client.model.return_embedding = True
        with torch.no_grad():
            unit_features, trained_logits = client.model(data[k].x)
        client.model.return_embedding = False
        outputs |= _fingerprints(state, f"client_{k}") | {
            f"client_{k}.scaling": state["scaling"].numpy().copy(),
            f"client_{k}.unit_features": unit_features.numpy(), f"client_{k}.logits": trained_logits.numpy(),
            f"client_{k}.scaled_prototype": shared["scaled_prototype"].numpy(),
            f"client_{k}.counts": shared["count_by_class_full"].numpy(),
        }
    # client A's personalised model (trained body, the prototypes it trained with) on the probe set
    clients["a"].testing(ROUND, torch.utils.data.DataLoader(probe_set, batch_size=64))
    scores = clients["a"].test_acc_dict[ROUND]["acc_by_criteria"]
    outputs |= {"client_a.pm_l": np.float64(scores["labeldist"]), "client_a.pm_v": np.float64(scores["validclass"])}

    server.aggregate(uploads, ROUND)
    new = server.server_model_state_dict
    scorer = FedNH.FedNHClient(criterion, data["a"], probe_set, config, -1, "cpu")
    scorer.set_params(new, set())
    scorer.testing(ROUND)
    with torch.no_grad():
        scorer.model.eval()
        gm_logits = scorer.model(probe_set.x)
    outputs |= _fingerprints(new, "global") | {
        "global.prototype": new["prototype"].numpy(), "global.scaling": new["scaling"].numpy(),
        "global.probe_logits": gm_logits.numpy(),
        "global.accuracy": np.float64(scorer.test_acc_dict[ROUND]["acc_by_criteria"]["uniform"]),
    }
    inputs = {"client_a.pixels": client_pixels["a"], "client_a.labels": np.array(CLIENT_LABELS["a"]),
              "client_b.pixels": client_pixels["b"], "client_b.labels": np.array(CLIENT_LABELS["b"]),
              "probe.pixels": probe, "probe.labels": np.array(PROBE_LABELS),
              "init_seed": np.int64(INIT_SEED), "round": np.int64(ROUND), "epochs": np.int64(EPOCHS),
              "lr": np.float64(CLIENT_LR), "lr_decay": np.float64(LR_DECAY), "momentum": np.float64(MOMENTUM),
              "weight_decay": np.float64(WEIGHT_DECAY), "max_grad_norm": np.float64(MAX_GRAD_NORM),
              "rho": np.float64(RHO), "fix_scaling": np.bool_(fix_scaling)}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    FedNH, FedUH = _import(checkouts["fednh"])
    snapshot = SNAPSHOTS["fednh"]
    where = "src/flbase/strategies/"
    paths = [save_fixture(
        "fednh-orthogonal-init", snapshot,
        f"{where}FedUH.py: FedUHClient._initialize_model (FedNH_head_init='orthogonal', 10 classes, Conv2Cifar) "
        "after torch.manual_seed(2022), in float64; torch.linalg.qr spied on for the matrix orthogonal_ factorises",
        rerun, {"seed": np.int64(INIT_SEED)}, _orthogonal_init(FedUH))]
    inputs, outputs = _server_aggregate(FedNH)
    paths.append(save_fixture(
        "fednh-server-aggregate", snapshot,
        f"{where}FedNH.py: FedNHServer.aggregate(uploads, round=1) on an object made with __new__ "
        "(server_config: learning_rate 1, FedNH_smoothing 0.9, no adv aggregation); in float64, W and the class "
        "means float32 values (our wire)",
        rerun, inputs, outputs))
    for fix_scaling, name in ((False, "fednh-round-learnable-scale"), (True, "fednh-round-fixed-scale")):
        inputs, outputs = _round(FedNH, fix_scaling)
        paths.append(save_fixture(
            name, snapshot,
            f"{where}FedNH.py: FedNHClient (constructed, setup_seed 2022) .set_params/.training/.upload/.testing, "
            f"FedNHServer.aggregate (made with __new__), a FedNHClient scoring the global model; "
            f"FedNH_fix_scaling={fix_scaling}; in float64, each client's W^0 rounded to float32 (our wire)",
            rerun, inputs, outputs))
    return paths
