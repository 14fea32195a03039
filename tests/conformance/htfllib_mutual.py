"""FML's and FedKD's fixtures, from HtFLlib's code (TsingZ0/HtFLlib, ``system/flcore``:
``clients/clientfml.py``, ``clients/clientkd.py``, ``servers/serverfml.py``, ``servers/serverkd.py``):
the two methods with a second, shared model that FedSA's paper compares with, as HtFLlib runs them.

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32, and their SVD runs on the float64 arrays): every float
output is float64. Nothing here crosses a float32 wire: our parameters stay float64 on ours.

One round of ``NUM_CLIENTS`` = 3 clients, each with its own seeded 1 x 16 x 16 images of
``NUM_CLASSES`` = 4 classes (``SIZES`` = 14, 11, 9 samples: batches of ``BATCH_SIZE`` = 4, their
``drop_last``: 3, 2 and 2 steps), one local epoch, lr 0.05 (FedKD's mentee at the same lr: their
``mentee_learning_rate``, 0.01 = ``-lr`` by default, is set to it), plain SGD, every module's gradient
clipped to norm 10 on its own (their ``clip_grad_norm_(..., 10)`` per model):

- the shared model (FML's "global" meme, FedKD's mentee) is ours:
  ``protofl.task.models.build_model("cnn", 1, 4, 16, seed=0)`` (PFLlib's FedAvgCNN layers, 512-d
  features), FedKD's with its head weight replaced by a near rank-1 matrix (``input.sent.head.weight``,
  seeded): from round 2 on, the mentee a client receives is the server's SVD-compressed aggregate,
  each matrix low-rank; a freshly initialised 4 x 512 head has a flat spectrum, whose
  compression HtFLlib turns into zeros (``htfllib-fedkd-compression``'s ``flat``, below) where ours
  keeps it, so the round compares where both compress;
- each client's own model (FML's private model, FedKD's mentor) is :func:`own_model`: a different
  architecture, Flatten -> Linear(256, d) -> ReLU -> Linear(d, 4), d = ``OWN_FEATURES`` (FedKD: 512,
  the mentee's: their W_h is Linear(feature_dim, feature_dim)), seeded ``OWN_SEED + p``;
- both go to their code as their ``BaseHeadSplit`` (made with ``__new__``: its constructor builds
  from ``args.models`` strings), ``.base`` our body and ``.head`` our head, their ``forward``
  (``head(base(x))``), the parameters in our order (``base.`` for our ``body.``);
- FedKD's W_h: Linear(512, 512, bias=False) drawn after ``torch.manual_seed(0)`` (our client's draw,
  ``SeededDraws(seed)``; their constructor draws it after the model).

Their clients and servers are made with ``__new__`` and the attributes ``train`` /
``aggregate_parameters`` read (their constructors read ``../dataset`` and write ``.pt`` files);
``load_item`` / ``save_item`` (``torch.save`` / ``torch.load`` of whole objects) are replaced in
their modules by an in-memory store that keeps and hands out deep copies (what a save and a load
give); ``load_train_data`` returns a ``DataLoader(shuffle=False, drop_last=True)`` over the client's
images in the order our training loop takes them: ``torch.randperm(n,
generator=torch.Generator().manual_seed(seed))`` with the client's seed (``input.client<p>.seed``,
given to our client as its config's ``seed``; the order is stored too). ``train_slow`` is False.
Their ``self.loss``, ``self.KL`` and ``self.MSE`` are wrapped to record each call's value, from
which each step's losses are summed as their ``train`` does (``loss`` and ``loss_g``), and a spy on
``torch.nn.utils.clip_grad_norm_`` records the norms each step clips.

Fixtures:

- ``htfllib-fml-round-{plain,clipped}``: ``clientFML.train`` on each client (alpha = beta = 0.5,
  FedSA's scripts; their ``main.py``'s default is 1), then ``FML.aggregate_parameters`` (the
  unweighted mean of the clients' trained global models). ``plain``: the images in [-1, 1]; no norm
  reached 10 (checked), so clipping never acted. ``clipped``: the images scaled by
  ``CLIPPED_SCALE``: on every client both models' gradients exceed 10 at some step (checked), so
  each is clipped on its own (FedKD's W_h's stays under 10 there: its clipping never acts).
- ``htfllib-fedkd-round-{plain,clipped}``: ``clientKD.train`` (energy T_start = 0.95, round 1) on each
  client, its ``compressed_param`` (``decomposition``) recovered (``recover``), then
  ``FedKD.aggregate_parameters`` (recover, unweighted mean, decomposition at 0.95) and client 0's
  ``set_parameters`` (the mentee every client receives). Every matrix's truncation was found
  (checked) with a margin of at least ``ENERGY_MARGIN`` to the energy (a rank the rounding cannot
  flip). 4 classes: their ``recover`` takes any array of length 3 (a 3-class head's bias) for a
  factor triple and fails on it.
- ``htfllib-fedkd-compression``: ``recover(decomposition(...))`` of a 10 x 12 matrix, 8 x 4 x 3 x 3
  and 6 x 4 x 5 x 5 convolution weights, a bias, a 1 x 6 matrix (not compressed: one row) and a
  ``flat`` 4 x 16 matrix (equal singular values: no truncation reaches the energy, HtFLlib returns
  zeros), at energies 0.95 and 0.98; the spectra decay geometrically (``_spectral``) so that the
  ranks differ between the two energies; and ``FedKD.aggregate_parameters`` at 0.95 over three
  clients' ``decomposition`` of such arrays (not ``flat``).
- ``htfllib-fedkd-energy``: the energy of each of their rounds, read from ``FedKD.train``'s loop
  (its other steps stand-ins that record ``self.energy`` and each client's ``energy`` when it trains),
  ``global_rounds`` = ``ENERGY_ROUNDS``, T 0.95 -> 0.98.

Outputs, each model entry as a :func:`fingerprint` under our names: ``initial.shared.<name>``,
``client<p>.initial.own.<name>``; ``client<p>.trained.own.<name>``, ``.trained.shared.<name>``, FedKD's
``.trained.hidden_map.weight`` (and ``initial.hidden_map.weight``) and ``.upload.<name>`` (the
recovered compressed mentee); per step ``client<p>.loss`` and ``.loss_shared`` (their ``loss`` and
``loss_g``), ``.clip_norms`` (steps x modules: own, shared, W_h); ``aggregate.<name>`` (FML: their
server's global model; FedKD: the mentee client 0 loads).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from conformance.common import Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded
from protofl.task.models import SeededDraws, SplitModel, build_model

SNAPSHOTS = {"htfllib": Snapshot("TsingZ0/HtFLlib", "e959261d906f40377410bc4d9d13ba3f6af56782")}

NUM_CLASSES, IMAGE_SIZE, IN_CHANNELS = 4, 16, 1  # (not 3 classes: see the docstring)
SIZES = (14, 11, 9)  # training samples of clients 0..2: 3, 2, 2 steps
NUM_CLIENTS = len(SIZES)
BATCH_SIZE, LR, EPOCHS, INIT_SEED, OWN_SEED = 4, 0.05, 1, 0, 10
ALPHA = BETA = 0.5
T_START, T_END = 0.95, 0.98
CLIP = 10.0  # their clip_grad_norm_'s max_norm, each module
CLIPPED_SCALE = 25.0  # the clipped case's images: [-25, 25]
CASES = {"plain": 1.0, "clipped": CLIPPED_SCALE}
OWN_FEATURES = {"fml": 32, "fedkd": 512}
ENERGIES = (0.95, 0.98)
ENERGY_ROUNDS = 5  # their global_rounds in the energy fixture
ENERGY_MARGIN = 1e-4  # of every rank's energy fraction to the energy, in the fixtures' compressions
COMPRESSION_SHAPES = {"matrix": (10, 12), "conv3": (8, 4, 3, 3), "conv5": (6, 4, 5, 5), "bias": (10,),
                      "row": (1, 6), "flat": (4, 16)}
SPECTRAL_DECAY = {"matrix": 0.7, "conv3": 0.3, "conv5": 0.55}  # singular value k: decay^k (x noise)


def own_model(feature_dim: int, seed: int) -> SplitModel:
    """A client's own model: Flatten -> Linear(256, d) -> ReLU | Linear(d, 4), seeded."""
    with SeededDraws(seed):
        body = nn.Sequential(nn.Flatten(), nn.Linear(IN_CHANNELS * IMAGE_SIZE**2, feature_dim), nn.ReLU())
        return SplitModel(body, nn.Linear(feature_dim, NUM_CLASSES), feature_dim)


