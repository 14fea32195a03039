"""CReFF's fixtures, from the implementation in FedNH's repository (Yutong-Dai/FedNH,
``src/flbase/strategies/CReFF.py``), the reference protofl's ``creff`` follows.

Their code computes in float64 here (``make_fixtures.py`` sets torch's default dtype). Two of
their tensors are float32 whatever the default dtype, and would meet float64 weights in a matmul
(a dtype error): the server's federated features (``torch.randn(..., dtype=torch.float)`` in the
constructor, which is not run: the object is made with ``__new__`` and its ``feature_syn`` set to
the stored float64 values) and the re-training set (``TensorDataset`` casts its images with
``.float()``: swapped, for that call only, for one that keeps their dtype). In their float32 runs
both are no-ops; no other adaptation.

What of theirs is called, on seeded inputs (4 classes, their Conv2Cifar, 192-d features):

- ``fednh-creff-client-gradients``: ``CReFFClient.compute_real_feature_gradient`` of two real
  clients (made after ``torch.manual_seed(2022)``, as ``setup_clients`` seeds them; A holds 3, 4
  and 2 images of classes 0, 1, 2, B 3 and 5 of classes 1 and 2; class 3 held by nobody), given
  the state dict of A's seeded model with its ``prototype.weight`` replaced by a seeded W_syn
  (what ``run`` sends: ``syn_feature_params``). ``CReFF_batch_real`` = 8 is at least each
  class's count, so each of their 10 ``np.random.permutation`` draws takes all of a class's
  images (only their order differs, which a mean cross-entropy does not see) and their mean over
  the 10 repeats is the gradient of the whole class, whatever the draws. The model's weights, too large to store, are
  kept as ``common.fingerprint``s (ours are built from the same seed).
- ``fednh-creff-server``: ``CReFFServer.aggregate`` (FedAvg, learning_rate 1: the unweighted mean)
  of two clients' small state dicts, then ``update_feature_syn`` (3 match epochs at lr 0.1, 5
  features per class, ``CReFF_dis_metric = 'ours'``) with the two clients' gradients of the first
  fixture (classes 1 and 2 from both, class 3 from none) and the stored initial features, then
  ``feature_re_train`` (4 epochs at lr 0.1 in batches of 8: 20 features, so batches of 8, 8, 4),
  on an object made with ``__new__`` (its constructor needs a federation). The orders their
  ``DataLoader(shuffle=True)`` drew are recorded (a spy on ``RandomSampler.__iter__``: the
  indices it yields each epoch), and the fresh ``nn.Linear``'s initial weight and bias (a spy on
  ``torch.optim.SGD``, given its parameters before the first step).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conformance.common import Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded
from conformance.fednh import INIT_SEED, OUR_NAMES, _Images, _tensor

SNAPSHOTS = {"fednh": Snapshot("Yutong-Dai/FedNH", "60c3161412d576cddc8187af318cdc8a91a8709f")}

NUM_CLASSES = 4
FEATURE_DIM = 192
BATCH_REAL = 8  # >= every class's count below: each draw takes all of a class's images
# client A: 3 images of class 0, 4 of class 1, 2 of class 2; client B: 3 of class 1, 5 of class 2;
# class 3 held by nobody
CLIENT_LABELS = {"a": [0, 1, 0, 1, 2, 1, 0, 2, 1], "b": [2, 1, 2, 2, 1, 2, 1, 2]}
PER_CLASS = 5  # CReFF_num_of_fl_feature
MATCH_EPOCHS, FEATURE_LR = 3, 0.1
RETRAIN_EPOCHS, CLASSIFIER_LR, BATCH_SIZE = 4, 0.1, 8
NUMPY_SEED = 0  # np.random.seed before their client's draws (their run seeds it each round)


def _import(checkout: Path):
    sys.path.insert(0, str(checkout))
    from src.flbase.strategies import CReFF

    return CReFF


def _client_config() -> dict:
    """Their client_config (experiments/Cifar10_Conv2Cifar.yaml) for Conv2Cifar, 4 classes."""
    return {"model": "Conv2Cifar", "num_classes": NUM_CLASSES, "input_size": (3, 32, 32), "batch_size": 64,
            "CReFF_batch_real": BATCH_REAL, "global_seed": 0}


def _w_syn() -> np.ndarray:
    """A seeded W_syn, as nn.Linear(192, C)'s init draws it: U(-1/sqrt(192), 1/sqrt(192))."""
    bound = 1 / np.sqrt(FEATURE_DIM)
    return seeded(21).uniform(-bound, bound, size=(NUM_CLASSES, FEATURE_DIM))


