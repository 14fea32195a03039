"""FedSA's fixtures, from the authors' code (lokinko/FedSA, ``system/flcore``).

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64. The arrays that cross
protofl's float32 wire are given to both sides as float32 values (fed to their code as float64
tensors): the anchors a client trains with and the server steps (their init rounded to float32,
as our server holds and broadcasts them), the clients' uploaded prototypes the server averages, a
client's round-1 prototypes that its round-2 margin is taken of (as our client takes it of its
upload) and the global prototypes it scores with (the same, as our server broadcasts them). That
rounding is the only adaptation of their inputs besides those below.

Their modules import ``mmcv.cnn`` (for ``build_norm_layer``) and ``h5py`` (results files), which
this venv has not: :func:`_stub_missing_modules` puts stand-ins in ``sys.modules``; the norm layer
is what mmcv's ``SyncBN`` builds, ``torch.nn.SyncBatchNorm`` (without a process group it
normalises with the batch statistics, as BatchNorm in training mode). Their disk I/O
(``load_item``/``save_item``) is redirected to a dict, their data loader to our seeded images.

- ``fedsa-anchors``: ``servers/serversa.py: FedSA.__init__`` (the server base's constructor, which
  builds a federation, and ``set_clients`` replaced by no-ops) after ``torch.manual_seed(0)``: the
  state every real run leaves, since the last ``clientSA.__init__`` calls ``torch.manual_seed(0)``
  just before the anchors are drawn. 10 classes, 512-d. Also ``clientSA.cal_global_gap`` (d_global).
- ``fedsa-losses``: ``clients/clientsa.py: clientSA.cal_anchors_loss`` (L_CC, L_R and L_MCL, each
  alone and weighted together) and its gradients, on seeded features, labels, anchors and a
  linear head; ``cal_local_gap`` / ``cal_global_gap`` (the margins, the local one also for no
  prototypes yet and for one class).
- ``fedsa-server``: ``servers/serversa.py: proto_aggregation`` and ``FedSA.update_semantic_anchors``
  on three clients' float32 prototypes (512-d, 5 classes, class 4 uploaded by nobody), from the
  anchors of their init rounded to float32.
- ``fedsa-client-rounds``: ``clientSA.train`` twice (rounds 1 and 2) on the FedAvgCNN of their
  scripts (1 x 28 x 28 input, ``BaseHeadSplit`` after ``torch.manual_seed(0)``: the body equals our
  ``cnn`` built with seed 0, the head, drawn after a dropped one, is stored), 12 seeded images of
  three classes as one full batch (so the order cannot differ), two local epochs, lr 0.01,
  lambda 10, lambda_MCL 1, lambda_CC 1; then ``test_metrics`` (nearest global prototype) on a probe
  set with the client's round-1 prototypes, rounded to float32, as the global ones. The anchors are
  their init scaled by 0.01 and rounded to float32, so that the client's own margin (from its
  round-1 prototypes) is the larger in round 2; that margin is taken of the round-1 prototypes
  rounded to float32 (``clientSA.protos`` replaced after round 1), as our client takes it of its
  upload. The stored ``output.round1.prototypes`` are theirs, unrounded.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from conformance.common import PFLLIB_CNN_NAMES, Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded

SNAPSHOTS = {"fedsa": Snapshot("lokinko/FedSA", "75bf1067fb96d759d9fa6e9d2c6f1b5bd53ee2a6")}

ANCHOR_SEED = 0  # the torch seed at the anchors' draw in every run of their code
NUM_CLASSES = 5
LAMBDA_R, LAMBDA_MCL, LAMBDA_CC = 10.0, 1.0, 1.0
LR, EPOCHS = 0.01, 2
ANCHOR_SCALE = 0.01
TRAIN_LABELS = [0] * 5 + [2] * 4 + [3] * 3
PROBE_LABELS = [0, 1, 2, 3, 4] * 2
OUR_NAMES = PFLLIB_CNN_NAMES


# --- calling their code --------------------------------------------------------------------


def _stub_missing_modules() -> None:
    mmcv, cnn = types.ModuleType("mmcv"), types.ModuleType("mmcv.cnn")
    cnn.ConvModule = None
    cnn.build_norm_layer = lambda cfg, num_features: (cfg["type"].lower(), nn.SyncBatchNorm(num_features))
    mmcv.cnn = cnn
    sys.modules.setdefault("mmcv", mmcv)
    sys.modules.setdefault("mmcv.cnn", cnn)
    sys.modules.setdefault("h5py", types.ModuleType("h5py"))


def _tensor(values: np.ndarray) -> torch.Tensor:
    """An array for their code: in torch's default dtype (float64)."""
    return torch.from_numpy(values).to(torch.get_default_dtype())