def shared_model() -> SplitModel:
    """The shared model's architecture and initial values (our server's and clients' ``cnn``, seed 0)."""
    return build_model("cnn", IN_CHANNELS, NUM_CLASSES, IMAGE_SIZE, INIT_SEED)


def hidden_map(seed: int = INIT_SEED) -> nn.Linear:
    """FedKD's initial W_h (our client's draw)."""
    with SeededDraws(seed):
        return nn.Linear(OWN_FEATURES["fedkd"], shared_model().feature_dim, bias=False)


def names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def order_seed(client: int) -> int:
    return 100 + client


def batch_order(n: int, seed: int) -> np.ndarray:
    """The order our training loop takes n samples in, for one epoch (protofl/task/train.py)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()


def client_x(inputs: dict[str, np.ndarray], p: int) -> torch.Tensor:
    """Client p's images as both sides train on them (scaled in the clipped case)."""
    return pixels_to_input(inputs[f"client{p}.pixels"]) * float(inputs["input_scale"])


def sent_head(feature_dim: int = 512) -> np.ndarray:
    """FedKD's sent head weight: a rank-1 matrix of nn.Linear's scale plus 2% noise (seeded)."""
    rng = seeded(7)
    bound = 1.0 / math.sqrt(feature_dim)
    u = rng.uniform(0.5, 1.0, NUM_CLASSES) * rng.choice([-1, 1], NUM_CLASSES)
    v = rng.uniform(-bound, bound, feature_dim)
    return np.outer(u, v) + 0.02 * rng.uniform(-bound, bound, (NUM_CLASSES, feature_dim))