def _as_array(gradients: dict) -> tuple[np.ndarray, np.ndarray]:
    """Their {class: [weight gradient]} as (C x C x d, zeros for a class not held; C held mask)."""
    array = np.zeros((NUM_CLASSES, NUM_CLASSES, FEATURE_DIM))
    held = np.zeros(NUM_CLASSES)
    for c, (weight,) in gradients.items():
        array[int(c)] = weight.detach().numpy()
        held[int(c)] = 1.0
    return array, held


def _client_gradients(CReFF) -> tuple[dict, dict]:
    config = _client_config()
    criterion = nn.CrossEntropyLoss()
    client_pixels = {k: pixels(30 + i, len(labels), (3, 32, 32)) for i, (k, labels) in enumerate(CLIENT_LABELS.items())}
    clients = {}
    for cid, (k, labels) in enumerate(CLIENT_LABELS.items()):
        torch.manual_seed(INIT_SEED)
        data = _Images(pixels_to_input(client_pixels[k]), np.array(labels))
        clients[k] = CReFF.CReFFClient(criterion, data, None, config, cid, "cpu")
    state = copy.deepcopy(clients["a"].get_params())  # the server's model: their seeded init
    w_syn = _w_syn()
    sent = copy.deepcopy(state)
    sent["prototype.weight"] = _tensor(w_syn)  # run's syn_feature_params
    inputs = {"w_syn": w_syn, "init_seed": np.int64(INIT_SEED), "batch_real": np.int64(BATCH_REAL),
              "numpy_seed": np.int64(NUMPY_SEED)}
    outputs = {f"initial.{name}": fingerprint(state[name].numpy()) for name in OUR_NAMES}
    np.random.seed(NUMPY_SEED)
    for k, labels in CLIENT_LABELS.items():
        gradients = clients[k].compute_real_feature_gradient(copy.deepcopy(sent))
        array, held = _as_array(gradients)
        inputs |= {f"client_{k}.pixels": client_pixels[k], f"client_{k}.labels": np.array(labels)}
        outputs |= {f"client_{k}.gradients": array, f"client_{k}.held": held}
    return inputs, outputs


class _KeepDtype(torch.utils.data.Dataset):
    """Their TensorDataset without its ``.float()`` (a no-op in their float32 runs)."""

    def __init__(self, images, labels):
        self.images, self.labels = images.detach(), labels.detach()

    def __getitem__(self, index):
        return self.images[index], self.labels[index]

    def __len__(self):
        return self.images.shape[0]


