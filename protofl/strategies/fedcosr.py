"""FedCoSR (Huang et al., arXiv:2404.17916): contrastive shareable representations.

The model is split into shared representation layers phi (the body, up to the 512-d
representation) and a personal head pi that never leaves the client. Equation numbers are the
paper's.

Client, first participation: its model is the seeded initial model (the server's, the same on
every client), with phi overwritten by the global phi; the first round trains with CE only (no
global prototypes exist yet). Later rounds: loss-wise local aggregation
phi <- tau phi_local + (1 - tau) phi_global with tau = exp(-gamma L_Reg) (Eq. 7-9), L_Reg the
client's mean InfoNCE of its last local epoch (or, ``tau-loss = "fresh-eval"``, of an eval pass
of its current model against the new prototypes; also used when no last value exists); then
CE + contrastive-weight * InfoNCE of each representation against all global prototypes (own class
positive, every other class negative, temperature tau_CL; Eq. 10-14). After training, per-class
mean representations of the local training split with the updated phi (Eq. 3-4) and the class
counts go up as bytes next to phi. phi, pi and L_Reg stay in ``context.state``.

Server: phi averaged weighted by local training sizes (Eq. 5); class prototypes averaged
weighted by the per-class counts (Eq. 6); a class nobody held this round keeps last round's
prototype (``keep-missing-prototypes``, not in the paper). phi goes out as the parameters, the
prototypes as bytes in the fit and evaluate config.

Ablations (Fig. 14): ``local-aggregation = "fixed"`` with ``fixed-tau = 0`` (w/o LA: plain
overwrite), ``negatives = false`` (w/o separation: InfoNCE without negatives becomes the aligned
term (1 - cos(w, p_y)) / tau_CL), ``contrastive-weight = 0`` (w/o CRL: InfoNCE still measured to
drive tau), and ``share-head = true`` (the head is averaged and mixed too; the spec's other
reading of "w/o Sep", which also gives a global model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.client import PrototypeClient
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import CONTRASTIVE_LOSS, GLOBAL_PROTOTYPES, ClassVectors, PayloadError
from protofl.settings import KeptModel, MethodOptions
from protofl.task.prototypes import aggregate_prototypes

LOCAL_AGGREGATION_WEIGHT = "la-tau"  # tau of Eq. 7, reported by each client
CE_LOSS = "ce-loss"  # L_Per: the cross-entropy, averaged over the batches
LOSS_KEYS = (CE_LOSS, CONTRASTIVE_LOSS)  # L_Per, and L_Reg: the last local epoch's mean InfoNCE


@dataclass(frozen=True)
class FedCoSROptions(MethodOptions):
    keeps_model: ClassVar[KeptModel] = "trains"  # the personal model
    keeps_client_state: ClassVar[bool] = True  # and L_Reg of its last epoch
    contrastive_weight: float = 1.0  # alpha (Eq. 14), not in the paper
    temperature: float = 0.1  # tau_CL (Eq. 13), not in the paper
    gamma: float = 1.0  # Eq. 7, not in the paper
    local_aggregation: Literal["loss-wise", "fixed"] = "loss-wise"
    fixed_tau: float = 0.0
    tau_loss: Literal["last-epoch", "fresh-eval"] = "last-epoch"
    negatives: bool = True
    share_head: bool = False
    keep_missing_prototypes: bool = True
    evaluate_at: Literal["after-fit", "after-aggregation"] = "after-fit"

    def check(self) -> None:
        if self.contrastive_weight < 0 or self.temperature <= 0 or self.gamma <= 0:
            raise ValueError("fedcosr: contrastive-weight must be >= 0, temperature and gamma > 0")
        if not 0.0 <= self.fixed_tau <= 1.0:
            raise ValueError(f"fedcosr.fixed-tau must be in [0, 1], got {self.fixed_tau}")

    def shares(self, name: str) -> bool:
        """phi (the body), plus the head with ``share-head``."""
        return self.share_head or not name.startswith("head.")


# --- math -------------------------------------------------------------------------------


def mixing_weight(contrastive_loss: float, gamma: float) -> float:
    """tau = exp(-gamma L_Reg) in (0, 1] (Eq. 7): the share of the client's own phi."""
    return math.exp(-gamma * contrastive_loss)


def mix_weights(local: list[np.ndarray], global_: list[np.ndarray], tau: float) -> list[np.ndarray]:
    """tau * local + (1 - tau) * global, array by array, each keeping its dtype (Eq. 8)."""
    return [
        (tau * a.astype(np.float64) + (1.0 - tau) * b.astype(np.float64)).astype(a.dtype)
        for a, b in zip(local, global_)
    ]


def sample_infonce_losses(
    features: torch.Tensor,
    labels: torch.Tensor,
    prototypes: torch.Tensor,
    available: torch.Tensor,
    temperature: float,
    negatives: bool = True,
) -> torch.Tensor:
    """Per-sample InfoNCE l_j against the global prototypes (Eq. 13), for the samples whose class
    has one: softmax over cos(w_j, p_c) / tau_CL for every available c, own class the target.

    ``negatives=False`` keeps only the positive pair: (1 - cos(w_j, p_y)) / tau_CL.
    """
    keep = available[labels]
    features, labels = features[keep], labels[keep]
    similarity = F.normalize(features, dim=1) @ F.normalize(prototypes.to(features.dtype), dim=1).t()
    if not negatives:
        return (1.0 - similarity.gather(1, labels.unsqueeze(1)).squeeze(1)) / temperature
    logits = (similarity / temperature).masked_fill(~available, float("-inf"))
    return F.cross_entropy(logits, labels, reduction="none")


