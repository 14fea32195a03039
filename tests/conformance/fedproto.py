"""FedProto's fixtures, from two codes: PFLlib's (TsingZ0/PFLlib, ``system/flcore``, the FedProto
that FedSA's and FedCoSR's papers compare with) and the original authors' (yuetan031/FedProto,
``lib/``).

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64. What would cross
protofl's float32 wire into a client's training is given to both sides as the same float32 values,
fed to their code as float64 tensors: the two other clients' uploaded prototypes (float32 draws,
``input.client_*.prototypes``) and the global prototypes of PFLlib's ``proto_aggregation``, rounded
to float32 as our server broadcasts them (:func:`over_our_wire`) before their clients train with
them (stored unrounded as ``output.global.prototypes``; rounded as the original code's
``input.global.prototypes``). That rounding is the one change to their inputs besides the
adaptations below.

- ``fedproto-pfllib-rounds``: ``clients/clientproto.py: clientProto.train`` twice on PFLlib's
  FedProto model (``FedAvgCNN(in_features=1, dim=1024)`` with its ``fc`` as the head, as its
  ``main.py`` builds it, after ``torch.manual_seed(0)``): round 1 without global prototypes (CE
  only), round 2 with global prototypes from ``servers/serverproto.py: proto_aggregation`` of two
  other clients' seeded prototypes (classes 0, 2, 4 and 0, 1: none for class 3, whose samples here
  get no prototype loss, as after a round this client sat out), rounded to float32 before
  ``set_protos``; 12 seeded images of three classes as one full batch (their loader shuffles: one
  batch makes the order irrelevant), two epochs, lr 0.01, lambda 1; then
  ``clientProto.test_metrics`` (nearest global prototype) on a probe set. The client is made with
  ``__new__`` (its constructor loads a dataset); the data loaders return the seeded images.
- ``fedproto-original-round``: ``lib/update.py: LocalUpdate.update_weights_het`` (CE as NLL of
  log-softmax + ld * MSE(feature, global prototype of its class), SGD with momentum 0.5,
  prototypes of the training-mode features of every batch), ``lib/utils.py: agg_func`` and
  ``proto_aggregation`` (unweighted over clients). Their models (CNNMnist, ...) train with
  dropout, whose draws nobody can match, so the model is a dropout-free module of ours with the
  FedAvgCNN layers, returning (log-softmax, feature) as their models do; it is the only adapter.
  Same images and (float32-rounded) global prototypes as above, momentum 0.5, ld 1; then
  ``test_inference_new_het_lt`` (nearest global prototype among the client's own classes) on the
  probe set, and ``proto_aggregation`` of this client's new (float64) prototypes and the two others'.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conformance.common import PFLLIB_CNN_NAMES, Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded

SNAPSHOTS = {
    "pfllib": Snapshot("TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350"),
    "original": Snapshot("yuetan031/FedProto", "97e42e2741e1ae2e2fce2465e80f38f6997f8836"),
}

NUM_CLASSES = 5
LAMBDA, LR, EPOCHS, ORIGINAL_MOMENTUM = 1.0, 0.01, 2, 0.5
TRAIN_LABELS = [0] * 5 + [2] * 4 + [3] * 3
PROBE_LABELS = [0, 1, 2, 3, 4] * 2
OTHER_CLIENTS = {"b": (0, 2, 4), "c": (0, 1)}  # the classes of two other clients: none holds class 3
OUR_NAMES = PFLLIB_CNN_NAMES


def other_client_prototypes(seed: int, classes: tuple[int, ...]) -> np.ndarray:
    """Another client's prototypes (rows of ``classes``; others zero), 512-d, >= 0, float32 (as our
    wire carries an upload)."""
    prototypes = np.zeros((NUM_CLASSES, 512), np.float32)
    prototypes[list(classes)] = np.maximum(seeded(seed).standard_normal((len(classes), 512)), 0) * 0.3
    return prototypes


def _inputs() -> dict:
    return {"train.pixels": pixels(41, len(TRAIN_LABELS)), "train.labels": np.array(TRAIN_LABELS),
            "probe.pixels": pixels(42, len(PROBE_LABELS)), "probe.labels": np.array(PROBE_LABELS),
            **{f"client_{k}.prototypes": other_client_prototypes(seed, classes)
               for seed, (k, classes) in enumerate(OTHER_CLIENTS.items(), start=51)},
            **{f"client_{k}.classes": np.array(classes) for k, classes in OTHER_CLIENTS.items()},
            "init_seed": np.int64(0),
            "lambda": np.float64(LAMBDA), "lr": np.float64(LR), "epochs": np.int64(EPOCHS)}


def _as_matrix(protos: dict) -> tuple[np.ndarray, np.ndarray]:
    matrix, mask = np.zeros((NUM_CLASSES, 512), np.float64), np.zeros(NUM_CLASSES, bool)
    for c, p in protos.items():
        if not isinstance(p, list):
            matrix[c], mask[c] = p.detach().numpy(), True
    return matrix, mask


def _tensor(values: np.ndarray) -> torch.Tensor:
    """An array for their code: in torch's default dtype (float64)."""
    return torch.from_numpy(values).to(torch.get_default_dtype())


