"""LG-FedAvg's, FedDistill's, FedTGP's, FedGH's and FedGen's fixtures, from HtFLlib's code
(TsingZ0/HtFLlib, ``system/flcore/{clients,servers}/{client,server}{lg,fd,tgp,gh,gen}.py``), the
implementations protofl's ``lgfedavg``, ``feddistill``, ``fedtgp``, ``fedgh`` and ``fedgen`` follow.

Their code computes in float64 here (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called casts back to float32). What was adapted, and nothing else:

- Their clients and servers keep every item in files (``clientbase.save_item``/``load_item``:
  ``torch.save``/``torch.load`` to ``<folder>/<role>_<name>.pt``): both are replaced, in every module
  that imported them, by an in-memory store that keeps a deep copy (what a save and a load give: a
  fresh copy each time; a missing item is None, as theirs).
- Their objects are made with ``__new__`` (their constructors read the datasets from ``../dataset``
  and build every client's model) and given by hand the attributes the methods called read. Their
  clients' ``load_train_data`` returns a ``DataLoader(batch_size, drop_last=True, shuffle=False)``
  (theirs) over a seeded ``TensorDataset``; the servers' clients are stand-ins holding ``id``,
  ``role``, ``train_samples`` and the items they saved (their heads, prototypes, logits).
- Their clients' model is a small ``BaseHeadSplit``-like :class:`SplitNet` (``.base``: Linear(6, 8)
  + ReLU, the 8-d feature; ``.head``: Linear(8, 4)), its initial values seeded and stored. The
  servers' heads are ``nn.Linear(512, C)`` (the feature size of protofl's ``cnn``, so that the
  tests can also run our strategies, whose feature size is their model's), FedTGP's prototypes
  192-d (protofl's ``fednh-cnn``'s: the trainable prototypes' d x d layers cost less than at 512).
- Their random draws are recorded: ``random.sample`` (the order of the uploads) is seeded, and the
  uploads' order stored; the orders their ``DataLoader(shuffle=True)`` drew each epoch (a spy on
  ``RandomSampler.__iter__``, as ``fednh_creff``); FedGen's labels (a spy on ``np.random.choice``)
  and noise (a spy on ``torch.rand``, which their ``Generator.forward`` calls). ``print`` output is
  discarded.

What is called, on which inputs (C classes, K = 3 clients; a client's classes are held in their
dicts in the order of ``CLIENT_CLASSES``, not ascending, as their ``collect_protos`` fills them in
the order of first appearance):

- ``htfllib-lgfedavg-server``: ``Server.receive_ids`` and ``LG_FedAvg.aggregate_parameters`` on
  three clients' heads (Linear(512, 4)) of ``SIZES`` training samples: the training-size weighted
  mean.
- ``htfllib-fedgh-server``: ``FedGH.receive_protos`` then ``train_head`` (``FEDGH["server_epochs"]`` epochs of
  SGD at ``server_learning_rate`` with cross-entropy over the uploaded (prototype, class) pairs in
  batches of ``batch_size``) from a seeded Linear(512, 4). The prototypes are multiples of 1/16 (so
  exact in float32: our wire's dtype changes nothing); their pairs' order (client, class) is stored.
- ``htfllib-fedgh-client``: ``clientGH.set_parameters`` (the server's head, a seeded Linear(8, 4),
  loaded over the client's), ``clientGH.train`` (one epoch, two batches of 4, cross-entropy) and
  ``collect_protos``: each batch's cross-entropy, the trained model, the uploaded prototypes. Their
  ``train`` saves the trained model before ``collect_protos`` loads it: the prototypes are the
  trained body's (its eval pass, over the batches ``drop_last`` keeps; ``make`` checks them against
  the class means of the trained body's features). Class 2 is held by no sample.
- ``htfllib-fedtgp-server``: ``FedTGP.receive_protos`` (the class gaps, min_gap, max_gap) then
  ``update_TGP`` (SGD at their ``local_learning_rate`` of ``Trainable_Global_Prototypes(C, 192, 192)``,
  made after ``torch.manual_seed(TGP_SEED)``, on Eq. 7 with margin min(max_gap, margin_threthold)),
  C = 5 with class 4 uploaded by nobody (its gap is min_gap). The prototypes are multiples of 1/16
  and each class is uploaded by at most two clients, so the uniform class means are exact in
  float32 (our wire's dtype changes nothing). The 192 x 192 weights are stored as
  ``common.fingerprint``s (of the initial values, the trained ones and their displacement); the
  global prototypes (their ``TGP.eval()`` outputs) in full.
- ``htfllib-fedtgp-client``: ``clientTGP.train`` (one epoch, two batches of 4) with global
  prototypes for every class (float32 values, as our wire carries them), ``lamda`` = 10, then
  (inside it) ``collect_protos``: each batch's cross-entropy and total loss (``self.loss``
  wrapped, as ``pfllib_baselines``'s ``_Recorded``: their ``loss += ...`` adds the MSE term in
  place to the tensor it returned), the trained model, the uploaded prototypes. Their ``train``
  calls ``collect_protos`` before it saves the trained model, and ``collect_protos`` loads the
  saved one: the prototypes they upload are those of the model the round started from (its eval
  pass, over the batches ``drop_last`` keeps), not of the trained one.
- ``htfllib-feddistill-server``: ``serverfd.proto_aggregation`` (the unweighted mean over the
  uploaders) of three clients' per-class mean logits (float32-exact values), class 1 uploaded by
  nobody.
- ``htfllib-feddistill-client``: ``clientFD.train`` (one epoch, three batches of 4) with the
  global logits of the previous fixture rounded to float32 (what our server sends: our wire carries
  class vectors in float32; class 1 has none: its target is the sample's own logit),
  ``lamda`` = 0.5: each batch's cross-entropy, distillation term and total, the trained model,
  the uploaded per-class mean logits (``agg_func`` over every batch's training-mode outputs).
- ``htfllib-fedgen-server``: ``Server.receive_ids``, ``FedGen.train_generator`` (``FEDGEN["server_epochs"]``
  Adam steps of their ``Generator(noise, C, hidden, 512)``, made after ``torch.manual_seed``, on the
  cross-entropy of the training-size weighted sum of the clients' heads' logits), then
  ``aggregate_parameters``; ``qualified_labels`` as their constructor builds it from the clients'
  class counts. Each step's labels, noise and loss are stored. Their ``train_generator`` trains the
  copy it loaded and never saves it (no ``save_item``: the stored generator stays the initial one,
  which ``make`` asserts): the trained generator is taken from the store's record of what it loaded.
- ``htfllib-fedgen-client``: ``clientGen.train`` (one epoch, two batches of 4) with a seeded
  generator in training mode (their server saves it so, from its constructor, and, as above, never
  saves a trained one): each batch's labels and noise drawn, the cross-entropy of the batch, of
  the generated features, and the total; the trained model.
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import sys
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conformance.common import Snapshot, fingerprint, save_fixture, seeded

SNAPSHOTS = {"htfllib": Snapshot("TsingZ0/HtFLlib", "e959261d906f40377410bc4d9d13ba3f6af56782")}

NUM_CLASSES = 4
IN_DIM, SMALL_DIM = 6, 8  # the clients' SplitNet: inputs, features
WIDE_DIM = 512  # the servers' heads and prototypes: protofl's cnn's feature size
TGP_DIM = 192  # FedTGP's prototypes: protofl's fednh-cnn's feature size (its 512 x 512 layers cost 7x more)
SIZES = (7, 12, 5)  # the clients' training samples (their train_samples; our num_examples)
# the classes each client uploads, in their dict's order (the order of first appearance)
CLIENT_CLASSES = ((2, 0), (3, 1, 2), (0, 1))
TGP_CLASSES = 5  # FedTGP's C: class 4 uploaded by nobody
SAMPLE_SEED = 3  # random.seed before receive_ids / receive_protos (the uploads' order)
LOADER_SEED = 11  # torch.manual_seed before a server's training (its loader's shuffles)
HEAD_SEED, TGP_SEED, GENERATOR_SEED = 5, 7, 9

FEDGH = {"batch_size": 3, "server_epochs": 2, "server_learning_rate": 0.05}
FEDTGP = {"batch_size": 3, "server_epochs": 3, "local_learning_rate": 0.05, "margin_threthold": 100.0}
FEDGH_CLIENT = {"batch_size": 4, "local_learning_rate": 0.1, "n": 8}
FEDTGP_CLIENT = {"batch_size": 4, "local_learning_rate": 0.1, "lamda": 10.0, "n": 8}
FEDDISTILL_CLIENT = {"batch_size": 4, "local_learning_rate": 0.1, "lamda": 0.5, "n": 12}
# FedDistill's uploads: client k's classes (class 1: nobody's)
FEDDISTILL_CLASSES = ((2, 0), (3, 0, 2), (3, 2))
FEDGEN = {"noise_dim": 4, "hidden_dim": 16, "batch_size": 8, "server_epochs": 5, "generator_learning_rate": 0.05}
# the class counts of FedGen's clients (summing to SIZES): their qualified_labels
FEDGEN_COUNTS = ((3, 0, 4, 0), (2, 5, 0, 5), (0, 1, 1, 3))
FEDGEN_CLIENT = {"batch_size": 4, "local_learning_rate": 0.1, "n": 8}
NUMPY_SEED = 0  # np.random.seed before FedGen's draws


class SplitNet(nn.Module):
    """HtFLlib's ``BaseHeadSplit`` in small: ``base`` (the feature), ``head``; forward = head(base(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(IN_DIM, SMALL_DIM), nn.ReLU())
        self.head = nn.Linear(SMALL_DIM, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(x))