# --- server -----------------------------------------------------------------------------


class FedCoSRStrategy(ServerRule):
    options_class = FedCoSROptions
    loss_metrics = LOSS_KEYS
    state_fields = ("global_prototypes",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.global_prototypes: ClassVectors | None = None

    def check_update(self, update: ClientUpdate) -> None:
        tau = update.metrics.get(LOCAL_AGGREGATION_WEIGHT)
        if not isinstance(tau, float) or not 0.0 <= tau <= 1.0:
            raise PayloadError(f"la-tau must be a float in [0, 1], got {tau!r}")

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return self.global_prototypes.to_config(GLOBAL_PROTOTYPES) if self.global_prototypes else {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        prototypes, mask = aggregate_prototypes(*stacked_statistics(updates), "count", **self.prototype_rule)  # Eq. 6
        if self.options.keep_missing_prototypes and self.global_prototypes is not None:
            kept = ~mask & self.global_prototypes.mask
            prototypes[kept], mask = self.global_prototypes.vectors[kept], mask | self.global_prototypes.mask
        self.global_prototypes = ClassVectors(prototypes, mask)
        taus = [u.metrics[LOCAL_AGGREGATION_WEIGHT] for u in updates]  # tau across clients
        self.recorder.update(server_round, la_tau_mean=float(np.mean(taus)), la_tau_min=min(taus), la_tau_max=max(taus))
        return self.average_parameters(updates)  # Eq. 5


# --- client -----------------------------------------------------------------------------


LAST_CONTRASTIVE_LOSS = "last-contrastive-loss"  # kept on the node for the next round's tau


class FedCoSRClient(PrototypeClient):
    options_class = FedCoSROptions

    def _info_nce(self, features, labels, prototypes) -> torch.Tensor:
        o = self.options
        return sample_infonce_losses(features, labels, *prototypes, o.temperature, o.negatives)

    def _last_contrastive_loss(self, prototypes) -> float | None:
        """L_Reg for tau: the last local epoch's mean, else an eval pass against ``prototypes``."""
        if self.options.tau_loss == "last-epoch" and LAST_CONTRASTIVE_LOSS in self.local_state:
            return float(self.local_state[LAST_CONTRASTIVE_LOSS])
        if prototypes is None:
            return None
        features, _ = self.forward(self.data.train_x)
        losses = self._info_nce(features, self.data.train_y, prototypes)
        return float(losses.mean()) if len(losses) else None

    def _local_aggregation(self, global_phi: list[np.ndarray], prototypes) -> float:
        """Set the model to [tau phi_local + (1 - tau) phi_global ; pi_local] (Eq. 8-9); returns tau.

        A client without a model of its own takes the global phi on the seeded initial head."""
        if not self.has_personal_model:
            self.load_shared(global_phi)
            return 0.0
        if self.options.local_aggregation == "fixed":
            tau = self.options.fixed_tau
        else:
            loss = self._last_contrastive_loss(prototypes)
            tau = 0.0 if loss is None else mixing_weight(loss, self.options.gamma)  # Eq. 7
        self.load_shared(mix_weights(self.shared_arrays(), global_phi, tau))
        return tau

    def receive(self, parameters, this_round):
        self.prototypes = self.global_prototypes(this_round)
        self.tau = self._local_aggregation(parameters, self.prototypes)
        self.contrastive_sums: list[torch.Tensor] = []
        self.contrastive_counts: list[int] = []

    def batch_loss(self, features, logits, labels, inputs):  # alpha * L_Reg (Eq. 13-14)
        if self.prototypes is None:
            return None  # the first round: CE only
        weight = self.options.contrastive_weight
        self.record_loss(**{CE_LOSS: F.cross_entropy(logits.detach(), labels)})
        with torch.set_grad_enabled(weight > 0):
            losses = self._info_nce(features, labels, self.prototypes)
        self.contrastive_sums.append(losses.detach().sum())
        self.contrastive_counts.append(len(losses))
        return weight * losses.mean() if weight > 0 and len(losses) else features.new_zeros(())

    def after_fit(self, statistics):
        """tau, L_Reg of the last local epoch (kept for the next tau); the model stays here."""
        metrics = {LOCAL_AGGREGATION_WEIGHT: float(self.tau)}
        last = self.steps_per_epoch()
        counted = sum(self.contrastive_counts[-last:])
        if counted:
            l_reg = float(torch.stack(self.contrastive_sums[-last:]).sum()) / counted
            self.local_state[LAST_CONTRASTIVE_LOSS] = np.float64(l_reg)
            metrics[CONTRASTIVE_LOSS] = l_reg
        return metrics

    def prepare_evaluation(self, parameters, this_round):
        """PM: the client's own model after its last local training (``after-fit``), or the model
        it would start the next round from (``after-aggregation``, PFLlib's point)."""
        if self.options.evaluate_at == "after-aggregation" or not self.has_personal_model:
            self._local_aggregation(parameters, self.global_prototypes(this_round))


STRATEGY, CLIENT = FedCoSRStrategy, FedCoSRClient