def over_our_wire(values: torch.Tensor) -> np.ndarray:
    """What our wire carries of their float64 array: float32."""
    return values.detach().numpy().astype(np.float32)


def _import(checkout: Path):
    _stub_missing_modules()
    sys.path.insert(0, str(checkout / "system"))
    import flcore.clients.clientsa as clientsa
    import flcore.servers.serversa as serversa
    from flcore.servers.serverbase import Server

    return clientsa, serversa, Server


def _client(clientsa, anchors: torch.Tensor, lamda=LAMBDA_R, mcl=LAMBDA_MCL, cc=LAMBDA_CC):
    """A clientSA with the fields its training and losses read (its constructor loads a dataset)."""
    client = clientsa.clientSA.__new__(clientsa.clientSA)
    client.__dict__.update(
        num_classes=len(anchors), device="cpu", loss=nn.CrossEntropyLoss(), loss_mse=nn.MSELoss(), protos=None,
        semantic_anchors=anchors, local_gap=0.0, global_gap=0.0, lamda=lamda, mcl=mcl, cc=cc, role="Client_0",
        save_folder_name="memory", learning_rate=LR, local_epochs=EPOCHS, train_slow=False, id=0,
        train_time_cost={"num_rounds": 0, "total_cost": 0.0},
    )
    return client


def _anchors(serversa, Server, num_classes: int, dim: int) -> torch.Tensor:
    args = SimpleNamespace(num_classes=num_classes, feature_dim=dim, lamda=LAMBDA_R, margin_contrastive=LAMBDA_MCL,
                           classifier_calibration=LAMBDA_CC)

    def server_init(self, args, times):
        self.device, self.join_ratio, self.num_clients = "cpu", 1.0, 0

    patched = {"__init__": server_init, "set_slow_clients": lambda self: None,
               "set_clients": lambda self, cls: None}
    saved = {name: getattr(Server, name) for name in patched}
    for name, fn in patched.items():
        setattr(Server, name, fn)
    try:
        torch.manual_seed(ANCHOR_SEED)
        server = serversa.FedSA(args, 0)
    finally:
        for name, fn in saved.items():
            setattr(Server, name, fn)
    return server.semantic_anchors


def _fixture_anchors(clientsa, serversa, Server) -> tuple[dict, dict]:
    anchors = _anchors(serversa, Server, 10, 512)
    client = _client(clientsa, anchors)
    client.cal_global_gap()
    return ({"seed": np.int64(ANCHOR_SEED), "num_classes": np.int64(10), "dim": np.int64(512)},
            {"anchors": anchors.numpy(), "global_margin": np.float64(client.global_gap)})


