"""FedNH (Dai et al., AAAI 2023): uniform-then-semantic class prototypes as a frozen cosine head.

Client: logits = s * cos(feature, W_c) with the server's unit-norm prototypes W as the head;
the head is a buffer (frozen, never optimised), so local training is plain cross-entropy over all
C classes (Eq. 2) and moves only the body. After training, per-class means of the normalised
features (Eq. 3) and the class counts go up as bytes. The personalised model is the model right
after local training (the body just trained with the head it trained against), kept in
``context.state`` for evaluation.

Server: W^0 spread uniformly on the unit sphere, the regular simplex by default (the optimum of
Eq. 1), the official code's orthonormal rows with ``prototype-init = "orthogonal"``; the body
averaged unweighted (Alg. 1 line 9; ``weighted = true`` for sample weights); then
W_c <- normalise(rho W_c + (1 - rho) m_c) (Eq. 4, Alg. 1 line 8) with m_c the normalised,
count-weighted mean of the clients' normalised class means (official code; ``prototype-means =
"raw"`` mixes the raw means as Eq. 4 is written). Classes no client held this round keep their
prototype; ``rho = 1`` is FedUH (prototypes never updated). W goes out as bytes in the fit and
evaluate config.

Scale s: fixed (paper, s = 30) or learnable, trained by the clients and averaged with the body
(``learnable-scale = true``, official code; it starts s at 1.0 for the CNN, 20.0 for the ResNet).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.config import ExperimentConfig
from protofl.strategies.base import (
    ArraySpec,
    ClientUpdate,
    PayloadError,
    PrototypeClient,
    PrototypeStrategy,
    average_parameters,
    check_class_counts,
    get_weights,
    set_weights,
)
from protofl.task.models import SplitModel
from protofl.task.train import class_means, features_and_logits, train

PROTOTYPE_INITS = ("simplex", "orthogonal")
PROTOTYPE_MEANS = ("normalized", "raw")


@dataclass(frozen=True)
class FedNHOptions:
    rho: float = 0.9
    prototype_init: str = "simplex"
    prototype_means: str = "normalized"
    scale: float = 30.0
    learnable_scale: bool = False
    weighted: bool = False

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> "FedNHOptions":
        options = config.options_as(cls, {"prototype_init": PROTOTYPE_INITS, "prototype_means": PROTOTYPE_MEANS})
        if not 0.0 <= options.rho <= 1.0:
            raise ValueError(f"fednh.rho must be in [0, 1], got {options.rho}")
        if options.scale <= 0:
            raise ValueError(f"fednh.scale must be > 0, got {options.scale}")
        return options


# --- math -------------------------------------------------------------------------------


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    return matrix / np.maximum(np.linalg.norm(matrix, axis=-1, keepdims=True), 1e-12)


def _orthonormal_columns(draw: np.ndarray) -> np.ndarray:
    """Gram-Schmidt (QR) of a d x C draw, signs fixed so the result is unique."""
    q, r = np.linalg.qr(draw)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def simplex_prototypes(num_classes: int, dim: int, seed: int) -> np.ndarray:
    """C unit vectors in R^d with pairwise cosine -1/(C-1): the regular simplex, which maximises
    the minimum distance between C points on the sphere (Eq. 1), in a seeded random orientation."""
    if not 2 <= num_classes <= dim:
        raise ValueError(f"the simplex init needs 2 <= classes <= feature size, got {num_classes} and {dim}")
    vertices = np.sqrt(num_classes / (num_classes - 1)) * (np.eye(num_classes) - 1.0 / num_classes)
    basis = _orthonormal_columns(np.random.default_rng(seed).standard_normal((dim, num_classes)))
    return (vertices @ basis.T).astype(np.float32)


def orthogonal_prototypes(num_classes: int, dim: int, seed: int) -> np.ndarray:
    """C orthonormal rows (pairwise cosine 0): the official code's init of a uniform draw."""
    if not 1 <= num_classes <= dim:
        raise ValueError(f"the orthogonal init needs classes <= feature size, got {num_classes} and {dim}")
    return _orthonormal_columns(np.random.default_rng(seed).uniform(size=(dim, num_classes))).T.astype(np.float32)


