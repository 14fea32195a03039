"""FedRCL fixtures from the authors' code: skynbe/FedRCL (``utils/loss.py``, ``clients/rcl_client.py``).

    git --git-dir=<mirror of skynbe/FedRCL> archive 378beb4 | tar -x -C /tmp/ref/FedRCL
    python tests/conformance/make_fixtures.py fedrcl --checkout /tmp/ref/FedRCL

The loss configuration is their ``configs/client/fedrcl.yaml``, read from the checkout (tau 0.05,
the ``scl`` pair: supervised, hardest positive and 2 hardest negatives; the ``penalty`` pair:
intra-class thresholding at 0.7; CE weight 1, prox and feature-align weights 0), with
``branch_level`` set to the CNN's three levels.

- ``fedrcl-terms``: ``CLLoss`` (their ``RCLClient.__init__`` builds one per pair as
  ``CLLoss(pair=pair, **rcl_loss)``), called as ``RCLClient._algorithm_rcl`` calls it
  (``reduction=False, topk_neg=2``), on seeded features of small batches, each 2-D (B x C) or a 4-D
  map average-pooled first (``F.adaptive_avg_pool2d(., 1)``, as ``_algorithm_rcl`` does): the
  per-sample ``scl`` and ``penalty`` values and the gradients of their batch means with respect
  to the features. The cases: random features (no penalty), collapsed classes (the penalty
  fires), classes above and below the threshold in one batch (``mixed``; there, class 4's
  samples 12 and 13 each have one partner above 0.7 and one below, and do not fire: the least
  similar partner decides; sample 11, both partners above, fires), a one-sample class beside a
  class with fewer than 2 other-class samples, a one-class batch, all classes singletons, a map.
- ``fedrcl-local-round``: ``RCLClient.local_train`` for one local epoch of two batches, on protofl's
  ``cnn`` (``build_model("cnn", 1, 10, 16, seed=0)``) behind the model interface of theirs that
  ``_algorithm`` reads (``model(x, no_relu=...)`` -> ``{"layer0", "layer1", "layer2", "logit"}``,
  ``num_layers``): the levels are the outputs of its two MaxPool2d and of its body (the feature),
  which ``_algorithm_rcl`` average-pools over space. Stored: the per-batch CE, scl, penalty and
  total, the batch order, and the trained weights (in full the small tensors, by
  :func:`~conformance.common.fingerprint` every tensor and its change).

Adapted, not changed: their ``utils/__init__.py`` imports their datasets (imageio, torchvision
data sets), ``utils/metrics.py`` torchmetrics and ``clients/build.py`` tabulate, which this venv
has not: bare packages stand in for ``utils``, ``models`` and ``clients`` (``from utils import *``
given the names ``rcl_client`` takes from it), a stub for ``utils.metrics`` (``evaluate``, not
called) and a registry stub for ``clients.build``; ``omegaconf``'s ``DictConfig`` is a dict with
attribute access. Their ``setup`` (a DataLoader over their data set) is replaced by the fields it
sets: the loader is our two batches in our order, the optimizer their ``torch.optim.SGD`` with
the config's momentum 0 and weight decay 0 (protofl's conformance setting; theirs is 1e-3) at lr
0.1 (theirs in round 1), the scheduler their ``LambdaLR`` (stepped after the epoch: no effect). No
AMP: ``use_amp`` false and their ``GradScaler`` disabled (on a CPU it disables itself). Their
``clip_grad_norm_(., 10)`` stays (wrapped to record the norms): the fixture checks that each
step's gradient norm is below 10, where it multiplies the gradients by exactly 1, so the steps are
plain SGD. ``_algorithm`` is wrapped to record each batch's losses and to check its levels for
ties.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conformance.common import Snapshot, fingerprint, pixels, pixels_to_input, save_fixture, seeded

SNAPSHOTS = {"fedrcl": Snapshot("skynbe/FedRCL", "378beb409add17838567ea25238afadb3258514f")}

NUM_CLASSES, IMAGE_SIZE, MODEL_SEED = 10, 16, 0
LR, BATCH_SIZE, ORDER_SEED = 0.1, 12, 3
# the labels of the local round's samples in the order they are trained on (two batches of 12)
BATCH_LABELS = [[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4], [5, 5, 5, 5, 5, 6, 6, 7, 8, 8, 9, 9]]
# the trained tensors stored in full (the others, 51200 and 32768 entries, by fingerprint only)
IN_FULL = ("body.0.0.weight", "body.0.0.bias", "body.0.3.bias", "body.1.bias", "head.weight", "head.bias")
# no near ties: every value their topk picks (and every value compared with the threshold) is
# this far from the next candidate (from 0.7), far above float64 reorderings (1e-16 of |s| <= 1)
MIN_GAP = 1e-9


class _Config(dict):
    """What ``omegaconf.DictConfig`` is to their code: items, attributes, ``get``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _config(value):
    if isinstance(value, dict):
        return _Config({k: _config(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_config(v) for v in value]
    return value


def _module(name: str, path: Path | None = None, **names) -> types.ModuleType:
    """A stand-in module (a bare package over ``path``), with a spec (torch._dynamo's find_spec
    asks every module in sys.modules for one)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
    if path is not None:
        module.__path__ = [str(path)]
    module.__dict__.update(names)
    sys.modules[name] = module
    return module


class _Registry:
    def register(self):
        return lambda cls: cls


@contextlib.contextmanager
def authors_code(checkout: Path) -> Iterator[types.SimpleNamespace]:
    """Their ``utils.loss`` and ``clients.rcl_client``, imported from ``checkout`` with the stand-ins
    of the module docstring; ``sys.path`` and ``sys.modules`` undone afterwards."""
    import yaml  # PyYAML, for their config file: needed only to make the fixtures

    saved_path = list(sys.path)
    sys.path.insert(0, str(checkout))
    try:
        utils = _module("utils", checkout / "utils")
        from utils import helper, loss  # noqa: E402  (their modules, under the bare package)

        # what `from utils import *` gives rcl_client: helper's and loss's exports (the other
        # modules' need the missing packages), numpy and defaultdict (from utils.data's imports)
        utils.__dict__.update({k: v for k, v in vars(helper).items() if not k.startswith("_")})
        utils.__dict__.update({k: getattr(loss, k) for k in loss.__all__}, np=np, defaultdict=defaultdict)
        _module("utils.metrics", evaluate=None)
        _module("models", checkout / "models", build_encoder=None)
        clients = _module("clients", checkout / "clients")
        _module("clients.build", CLIENT_REGISTRY=_Registry())
        from clients import base_client  # noqa: E402

        clients.Client = base_client.Client
        from clients import rcl_client  # noqa: E402

        config = _config(yaml.safe_load((checkout / "configs" / "client" / "fedrcl.yaml").read_text()))
        yield types.SimpleNamespace(loss=loss, rcl_client=rcl_client, config=config)
    finally:
        sys.path[:] = saved_path
        for name in list(sys.modules):
            if name.split(".")[0] in ("utils", "models", "clients"):
                del sys.modules[name]


def _criteria(code, config) -> dict:
    """As ``RCLClient.__init__`` builds them: one ``CLLoss`` per pair."""
    return {pair.name: code.loss.CLLoss(pair=pair, **config.rcl_loss) for pair in config.rcl_loss.pairs}


# --- fedrcl-terms ----------------------------------------------------------------------------


def _check_no_ties(features: torch.Tensor, labels: torch.Tensor, negatives: int, threshold: float) -> None:
    """What their topk picks (the least similar same-class sample, the ``negatives`` most similar
    others, the least similar same-class partner) and the threshold test are ``MIN_GAP`` clear."""
    pooled = features.flatten(2).mean(2) if features.dim() > 2 else features
    z = F.normalize(pooled.detach(), dim=1)
    s = (z @ z.T).numpy()
    same = (labels[:, None] == labels[None, :]).numpy()
    for i in range(len(s)):
        own = np.sort(s[i][same[i]])
        others = np.sort(s[i][~same[i]])[::-1]
        if len(own) > 1:
            assert own[1] - own[0] > MIN_GAP, f"row {i}: tied positives"
            partners = np.sort(np.delete(s[i], i)[np.delete(same[i], i)])
            if len(partners) > 1:
                assert partners[1] - partners[0] > MIN_GAP, f"row {i}: tied partners"
            assert abs(partners[0] - threshold) > MIN_GAP, f"row {i}: partner at the threshold"
        if len(others) > negatives:
            assert others[negatives - 1] - others[negatives] > MIN_GAP, f"row {i}: tied negatives"


def _term_cases(rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (features, labels)."""
    cases = {}
    labels = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4])
    cases["random"] = rng.standard_normal((12, 8)), labels
    prototypes = rng.standard_normal((5, 16))
    cases["collapsed"] = prototypes[labels] + 0.15 * rng.standard_normal((12, 16)), labels
    # classes 0 and 1 collapsed (all pairs above 0.7: fires), 2 and 3 spread (below: does not),
    # class 4: one sample near its prototype, two far: pairs on both sides, the least similar decides
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5])
    noise = np.array([0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 1.5, 1.5, 1.5, 2.0, 2.0, 0.05, 0.5, 0.9, 1.0])
    prototypes = rng.standard_normal((6, 16))
    cases["mixed"] = prototypes[labels] + noise[:, None] * rng.standard_normal((15, 16)), labels
    # class 1 alone: its positive is itself, no partner; class 0 has 1 other-class sample (< 2)
    labels = np.array([0, 0, 0, 0, 0, 0, 0, 1])
    cases["singleton_few_negatives"] = rng.standard_normal((8, 6)) + np.array([2.0, 0, 0, 0, 0, 0]), labels
    cases["one_class"] = rng.standard_normal((7, 5)) + np.array([1.5, 0, 0, 0, 0]), np.zeros(7, dtype=np.int64)
    cases["singletons"] = rng.standard_normal((6, 10)), np.arange(6)
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])
    prototypes = np.abs(rng.standard_normal((4, 12, 1, 1)))
    cases["map"] = prototypes[labels] + 0.4 * rng.standard_normal((10, 12, 3, 3)), labels
    return cases


