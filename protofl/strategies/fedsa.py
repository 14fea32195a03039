"""FedSA (Zhou et al., AAAI 2025): semantic anchors for prototype-based FL.

No model parameters are exchanged, so every client may run its own architecture (``model =
"htfe2"`` ... ``"htfe8"``, or a node's ``model`` node-config value); all must give D-dim features.

Server: semantic anchors A^0 drawn once from the run seed: Gaussian class vectors through an
untrained Linear-BN-ReLU x2 embedding (``anchor-init = "projected"``; ``"random"`` is Table 4's
"no ER" row). Each round, the global prototype of each class uploaded this round is the
unweighted mean over its uploaders (``proto-agg = "mean"``, the official code; ``"weighted"`` by
class counts), and those classes' anchors move by EMA A <- alpha A + (1 - alpha) P (Eq. 10,
alpha = 0.9999). Anchors and global prototypes go out as bytes in the fit and evaluate config.

Client: its own persistent model (``context.state``). Loss per mini-batch
CE + lambda_r L_R + lambda_mcl L_MCL + lambda_cc L_CC with, in the official code's per-sample
forms (spec section 9, the default), L_R = MSE(z, A_y) averaged over B x D (Eq. 5) and
L_MCL = CE over -(||z - A_c|| + d* [c = y]) (Eq. 7); ``loss-form = "prototype"`` applies both to
the batch's class means as the paper writes them (L_R = sum_c ||P_c - A_c||). The margin
d* = max(margin of the anchors, margin of the client's last uploaded prototypes), the margin being
the mean nearest-neighbour distance (code) or ``margin = "pairwise"``: the sum of all pairwise
distances / (N - 1)^2 (Eq. 6 as printed). L_CC = CE of every anchor through the local head (Eq. 8). Local
prototypes: per-class means of the training-mode features seen during training (Eq. 2; the
code's ``prototype-pass = "during-train"``, or ``"post-eval"``), uploaded with the class counts.

Evaluation on the local test split with three predictors, all logged: nearest global prototype
(the paper's number, ``inference = "prototype"``), nearest anchor, and the classifier head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import MetricRecord
from torch import nn

from protofl.config import ExperimentConfig
from protofl.strategies.base import (
    PROTOTYPE_PASSES,
    ArraySpec,
    ClientUpdate,
    PrototypeClient,
    PrototypeStrategy,
    aggregate_prototypes,
    check_class_counts,
    check_loss_metrics,
    mean_client_metrics,
    prototype_broadcast,
)
from protofl.task.models import MODEL_FAMILIES
from protofl.task.train import (
    head_prediction,
    nearest_prototype,
    train,
)

ANCHOR_INITS = ("projected", "random")
PROTO_AGGS = {"mean": "uniform", "weighted": "count"}  # -> aggregate_prototypes' weighting
INFERENCES = ("prototype", "anchor", "head")
LOSS_FORMS = ("sample", "prototype")
LOSS_KEYS = ("regularization-loss", "contrastive-loss", "calibration-loss")


@dataclass(frozen=True)
class FedSAOptions:
    lambda_r: float = 10.0  # lambda_1; the paper writes 0.1, every official script runs 10 with this MSE form
    lambda_mcl: float | str = "auto"  # lambda_2: "auto" = 0.01 for one architecture, 1.0 for a model family
    lambda_cc: float = 1.0  # lambda_3
    ema: float = 0.9999  # alpha of Eq. 10; 1 keeps the anchors fixed
    anchor_init: str = "projected"
    proto_agg: str = "mean"
    prototype_pass: str = "during-train"
    inference: str = "prototype"
    loss_form: str = "sample"
    margin: str = "nearest"

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> "FedSAOptions":
        options = config.options_as(cls, {
            "anchor_init": ANCHOR_INITS, "proto_agg": tuple(PROTO_AGGS), "prototype_pass": PROTOTYPE_PASSES,
            "inference": INFERENCES, "loss_form": LOSS_FORMS, "margin": tuple(MARGINS),
        })
        if isinstance(options.lambda_mcl, str) and options.lambda_mcl != "auto":
            raise ValueError(f"fedsa.lambda-mcl must be a number or 'auto', got {options.lambda_mcl!r}")
        if min(options.lambda_r, options.lambda_cc, options.mcl_weight(config)) < 0:
            raise ValueError("fedsa: the loss weights must be >= 0")
        if not 0.0 < options.ema <= 1.0:
            raise ValueError(f"fedsa.ema must be in (0, 1], got {options.ema}")
        return options

    def mcl_weight(self, config: ExperimentConfig) -> float:
        """lambda_2: the paper's 0.01 under statistical heterogeneity only, 1.0 with a model family."""
        if self.lambda_mcl == "auto":
            return 1.0 if config.model in MODEL_FAMILIES else 0.01
        return float(self.lambda_mcl)


