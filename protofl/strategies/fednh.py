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
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import PayloadError
from protofl.settings import ExperimentSettings, KeptModel, MethodOptions
from protofl.task.models import SplitModel
from protofl.task.prototypes import robust_class_means
from protofl.task.robust import RobustRule

PROTOTYPES = "prototypes"  # W, C x d unit rows, broadcast in the fit and evaluate config


@dataclass(frozen=True)
class FedNHOptions(MethodOptions):
    keeps_model: ClassVar[KeptModel] = "scores"  # PM: the model right after its last local training
    capturable: ClassVar[bool] = True  # no batch loss
    max_grad_norm: ClassVar[float] = 10.0  # [code]: each step's gradient clipped at total norm 10
    rho: float = 0.9
    prototype_init: Literal["simplex", "orthogonal"] = "simplex"
    prototype_means: Literal["normalized", "raw"] = "normalized"
    scale: float = 30.0
    learnable_scale: bool = False
    weighted: bool = False

    def check(self) -> None:
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"fednh.rho must be in [0, 1], got {self.rho}")
        if self.scale <= 0:
            raise ValueError(f"fednh.scale must be > 0, got {self.scale}")


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
    """C orthonormal rows (pairwise cosine 0), as the official code's ``orthogonal_``: the QR of a
    standard normal d x C draw (``orthogonal_`` discards the uniform draw it is handed), so the
    rows point anywhere, not into the non-negative orthant the ReLU features live in."""
    if not 1 <= num_classes <= dim:
        raise ValueError(f"the orthogonal init needs classes <= feature size, got {num_classes} and {dim}")
    draw = np.random.default_rng(seed).standard_normal((dim, num_classes))
    return _orthonormal_columns(draw).T.astype(np.float32)


def update_prototypes(
    prototypes: np.ndarray,
    class_means: np.ndarray,
    class_counts: np.ndarray,
    rho: float,
    normalize_means: bool = True,
    rule: RobustRule = "method",
    trim_fraction: float = 0.2,
) -> np.ndarray:
    """The server's prototype step (Eq. 4) for C x d prototypes, K x C x d client class means
    (means of unit features, zero rows for absent classes) and K x C class counts.

    m_c = sum_k n_kc u_kc / sum_k n_kc, with u_kc the client mean normalised (``normalize_means``,
    official code, which then normalises m_c too) or raw (Eq. 4 as written);
    W_c <- normalise(rho W_c + (1 - rho) m_c). Classes with no samples this round are unchanged.
    Another robust ``rule`` replaces the count-weighted mean of m_c.
    """
    counts = class_counts.astype(np.float64)
    total = counts.sum(axis=0)
    held = total > 0
    if rho >= 1.0 or not held.any():
        return prototypes.copy()
    means = class_means.astype(np.float64)
    if normalize_means:
        means = _unit_rows(means)
    if rule == "method":
        mixed = np.einsum("kc,kcd->cd", counts, means)[held] / total[held, None]
    else:
        mixed = robust_class_means(means, counts, rule, trim_fraction)[held]
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


def prepare_model(model: SplitModel, settings: ExperimentSettings) -> SplitModel:
    """Replace the backbone's linear head by the cosine head on the initial prototypes W^0."""
    options = FedNHOptions.from_settings(settings)
    init = simplex_prototypes if options.prototype_init == "simplex" else orthogonal_prototypes
    prototypes = init(model.head.out_features, model.feature_dim, settings.seed)
    # W in the model's dtype (torch's default, as the body's parameters), its values the wire's float32
    model.head = CosineHead(torch.from_numpy(prototypes).to(torch.get_default_dtype()), options.scale,
                            options.learnable_scale)
    return model


# --- server -----------------------------------------------------------------------------


class FedNHStrategy(ServerRule):
    options_class = FedNHOptions
    state_fields = ("prototypes",)

    @property
    def prototypes(self) -> np.ndarray:
        """W^t: the GM's head holds the only copy."""
        return self.model.head.prototypes.cpu().numpy()

    @prototypes.setter
    def prototypes(self, value: np.ndarray) -> None:
        self.model.head.prototypes.copy_(torch.from_numpy(value))

    def check_update(self, update: ClientUpdate) -> None:
        if self.settings.dp_noise > 0:
            return  # noised means leave the unit ball; the server normalises them (prototype-means)
        if (np.linalg.norm(update.statistics.means.astype(np.float64), axis=1) > 1.0 + 1e-3).any():
            raise PayloadError("a class mean of unit features has a norm above 1")

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return {PROTOTYPES: self.prototypes.astype(np.float32)}  # the wire's dtype, whatever the model's

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        means, counts = stacked_statistics(updates)
        normalize_means = self.options.prototype_means == "normalized"
        self.prototypes = update_prototypes(  # Eq. 4
            self.prototypes, means, counts, self.options.rho, normalize_means, **self.prototype_rule
        )
        return self.average_parameters(updates, None if self.options.weighted else [1] * len(updates))  # Alg. 1 l. 9


# --- client -----------------------------------------------------------------------------


class FedNHClient(PrototypeClient):
    options_class = FedNHOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        prototypes = self.received_class_vectors(this_round, PROTOTYPES)
        if prototypes is None:
            raise ValueError("FedNH: the server sent no prototypes")
        self.model.head.prototypes.copy_(torch.from_numpy(prototypes))

    def prototype_vectors(self, features, logits):
        return F.normalize(features, dim=1)  # Eq. 3: class means of the normalised features


STRATEGY, CLIENT = FedNHStrategy, FedNHClient