def _others(inputs: dict) -> list[dict]:
    """The other clients' uploads as their code holds them: {class: prototype}."""
    return [{c: _tensor(inputs[f"client_{k}.prototypes"][c]) for c in classes}
            for k, classes in OTHER_CLIENTS.items()]


def over_our_wire(prototypes: np.ndarray) -> np.ndarray:
    """Global prototypes as our server broadcasts them: rounded to float32."""
    return prototypes.astype(np.float32)


def _fingerprints(model: nn.Module, prefix: str) -> dict:
    state = model.state_dict()
    return {f"{prefix}.{name}": fingerprint(state[name].detach().numpy()) for name in OUR_NAMES}


# --- PFLlib --------------------------------------------------------------------------------


def _pfllib(checkout: Path) -> tuple[dict, dict]:
    sys.modules.setdefault("h5py", types.ModuleType("h5py"))
    sys.path.insert(0, str(checkout / "system"))
    import flcore.clients.clientproto as clientproto
    import flcore.servers.serverproto as serverproto
    from flcore.trainmodel.models import BaseHeadSplit, FedAvgCNN

    inputs = _inputs()
    x, y = pixels_to_input(inputs["train.pixels"]), torch.from_numpy(inputs["train.labels"])
    probe = torch.utils.data.TensorDataset(pixels_to_input(inputs["probe.pixels"]), torch.from_numpy(inputs["probe.labels"]))
    torch.manual_seed(0)
    model = FedAvgCNN(in_features=1, num_classes=NUM_CLASSES, dim=1024)
    head = copy.deepcopy(model.fc)  # main.py, FedProto
    model.fc = nn.Identity()
    model = BaseHeadSplit(model, head)
    client = clientproto.clientProto.__new__(clientproto.clientProto)
    client.__dict__.update(
        model=model, device="cpu", num_classes=NUM_CLASSES, protos=None, global_protos=None, loss_mse=nn.MSELoss(),
        lamda=LAMBDA, local_epochs=EPOCHS, train_slow=False, learning_rate_decay=False, loss=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=LR), train_time_cost={"num_rounds": 0, "total_cost": 0.0},
        load_train_data=lambda batch_size=None: torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), len(y), drop_last=True, shuffle=True),
        load_test_data=lambda batch_size=None: torch.utils.data.DataLoader(probe, 10, shuffle=True),
    )
    outputs = _fingerprints(model, "initial")
    for server_round in (1, 2):
        client.train()
        prototypes, mask = _as_matrix(client.protos)
        model.eval()
        with torch.no_grad():
            features = model.base(x)
            logits = model.head(features)
        outputs |= _fingerprints(model, f"round{server_round}") | {
            f"round{server_round}.prototypes": prototypes, f"round{server_round}.mask": mask,
            f"round{server_round}.features": features.numpy(), f"round{server_round}.logits": logits.numpy()}
        if server_round == 1:
            global_protos = serverproto.proto_aggregation(_others(inputs))
            outputs["global.prototypes"], outputs["global.mask"] = _as_matrix(global_protos)
            sent = over_our_wire(outputs["global.prototypes"])
            held = np.flatnonzero(outputs["global.mask"])
            # a defaultdict(list) as theirs: a class without a prototype reads as []
            client.set_protos(defaultdict(list, {int(c): _tensor(sent[c]) for c in held}))
    correct, tested, _ = client.test_metrics()
    outputs |= {"probe.correct": np.int64(correct), "probe.tested": np.int64(tested)}
    return inputs, outputs


# --- the original code ---------------------------------------------------------------------