def _fixture_losses(clientsa) -> tuple[dict, dict]:
    rng = seeded(21)
    classes, dim, batch = 4, 16, 6
    anchors = np.maximum(rng.standard_normal((classes, dim)), 0) * 0.5
    features = np.maximum(rng.standard_normal((batch, dim)), 0)
    labels = np.array([0, 1, 1, 3, 0, 3])
    head_weight = rng.standard_normal((classes, dim)) * 0.2
    head_bias = rng.standard_normal(classes) * 0.1
    # last round's prototypes: spread wider than the anchors, so the local margin is d*
    previous = np.maximum(rng.standard_normal((3, dim)), 0) * 2.0
    inputs = {"anchors": anchors, "features": features, "labels": labels, "head_weight": head_weight,
              "head_bias": head_bias, "previous_prototypes": previous, "previous_classes": np.array([0, 2, 3])}
    outputs = {}
    client = _client(clientsa, _tensor(anchors))
    client.cal_local_gap()  # no prototypes yet: stays 0
    outputs["local_margin_first_round"] = np.float64(client.local_gap)
    client.protos = {0: _tensor(previous[0])}
    client.cal_local_gap()  # one class: -inf
    outputs["local_margin_one_class"] = np.float64(client.local_gap)
    client.protos = {int(c): _tensor(p) for c, p in zip(inputs["previous_classes"], previous)}
    client.local_gap = 0.0
    client.cal_local_gap()
    client.cal_global_gap()
    outputs["local_margin"], outputs["global_margin"] = np.float64(client.local_gap), np.float64(client.global_gap)
    for name, weights in {"calibration": (0.0, 0.0, 1.0), "regularization": (1.0, 0.0, 0.0),
                          "margin_contrastive": (0.0, 1.0, 0.0), "total": (LAMBDA_R, LAMBDA_MCL, LAMBDA_CC)}.items():
        client.lamda, client.mcl, client.cc = weights
        head = nn.Linear(dim, classes)
        with torch.no_grad():
            head.weight.copy_(_tensor(head_weight))
            head.bias.copy_(_tensor(head_bias))
        feats = _tensor(features).requires_grad_(True)
        loss, _ = client.cal_anchors_loss(feats, SimpleNamespace(head=head), torch.from_numpy(labels))
        loss.backward()
        outputs |= {f"{name}.loss": loss.detach().numpy(), f"{name}.grad_features": feats.grad.numpy(),
                    f"{name}.grad_head_weight": head.weight.grad.numpy(), f"{name}.grad_head_bias": head.bias.grad.numpy()}
    inputs |= {"lambda_r": np.float64(LAMBDA_R), "lambda_mcl": np.float64(LAMBDA_MCL), "lambda_cc": np.float64(LAMBDA_CC)}
    return inputs, outputs


def _fixture_server(serversa, anchors: np.ndarray) -> tuple[dict, dict]:
    """``anchors``: float32, as our server holds them; the uploads float32, as our wire carries them."""
    rng = seeded(31)
    dim = anchors.shape[1]
    held = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=bool)
    prototypes = np.where(held[..., None], np.maximum(rng.standard_normal((3, NUM_CLASSES, dim)), 0), 0).astype(np.float32)
    counts = np.where(held, rng.integers(1, 50, size=held.shape), 0)
    uploads = [{c: _tensor(prototypes[k, c]) for c in np.flatnonzero(held[k])} for k in range(3)]
    global_protos = serversa.proto_aggregation(uploads)
    server = serversa.FedSA.__new__(serversa.FedSA)
    server.semantic_anchors, server.global_protos = _tensor(anchors), global_protos
    server.update_semantic_anchors()
    aggregated = np.zeros((NUM_CLASSES, dim))
    for c, p in global_protos.items():
        aggregated[c] = p.numpy()
    mask = np.isin(np.arange(NUM_CLASSES), list(global_protos))
    return ({"anchors": anchors, "client_prototypes": prototypes, "client_counts": counts},
            {"global_prototypes": aggregated, "mask": mask, "anchors": server.semantic_anchors.numpy()})


def _fingerprints(model: nn.Module, prefix: str) -> dict:
    state = model.state_dict()
    return {f"{prefix}.{name}": fingerprint(state[name].detach().numpy()) for name in OUR_NAMES}