def split_net(given: dict[str, np.ndarray], prefix: str = "model") -> SplitNet:
    """A :class:`SplitNet` holding the stored values ``<prefix>.<name>``."""
    net = SplitNet()
    net.load_state_dict({k: torch.from_numpy(given[f"{prefix}.{k}"].copy()) for k in net.state_dict()})
    return net


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(values)).to(torch.get_default_dtype())


def _state(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{k}": v.detach().numpy().copy() for k, v in module.state_dict().items()}


def _seeded_net(seed: int) -> SplitNet:
    rng = seeded(seed)
    net = SplitNet()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(_tensor(rng.standard_normal(tuple(p.shape)) * 0.5))
    return net


def _quantized(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    """Normal draws times ``scale``, rounded to multiples of 1/16: exact in float32, and so are
    their means over two."""
    return np.round(rng.standard_normal(shape) * scale * 16) / 16


def _float32_exact(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


# --- their code, adapted ------------------------------------------------------------------------

class _Store:
    """Their ``save_item``/``load_item`` in memory: a deep copy each way (torch.save, torch.load)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], object] = {}
        self.loaded: list[tuple[tuple[str, str], object]] = []  # each load's key and the copy it gave

    def save_item(self, item, role, item_name, item_path=None):
        self.items[(role, item_name)] = copy.deepcopy(item)

    def load_item(self, role, item_name, item_path=None):
        key = (role, item_name)
        item = copy.deepcopy(self.items[key]) if key in self.items else None
        self.loaded.append((key, item))
        return item


def _import(checkout: Path) -> dict[str, types.ModuleType]:
    sys.modules.setdefault("h5py", types.ModuleType("h5py"))  # serverbase imports it (results files only)
    sys.path.insert(0, str(checkout / "system"))
    import importlib

    names = ["clients.clientbase", "servers.serverbase"] + [
        f"{side}s.{side}{m}" for m in ("lg", "fd", "tgp", "gh", "gen") for side in ("client", "server")]
    return {name.split(".")[1]: importlib.import_module(f"flcore.{name}") for name in names}


@contextlib.contextmanager
def _in_memory(modules: dict[str, types.ModuleType]):
    """Every module's ``save_item``/``load_item`` -> one :class:`_Store`; stdout discarded."""
    store = _Store()
    saved = {name: (m.save_item, m.load_item) for name, m in modules.items()}
    for m in modules.values():
        m.save_item, m.load_item = store.save_item, store.load_item
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield store
    finally:
        for name, m in modules.items():
            m.save_item, m.load_item = saved[name]


@contextlib.contextmanager
def _recorded_orders():
    """The indices each ``DataLoader(shuffle=True)`` epoch drew (a spy on ``RandomSampler.__iter__``)."""
    orders: list[list[int]] = []
    sampler = torch.utils.data.RandomSampler
    draw = sampler.__iter__

    def record(self):
        order = list(draw(self))
        orders.append(order)
        yield from order

    sampler.__iter__ = record
    try:
        yield orders
    finally:
        sampler.__iter__ = draw


class _Recorded:
    """Their ``self.loss``: each call's value, and the tensor it returned (to which their
    ``loss += ...`` adds the method's term in place: read after training, a batch's total)."""

    def __init__(self) -> None:
        self.inner = nn.CrossEntropyLoss()
        self.values: list[float] = []
        self.tensors: list[torch.Tensor] = []

    def __call__(self, output, target):
        loss = self.inner(output, target)
        self.values.append(loss.item())
        self.tensors.append(loss)
        return loss


def _stand_in(i: int, n: int = 0) -> types.SimpleNamespace:
    """A server's client: what the server methods called read of it."""
    return types.SimpleNamespace(id=i, role=f"Client_{i}", save_folder_name="items", train_samples=n)


def _server(cls, **attributes):
    server = cls.__new__(cls)
    server.__dict__.update(dict(device="cpu", role="Server", save_folder_name="items", client_drop_rate=0.0),
                           **attributes)
    return server


def _client(cls, x: torch.Tensor, y: torch.Tensor, batch_size: int, lr: float, **attributes):
    client = cls.__new__(cls)
    data = torch.utils.data.TensorDataset(x, y)
    client.__dict__.update(dict(
        id=0, role="Client_0", save_folder_name="items", device="cpu", learning_rate=lr, local_epochs=1,
        batch_size=batch_size, num_classes=NUM_CLASSES, train_slow=False, train_samples=len(y),
        train_time_cost={"num_rounds": 0, "total_cost": 0.0}, loss=_Recorded(),
        load_train_data=lambda batch_size=None: torch.utils.data.DataLoader(
            data, batch_size or client.batch_size, drop_last=True, shuffle=False)), **attributes)
    return client


def _client_data(seed: int, n: int, labels=None) -> tuple[np.ndarray, np.ndarray]:
    rng = seeded(seed)
    x = rng.standard_normal((n, IN_DIM))
    y = rng.integers(0, NUM_CLASSES, n) if labels is None else np.array(labels)
    return x, y


def _as_array(vectors: dict, classes: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Their {class: vector} (a defaultdict: [] for a class without one) -> (C x dim, C mask)."""
    array, mask = np.zeros((classes, dim)), np.zeros(classes, dtype=bool)
    for c, v in vectors.items():
        if not isinstance(v, list):
            array[int(c)], mask[int(c)] = torch.as_tensor(v).detach().numpy(), True
    return array, mask


# --- the fixtures -------------------------------------------------------------------------------

def _lgfedavg(m) -> tuple[dict, dict]:
    rng = seeded(40)
    heads = [(rng.standard_normal((NUM_CLASSES, WIDE_DIM)), rng.standard_normal(NUM_CLASSES)) for _ in SIZES]
    clients = [_stand_in(i, n) for i, n in enumerate(SIZES)]
    with _in_memory(m) as store:
        for client, (weight, bias) in zip(clients, heads):
            model = types.SimpleNamespace(head=nn.Linear(WIDE_DIM, NUM_CLASSES))  # aggregate_parameters: .head
            model.head.load_state_dict({"weight": _tensor(weight), "bias": _tensor(bias)})
            store.save_item(model, client.role, "model")
        server = _server(m["serverlg"].LG_FedAvg, clients=clients, selected_clients=clients,
                         current_num_join_clients=len(clients))
        random.seed(SAMPLE_SEED)
        server.receive_ids()
        server.aggregate_parameters()
        head = store.load_item("Server", "head")
    inputs = {"sizes": np.array(SIZES)}
    for i, (weight, bias) in enumerate(heads):
        inputs |= {f"client{i}.weight": weight, f"client{i}.bias": bias}
    outputs = {"weight": head.weight.detach().numpy(), "bias": head.bias.detach().numpy(),
               "uploaded_ids": np.array(server.uploaded_ids), "uploaded_weights": np.array(server.uploaded_weights)}
    return inputs, outputs


def _uploaded_prototypes(seed: int, classes: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """K x classes x dim prototypes (class centre + client noise, multiples of 1/16) and K x classes
    counts, zero where a client does not hold the class (``CLIENT_CLASSES``)."""
    rng = seeded(seed)
    centres = _quantized(rng, (classes, dim), 1.0)
    means, counts = np.zeros((len(SIZES), classes, dim)), np.zeros((len(SIZES), classes), dtype=np.int64)
    for k, held in enumerate(CLIENT_CLASSES):
        for c in held:
            means[k, c] = centres[c] + _quantized(rng, dim, 0.5)
            counts[k, c] = rng.integers(1, 6)
    return means, counts


def _save_protos(store: _Store, means: np.ndarray, as_key=int) -> None:
    """Each client's {class: prototype} in the order of ``CLIENT_CLASSES`` (their agg_func's dict)."""
    for k, held in enumerate(CLIENT_CLASSES):
        protos = defaultdict(list)
        for c in held:
            protos[as_key(c)] = _tensor(means[k, c])
        store.save_item(protos, f"Client_{k}", "protos")


def _pair_order(server_ids) -> tuple[np.ndarray, np.ndarray]:
    """The (client, class) of each uploaded pair, in their list's order."""
    pairs = [(k, c) for k in server_ids for c in CLIENT_CLASSES[k]]
    return np.array([k for k, _ in pairs]), np.array([c for _, c in pairs])


def _fedgh(m) -> tuple[dict, dict]:
    means, counts = _uploaded_prototypes(41, NUM_CLASSES, WIDE_DIM)
    torch.manual_seed(HEAD_SEED)
    head = nn.Linear(WIDE_DIM, NUM_CLASSES)
    initial = _state(head, "initial")
    clients = [_stand_in(i, n) for i, n in enumerate(SIZES)]
    with _in_memory(m) as store:
        _save_protos(store, means)
        store.save_item(head, "Server", "head")
        server = _server(m["servergh"].FedGH, selected_clients=clients, current_num_join_clients=len(clients),
                         CEloss=nn.CrossEntropyLoss(), batch_size=FEDGH["batch_size"],
                         server_epochs=FEDGH["server_epochs"],
                         server_learning_rate=FEDGH["server_learning_rate"])
        random.seed(SAMPLE_SEED)
        server.receive_protos()
        uploaded = store.load_item("Server", "uploaded_protos")
        torch.manual_seed(LOADER_SEED)
        with _recorded_orders() as orders:
            server.train_head()
        trained = store.load_item("Server", "head")
    pair_clients, pair_classes = _pair_order(server.uploaded_ids)
    assert [int(y) for _, y in uploaded] == pair_classes.tolist()
    n = len(uploaded)
    assert len(orders) == FEDGH["server_epochs"] and all(sorted(o) == list(range(n)) for o in orders)
    inputs = {"means": means, "counts": counts, "sizes": np.array(SIZES), "orders": np.array(orders),
              "pair_clients": pair_clients, "pair_classes": pair_classes} | initial
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in FEDGH.items()}
    outputs = {"weight": trained.weight.detach().numpy(), "bias": trained.bias.detach().numpy(),
               "prototypes": np.stack([p.numpy() for p, _ in uploaded]),
               "labels": np.array([int(y) for _, y in uploaded]), "uploaded_ids": np.array(server.uploaded_ids)}
    return inputs, outputs


def _fedgh_client(m) -> tuple[dict, dict]:
    o = FEDGH_CLIENT
    x, y = _client_data(52, o["n"], [1, 3, 0, 1, 3, 0, 0, 1])  # class 2: no sample
    net = _seeded_net(53)
    head = _seeded_net(54).head  # the server's, which set_parameters loads over the client's own
    client = _client(m["clientgh"].clientGH, _tensor(x), torch.from_numpy(y), o["batch_size"],
                     o["local_learning_rate"])
    with _in_memory(m) as store:
        store.save_item(net, client.role, "model")
        store.save_item(head, "Server", "head")
        client.set_parameters()
        client.train()
        client.collect_protos()
        trained = store.load_item(client.role, "model")
        uploaded = store.load_item(client.role, "protos")
    recorded = client.loss
    assert len(recorded.values) == o["n"] // o["batch_size"]
    assert not any(torch.equal(a, b) for a, b in zip(head.parameters(), net.head.parameters()))  # another head
    protos, held = _as_array(uploaded, NUM_CLASSES, SMALL_DIM)
    with torch.no_grad():  # the trained body's class means: what they upload (not the received body's)
        features = trained.base.eval()(_tensor(x)).numpy()
    for c in range(NUM_CLASSES):
        assert held[c] == (y == c).any()
        if held[c]:
            np.testing.assert_allclose(protos[c], features[y == c].mean(axis=0), rtol=1e-12, atol=1e-14)
    inputs = {"x": x, "y": y} | _state(net, "model") | _state(head, "server_head")
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in o.items()}
    outputs = {"ce": np.array(recorded.values), "prototypes": protos, "held": held} | _state(trained, "trained")
    return inputs, outputs


TGP_NAMES = {  # theirs (middle: a Sequential of one Sequential(Linear, ReLU)) -> ours (TrainablePrototypes)
    "embedings.weight": "embedding.weight", "middle.0.0.weight": "middle.0.weight", "middle.0.0.bias": "middle.0.bias",
    "fc.weight": "out.weight", "fc.bias": "out.bias",
}


def _fedtgp(m) -> tuple[dict, dict]:
    servertgp = m["servertgp"]
    means, counts = _uploaded_prototypes(42, TGP_CLASSES, TGP_DIM)
    assert ((counts > 0).sum(axis=0) <= 2).all()  # the uniform means exact in float32
    torch.manual_seed(TGP_SEED)
    tgp = servertgp.Trainable_Global_Prototypes(TGP_CLASSES, TGP_DIM, TGP_DIM, "cpu")
    initial = {name: t.detach().clone() for name, t in tgp.state_dict().items()}
    clients = [_stand_in(i, n) for i, n in enumerate(SIZES)]
    with _in_memory(m) as store:
        _save_protos(store, means)
        store.save_item(tgp, "Server", "TGP")
        server = _server(servertgp.FedTGP, selected_clients=clients, num_classes=TGP_CLASSES,
                         server_learning_rate=FEDTGP["local_learning_rate"], batch_size=FEDTGP["batch_size"],
                         server_epochs=FEDTGP["server_epochs"], margin_threthold=FEDTGP["margin_threthold"],
                         CEloss=nn.CrossEntropyLoss())
        server.receive_protos()
        pair_clients, pair_classes = _pair_order([c.id for c in clients])
        assert [int(y) for _, y in server.uploaded_protos] == pair_classes.tolist()
        averaged = servertgp.proto_cluster([store.load_item(c.role, "protos") for c in clients])
        gap, min_gap, max_gap = server.gap.numpy().copy(), server.min_gap.item(), server.max_gap.item()
        torch.manual_seed(LOADER_SEED)
        with _recorded_orders() as orders:
            server.update_TGP()
        trained = store.load_item("Server", "TGP").state_dict()
        global_protos = store.load_item("Server", "global_protos")
    n = len(pair_classes)
    assert len(orders) == FEDTGP["server_epochs"] and all(sorted(o) == list(range(n)) for o in orders)
    class_means, held = _as_array(averaged, TGP_CLASSES, TGP_DIM)
    prototypes, _ = _as_array(global_protos, TGP_CLASSES, TGP_DIM)
    inputs = {"means": means, "counts": counts, "orders": np.array(orders), "pair_clients": pair_clients,
              "pair_classes": pair_classes, "tgp_seed": np.int64(TGP_SEED)}
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in FEDTGP.items()}
    outputs = {"class_means": class_means, "held": held, "gap": gap, "min_gap": np.float64(min_gap),
               "max_gap": np.float64(max_gap), "margin": np.float64(min(max_gap, FEDTGP["margin_threthold"])),
               "global_prototypes": prototypes}
    for name, ours in TGP_NAMES.items():
        outputs[f"initial.{ours}"] = fingerprint(initial[name].numpy())
        outputs[f"trained.{ours}"] = fingerprint(trained[name].numpy())
        outputs[f"displacement.{ours}"] = fingerprint((trained[name] - initial[name]).numpy())
    return inputs, outputs