class _FedAvgCNNLogSoftmax(nn.Module):
    """The adapter: FedAvgCNN's layers, forward -> (log-softmax, feature) as their models return."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(
            nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
            nn.Flatten(), nn.Sequential(nn.Linear(1024, 512), nn.ReLU(inplace=True)))
        self.head = nn.Linear(512, NUM_CLASSES)

    def forward(self, x):
        feature = self.base(x)
        return F.log_softmax(self.head(feature), dim=1), feature


ADAPTER_NAMES = {  # the adapter's entries -> ours
    "base.0.0.weight": "body.0.0.weight", "base.0.0.bias": "body.0.0.bias",
    "base.1.0.weight": "body.0.3.weight", "base.1.0.bias": "body.0.3.bias",
    "base.3.0.weight": "body.1.weight", "base.3.0.bias": "body.1.bias",
    "head.weight": "head.weight", "head.bias": "head.bias",
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _original(checkout: Path, global_prototypes: np.ndarray, global_mask: np.ndarray) -> tuple[dict, dict]:
    lib = checkout / "lib"
    sys.path[:0] = [str(lib / "models"), str(lib)]  # "models": lib/models/models.py
    update = _load("fedproto_original_update", lib / "update.py")
    utils = _load("fedproto_original_utils", lib / "utils.py")
    inputs = _inputs() | {"global.prototypes": global_prototypes, "global.mask": global_mask,
                          "momentum": np.float64(ORIGINAL_MOMENTUM)}
    x, y = pixels_to_input(inputs["train.pixels"]), torch.from_numpy(inputs["train.labels"])
    args = SimpleNamespace(local_bs=len(y), device="cpu", optimizer="sgd", lr=LR, train_ep=EPOCHS, ld=LAMBDA,
                           num_classes=NUM_CLASSES, verbose=False)
    local = update.LocalUpdate(args, torch.utils.data.TensorDataset(x, y), range(len(y)))
    torch.manual_seed(0)
    model = _FedAvgCNNLogSoftmax()
    outputs = {f"initial.{ours}": fingerprint(model.state_dict()[theirs].numpy()) for theirs, ours in ADAPTER_NAMES.items()}
    given = {int(c): [_tensor(global_prototypes[c])] for c in np.flatnonzero(global_mask)}
    state, losses, _, collected = local.update_weights_het(args, 0, given, model, global_round=1)
    prototypes = utils.agg_func(collected)
    outputs |= {f"trained.{ours}": fingerprint(state[theirs].numpy()) for theirs, ours in ADAPTER_NAMES.items()}
    outputs |= {"loss.total": np.float64(losses["total"]), "loss.ce": np.float64(losses["1"]),
                "loss.prototype": np.float64(losses["2"])}
    matrix, mask = _as_matrix(prototypes)
    outputs |= {"prototypes": matrix, "mask": mask}
    # their score: the nearest global prototype among this client's own classes only
    # (classes_list), with a cumulative counter that, for the first user, adds the head's count:
    # accuracy_with_prototypes = (correct_head + correct_prototypes) / (2 n)
    probe = torch.utils.data.TensorDataset(pixels_to_input(inputs["probe.pixels"]),
                                           torch.from_numpy(inputs["probe.labels"]))
    n = len(probe)
    args.num_users = 1
    model.load_state_dict(state)
    head_accuracy, prototype_accuracy, _ = update.test_inference_new_het_lt(
        args, [model], probe, [np.unique(inputs["train.labels"])], {0: range(n)}, given)
    outputs |= {"probe.head_accuracy": np.float64(head_accuracy[0]),
                "probe.prototype_accuracy_reported": np.float64(prototype_accuracy[0]),
                "probe.prototype_correct": np.int64(round(2 * n * prototype_accuracy[0] - n * head_accuracy[0]))}
    aggregated = utils.proto_aggregation(dict(enumerate([prototypes, *_others(inputs)])))
    outputs["aggregated.prototypes"], outputs["aggregated.mask"] = _as_matrix({c: v[0] for c, v in aggregated.items()})
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    inputs, outputs = _pfllib(checkouts["pfllib"])
    paths = [save_fixture(
        "fedproto-pfllib-rounds", SNAPSHOTS["pfllib"],
        "system/flcore/clients/clientproto.py: clientProto.train (two rounds), set_protos, test_metrics on a "
        "clientProto made with __new__ (data loaders return seeded images); servers/serverproto.py: "
        "proto_aggregation; model FedAvgCNN(in_features=1, dim=1024) with fc as the head after torch.manual_seed(0); "
        "in float64, the round-2 global prototypes rounded to float32 (our wire) before set_protos",
        rerun, inputs, outputs)]
    sent = over_our_wire(outputs["global.prototypes"])
    inputs, outputs = _original(checkouts["original"], sent, outputs["global.mask"])
    paths.append(save_fixture(
        "fedproto-original-round", SNAPSHOTS["original"],
        "lib/update.py: LocalUpdate(...).update_weights_het (one round, the model a dropout-free FedAvgCNN of ours "
        "returning (log-softmax, feature)); lib/utils.py: agg_func, proto_aggregation; in float64, the global "
        "prototypes PFLlib's rounded to float32 (our wire)",
        rerun, inputs, outputs))
    return paths