# --- math -------------------------------------------------------------------------------


def initial_anchors(num_classes: int, dim: int, seed: int, projected: bool = True) -> np.ndarray:
    """A^0 (C x D float32): N(0, I) class vectors, through an untrained Linear-BN-ReLU x2 embedding
    (PyTorch's default init; the BatchNorms standardise each dimension across the C vectors, as in
    training mode) with ``projected``, else raw. The same seed gives the same anchors."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        anchors = torch.randn(num_classes, dim)
        if projected:
            embedding = nn.Sequential(
                nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
                nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
            )
            anchors = embedding.train()(anchors)
    return anchors.numpy().astype(np.float32)


def nearest_neighbour_margin(vectors: torch.Tensor) -> float | None:
    """Mean over the rows of the Euclidean distance to the nearest other row (the code's margin
    statistic, spec 2.2); None with fewer than two rows."""
    if len(vectors) < 2:
        return None
    distances = torch.cdist(vectors.double(), vectors.double())
    distances.fill_diagonal_(float("inf"))
    return float(distances.min(dim=1).values.mean())


def pairwise_margin(vectors: torch.Tensor) -> float | None:
    """The paper's Eq. 6: the sum of the distances over all ordered pairs / (N - 1)^2; None for N < 2."""
    if len(vectors) < 2:
        return None
    return float(torch.cdist(vectors.double(), vectors.double()).sum() / (len(vectors) - 1) ** 2)


MARGINS = {"nearest": nearest_neighbour_margin, "pairwise": pairwise_margin}


def batch_class_means(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the classes in the batch, their mean features), differentiable: the paper's per-batch P_c."""
    classes, index = labels.unique(return_inverse=True)
    sums = features.new_zeros(len(classes), features.shape[1]).index_add(0, index, features)
    return classes, sums / torch.bincount(index).unsqueeze(1).to(features.dtype)


def ema_update(anchors: np.ndarray, prototypes: np.ndarray, mask: np.ndarray, alpha: float) -> np.ndarray:
    """A_c <- alpha A_c + (1 - alpha) P_c for the classes in ``mask``; the others keep theirs (Eq. 10)."""
    updated = anchors.astype(np.float64)
    updated[mask] = alpha * updated[mask] + (1.0 - alpha) * prototypes[mask].astype(np.float64)
    return updated.astype(anchors.dtype)