def terms(code, rng) -> tuple[dict, dict]:
    config = code.config
    criteria = _criteria(code, config)
    penalty_pair = next(p for p in config.rcl_loss.pairs if p.name == "penalty")
    inputs, outputs = {}, {}
    for name, (features, labels) in _term_cases(rng).items():
        x, y = torch.from_numpy(features), torch.from_numpy(labels.astype(np.int64))
        _check_no_ties(x, y, config.rcl_loss.topk_neg, penalty_pair.threshold)
        inputs |= {f"{name}.features": features, f"{name}.labels": y.numpy()}
        for term, criterion in criteria.items():
            feature = x.clone().requires_grad_(True)
            level = F.adaptive_avg_pool2d(feature, 1) if feature.dim() == 4 else feature  # _algorithm_rcl
            per_sample = criterion(old_feat=level.detach(), new_feat=level, target=y, reduction=False,
                                   topk_neg=config.rcl_loss.topk_neg)
            per_sample.mean().backward()
            outputs |= {f"{name}.{term}": per_sample.detach().numpy(), f"{name}.{term}.gradient": feature.grad.numpy()}
    inputs |= {"temperature": np.float64(config.rcl_loss.temp), "threshold": np.float64(penalty_pair.threshold),
               "negatives": np.int64(config.rcl_loss.topk_neg)}
    return inputs, outputs