def _server(CReFF, client_gradients: dict) -> tuple[dict, dict]:
    rng = seeded(22)
    N = NUM_CLASSES * PER_CLASS
    w_syn = _w_syn()
    features = rng.standard_normal((NUM_CLASSES, PER_CLASS, FEATURE_DIM))
    # FedAvg: a small state dict (the model's entries are averaged alike), two clients of different sizes
    server_state = {"linear2.weight": rng.standard_normal((3, 4)), "linear2.bias": rng.standard_normal(3),
                    "prototype.weight": rng.standard_normal((NUM_CLASSES, 4))}
    client_states = [{k: v + rng.standard_normal(v.shape) for k, v in server_state.items()} for _ in range(2)]

    server = CReFF.CReFFServer.__new__(CReFF.CReFFServer)
    server.server_config = {"learning_rate": 1.0, "lr_decay_per_round": 1.0, "CReFF_match_epoch": MATCH_EPOCHS,
                            "CReFF_lr_feature": FEATURE_LR, "CReFF_lr_net": CLASSIFIER_LR,
                            "CReFF_crt_epoch": RETRAIN_EPOCHS, "CReFF_dis_metric": "ours"}
    server.device = "cpu"
    server.exclude_layer_keys = set()
    server.server_model_state_dict = {k: _tensor(v.copy()) for k, v in server_state.items()}
    server.lantent_dim, server.num_classes, server.num_of_feature = FEATURE_DIM, NUM_CLASSES, PER_CLASS
    # what the constructor sets, its features float64 (their randn's dtype=torch.float), a copy
    # (not a view of the stored input, which their SGD steps would overwrite)
    server.feature_syn = _tensor(features.reshape(N, FEATURE_DIM).copy()).requires_grad_(True)
    server.label_syn = torch.tensor(np.array([np.ones(PER_CLASS) * i for i in range(NUM_CLASSES)]),
                                    dtype=torch.long).view(-1)
    server.optimizer_feature = torch.optim.SGD([server.feature_syn], lr=FEATURE_LR)
    server.feature_criterion = nn.CrossEntropyLoss()
    server.feature_net = nn.Linear(FEATURE_DIM, NUM_CLASSES, bias=False)

    server.aggregate([{k: _tensor(v.copy()) for k, v in s.items()} for s in client_states], round=1)
    aggregate = {k: v.numpy().copy() for k, v in server.server_model_state_dict.items()}

    gradients = np.stack([client_gradients[f"client_{k}.gradients"] for k in CLIENT_LABELS])
    held = np.stack([client_gradients[f"client_{k}.held"] for k in CLIENT_LABELS])
    uploads = [{c: [_tensor(gradients[i, c].copy())] for c in range(NUM_CLASSES) if held[i, c]}
               for i in range(len(held))]
    sent = copy.deepcopy(server.server_model_state_dict)
    sent["prototype.weight"] = _tensor(w_syn)
    server.update_feature_syn(copy.deepcopy(sent), copy.deepcopy(uploads))
    matched = server.feature_syn.detach().numpy().reshape(NUM_CLASSES, PER_CLASS, FEATURE_DIM).copy()

    orders, initial = [], []
    sampler = torch.utils.data.RandomSampler
    draw, sgd, dataset = sampler.__iter__, torch.optim.SGD, CReFF.TensorDataset

    def record_order(self):
        order = list(draw(self))  # one epoch's indices, as their loader takes them
        orders.append(order)
        yield from order

    def record_sgd(params, *args, **kwargs):
        params = list(params)
        initial.append([p.detach().clone() for p in params])
        return sgd(params, *args, **kwargs)

    torch.manual_seed(23)
    sampler.__iter__, torch.optim.SGD, CReFF.TensorDataset = record_order, record_sgd, _KeepDtype
    try:
        head, full = server.feature_re_train(copy.deepcopy(server.server_model_state_dict), BATCH_SIZE)
    finally:
        sampler.__iter__, torch.optim.SGD, CReFF.TensorDataset = draw, sgd, dataset
    assert len(orders) == RETRAIN_EPOCHS and all(sorted(o) == list(range(N)) for o in orders), orders
    ((initial_weight, initial_bias),) = initial

    inputs = {"w_syn": w_syn, "client_gradients": gradients, "client_held": held, "features": features,
              "match_epochs": np.int64(MATCH_EPOCHS), "feature_lr": np.float64(FEATURE_LR),
              "retrain_epochs": np.int64(RETRAIN_EPOCHS), "classifier_lr": np.float64(CLASSIFIER_LR),
              "batch_size": np.int64(BATCH_SIZE), "orders": np.array(orders, dtype=np.int64),
              "initial_weight": initial_weight.numpy(), "initial_bias": initial_bias.numpy(),
              "client_num_examples": np.array([len(labels) for labels in CLIENT_LABELS.values()])}
    inputs |= {f"server.{k}": v for k, v in server_state.items()}
    inputs |= {f"client_{i}.{k}": v for i, s in enumerate(client_states) for k, v in s.items()}
    outputs = {"features": matched, "weight": head["weight"].numpy(), "bias": head["bias"].numpy(),
               "full.prototype.weight": full["prototype.weight"].numpy()}
    outputs |= {f"aggregate.{k}": v for k, v in aggregate.items()}
    outputs |= {f"full.{k}": full[k].numpy() for k in server_state if k != "prototype.weight"}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    CReFF = _import(checkouts["fednh"])
    snapshot = SNAPSHOTS["fednh"]
    where = "src/flbase/strategies/CReFF.py"
    inputs, outputs = _client_gradients(CReFF)
    paths = [save_fixture(
        "fednh-creff-client-gradients", snapshot,
        f"{where}: CReFFClient (constructed after torch.manual_seed(2022), Conv2Cifar, 4 classes)"
        f".compute_real_feature_gradient(A's state dict with prototype.weight = W_syn), clients A then B after "
        f"np.random.seed({NUMPY_SEED}), CReFF_batch_real={BATCH_REAL}; in float64",
        rerun, inputs, outputs)]
    server_inputs, server_outputs = _server(CReFF, outputs)
    paths.append(save_fixture(
        "fednh-creff-server", snapshot,
        f"{where}: CReFFServer (made with __new__, feature_syn float64).aggregate(round=1, learning_rate 1), "
        f".update_feature_syn(state with prototype.weight = W_syn, the gradients of fednh-creff-client-gradients), "
        f".feature_re_train(state, {BATCH_SIZE}) after torch.manual_seed(23), TensorDataset without .float(), "
        "RandomSampler.__iter__ and torch.optim.SGD spied on (the epochs' orders, the fresh Linear's initial values); "
        "in float64",
        rerun, server_inputs, server_outputs))
    return paths