def _fedtgp_client(m) -> tuple[dict, dict]:
    o = FEDTGP_CLIENT
    x, y = _client_data(43, o["n"], [0, 2, 1, 0, 3, 3, 2, 0])
    net = _seeded_net(44)
    global_protos = defaultdict(list)
    prototypes = _float32_exact(seeded(45), (NUM_CLASSES, SMALL_DIM), 1.0)  # as our wire carries them
    for c in range(NUM_CLASSES):  # FedTGP: every class has one
        global_protos[c] = _tensor(prototypes[c])
    client = _client(m["clienttgp"].clientTGP, _tensor(x), torch.from_numpy(y), o["batch_size"],
                     o["local_learning_rate"], lamda=o["lamda"], loss_mse=nn.MSELoss())
    with _in_memory(m) as store:
        store.save_item(net, client.role, "model")
        store.save_item(global_protos, "Server", "global_protos")
        client.train()
        trained = store.load_item(client.role, "model")
        uploaded = store.load_item(client.role, "protos")
    recorded = client.loss
    assert len(recorded.values) == o["n"] // o["batch_size"]
    protos, held = _as_array(uploaded, NUM_CLASSES, SMALL_DIM)
    inputs = {"x": x, "y": y, "global_prototypes": prototypes} | _state(net, "model")
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in o.items()}
    outputs = {"ce": np.array(recorded.values), "loss": np.array([t.item() for t in recorded.tensors]),
               "prototypes": protos, "held": held} | _state(trained, "trained")
    return inputs, outputs


