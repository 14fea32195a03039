"""FedProx's, MOON's, SCAFFOLD's and FedNTD's fixtures, from PFLlib's code (TsingZ0/PFLlib,
``system/flcore``): the baselines FedSC's and FedSKC's papers compare with, as PFLlib runs them
(/work/notes/pfllib_baselines.md describes what each computes).

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64. Nothing here crosses a
float32 wire: our clients and server keep the model's dtype (float64 in the conformance tests) for
the parameters, SCAFFOLD's control variates and the losses.

One federation of ``NUM_CLIENTS`` = 4 clients (N), each with its own seeded 1 x 16 x 16 images of
``NUM_CLASSES`` = 4 classes (``SIZES`` samples: batches of ``BATCH_SIZE`` = 4 leave 1, 3, 2 and 3 of
them out, PFLlib's ``drop_last``: 2, 2, 2 and 1 steps), runs two rounds of each method's real server
and clients: round 1 trains clients 0, 1, 2, round 2 clients 1, 2, 3 (``ROUNDS``), so that round 2 has clients
that trained before (MOON's previous model, SCAFFOLD's c_i are theirs) and one that did not (the
initial model, c_i = 0), and SCAFFOLD's server control variate is not zero. One local epoch, lr 0.05,
plain SGD (PFLlib's: no momentum, no weight decay), the mean cross-entropy.

- The model is ours: ``protofl.task.models.build_model("cnn", 1, 4, 16, seed=0)`` (PFLlib's
  FedAvgCNN layers; 16 x 16 inputs flatten to 64), wrapped in their ``BaseHeadSplit(body, head)``,
  the adapter their ``main.py`` builds for MOON (``model.base``: our body, the 512-d post-ReLU
  feature; ``model.head``: our head). For FedProx, SCAFFOLD and FedNTD, which PFLlib runs on the
  unsplit FedAvgCNN, it computes the same function, with the parameters in the same order
  (``base.*`` = our ``body.*``).
- Their servers are built by their constructors (``serverprox.FedProx``, ``servermoon.MOON``,
  ``serverscaffold.SCAFFOLD``, ``serverntd.FedNTD``, which build the clients), with
  ``read_client_data`` (which reads ``../dataset``) returning our seeded images and ``h5py`` (which
  their server base imports for its results files) a stand-in module. Each round runs their
  ``send_models``, each selected client's ``train``, ``receive_models`` (its ``random.sample``
  seeded: it only orders the sum) and ``aggregate_parameters``. Not called: ``select_clients``
  (``np.random.choice``, unseeded in their code: the selection is set to ``ROUNDS``) and
  ``evaluate``.
- Their clients' ``load_train_data`` returns a ``DataLoader(shuffle=False, drop_last=True)`` over the
  client's images in the order our client takes them in that round:
  ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` with the round's seed
  (``input.round<r>.client<p>.seed``, given to our client as its config's ``seed``); the order is
  stored too (``.order``).
- Their ``self.loss`` (``nn.CrossEntropyLoss()``) is wrapped to record each batch's value
  (:class:`_Recorded`): the cross-entropy, and the batch's total loss, since MOON's and FedNTD's
  ``loss += ...`` add their terms in place to the tensor it returned. FedProx's loss is the
  cross-entropy alone (its proximal term is in the optimiser's step): the wrapper also records
  (mu-free) ||w - x||^2 / 2 at each step (w before the step, x their ``global_params``), the term
  our client adds to its loss and reports.

Outputs, with ``<name>`` our state_dict names, each model entry as a :func:`fingerprint`:
``initial.<name>``; ``round<r>.client<p>.trained.<name>``, ``.loss`` and ``.ce`` (per step),
FedProx's ``.proximal``; ``round<r>.aggregate.<name>`` (their global model after the round);
SCAFFOLD's ``round<r>.client<p>.control.<name>`` (c_i+ after ``update_yc``) and
``.control_delta.<name>`` (the Delta c of ``delta_yc``, which their server adds up), and
``round<r>.server_control.<name>`` (their ``global_c`` after the round).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from conformance.common import Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded

SNAPSHOTS = {"pfllib": Snapshot("TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350")}

NUM_CLASSES, IMAGE_SIZE = 4, 16
SIZES = (9, 11, 10, 7)  # training samples of clients 0..3
NUM_CLIENTS = len(SIZES)
ROUNDS = {1: (0, 1, 2), 2: (1, 2, 3)}  # the clients each round trains
JOIN_RATIO = 0.75  # their m = int(N * join_ratio) = 3 = the clients each round trains
BATCH_SIZE, LR, EPOCHS, INIT_SEED = 4, 0.05, 1, 0
METHODS = {  # method -> their server (module, class), {their arg: (our option, value)}, our other options
    "fedprox": ("serverprox", "FedProx", {"mu": ("mu", 0.5)}, {}),
    "moon": ("servermoon", "MOON", {"mu": ("mu", 1.0), "tau": ("temperature", 0.5)}, {}),
    "scaffold": ("serverscaffold", "SCAFFOLD", {"server_learning_rate": ("server-lr", 0.5)}, {}),
    "fedntd": ("serverntd", "FedNTD", {"beta": ("beta", 1.0), "tau": ("temperature", 2.0)},
               {"weighted": False}),  # their serverntd: the uniform average
}


def names(model: torch.nn.Module) -> list[str]:
    """Our state_dict names of the parameters, in order (theirs: ``base.`` for ``body.``)."""
    return [name for name, _ in model.named_parameters()]


def order_seed(server_round: int, client: int) -> int:
    """The seed of a client's batch order in a round (our config's ``seed``)."""
    return 100 * server_round + client


def batch_order(n: int, seed: int) -> np.ndarray:
    """The order our training loop takes n samples in, for one epoch (protofl/task/train.py)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