def round_inputs(method: str, case: str) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for p, n in enumerate(SIZES):
        inputs[f"client{p}.pixels"] = pixels(80 + p, n, (IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE))
        inputs[f"client{p}.labels"] = seeded(90 + p).integers(0, NUM_CLASSES, n)
        inputs[f"client{p}.seed"] = np.int64(order_seed(p))
        inputs[f"client{p}.order"] = batch_order(n, order_seed(p))
    inputs |= {"init_seed": np.int64(INIT_SEED), "own_seed": np.int64(OWN_SEED), "lr": np.float64(LR),
               "epochs": np.int64(EPOCHS), "batch_size": np.int64(BATCH_SIZE), "input_scale": np.float64(CASES[case]),
               "own_features": np.int64(OWN_FEATURES[method])}
    if method == "fml":
        inputs |= {"alpha": np.float64(ALPHA), "beta": np.float64(BETA)}
    else:
        inputs |= {"energy_start": np.float64(T_START), "energy_end": np.float64(T_END),
                   "sent.head.weight": sent_head()}
    return inputs


def sent_model(method: str, inputs: dict[str, np.ndarray]) -> SplitModel:
    model = shared_model()
    if method == "fedkd":
        with torch.no_grad():
            model.head.weight.copy_(torch.from_numpy(inputs["sent.head.weight"]))
    return model


def energy_fractions(array: np.ndarray) -> np.ndarray:
    """The energy fraction of the first 1, 2, ..., K singular values (a convolution's kernels summed)."""
    s = np.linalg.svd(array, compute_uv=False)
    power = (s**2).reshape(-1, s.shape[-1]).sum(axis=0)
    return np.cumsum(power) / power.sum()


def check_truncation(array: np.ndarray, energy: float, what: str) -> int:
    """The rank HtFLlib's decomposition keeps (0: none below full reaches ``energy``); raises when a
    fraction lies within ``ENERGY_MARGIN`` of the energy (the rounding could flip the rank)."""
    fractions = energy_fractions(array)
    margin = np.min(np.abs(fractions[:-1] - energy))
    if margin < ENERGY_MARGIN:
        raise RuntimeError(f"{what}: an energy fraction within {margin:.2g} of {energy}")
    above = np.flatnonzero(fractions[:-1] > energy)
    return int(above[0]) + 1 if len(above) else 0