def _feddistill_server(m) -> tuple[dict, dict]:
    rng = seeded(46)
    uploads = np.zeros((len(FEDDISTILL_CLASSES), NUM_CLASSES, NUM_CLASSES))
    counts = np.zeros((len(FEDDISTILL_CLASSES), NUM_CLASSES), dtype=np.int64)
    dicts = []
    for k, held in enumerate(FEDDISTILL_CLASSES):
        logits = defaultdict(list)
        for c in held:
            uploads[k, c] = _float32_exact(rng, NUM_CLASSES, 2.0)
            counts[k, c] = rng.integers(1, 6)
            logits[c] = _tensor(uploads[k, c])
        dicts.append(logits)
    aggregated = m["serverfd"].proto_aggregation(dicts)
    global_logits, available = _as_array(aggregated, NUM_CLASSES, NUM_CLASSES)
    return {"means": uploads, "counts": counts}, {"global_logits": global_logits, "available": available}


def _feddistill_client(m, server_outputs: dict) -> tuple[dict, dict]:
    o = FEDDISTILL_CLIENT
    x, y = _client_data(47, o["n"], [1, 0, 2, 3, 1, 2, 0, 0, 3, 1, 2, 1])
    net = _seeded_net(48)
    sent = server_outputs["global_logits"].astype(np.float32).astype(np.float64)  # as our wire carries them
    global_logits = defaultdict(list)  # their proto_aggregation's: no entry for class 1
    for c in np.flatnonzero(server_outputs["available"]):
        global_logits[int(c)] = _tensor(sent[c])
    client = _client(m["clientfd"].clientFD, _tensor(x), torch.from_numpy(y), o["batch_size"],
                     o["local_learning_rate"], lamda=o["lamda"])
    with _in_memory(m) as store:
        store.save_item(net, client.role, "model")
        store.save_item(global_logits, "Server", "global_logits")
        client.train()
        trained = store.load_item(client.role, "model")
        uploaded = store.load_item(client.role, "logits")
    recorded = client.loss  # per batch: CE(output, y), then CE(output, logit_new)
    batches = o["n"] // o["batch_size"]
    assert len(recorded.values) == 2 * batches
    logits, held = _as_array(uploaded, NUM_CLASSES, NUM_CLASSES)
    inputs = {"x": x, "y": y, "global_logits": sent, "available": server_outputs["available"]} | _state(net, "model")
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in o.items()}
    outputs = {"ce": np.array(recorded.values[0::2]), "distillation": np.array(recorded.values[1::2]),
               "loss": np.array([t.item() for t in recorded.tensors[0::2]]), "logits": logits,
               "held": held} | _state(trained, "trained")
    return inputs, outputs