def client_inputs() -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for p, n in enumerate(SIZES):
        inputs[f"client{p}.pixels"] = pixels(60 + p, n, (1, IMAGE_SIZE, IMAGE_SIZE))
        inputs[f"client{p}.labels"] = seeded(70 + p).integers(0, NUM_CLASSES, n)
    for r, clients in ROUNDS.items():
        for p in clients:
            seed = order_seed(r, p)
            inputs[f"round{r}.client{p}.seed"] = np.int64(seed)
            inputs[f"round{r}.client{p}.order"] = batch_order(SIZES[p], seed)
    return inputs | {"init_seed": np.int64(INIT_SEED), "lr": np.float64(LR), "epochs": np.int64(EPOCHS),
                     "batch_size": np.int64(BATCH_SIZE), "num_clients": np.int64(NUM_CLIENTS)}


def _fingerprints(tensors, our_names: list[str], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": fingerprint(t.detach().numpy()) for name, t in zip(our_names, tensors)}


class _Recorded:
    """Their ``self.loss``, recording each batch's cross-entropy and the tensor it returns, to
    which MOON's and FedNTD's ``loss += ...`` add their terms in place (read after training: the
    batch's total loss); with ``proximal``, also FedProx's ||w - x||^2 / 2 at the step."""

    def __init__(self, client, proximal: bool = False) -> None:
        self.client, self.inner, self.proximal = client, client.loss, proximal
        self.ce: list[float] = []
        self.totals: list[torch.Tensor] = []
        self.proximal_terms: list[float] = []

    def __call__(self, output, y):
        loss = self.inner(output, y)
        self.ce.append(loss.item())
        self.totals.append(loss)
        if self.proximal:
            with torch.no_grad():
                term = sum(((p - g) ** 2).sum() for p, g in zip(self.client.model.parameters(),
                                                                 self.client.global_params)) / 2
            self.proximal_terms.append(term.item())
        return loss


def _import(checkout: Path):
    sys.modules.setdefault("h5py", types.ModuleType("h5py"))  # serverbase imports it (results files only)
    sys.path.insert(0, str(checkout / "system"))
    import flcore.clients.clientbase as clientbase
    import flcore.servers.serverbase as serverbase
    from flcore.trainmodel.models import BaseHeadSplit

    return clientbase, serverbase, BaseHeadSplit


def their_server(checkout: Path, module: str, class_name: str, inputs: dict[str, np.ndarray], theirs: dict):
    """Their server (and clients), built by its constructor on the clients' seeded images
    (``inputs``: ``client<p>.pixels``/``.labels``, ``num_clients``, ``batch_size``) and our model, with
    ``theirs`` their method's arguments; returns (server, images, labels, our names). The fixture
    writers of FedProx, MOON, SCAFFOLD, FedNTD, pFedMe, Per-FedAvg, FedAMP, FedALA and FedPAC call it."""
    from protofl.task.models import build_model

    clientbase, serverbase, BaseHeadSplit = _import(checkout)
    num_clients = int(inputs["num_clients"])
    x = {p: pixels_to_input(inputs[f"client{p}.pixels"]) for p in range(num_clients)}
    y = {p: torch.from_numpy(inputs[f"client{p}.labels"]) for p in range(num_clients)}

    def read_client_data(dataset, idx, is_train=True, few_shot=0):  # theirs reads ../dataset/<name>
        return list(zip(x[idx], y[idx]))

    server_module = importlib.import_module(f"flcore.servers.{module}")
    serverbase.read_client_data = clientbase.read_client_data = read_client_data
    for name, client_module in list(sys.modules.items()):  # a client that reads its data itself (clientALA)
        if name.startswith("flcore.clients.") and hasattr(client_module, "read_client_data"):
            client_module.read_client_data = read_client_data
    ours = build_model("cnn", 1, NUM_CLASSES, IMAGE_SIZE, INIT_SEED)
    args = SimpleNamespace(
        model=BaseHeadSplit(ours.body, ours.head), algorithm=class_name, dataset="seeded", device="cpu",
        save_folder_name="items", num_classes=NUM_CLASSES, batch_size=int(inputs["batch_size"]),
        local_learning_rate=LR, local_epochs=EPOCHS, few_shot=0, learning_rate_decay=False,
        learning_rate_decay_gamma=0.99, global_rounds=len(ROUNDS), join_ratio=JOIN_RATIO, random_join_ratio=False,
        num_clients=num_clients, time_select=False, goal="conformance", time_threthold=10000, top_cnt=100,
        auto_break=False, eval_gap=1, client_drop_rate=0.0, train_slow_rate=0.0, send_slow_rate=0.0, dlg_eval=False,
        dlg_gap=100, batch_num_per_client=2, num_new_clients=0, fine_tuning_epoch_new=0, **theirs,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        server = getattr(server_module, class_name)(args, 0)
    assert server.num_join_clients == len(ROUNDS[1])
    assert not any(c.train_slow or c.send_slow for c in server.clients)
    return server, x, y, names(ours)


def _run(method: str, checkout: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    module_name, class_name, their_options, _ = METHODS[method]
    theirs = {"mu": 0.0, "tau": 1.0, "beta": 0.0, "server_learning_rate": 1.0}  # what the others read unset
    theirs |= {name: value for name, (_, value) in their_options.items()}
    server, x, y, our_names = their_server(checkout, module_name, class_name, inputs, theirs)
    outputs = _fingerprints(server.global_model.parameters(), our_names, "initial")
    for r, clients in ROUNDS.items():
        server.selected_clients = [server.clients[p] for p in clients]  # select_clients, without its draw
        server.current_num_join_clients = len(clients)
        server.send_models()
        recorders = {}
        for p in clients:
            order = torch.from_numpy(inputs[f"round{r}.client{p}.order"])
            batches = torch.utils.data.TensorDataset(x[p][order], y[p][order])
            client = server.clients[p]
            client.load_train_data = lambda batch_size=None, batches=batches: torch.utils.data.DataLoader(
                batches, BATCH_SIZE, shuffle=False, drop_last=True)
            recorders[p] = client.loss = _Recorded(client, proximal=method == "fedprox")
        for client in server.selected_clients:
            client.train()
        for p in clients:
            client, recorded, prefix = server.clients[p], recorders[p], f"round{r}.client{p}"
            outputs |= _fingerprints(client.model.parameters(), our_names, f"{prefix}.trained")
            outputs[f"{prefix}.loss"] = np.array([t.item() for t in recorded.totals])
            outputs[f"{prefix}.ce"] = np.array(recorded.ce)
            assert len(recorded.ce) == SIZES[p] // BATCH_SIZE
            if method == "fedprox":
                outputs[f"{prefix}.proximal"] = np.array(recorded.proximal_terms)
            if method in ("moon", "fedntd") and r == 2 and len(recorded.ce) > 1:  # (FedNTD's is 0 at w = x)
                assert (outputs[f"{prefix}.loss"] != outputs[f"{prefix}.ce"]).any()  # their term was recorded
            if method == "scaffold":
                outputs |= _fingerprints(client.client_c, our_names, f"{prefix}.control")
                outputs |= _fingerprints(client.delta_yc()[1], our_names, f"{prefix}.control_delta")
        random.seed(0)  # receive_models' random.sample: only the order of the sum
        server.receive_models()
        server.aggregate_parameters()
        outputs |= _fingerprints(server.global_model.parameters(), our_names, f"round{r}.aggregate")
        if method == "scaffold":
            outputs |= _fingerprints(server.global_c, our_names, f"round{r}.server_control")
    return outputs


CALLS = {
    "fedprox": "servers/serverprox.py: FedProx (clients/clientprox.py: clientProx.train, PerturbedGradientDescent)",
    "moon": "servers/servermoon.py: MOON (clients/clientmoon.py: clientMOON.train)",
    "scaffold": "servers/serverscaffold.py: SCAFFOLD (clients/clientscaffold.py: clientSCAFFOLD.train, "
                "update_yc, delta_yc; SCAFFOLDOptimizer)",
    "fedntd": "servers/serverntd.py: FedNTD (clients/clientntd.py: clientNTD.train)",
}


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    paths = []
    for method, (_, _, their_options, _) in METHODS.items():
        inputs = client_inputs() | {f"their.{k}": np.float64(v) for k, (_, v) in their_options.items()}
        outputs = _run(method, checkouts["pfllib"], inputs)
        call = (f"system/flcore/{CALLS[method]}: the constructor, then two rounds of send_models, train, "
                "receive_models (random.seed(0)), aggregate_parameters, the selection set (rounds 1: clients 0-2, "
                "2: clients 1-3); read_client_data returns seeded 1x16x16 images, load_train_data a "
                "DataLoader(shuffle=False, drop_last=True) in our client's order, h5py a stand-in; the model "
                "BaseHeadSplit(body, head) of protofl's build_model('cnn', 1, 4, 16, seed=0); self.loss wrapped to "
                "record each batch's loss; in float64")
        paths.append(save_fixture(f"{method}-pfllib-rounds", SNAPSHOTS["pfllib"], call, rerun, inputs, outputs))
    return paths