def _spectral(rng: np.random.Generator, shape: tuple[int, ...], decay: float) -> np.ndarray:
    """A matrix (each kernel of a convolution) U diag(s) V^T with s_k = decay^k (1 + 10% noise)."""
    *batch, m, n = shape
    k = min(m, n)
    out = np.empty(shape)
    for index in np.ndindex(*batch):
        u = np.linalg.qr(rng.standard_normal((m, k)))[0]
        v = np.linalg.qr(rng.standard_normal((n, k)))[0]
        s = decay ** np.arange(k) * (1 + 0.1 * rng.uniform(-1, 1, k))
        out[index] = (u * s) @ v.T
    return out


def compression_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = seeded(seed)
    arrays = {}
    for name, shape in COMPRESSION_SHAPES.items():
        if name in SPECTRAL_DECAY:
            arrays[name] = _spectral(rng, shape, SPECTRAL_DECAY[name])
        elif name == "flat":  # 4 orthonormal rows x 2: four equal singular values
            arrays[name] = 2.0 * np.linalg.qr(rng.standard_normal((shape[1], shape[0])))[0].T
        else:
            arrays[name] = rng.standard_normal(shape)
    return arrays


# --- calling their code --------------------------------------------------------------------


class _Store:
    """Their ``load_item`` / ``save_item`` in memory: deep copies in, deep copies out (torch.save,
    torch.load)."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], object] = {}

    def save_item(self, item, role, item_name, item_path=None):
        self.items[role, item_name] = copy.deepcopy(item)

    def load_item(self, role, item_name, item_path=None):
        return copy.deepcopy(self.items[role, item_name])


class _Recorder:
    """One of their loss modules (``self.loss``, ``self.KL``, ``self.MSE``), recording each value."""

    def __init__(self, inner: nn.Module) -> None:
        self.inner, self.values = inner, []

    def __call__(self, *args):
        value = self.inner(*args)
        self.values.append(value.item())
        return value


class _ClipSpy:
    """``torch.nn.utils.clip_grad_norm_``, recording the total norms it saw."""

    def __init__(self) -> None:
        self.inner, self.norms = torch.nn.utils.clip_grad_norm_, []

    def __call__(self, parameters, max_norm, *args, **kwargs):
        assert max_norm == CLIP
        norm = self.inner(parameters, max_norm, *args, **kwargs)
        self.norms.append(float(norm))
        return norm


def _import(checkout: Path):
    sys.modules.setdefault("h5py", types.ModuleType("h5py"))  # serverbase imports it (results files only)
    sys.path.insert(0, str(checkout / "system"))
    import flcore.clients.clientfml as clientfml
    import flcore.clients.clientkd as clientkd
    import flcore.servers.serverfml as serverfml
    import flcore.servers.serverkd as serverkd
    from flcore.trainmodel.models import BaseHeadSplit

    return clientfml, clientkd, serverfml, serverkd, BaseHeadSplit


def _theirs(BaseHeadSplit, model: SplitModel) -> nn.Module:
    """Their BaseHeadSplit over a copy of our model's body (``base``) and head."""
    split = BaseHeadSplit.__new__(BaseHeadSplit)
    nn.Module.__init__(split)
    split.base, split.head = copy.deepcopy(model.body), copy.deepcopy(model.head)
    return split


def _fingerprints(tensors, our_names: list[str], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}": fingerprint(np.asarray(t.detach().numpy() if torch.is_tensor(t) else t))
            for name, t in zip(our_names, tensors)}