GENERATOR_NAMES = {  # theirs -> ours (protofl.strategies.fedgen.Generator)
    "fc1.0.weight": "hidden.0.weight", "fc1.0.bias": "hidden.0.bias", "fc1.1.weight": "hidden.1.weight",
    "fc1.1.bias": "hidden.1.bias", "fc1.1.running_mean": "hidden.1.running_mean",
    "fc1.1.running_var": "hidden.1.running_var", "fc1.1.num_batches_tracked": "hidden.1.num_batches_tracked",
    "fc.weight": "out.weight", "fc.bias": "out.bias",
}


def _generator_state(generator: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{GENERATOR_NAMES[k]}": v.detach().numpy().copy() for k, v in generator.state_dict().items()}


@contextlib.contextmanager
def _recorded_draws():
    """The labels of each ``np.random.choice`` and the noise of each ``torch.rand`` (their
    Generator.forward's eps) while their code runs."""
    labels, noise = [], []
    choice, rand = np.random.choice, torch.rand

    def record_choice(*args, **kwargs):
        drawn = choice(*args, **kwargs)
        labels.append(np.array(drawn))
        return drawn

    def record_rand(*args, **kwargs):
        drawn = rand(*args, **kwargs)
        noise.append(drawn.detach().numpy().copy())
        return drawn

    np.random.choice, torch.rand = record_choice, record_rand
    try:
        yield labels, noise
    finally:
        np.random.choice, torch.rand = choice, rand


def _qualified_labels(counts) -> list[int]:
    """Their FedGen constructor's: every client's labels, class by class."""
    return [c for client in counts for c in range(NUM_CLASSES) for _ in range(int(client[c]))]


def _fedgen_server(m) -> tuple[dict, dict]:
    servergen = m["servergen"]
    o = FEDGEN
    assert [sum(c) for c in FEDGEN_COUNTS] == list(SIZES)
    rng = seeded(49)
    heads = [(rng.standard_normal((NUM_CLASSES, WIDE_DIM)) * 0.05, rng.standard_normal(NUM_CLASSES) * 0.05)
             for _ in SIZES]
    torch.manual_seed(GENERATOR_SEED)
    generator = servergen.Generator(o["noise_dim"], NUM_CLASSES, o["hidden_dim"], WIDE_DIM, "cpu")
    initial = _generator_state(generator, "initial")
    clients = [_stand_in(i, n) for i, n in enumerate(SIZES)]
    loss = _Recorded()
    with _in_memory(m) as store:
        for client, (weight, bias) in zip(clients, heads):
            model = types.SimpleNamespace(head=nn.Linear(WIDE_DIM, NUM_CLASSES))
            model.head.load_state_dict({"weight": _tensor(weight), "bias": _tensor(bias)})
            store.save_item(model, client.role, "model")
        store.save_item(generator, "Server", "generative_model")
        server = _server(servergen.FedGen, clients=clients, selected_clients=clients,
                         current_num_join_clients=len(clients), loss=loss, batch_size=o["batch_size"],
                         generator_learning_rate=o["generator_learning_rate"], server_epochs=o["server_epochs"],
                         qualified_labels=_qualified_labels(FEDGEN_COUNTS))
        random.seed(SAMPLE_SEED)
        server.receive_ids()
        np.random.seed(NUMPY_SEED)
        with _recorded_draws() as (labels, noise):
            server.train_generator()
        # train_generator does not save_item the generator it trained (the store keeps the initial
        # one): the trained one is the copy it loaded
        (trained,) = [item for key, item in store.loaded if key == ("Server", "generative_model")]
        kept = store.load_item("Server", "generative_model")
        server.aggregate_parameters()
        head = store.load_item("Server", "head")
    assert all(torch.equal(v, generator.state_dict()[k]) for k, v in kept.state_dict().items())
    assert len(labels) == len(noise) == len(loss.values) == o["server_epochs"]
    inputs = {"sizes": np.array(SIZES), "class_counts": np.array(FEDGEN_COUNTS), "labels": np.stack(labels),
              "noise": np.stack(noise)} | initial
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in o.items()}
    for i, (weight, bias) in enumerate(heads):
        inputs |= {f"client{i}.weight": weight, f"client{i}.bias": bias}
    outputs = {"loss": np.array(loss.values), "uploaded_ids": np.array(server.uploaded_ids),
               "head.weight": head.weight.detach().numpy(), "head.bias": head.bias.detach().numpy()}
    return inputs, outputs | _generator_state(trained, "trained")