def _fixture_rounds(clientsa, serversa, Server) -> tuple[dict, dict]:
    from flcore.trainmodel.models import BaseHeadSplit

    anchors = over_our_wire(_anchors(serversa, Server, NUM_CLASSES, 512) * ANCHOR_SCALE)
    train_pixels, probe_pixels = pixels(41, len(TRAIN_LABELS)), pixels(42, len(PROBE_LABELS))
    x, y = pixels_to_input(train_pixels), torch.tensor(TRAIN_LABELS)
    probe = torch.utils.data.TensorDataset(pixels_to_input(probe_pixels), torch.tensor(PROBE_LABELS))
    store: dict = {}
    clientsa.save_item = lambda item, role, name, path=None: store.__setitem__((role, name), item)
    clientsa.load_item = lambda role, name, path=None: store.get((role, name))
    args = SimpleNamespace(models=["FedAvgCNN(in_features=1, num_classes=args.num_classes, dim=1024)"],
                           num_classes=NUM_CLASSES, feature_dim=512)
    torch.manual_seed(0)  # Client.__init__ seeds 0 before its BaseHeadSplit
    store[("Client_0", "model")] = BaseHeadSplit(args, 0)
    initial = store[("Client_0", "model")]
    # their head is a Linear drawn after the whole FedAvgCNN (whose own fc is dropped): kept in full
    outputs = _fingerprints(initial, "initial") | {"initial.head.weight.full": initial.head.weight.detach().numpy().copy(),
                                                   "initial.head.bias.full": initial.head.bias.detach().numpy().copy()}
    client = _client(clientsa, _tensor(anchors))
    client.load_train_data = lambda batch_size=None: torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), len(y), drop_last=True, shuffle=False)
    client.load_test_data = lambda batch_size=None: torch.utils.data.DataLoader(probe, 10, shuffle=False)
    for server_round in (1, 2):
        client.train()
        model = store[("Client_0", "model")]
        protos = np.zeros((NUM_CLASSES, 512))
        for c, p in store[("Client_0", "protos")].items():
            protos[c] = p.numpy()
        model.eval()
        with torch.no_grad():
            features = model.base(x)
            logits = model.head(features)
        outputs |= _fingerprints(model, f"round{server_round}") | {
            f"round{server_round}.margin": np.float64(max(client.local_gap, client.global_gap)),
            f"round{server_round}.local_margin": np.float64(client.local_gap),
            f"round{server_round}.prototypes": protos, f"round{server_round}.features": features.numpy(),
            f"round{server_round}.logits": logits.numpy()}
        if server_round == 1:  # its prototypes as our wire carries them: rounded to float32
            uploaded = {c: _tensor(over_our_wire(p)) for c, p in store[("Client_0", "protos")].items()}
            client.protos = uploaded  # our client's round-2 margin is that of its upload
            store[("Server", "global_protos")] = defaultdict(list, uploaded)  # our server's broadcast
    correct, tested, _ = client.test_metrics()
    outputs |= {"probe.correct": np.int64(correct), "probe.tested": np.int64(tested)}
    inputs = {"anchors": anchors, "train.pixels": train_pixels, "train.labels": np.array(TRAIN_LABELS),
              "probe.pixels": probe_pixels, "probe.labels": np.array(PROBE_LABELS), "init_seed": np.int64(0),
              "lr": np.float64(LR), "epochs": np.int64(EPOCHS), "lambda_r": np.float64(LAMBDA_R),
              "lambda_mcl": np.float64(LAMBDA_MCL), "lambda_cc": np.float64(LAMBDA_CC)}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    clientsa, serversa, Server = _import(checkouts["fedsa"])
    snapshot = SNAPSHOTS["fedsa"]
    calls = {
        "fedsa-anchors": ("system/flcore/servers/serversa.py: FedSA.__init__ (Server.__init__, set_slow_clients, "
                          "set_clients patched to no-ops; mmcv SyncBN -> torch.nn.SyncBatchNorm) after "
                          "torch.manual_seed(0); clients/clientsa.py: clientSA.cal_global_gap; in float64",
                          _fixture_anchors(clientsa, serversa, Server)),
        "fedsa-losses": ("system/flcore/clients/clientsa.py: clientSA.cal_anchors_loss (and cal_mcl_loss), "
                         "cal_local_gap, cal_global_gap on a clientSA made with __new__; in float64",
                         _fixture_losses(clientsa)),
        "fedsa-server": ("system/flcore/servers/serversa.py: proto_aggregation, FedSA.update_semantic_anchors "
                         "(a FedSA made with __new__); in float64, the anchors and uploads float32 values (our wire)",
                         _fixture_server(serversa, over_our_wire(_anchors(serversa, Server, NUM_CLASSES, 512)))),
        "fedsa-client-rounds": ("system/flcore/clients/clientsa.py: clientSA.train (two rounds) and test_metrics, "
                                "load_item/save_item to a dict, load_train_data/load_test_data to seeded images; "
                                "BaseHeadSplit(FedAvgCNN(in_features=1, dim=1024)) after torch.manual_seed(0); "
                                "in float64, the anchors, and the round-1 prototypes for the round-2 margin and as "
                                "global prototypes, rounded to float32 (our wire)",
                                _fixture_rounds(clientsa, serversa, Server)),
    }
    return [save_fixture(name, snapshot, call, rerun, *arrays) for name, (call, arrays) in calls.items()]