def _round(method: str, case: str, checkout: Path) -> tuple[dict, dict]:
    clientfml, clientkd, serverfml, serverkd, BaseHeadSplit = _import(checkout)
    client_module, server_module = (clientfml, serverfml) if method == "fml" else (clientkd, serverkd)
    store = _Store()
    for module in (client_module, server_module):
        module.load_item, module.save_item = store.load_item, store.save_item
    inputs = round_inputs(method, case)
    sent = sent_model(method, inputs)
    shared_names = names(sent)
    outputs = _fingerprints(sent.parameters(), shared_names, "initial.shared")
    store.save_item(_theirs(BaseHeadSplit, sent), "Server", "global_model")
    if method == "fedkd":
        initial_map = hidden_map()
        outputs |= _fingerprints([initial_map.weight], ["weight"], "initial.hidden_map")
    clients = []
    for p, n in enumerate(SIZES):
        own = own_model(OWN_FEATURES[method], OWN_SEED + p)
        own_names = names(own)
        outputs |= _fingerprints(own.parameters(), own_names, f"client{p}.initial.own")
        cls = client_module.clientFML if method == "fml" else client_module.clientKD
        client = cls.__new__(cls)
        client.id, client.role, client.save_folder_name, client.device = p, f"Client_{p}", "memory", "cpu"
        client.learning_rate, client.local_epochs, client.train_slow = LR, EPOCHS, False
        client.train_time_cost = {"num_rounds": 0, "total_cost": 0.0}
        client.loss, client.KL = _Recorder(nn.CrossEntropyLoss()), _Recorder(nn.KLDivLoss())
        if method == "fml":
            client.alpha, client.beta = ALPHA, BETA
        else:
            client.mentee_learning_rate, client.energy = LR, T_START
            client.MSE = _Recorder(nn.MSELoss())
            store.save_item(initial_map, client.role, "W_h")
            store.save_item(store.load_item("Server", "global_model"), client.role, "global_model")  # their __init__'s
        store.save_item(_theirs(BaseHeadSplit, own), client.role, "model")
        order = torch.from_numpy(inputs[f"client{p}.order"])
        x, y = client_x(inputs, p)[order], torch.from_numpy(inputs[f"client{p}.labels"])[order]
        client.load_train_data = lambda batch_size=None, data=torch.utils.data.TensorDataset(x, y): (
            torch.utils.data.DataLoader(data, BATCH_SIZE, shuffle=False, drop_last=True))
        spy = _ClipSpy()
        torch.nn.utils.clip_grad_norm_ = spy
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # KLDivLoss's reduction='mean'
                client.train()
        finally:
            torch.nn.utils.clip_grad_norm_ = spy.inner
        steps = n // BATCH_SIZE
        modules = 2 if method == "fml" else 3
        norms = np.array(spy.norms).reshape(steps, modules)
        if case == "plain" and norms.max() >= CLIP:
            raise RuntimeError(f"{method} client {p}: clipping acted (norm {norms.max()}) in the plain case")
        if case == "clipped" and not (norms[:, :2] > CLIP).any(axis=0).all():
            raise RuntimeError(f"{method} client {p}: not both models clipped: {norms}")
        outputs[f"client{p}.clip_norms"] = norms
        prefix = f"client{p}"
        ce = np.array(client.loss.values).reshape(steps, 2)
        kl = np.array(client.KL.values).reshape(steps, 2)
        if method == "fml":  # their loss, loss_g
            outputs[f"{prefix}.loss"] = ALPHA * ce[:, 0] + (1 - ALPHA) * kl[:, 0]
            outputs[f"{prefix}.loss_shared"] = BETA * ce[:, 1] + (1 - BETA) * kl[:, 1]
        else:  # CE + L_d + L_h, CE_g + L_d_g + L_h_g
            mse = np.array(client.MSE.values).reshape(steps, 2)
            scale = ce[:, 0] + ce[:, 1]
            outputs[f"{prefix}.loss"] = ce[:, 0] + kl[:, 0] / scale + mse[:, 0] / scale
            outputs[f"{prefix}.loss_shared"] = ce[:, 1] + kl[:, 1] / scale + mse[:, 1] / scale
        trained_own = store.load_item(client.role, "model")
        trained_shared = store.load_item(client.role, "global_model")
        outputs |= _fingerprints(trained_own.parameters(), own_names, f"{prefix}.trained.own")
        outputs |= _fingerprints(trained_shared.parameters(), shared_names, f"{prefix}.trained.shared")
        if method == "fedkd":
            outputs |= _fingerprints(store.load_item(client.role, "W_h").parameters(), ["weight"],
                                     f"{prefix}.trained.hidden_map")
            for name, t in zip(shared_names, trained_shared.parameters()):
                if t.ndim > 1 and t.shape[0] > 1 and check_truncation(t.detach().numpy(), T_START, name) == 0:
                    raise RuntimeError(f"client {p} {name}: no truncation reaches {T_START} (HtFLlib: zeros)")
            upload = clientkd.recover(store.load_item(client.role, "compressed_param"))
            outputs |= _fingerprints([upload[f"base.{n[5:]}" if n.startswith("body.") else n] for n in shared_names],
                                     shared_names, f"{prefix}.upload")
        clients.append(client)
    cls = server_module.FML if method == "fml" else server_module.FedKD
    server = cls.__new__(cls)
    server.role, server.save_folder_name = "Server", "memory"
    server.uploaded_ids, server.clients = list(range(NUM_CLIENTS)), clients
    if method == "fml":
        server.aggregate_parameters()
        aggregate = list(store.load_item("Server", "global_model").parameters())
    else:
        server.energy = T_START
        uploads = [list(clientkd.recover(store.load_item(c.role, "compressed_param")).values()) for c in clients]
        for name, arrays in zip(shared_names, zip(*uploads)):
            mean = sum(a / NUM_CLIENTS for a in arrays)
            if mean.ndim > 1 and mean.shape[0] > 1 and check_truncation(mean, T_START, f"mean {name}") == 0:
                raise RuntimeError(f"aggregate {name}: no truncation reaches {T_START} (HtFLlib: zeros)")
        server.aggregate_parameters()
        clients[0].set_parameters()
        aggregate = list(store.load_item(clients[0].role, "global_model").parameters())
    outputs |= _fingerprints(aggregate, shared_names, "aggregate")
    return inputs, outputs