def _fedgen_client(m) -> tuple[dict, dict]:
    clientgen, servergen = m["clientgen"], m["servergen"]
    o = FEDGEN_CLIENT
    x, y = _client_data(50, o["n"], [3, 1, 0, 2, 1, 1, 0, 2])
    net = _seeded_net(51)
    torch.manual_seed(GENERATOR_SEED)
    generator = servergen.Generator(FEDGEN["noise_dim"], NUM_CLASSES, FEDGEN["hidden_dim"], SMALL_DIM, "cpu")
    generator.train()  # as their server saves it after train_generator
    counts = FEDGEN_COUNTS
    client = _client(clientgen.clientGen, _tensor(x), torch.from_numpy(y), o["batch_size"],
                     o["local_learning_rate"], qualified_labels=_qualified_labels(counts))
    with _in_memory(m) as store:
        store.save_item(net, client.role, "model")
        store.save_item(generator, "Server", "generative_model")
        np.random.seed(NUMPY_SEED)
        with _recorded_draws() as (labels, noise):
            client.train()
        trained = store.load_item(client.role, "model")
    recorded = client.loss  # per batch: CE(output, y), then CE(head(G(labels)), labels)
    batches = o["n"] // o["batch_size"]
    assert len(recorded.values) == 2 * batches and len(labels) == len(noise) == batches
    inputs = {"x": x, "y": y, "class_counts": np.array(counts), "labels": np.stack(labels),
              "noise": np.stack(noise)} | _state(net, "model") | _generator_state(generator, "generator")
    inputs |= {k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in o.items()}
    inputs |= {k: np.int64(FEDGEN[k]) for k in ("noise_dim", "hidden_dim")}
    outputs = {"ce": np.array(recorded.values[0::2]), "generated": np.array(recorded.values[1::2]),
               "loss": np.array([t.item() for t in recorded.tensors[0::2]])} | _state(trained, "trained")
    return inputs, outputs