def anchor_regularization(features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """L_R: squared distance of each feature to its class anchor, averaged over B x D (Eq. 5, code form)."""
    return F.mse_loss(features, anchors[labels])


def margin_contrastive_loss(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, margin: float
) -> torch.Tensor:
    """L_MCL: cross-entropy over the negative distances to every anchor, the own class's distance
    enlarged by the margin d* (Eq. 7, per sample; no temperature, no normalisation)."""
    squared = (features**2).sum(1, keepdim=True) - 2 * features @ anchors.t() + (anchors**2).sum(1)
    distances = squared.clamp_min(1e-12).sqrt()
    distances = distances + margin * F.one_hot(labels, len(anchors)).to(distances.dtype)
    return F.cross_entropy(-distances, labels)


def anchor_calibration_loss(head: nn.Module, anchors: torch.Tensor) -> torch.Tensor:
    """L_CC: every anchor through the local head must be classified as its class (Eq. 8)."""
    return F.cross_entropy(head(anchors), torch.arange(len(anchors), device=anchors.device))


# --- server -----------------------------------------------------------------------------


class FedSAStrategy(PrototypeStrategy):
    has_global_model = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedSAOptions.from_config(self.config)
        self.initial_anchors = initial_anchors(
            self.num_classes, self.feature_dim, self.config.seed, self.options.anchor_init == "projected"
        )
        self.anchors = self.initial_anchors
        self.global_prototypes: np.ndarray | None = None
        self.prototype_mask: np.ndarray | None = None

    def upload_spec(self) -> dict[str, ArraySpec]:
        return self.class_statistics_spec("prototypes")

    def check_update(self, update: ClientUpdate) -> None:
        check_class_counts(update)
        check_loss_metrics(update, LOSS_KEYS)

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return {"anchors": self.anchors, **prototype_broadcast(self.global_prototypes, self.prototype_mask)}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> None:
        self.global_prototypes, self.prototype_mask = aggregate_prototypes(  # Eq. 3 as the code
            np.stack([u.payload["prototypes"] for u in updates]),
            np.stack([u.payload["class-counts"] for u in updates]),
            PROTO_AGGS[self.options.proto_agg],
        )
        self.anchors = ema_update(self.anchors, self.global_prototypes, self.prototype_mask, self.options.ema)
        drift = np.linalg.norm(self.anchors - self.initial_anchors) / np.linalg.norm(self.initial_anchors)
        self.recorder.update(
            server_round,
            anchor_margin=nearest_neighbour_margin(torch.from_numpy(self.anchors)),
            prototype_margin=nearest_neighbour_margin(torch.from_numpy(self.global_prototypes[self.prototype_mask])),
            anchor_drift=float(drift),
            **mean_client_metrics(updates, LOSS_KEYS),
        )


# --- client -----------------------------------------------------------------------------


class FedSAClient(PrototypeClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedSAOptions.from_config(self.config)
        self.lambda_mcl = self.options.mcl_weight(self.config)

    def _anchors(self, config) -> torch.Tensor:
        anchors = self.received_class_vectors(config, "anchors")
        if anchors is None:
            raise ValueError("FedSA: the server sent no anchors")
        return torch.from_numpy(anchors).to(self.device)

    def _margin(self, anchors: torch.Tensor) -> float:
        """d* = max(global anchor margin, this client's margin of its last uploaded prototypes)."""
        own = float(self.state["fedsa"]["prototype-margin"]) if "fedsa" in self.state else 0.0
        return max(MARGINS[self.options.margin](anchors), own)

    def _regularization_and_contrastive(self, features, labels, anchors, margin) -> tuple[torch.Tensor, torch.Tensor]:
        """L_R and L_MCL per sample (code) or on the batch's class means (paper)."""
        if self.options.loss_form == "sample":
            return (
                anchor_regularization(features, labels, anchors),
                margin_contrastive_loss(features, labels, anchors, margin),
            )
        classes, means = batch_class_means(features, labels)
        return (means - anchors[classes]).norm(dim=1).sum(), margin_contrastive_loss(means, classes, anchors, margin)

    def fit(self, parameters, config):
        self.restore_personal_model()
        anchors = self._anchors(config)
        margin = self._margin(anchors)
        seen = self.prototype_collector(self.options.prototype_pass)
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in LOSS_KEYS}

        def anchor_losses(features, logits, labels):
            if seen is not None:
                seen.add(features, labels)  # Eq. 2 over the training-mode features
            regularization, contrastive = self._regularization_and_contrastive(features, labels, anchors, margin)
            terms = {
                "regularization-loss": regularization,
                "contrastive-loss": contrastive,
                "calibration-loss": anchor_calibration_loss(self.model.head, anchors),
            }
            for key, value in terms.items():
                parts[key].append(value.detach())
            return (
                self.options.lambda_r * terms["regularization-loss"]
                + self.lambda_mcl * terms["contrastive-loss"]
                + self.options.lambda_cc * terms["calibration-loss"]
            )

        loss = train(
            self.model, self.data.train_x, self.data.train_y, extra_loss=anchor_losses, **self.train_kwargs(config)
        )
        prototypes = self.local_prototypes(seen)
        counts = self.data.class_counts()
        own_margin = MARGINS[self.options.margin](torch.from_numpy(prototypes[counts > 0]))
        if own_margin is None:
            self.state.pop("fedsa", None)  # one class: no margin of its own (the code's -inf)
        else:
            self.state["fedsa"] = MetricRecord({"prototype-margin": own_margin})
        self.store_personal_model()
        metrics = {key: float(torch.stack(values).mean()) for key, values in parts.items() if values}
        fit_metrics = self.fit_metrics(loss, prototypes=prototypes, **{"class-counts": counts})
        return [], self.data.num_train, fit_metrics | metrics

    def evaluate(self, parameters, config):
        self.restore_personal_model()
        anchors = self._anchors(config)
        predictors = {
            "head": head_prediction,
            "anchor": lambda f, _logits: nearest_prototype(f, anchors, torch.ones_like(anchors[:, 0], dtype=bool)),
        }
        received = self.global_prototypes(config)
        if received is not None:
            predictors["prototype"] = lambda f, _logits: nearest_prototype(f, *received)
        reported = self.options.inference if self.options.inference in predictors else "anchor"
        return self.evaluate_predictors(predictors, reported)


STRATEGY, CLIENT = FedSAStrategy, FedSAClient