def update_prototypes(
    prototypes: np.ndarray,
    class_means: np.ndarray,
    class_counts: np.ndarray,
    rho: float,
    normalize_means: bool = True,
) -> np.ndarray:
    """The server's prototype step (Eq. 4) for C x d prototypes, K x C x d client class means
    (means of unit features, zero rows for absent classes) and K x C class counts.

    m_c = sum_k n_kc u_kc / sum_k n_kc, with u_kc the client mean normalised (``normalize_means``,
    official code, which then normalises m_c too) or raw (Eq. 4 as written);
    W_c <- normalise(rho W_c + (1 - rho) m_c). Classes with no samples this round are unchanged.
    """
    counts = class_counts.astype(np.float64)
    total = counts.sum(axis=0)
    held = total > 0
    if rho >= 1.0 or not held.any():
        return prototypes.copy()
    means = class_means.astype(np.float64)
    if normalize_means:
        means = _unit_rows(means)
    mixed = np.einsum("kc,kcd->cd", counts, means)[held] / total[held, None]
    if normalize_means:
        mixed = _unit_rows(mixed)
    updated = prototypes.astype(np.float64)
    updated[held] = _unit_rows(rho * updated[held] + (1.0 - rho) * mixed)
    return updated.astype(np.float32)


class CosineHead(nn.Module):
    """logits = s * cos(feature, W_c). W (C x d, unit rows) is a buffer set from the server's
    broadcast: never trained, and not part of the exchanged parameters (non-persistent)."""

    def __init__(self, prototypes: torch.Tensor, scale: float, learnable_scale: bool) -> None:
        super().__init__()
        self.register_buffer("prototypes", prototypes, persistent=False)
        if learnable_scale:
            self.scale = nn.Parameter(torch.tensor(float(scale)))
        else:
            self.register_buffer("scale", torch.tensor(float(scale)), persistent=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(features, dim=1) @ self.prototypes.t()


def prepare_model(model: SplitModel, config: ExperimentConfig) -> SplitModel:
    """Replace the backbone's linear head by the cosine head on the initial prototypes W^0."""
    options = FedNHOptions.from_config(config)
    init = simplex_prototypes if options.prototype_init == "simplex" else orthogonal_prototypes
    prototypes = init(model.head.out_features, model.feature_dim, config.seed)
    model.head = CosineHead(torch.from_numpy(prototypes), options.scale, options.learnable_scale)
    return model


# --- server -----------------------------------------------------------------------------


class FedNHStrategy(PrototypeStrategy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedNHOptions.from_config(self.config)

    @property
    def prototypes(self) -> np.ndarray:
        """W^t: the GM's head holds the only copy."""
        return self.model.head.prototypes.cpu().numpy()

    def upload_spec(self) -> dict[str, ArraySpec]:
        return self.class_statistics_spec("class-means")

    def check_update(self, update: ClientUpdate) -> None:
        check_class_counts(update)
        if (np.linalg.norm(update.payload["class-means"], axis=1) > 1.0 + 1e-3).any():
            raise PayloadError("a class mean of unit features has a norm above 1")

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return {"prototypes": self.prototypes}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        updated = update_prototypes(  # Eq. 4
            self.prototypes,
            np.stack([u.payload["class-means"] for u in updates]),
            np.stack([u.payload["class-counts"] for u in updates]),
            self.options.rho,
            self.options.prototype_means == "normalized",
        )
        self.model.head.prototypes.copy_(torch.from_numpy(updated))
        return average_parameters(updates, self.options.weighted)  # Alg. 1 line 9


# --- client -----------------------------------------------------------------------------


class FedNHClient(PrototypeClient):
    def _use_prototypes(self, config) -> None:
        prototypes = self.received_class_vectors(config, "prototypes")
        if prototypes is None:
            raise ValueError("FedNH: the server sent no prototypes")
        self.model.head.prototypes.copy_(torch.from_numpy(prototypes))

    def fit(self, parameters, config):
        set_weights(self.model, parameters)
        self._use_prototypes(config)
        loss = train(self.model, self.data.train_x, self.data.train_y, **self.train_kwargs(config))  # Eq. 2
        features, _ = features_and_logits(self.model, self.data.train_x)
        means, counts = class_means(F.normalize(features, dim=1), self.data.train_y, self.data.num_classes)  # Eq. 3
        self.store_personal_model()
        metrics = self.fit_metrics(loss, **{"class-means": means, "class-counts": counts})
        return get_weights(self.model), self.data.num_train, metrics

    def evaluate(self, parameters, config):
        """PM: the model right after this client's last local training; the global model (with
        the broadcast prototypes) on a client that has not trained yet."""
        if not self.restore_personal_model():
            set_weights(self.model, parameters)
            self._use_prototypes(config)
        return self.evaluate_head()


STRATEGY, CLIENT = FedNHStrategy, FedNHClient