CALLS = {
    "lgfedavg-server": "servers/serverbase.py: Server.receive_ids (random.seed({seed})), servers/serverlg.py: "
                       "LG_FedAvg.aggregate_parameters; three clients' Linear(512, 4) heads",
    "fedgh-server": "servers/servergh.py: FedGH.receive_protos (random.seed({seed})), FedGH.train_head "
                    "(torch.manual_seed({loader}); RandomSampler.__iter__ spied on); a seeded Linear(512, 4) head",
    "fedgh-client": "clients/clientgh.py: clientGH.set_parameters (a seeded server head), clientGH.train, "
                    "clientGH.collect_protos; self.loss wrapped to record each call",
    "fedtgp-server": "servers/servertgp.py: FedTGP.receive_protos, FedTGP.update_TGP (torch.manual_seed({loader}); "
                     "RandomSampler.__iter__ spied on), Trainable_Global_Prototypes(5, 192, 192) made after "
                     "torch.manual_seed({tgp}); proto_cluster",
    "fedtgp-client": "clients/clienttgp.py: clientTGP.train (and collect_protos) with float32-exact global "
                     "prototypes for every class; self.loss wrapped to record each batch's loss",
    "feddistill-server": "servers/serverfd.py: proto_aggregation of three clients' logits dicts",
    "feddistill-client": "clients/clientfd.py: clientFD.train with the global logits of htfllib-feddistill-server "
                         "rounded to float32; "
                         "self.loss wrapped to record each call",
    "fedgen-server": "servers/serverbase.py: Server.receive_ids (random.seed({seed})), servers/servergen.py: "
                     "FedGen.train_generator (np.random.seed({numpy}); np.random.choice and torch.rand spied on), "
                     "FedGen.aggregate_parameters; Generator made after torch.manual_seed({generator})",
    "fedgen-client": "clients/clientgen.py: clientGen.train (np.random.seed({numpy}); np.random.choice and "
                     "torch.rand spied on), the Generator made after torch.manual_seed({generator}), in training "
                     "mode; self.loss wrapped to record each call",
}
ADAPTED = ("; objects made with __new__, save_item/load_item an in-memory store, load_train_data a "
           "DataLoader(drop_last=True, shuffle=False) over seeded tensors; in float64")


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    m = _import(checkouts["htfllib"])
    snapshot = SNAPSHOTS["htfllib"]
    seeds = {"seed": SAMPLE_SEED, "loader": LOADER_SEED, "tgp": TGP_SEED, "numpy": NUMPY_SEED,
             "generator": GENERATOR_SEED}
    distill_server = _feddistill_server(m)
    pieces = {
        "lgfedavg-server": _lgfedavg(m),
        "fedgh-server": _fedgh(m),
        "fedgh-client": _fedgh_client(m),
        "fedtgp-server": _fedtgp(m),
        "fedtgp-client": _fedtgp_client(m),
        "feddistill-server": distill_server,
        "feddistill-client": _feddistill_client(m, distill_server[1]),
        "fedgen-server": _fedgen_server(m),
        "fedgen-client": _fedgen_client(m),
    }
    return [save_fixture(f"htfllib-{piece}", snapshot, "system/flcore/" + CALLS[piece].format(**seeds) + ADAPTED,
                         rerun, inputs, outputs)
            for piece, (inputs, outputs) in pieces.items()]