def _compression(checkout: Path) -> tuple[dict, dict]:
    _, clientkd, _, serverkd, _ = _import(checkout)
    store = _Store()
    serverkd.load_item, serverkd.save_item = store.load_item, store.save_item
    inputs = {f"single.{k}": v for k, v in compression_arrays(40).items()}
    outputs: dict[str, np.ndarray] = {}
    for energy in ENERGIES:
        arrays = {k.removeprefix("single."): v for k, v in inputs.items()}
        for name, array in arrays.items():
            if array.ndim > 1 and array.shape[0] > 1:
                rank = check_truncation(array, energy, f"{name} at {energy}")
                if (rank == 0) != (name == "flat"):
                    raise RuntimeError(f"{name} at {energy}: rank {rank}")
                outputs[f"{energy}.{name}.rank"] = np.int64(rank)
        recovered = clientkd.recover(clientkd.decomposition(copy.deepcopy(arrays).items(), energy))
        outputs |= {f"{energy}.{name}": np.asarray(a, dtype=np.float64) for name, a in recovered.items()}
    if outputs["0.95.matrix.rank"] == outputs["0.98.matrix.rank"]:
        raise RuntimeError("the matrix's ranks at 0.95 and 0.98 do not differ")
    assert not outputs["0.95.flat"].any() and not outputs["0.98.flat"].any()  # their zeros
    # the server step: three clients' compressed uploads, recovered, averaged, compressed
    kept = [k for k in COMPRESSION_SHAPES if k != "flat"]
    server = serverkd.FedKD.__new__(serverkd.FedKD)
    server.role, server.save_folder_name, server.energy = "Server", "memory", T_START
    server.uploaded_ids, server.clients = list(range(NUM_CLIENTS)), []
    model = nn.Module()
    for name in kept:
        model.register_parameter(name, nn.Parameter(torch.zeros(COMPRESSION_SHAPES[name])))
    store.save_item(model, "Server", "global_model")
    recovered_uploads = []
    for p in range(NUM_CLIENTS):
        arrays = {k: v for k, v in compression_arrays(50 + p).items() if k in kept}
        inputs |= {f"client{p}.{k}": v for k, v in arrays.items()}
        client = SimpleNamespace(role=f"Client_{p}", save_folder_name="memory")
        store.save_item(clientkd.decomposition(copy.deepcopy(arrays).items(), T_START), client.role, "compressed_param")
        recovered_uploads.append(clientkd.recover(store.load_item(client.role, "compressed_param")))
        server.clients.append(client)
    for name in kept:
        mean = sum(u[name] / NUM_CLIENTS for u in recovered_uploads)
        if mean.ndim > 1 and mean.shape[0] > 1 and check_truncation(mean, T_START, f"mean {name}") == 0:
            raise RuntimeError(f"server mean {name}: no truncation")
    server.aggregate_parameters()
    aggregate = clientkd.recover(store.load_item("Server", "compressed_param"))
    outputs |= {f"server.{name}": np.asarray(aggregate[name], dtype=np.float64) for name in kept}
    return inputs | {"server.energy": np.float64(T_START)}, outputs