# --- fedrcl-local-round ----------------------------------------------------------------------


class LevelsModel(nn.Module):
    """protofl's ``cnn`` as their client reads a model: ``model(x, no_relu=...)`` returns its levels
    ``layer0``.. and the ``logit`` (``no_relu`` ignored: the CNN's levels are its modules' outputs,
    as for their VGG9), and ``num_layers`` says how many levels."""

    num_layers = 3

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, no_relu: bool = True) -> dict[str, torch.Tensor]:
        conv, linear, relu = self.model.body  # body: Sequential(conv blocks, Linear, ReLU)
        levels = []
        for module in conv:  # conv5x5, ReLU, MaxPool2d, conv5x5, ReLU, MaxPool2d, Flatten
            x = module(x)
            if isinstance(module, nn.MaxPool2d):
                levels.append(x)
        feature = relu(linear(x))
        levels.append(feature)
        return {**{f"layer{l}": level for l, level in enumerate(levels)}, "feature": feature,
                "logit": self.model.head(feature)}


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}


def local_round(code, rng) -> tuple[dict, dict]:
    from protofl.task.models import build_model

    labels_in_order = np.concatenate(BATCH_LABELS)
    n = len(labels_in_order)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(ORDER_SEED)).numpy()
    labels = np.empty(n, dtype=np.int64)
    labels[order] = labels_in_order  # sample order[k] is the k-th trained on
    images = pixels(int(rng.integers(2**31)), n, (1, IMAGE_SIZE, IMAGE_SIZE))
    x, y = pixels_to_input(images), torch.from_numpy(labels)

    model = build_model("cnn", 1, NUM_CLASSES, IMAGE_SIZE, seed=MODEL_SEED)
    initial = _state(model)
    config = _config(code.config)
    config.rcl_loss.branch_level = list(range(LevelsModel.num_layers))
    args = _Config(client=config, use_amp=False, trainer=_Config(local_epochs=1, local_lr_decay=0.998),
                   optimizer=_Config(momentum=0.0, wd=0.0), dataset=_Config(name="fixture"))
    rcl_client = code.rcl_client
    rcl_client.GradScaler = functools.partial(torch.amp.GradScaler, "cuda", enabled=False)  # no AMP
    levels_model = LevelsModel(model)
    client = rcl_client.RCLClient(args, client_index=0, model=levels_model)
    # what their setup() sets (it would build a DataLoader over their data set)
    for p in client.global_model.parameters():
        p.requires_grad = False
    client.device, client.num_layers = "cpu", levels_model.num_layers
    batches = [torch.from_numpy(order[k : k + BATCH_SIZE]) for k in range(0, n, BATCH_SIZE)]
    client.loader = [(x[b], y[b]) for b in batches]
    client.optimizer = torch.optim.SGD(levels_model.parameters(), lr=LR, momentum=args.optimizer.momentum,
                                       weight_decay=args.optimizer.wd)
    client.scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer=client.optimizer, lr_lambda=lambda epoch: args.trainer.local_lr_decay**epoch)

    recorded: list[dict[str, float]] = []
    algorithm = client._algorithm

    def recording(images, batch_labels):
        losses, features = algorithm(images, batch_labels)
        recorded.append({k: float(torch.as_tensor(v).detach()) for k, v in losses.items()})
        for level in range(levels_model.num_layers):
            _check_no_ties(features["local"][f"layer{level}"], batch_labels, config.rcl_loss.topk_neg,
                           next(p for p in config.rcl_loss.pairs if p.name == "penalty").threshold)
        return losses, features

    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def clip_recording(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        norm = clip(parameters, max_norm, *args, **kwargs)
        norms.append(float(norm))
        return norm

    client._algorithm = recording
    torch.nn.utils.clip_grad_norm_ = clip_recording
    try:
        state, _ = client.local_train(global_epoch=1)
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    assert max(norms) < 10, f"gradient norms {norms}: their clipping at 10 would act"
    trained = {name[len("model."):]: v.numpy() for name, v in state.items()}
    weights = client.get_weights()
    totals = [sum(weights[k] * b[k] for k in b) for b in recorded]
    inputs = {"pixels": images, "labels": labels, "order": order, "order_seed": np.int64(ORDER_SEED),
              "lr": np.float64(LR), "batch_size": np.int64(BATCH_SIZE), "model_seed": np.int64(MODEL_SEED),
              "image_size": np.int64(IMAGE_SIZE), "num_classes": np.int64(NUM_CLASSES),
              **{f"initial.{name}.fingerprint": fingerprint(v) for name, v in initial.items()}}
    outputs = {"ce": np.array([b["cls"] for b in recorded]), "scl": np.array([b["scl"] for b in recorded]),
               "penalty": np.array([b["penalty"] for b in recorded]), "total": np.array(totals),
               "gradient_norm": np.array(norms),
               **{f"trained.{name}": trained[name] for name in IN_FULL},
               **{f"trained.{name}.fingerprint": fingerprint(v) for name, v in trained.items()},
               **{f"change.{name}.fingerprint": fingerprint(v - initial[name]) for name, v in trained.items()}}
    return inputs, outputs


def make(checkouts: dict[str, Path], rerun: str) -> list[Path]:
    snapshot = SNAPSHOTS["fedrcl"]
    with authors_code(checkouts["fedrcl"]) as code:
        return [
            save_fixture("fedrcl-terms", snapshot, "utils/loss.py CLLoss, one per pair of configs/client/fedrcl.yaml, "
                         "called as clients/rcl_client.py RCLClient._algorithm_rcl calls it (reduction=False, "
                         "topk_neg=2; a 4-D map adaptive_avg_pool2d'ed first); the gradients of the batch means",
                         rerun, *terms(code, seeded(1))),
            save_fixture("fedrcl-local-round", snapshot, "clients/rcl_client.py RCLClient.local_train, one local "
                         "epoch of two batches, on protofl's cnn behind their model interface (levels: the "
                         "MaxPool2d outputs and the feature); setup's fields set directly, SGD momentum 0, "
                         "weight decay 0, no AMP", rerun, *local_round(code, seeded(2))),
        ]
