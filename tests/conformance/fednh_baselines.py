"""FedPer's, FedRep's, FedBABU's, FedRoD's and Ditto's fixtures, from the code of FedNH's authors
(Yutong-Dai/FedNH, ``src/flbase/strategies/{FedPer,FedRep,FedBABU,FedROD,Ditto}.py``), the baselines
FedNH's paper compares with, as that code runs them.

Their code computes in float64 (``make_fixtures.py`` sets torch's default dtype; nothing on the
paths called here casts back to float32): every float output is float64. Nothing crosses a float32
wire: our parameters stay float64 on ours.

One round (round ``ROUND`` = 2, so that the lr decay acts) of two real clients of theirs, each
constructed after ``torch.manual_seed(2022)`` as their ``setup_clients`` does (so all start from
the same Conv2Cifar, 5 classes, 192-d features, head ``prototype`` = Linear(192, 5, bias=False)),
each on its own seeded 3 x 32 x 32 images (client A: 3 of class 0, 1 of class 1; client B: 1 of
class 1, 2 of class 3; classes 2 and 4 held by nobody), then one aggregation by their
``FedAvgServer.aggregate`` (the object made with ``__new__``, its constructor needs a federation:
``learning_rate`` 1, ``lr_decay_per_round`` 1: the unweighted mean, our ``weighted = false``;
``exclude_layer_keys`` = {prototype.weight} for FedPer, FedRep, FedBABU as their servers set it,
none for FedRoD and Ditto). Each client first ``set_params`` the server's model, and trains as
their server's ``run`` drives it:

- ``fednh-fedper-round``: ``FedPerClient.training`` (all layers);
- ``fednh-fedrep-round``: ``to_freeze_layers(body)``, ``training(r, FedRep_head_epochs = 3)``,
  ``to_freeze_layers({prototype.weight})``, ``training(r, num_epochs)``, ``to_freeze_layers(set())``;
- ``fednh-fedbabu-round``: the head frozen (``to_freeze_layers({prototype.weight})``, as their
  server's constructor does), ``training``; after the aggregation, client A's final fine-tune
  ``to_freeze_layers(set())``, ``training(final_round, FedBABU_finetune_epoch = 2)`` with
  ``final_round`` = num_rounds + 1 = 3 (their code's, for a run of ``ROUND`` rounds). Adapted: the
  client first loads the aggregated body (``set_params(aggregate, exclude)``); their run fine-tunes
  the body the client last trained itself;
- ``fednh-fedrod-hyper-round`` / ``fednh-fedrod-linear-round``: ``FedRODClient.training`` with
  ``FedROD_phead_separate = True`` (FedNH's FedROD_dir.sh) and ``FedROD_hyper_clf`` True (their
  CIFAR yaml) / False. Their hypernetwork (``base.hypercls``) is drawn from torch's generator after
  the model, ours from a generator of its own: its initial values are replaced by a seeded draw of
  nn.Linear's init distribution (``hypernetwork_init``), which the test sends ours as the round's
  parameters;
- ``fednh-ditto-round``: ``DittoClient.training`` then ``personalized_training`` (lambda 0.75,
  their code's; the reference their ``DittoOptimizer`` steps towards is the client's model after
  ``training``: our ``reference = "trained"``).

Settings: lr 0.01 x 0.99^(round - 1) (their ``diminishing`` scheduler), 1 local epoch
(``num_epochs``; FedRep's head and FedBABU's fine-tune take several), each client's data one full
batch (``batch_size`` 64 >= its samples: their shuffled loader and ours take the same batch,
their ``setup_seed`` cannot matter; no dropout in Conv2Cifar), momentum 0 and weight decay 0
(their Ditto and FedRoD personal optimizers are plain SGD, ours run the run's settings). Their
code clips every step of ``setup_optimizer``'s optimizer at total norm 10 (and Ditto's personal
step, before adding lambda (v - w)); ours runs with a large max-grad-norm: a spy on
``clip_grad_norm_`` checks that no norm of theirs reached 10 (``largest_gradient_norm``), so
clipping never acted on either side.

Outputs, with ``<name>`` our state_dict names (``OUR_NAMES`` + ``head.weight`` for their
``prototype.weight``; FedRoD: ``base.`` stripped, ``hypernetwork.hidden/out`` for ``hypercls.linear1/2``),
each as a :func:`fingerprint`: ``initial.<name>``; ``client_<k>.trained.<name>`` (their upload) and
``client_<k>.loss`` (their ``train_loss_dict[round]``, per epoch, of the last ``training`` call;
FedRoD: the personal head's loss; Ditto: the global model's); ``aggregate.<name>`` (their server's
model after ``aggregate``); FedBABU's ``client_a.finetuned.<name>``; FedRoD's
``client_<k>.personal_head`` (linear: ``p_head.weight``, C x d; hyper: ``hypercls(p_i)``, d x C,
of the trained hypernetwork); Ditto's ``client_<k>.personal.<name>``.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conformance.common import fingerprint, pixels, pixels_to_input, save_fixture, seeded
from conformance.fednh import INIT_SEED, OUR_NAMES, SNAPSHOTS, _Images

NUM_CLASSES, FEATURE_DIM = 5, 192
ROUND, EPOCHS, BATCH_SIZE = 2, 1, 64
# client A: 3 images of class 0 and 1 of class 1; client B: 1 of class 1 and 2 of class 3
CLIENT_LABELS = {"a": [0, 0, 0, 1], "b": [1, 3, 3]}
LR, LR_DECAY = 0.01, 0.99
HEAD_EPOCHS = 3  # FedRep_head_epochs (10 in their yaml; 3 keeps the test short)
FINETUNE_EPOCHS = 2  # FedBABU_finetune_epoch (5 in their yaml)
LAMBDA = 0.75  # Ditto_lambda (their yaml)
THEIR_CLIP = 10.0  # the max_norm their training loops clip at
HYPER_SEED = 31  # hypernetwork_init's
# their Conv2Cifar's entries -> ours (protofl.task.models.fednh_cnn)
CONV2CIFAR_NAMES = OUR_NAMES | {"prototype.weight": "head.weight"}
HYPER_NAMES = {"hypercls.linear1.weight": "hypernetwork.hidden.weight",
               "hypercls.linear1.bias": "hypernetwork.hidden.bias",
               "hypercls.linear2.weight": "hypernetwork.out.weight",
               "hypercls.linear2.bias": "hypernetwork.out.bias"}
# fixture -> (their strategy module, their client class, their config's method keys, excluded keys)
METHODS = {
    "fedper": ("FedPer", "FedPerClient", {}, {"prototype.weight"}),
    "fedrep": ("FedRep", "FedRepClient", {"FedRep_head_epochs": HEAD_EPOCHS}, {"prototype.weight"}),
    "fedbabu": ("FedBABU", "FedBABUClient", {"FedBABU_finetune_epoch": FINETUNE_EPOCHS}, {"prototype.weight"}),
    "fedrod-hyper": ("FedROD", "FedRODClient", {"FedROD_hyper_clf": True, "FedROD_phead_separate": True}, set()),
    "fedrod-linear": ("FedROD", "FedRODClient", {"FedROD_hyper_clf": False, "FedROD_phead_separate": True}, set()),
    "ditto": ("Ditto", "DittoClient", {"Ditto_lambda": LAMBDA}, set()),
}


def hypernetwork_init(feature_dim: int = FEATURE_DIM, num_classes: int = NUM_CLASSES) -> dict[str, np.ndarray]:
    """FedRoD's initial hypernetwork (Linear(C, d), Linear(d, d C)), by our names: nn.Linear's
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, drawn from ``seeded(HYPER_SEED)``."""
    rng = seeded(HYPER_SEED)
    values = {}
    for layer, (fan_in, fan_out) in (("hidden", (num_classes, feature_dim)),
                                     ("out", (feature_dim, feature_dim * num_classes))):
        bound = 1.0 / math.sqrt(fan_in)
        values[f"hypernetwork.{layer}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in))
        values[f"hypernetwork.{layer}.bias"] = rng.uniform(-bound, bound, fan_out)
    return values


def their_names(method: str) -> dict[str, str]:
    """Their state_dict names -> ours."""
    if method.startswith("fedrod"):  # ModelWrapper(base = Conv2Cifar without prototype, head = g)
        names = {f"base.{k}": v for k, v in OUR_NAMES.items()} | {"head.weight": "head.weight"}
        return names | ({f"base.{k}": v for k, v in HYPER_NAMES.items()} if method == "fedrod-hyper" else {})
    return CONV2CIFAR_NAMES


def client_inputs() -> dict[str, np.ndarray]:
    inputs = {}
    for seed, (k, labels) in enumerate(CLIENT_LABELS.items(), start=1):
        inputs[f"client_{k}.pixels"] = pixels(seed, len(labels), (3, 32, 32))
        inputs[f"client_{k}.labels"] = np.array(labels)
    return inputs | {"init_seed": np.int64(INIT_SEED), "round": np.int64(ROUND), "epochs": np.int64(EPOCHS),
                     "batch_size": np.int64(BATCH_SIZE), "lr": np.float64(LR), "lr_decay": np.float64(LR_DECAY),
                     "momentum": np.float64(0.0), "weight_decay": np.float64(0.0)}


def _config(extra: dict) -> dict:
    return {
        "model": "Conv2Cifar", "num_classes": NUM_CLASSES, "input_size": (3, 32, 32), "dim": FEATURE_DIM,
        "num_epochs": EPOCHS, "batch_size": BATCH_SIZE, "optimizer": "SGD", "client_lr": LR,
        "client_lr_scheduler": "diminishing", "lr_decay_per_round": LR_DECAY, "sgd_momentum": 0.0,
        "sgd_weight_decay": 0.0, "num_rounds": ROUND, "global_seed": 0,
    } | extra


def _server(module, state: dict, exclude: set):
    """Their FedAvgServer (the base of every server here) with what ``aggregate`` reads."""
    server = module.FedAvgServer.__new__(module.FedAvgServer)
    server.server_config = {"learning_rate": 1.0, "lr_decay_per_round": 1.0}
    server.exclude_layer_keys = set(exclude)
    server.server_model_state_dict = state
    return server


class _ClipSpy:
    """``torch.nn.utils.clip_grad_norm_``, recording the total norms it saw."""

    def __init__(self) -> None:
        self.inner, self.norms = torch.nn.utils.clip_grad_norm_, []

    def __call__(self, parameters, max_norm, *args, **kwargs):
        assert max_norm == THEIR_CLIP
        norm = self.inner(parameters, max_norm, *args, **kwargs)
        self.norms.append(float(norm))
        return norm


def _fingerprints(state: dict, names: dict[str, str], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{ours}": fingerprint(state[theirs].detach().numpy()) for theirs, ours in names.items()}


def _round(checkout: Path, method: str) -> tuple[dict, dict]:
    module_name, client_name, extra, exclude = METHODS[method]
    sys.path.insert(0, str(checkout))
    module = importlib.import_module(f"src.flbase.strategies.{module_name}")
    from src.flbase.strategies import FedAvg

    names = their_names(method)
    config = _config(extra)
    inputs = client_inputs()
    data = {k: _Images(pixels_to_input(inputs[f"client_{k}.pixels"]), inputs[f"client_{k}.labels"])
            for k in CLIENT_LABELS}
    clients = {}
    for cid, k in enumerate(CLIENT_LABELS):
        torch.manual_seed(INIT_SEED)  # their setup_clients: every client the same model
        clients[k] = getattr(module, client_name)(nn.CrossEntropyLoss(), data[k], None, config, cid, "cpu")
        if method == "fedrod-hyper":
            hyper = clients[k].model.base.hypercls
            with torch.no_grad():
                for theirs, ours in HYPER_NAMES.items():
                    hyper.get_parameter(theirs.removeprefix("hypercls.")).copy_(
                        torch.from_numpy(hypernetwork_init()[ours]))
        if method == "fedbabu":  # their FedBABUServer's constructor: the head frozen on every client
            clients[k].to_freeze_layers(exclude)
    server = _server(FedAvg, copy.deepcopy(clients["a"].get_params()), exclude)
    outputs = _fingerprints(server.server_model_state_dict, names, "initial")
    body = {n for n in server.server_model_state_dict if n not in exclude}
    spy = _ClipSpy()
    torch.nn.utils.clip_grad_norm_ = spy
    try:
        uploads = []
        for k, client in clients.items():
            client.set_params(server.server_model_state_dict, server.exclude_layer_keys)
            if method == "fedrep":  # their FedRepServer.run
                client.to_freeze_layers(body)
                client.training(ROUND, config["FedRep_head_epochs"])
                client.to_freeze_layers(exclude)
                client.training(ROUND, config["num_epochs"])
                client.to_freeze_layers(set())
            else:
                client.training(ROUND, config["num_epochs"])
            if method == "ditto":
                client.personalized_training(ROUND, config["num_epochs"])
                outputs |= _fingerprints(client.personalized_model.state_dict(), names, f"client_{k}.personal")
            uploads.append(client.upload())
            outputs |= _fingerprints(uploads[-1], names, f"client_{k}.trained")
            outputs[f"client_{k}.loss"] = np.array(client.train_loss_dict[ROUND], dtype=np.float64)
            if method == "fedrod-linear":
                outputs[f"client_{k}.personal_head"] = client.p_head.weight.detach().numpy().copy()
            if method == "fedrod-hyper":
                with torch.no_grad():
                    generated = client.model.base.hypercls(client.sample_per_class)
                outputs[f"client_{k}.personal_head"] = generated.numpy().copy()
                inputs[f"client_{k}.label_distribution"] = client.sample_per_class.numpy().astype(np.float64)
        server.aggregate(uploads, ROUND)
        outputs |= _fingerprints(server.server_model_state_dict, names, "aggregate")
        if method == "fedbabu":  # client A's final fine-tune, from the aggregated body (adapted, see above)
            final_round = config["num_rounds"] + 1
            for k, client in list(clients.items())[:1]:
                client.set_params(server.server_model_state_dict, server.exclude_layer_keys)
                client.to_freeze_layers(set())
                client.training(final_round, config["FedBABU_finetune_epoch"])
                outputs |= _fingerprints(client.get_params(), names, f"client_{k}.finetuned")
            inputs["final_round"] = np.int64(final_round)
    finally:
        torch.nn.utils.clip_grad_norm_ = spy.inner
    largest = max(spy.norms)
    if largest >= THEIR_CLIP:
        raise RuntimeError(f"{method}: their clipping acted (gradient norm {largest}); the fixture would not compare")
    outputs["largest_gradient_norm"] = np.float64(largest)
    inputs |= {f"their.{key}": np.asarray(value) for key, value in extra.items()}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    snapshot = SNAPSHOTS["fednh"]
    paths = []
    for method, (module_name, client_name, extra, exclude) in METHODS.items():
        inputs, outputs = _round(checkouts["fednh"], method)
        steps = {"fedrep": "to_freeze_layers/training (head), to_freeze_layers/training (body), as FedRepServer.run",
                 "fedbabu": "training; after aggregate, set_params(aggregate) then to_freeze_layers(set()) and "
                            "training(num_rounds + 1, FedBABU_finetune_epoch) (their final fine-tune, from the "
                            "aggregated body)",
                 "ditto": "training then personalized_training, as DittoServer.run"}.get(method, "training")
        paths.append(save_fixture(
            f"fednh-{method}-round", snapshot,
            f"src/flbase/strategies/{module_name}.py: two {client_name}s (constructed after torch.manual_seed(2022)) "
            f".set_params/{steps}/.upload with {extra or 'their defaults'}; FedAvg.py: FedAvgServer.aggregate "
            f"(made with __new__, learning_rate 1, exclude {sorted(exclude)}); in float64, one full batch, momentum 0, "
            "weight decay 0, clip_grad_norm_ spied on (never reached 10)"
            + ("; their hypercls's initial values replaced by hypernetwork_init()" if method == "fedrod-hyper" else ""),
            rerun, inputs, outputs))
    return paths