def _energy(checkout: Path) -> tuple[dict, dict]:
    _, _, _, serverkd, _ = _import(checkout)
    server = serverkd.FedKD.__new__(serverkd.FedKD)
    server.global_rounds, server.eval_gap, server.auto_break = ENERGY_ROUNDS, 1, False
    server.T_start, server.T_end, server.energy = T_START, T_END, T_START
    server.Budget, server.rs_test_acc = [], [0.0]
    client_energies, server_energies = [], []

    class _Client:
        energy = T_START

        def train(self):
            client_energies.append(self.energy)

    server.clients = [_Client(), _Client()]
    server.select_clients = lambda: server.clients
    server.evaluate = server.receive_ids = server.send_parameters = server.save_results = lambda: None
    server.aggregate_parameters = lambda: server_energies.append(server.energy)
    with contextlib.redirect_stdout(io.StringIO()):
        server.train()
    client_energies = np.array(client_energies).reshape(ENERGY_ROUNDS + 1, len(server.clients))
    assert (client_energies == client_energies[:, :1]).all()
    inputs = {"global_rounds": np.int64(ENERGY_ROUNDS), "energy_start": np.float64(T_START),
              "energy_end": np.float64(T_END)}
    return inputs, {"client_energy": client_energies[:, 0], "server_energy": np.array(server_energies)}


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    checkout, snapshot = checkouts["htfllib"], SNAPSHOTS["htfllib"]
    adapted = ("made with __new__, load_item/save_item an in-memory store of deep copies, load_train_data a "
               "DataLoader(shuffle=False, drop_last=True) over seeded 1x16x16 images in our client's order, "
               "models BaseHeadSplit (__new__) over protofl's cnn (seed 0) and a seeded MLP, self.loss/KL/MSE "
               "wrapped to record, clip_grad_norm_ spied on; in float64")
    calls = {
        "fml": "system/flcore/clients/clientfml.py: clientFML.train (alpha = beta = 0.5) on 3 clients; "
               "servers/serverfml.py: FML.aggregate_parameters",
        "fedkd": "system/flcore/clients/clientkd.py: clientKD.train (energy 0.95, mentee lr = lr, W_h "
                 "Linear(512, 512) after torch.manual_seed(0)) and recover(compressed_param) on 3 clients; "
                 "servers/serverkd.py: FedKD.aggregate_parameters (energy 0.95), then clientKD.set_parameters",
    }
    paths = []
    for method in ("fml", "fedkd"):
        for case in CASES:
            inputs, outputs = _round(method, case, checkout)
            call = f"{calls[method]}; {case} case (images x {CASES[case]}); {adapted}"
            paths.append(save_fixture(f"htfllib-{method}-round-{case}", snapshot, call, rerun, inputs, outputs))
    inputs, outputs = _compression(checkout)
    paths.append(save_fixture(
        "htfllib-fedkd-compression", snapshot,
        "system/flcore/clients/clientkd.py: recover(decomposition(named arrays, energy)) at 0.95 and 0.98; "
        "servers/serverkd.py: FedKD.aggregate_parameters (made with __new__, energy 0.95, load_item/save_item an "
        "in-memory store) over three clients' decomposition(..., 0.95), its compressed_param recovered; in float64",
        rerun, inputs, outputs))
    inputs, outputs = _energy(checkout)
    paths.append(save_fixture(
        "htfllib-fedkd-energy", snapshot,
        "system/flcore/servers/serverkd.py: FedKD.train (made with __new__, global_rounds 5, T 0.95 -> 0.98; "
        "select_clients, evaluate, receive_ids, send_parameters, save_results stand-ins; aggregate_parameters "
        "records self.energy, each client's train its energy)", rerun, inputs, outputs))
    return paths
