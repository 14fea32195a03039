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

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import MetricRecord

from protofl.config import ExperimentConfig
from protofl.strategies.base import (
    ArraySpec,
    ClientUpdate,
    PayloadError,
    PrototypeClient,
    PrototypeStrategy,
    aggregate_prototypes,
    average_parameters,
    check_class_counts,
    check_loss_metrics,
    mean_client_metrics,
    prototype_broadcast,
)
from protofl.task.train import class_means, features_and_logits, train

LOCAL_AGGREGATIONS = ("loss-wise", "fixed")
TAU_LOSSES = ("last-epoch", "fresh-eval")
EVALUATE_AT = ("after-fit", "after-aggregation")


@dataclass(frozen=True)
class FedCoSROptions:
    contrastive_weight: float = 1.0  # alpha (Eq. 14), not in the paper
    temperature: float = 0.1  # tau_CL (Eq. 13), not in the paper
    gamma: float = 1.0  # Eq. 7, not in the paper
    local_aggregation: str = "loss-wise"
    fixed_tau: float = 0.0
    tau_loss: str = "last-epoch"
    negatives: bool = True
    share_head: bool = False
    keep_missing_prototypes: bool = True
    evaluate_at: str = "after-fit"

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> "FedCoSROptions":
        options = config.options_as(
            cls, {"local_aggregation": LOCAL_AGGREGATIONS, "tau_loss": TAU_LOSSES, "evaluate_at": EVALUATE_AT}
        )
        if options.contrastive_weight < 0 or options.temperature <= 0 or options.gamma <= 0:
            raise ValueError("fedcosr: contrastive-weight must be >= 0, temperature and gamma > 0")
        if not 0.0 <= options.fixed_tau <= 1.0:
            raise ValueError(f"fedcosr.fixed-tau must be in [0, 1], got {options.fixed_tau}")
        return options


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


def prototype_info_nce(
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


def shared_names(model: torch.nn.Module, share_head: bool) -> list[str]:
    """The model entries exchanged with the server: phi (the body), plus the head with ``share-head``."""
    return [name for name in model.state_dict() if share_head or not name.startswith("head.")]


def batches_per_epoch(num_samples: int, batch_size: int) -> int:
    """Steps :func:`protofl.task.train.train` takes per epoch (it skips a trailing 1-sample batch)."""
    full, rest = divmod(num_samples, batch_size)
    return full + (1 if rest > 1 or num_samples == 1 else 0)


# --- server -----------------------------------------------------------------------------


class FedCoSRStrategy(PrototypeStrategy):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedCoSROptions.from_config(self.config)
        shared = set(shared_names(self.model, self.options.share_head))
        self.shared_indices = [i for i, name in enumerate(self.model.state_dict()) if name in shared]
        self.prototypes: np.ndarray | None = None
        self.prototype_mask: np.ndarray | None = None

    @property
    def has_global_model(self) -> bool:
        return self.options.share_head

    def shared_weights(self) -> list[np.ndarray]:
        """phi (and pi with ``share-head``): clients build the same seeded initial head."""
        return [self.initial_weights[i] for i in self.shared_indices]

    def upload_spec(self) -> dict[str, ArraySpec]:
        return self.class_statistics_spec("prototypes")

    def check_update(self, update: ClientUpdate) -> None:
        check_class_counts(update)
        tau = update.metrics.get("la-tau")
        if not isinstance(tau, float) or not 0.0 <= tau <= 1.0:
            raise PayloadError(f"la-tau must be a float in [0, 1], got {tau!r}")
        check_loss_metrics(update, ("contrastive-loss", "ce-loss"))

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        return prototype_broadcast(self.prototypes, self.prototype_mask)

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        prototypes, mask = aggregate_prototypes(  # Eq. 6
            np.stack([u.payload["prototypes"] for u in updates]),
            np.stack([u.payload["class-counts"] for u in updates]),
            "count",
        )
        if self.options.keep_missing_prototypes and self.prototypes is not None:
            kept = ~mask & self.prototype_mask
            prototypes[kept], mask = self.prototypes[kept], mask | self.prototype_mask
        self.prototypes, self.prototype_mask = prototypes, mask
        self._record_client_stats(server_round, updates)
        return average_parameters(updates)  # Eq. 5

    def _record_client_stats(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """tau across clients, and the sample-weighted L_Per and L_Reg of this round."""
        taus = [u.metrics["la-tau"] for u in updates]
        fields = {"la_tau_mean": float(np.mean(taus)), "la_tau_min": min(taus), "la_tau_max": max(taus)}
        self.recorder.update(server_round, **fields, **mean_client_metrics(updates, ("ce-loss", "contrastive-loss")))


# --- client -----------------------------------------------------------------------------


class FedCoSRClient(PrototypeClient):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options = FedCoSROptions.from_config(self.config)
        self.shared_names = shared_names(self.model, self.options.share_head)

    def _shared_arrays(self) -> list[np.ndarray]:
        state = self.model.state_dict()
        return [state[name].detach().cpu().numpy() for name in self.shared_names]

    def _load_shared(self, arrays: list[np.ndarray]) -> None:
        if len(arrays) != len(self.shared_names):
            raise ValueError(f"FedCoSR: got {len(arrays)} shared arrays, the model shares {len(self.shared_names)}")
        state = self.model.state_dict()
        self.model.load_state_dict(
            {name: torch.as_tensor(a, dtype=state[name].dtype) for name, a in zip(self.shared_names, arrays)},
            strict=False,
        )

    def _info_nce(self, features, labels, prototypes) -> torch.Tensor:
        o = self.options
        return prototype_info_nce(features, labels, *prototypes, o.temperature, o.negatives)

    def _last_contrastive_loss(self, prototypes) -> float | None:
        """L_Reg for tau: the last local epoch's mean, else an eval pass against ``prototypes``."""
        if self.options.tau_loss == "last-epoch" and "fedcosr" in self.state:
            return float(self.state["fedcosr"]["contrastive-loss"])
        if prototypes is None:
            return None
        features, _ = features_and_logits(self.model, self.data.train_x)
        losses = self._info_nce(features, self.data.train_y, prototypes)
        return float(losses.mean()) if len(losses) else None

    def _local_aggregation(self, global_phi: list[np.ndarray], prototypes) -> float:
        """Set the model to [tau phi_local + (1 - tau) phi_global ; pi_local] (Eq. 8-9); returns tau.

        A client without a model of its own takes the global phi on the seeded initial head."""
        if not self.restore_personal_model():
            self._load_shared(global_phi)
            return 0.0
        if self.options.local_aggregation == "fixed":
            tau = self.options.fixed_tau
        else:
            loss = self._last_contrastive_loss(prototypes)
            tau = 0.0 if loss is None else mixing_weight(loss, self.options.gamma)  # Eq. 7
        self._load_shared(mix_weights(self._shared_arrays(), global_phi, tau))
        return tau

    def fit(self, parameters, config):
        prototypes = self.global_prototypes(config)
        tau = self._local_aggregation(parameters, prototypes)
        weight = self.options.contrastive_weight
        contrastive_sums, contrastive_counts, ce_losses = [], [], []

        def contrastive_term(features, logits, labels):  # alpha * L_Reg (Eq. 13-14)
            ce_losses.append(F.cross_entropy(logits.detach(), labels))
            with torch.set_grad_enabled(weight > 0):
                losses = self._info_nce(features, labels, prototypes)
            contrastive_sums.append(losses.detach().sum())
            contrastive_counts.append(len(losses))
            return weight * losses.mean() if weight > 0 and len(losses) else features.new_zeros(())

        kwargs = self.train_kwargs(config)
        loss = train(
            self.model, self.data.train_x, self.data.train_y,
            extra_loss=contrastive_term if prototypes is not None else None, **kwargs,
        )
        metrics = {"la-tau": float(tau)}
        if prototypes is not None:
            last = batches_per_epoch(self.data.num_train, kwargs["batch_size"])
            counted = sum(contrastive_counts[-last:])
            if counted:
                l_reg = float(torch.stack(contrastive_sums[-last:]).sum()) / counted
                self.state["fedcosr"] = MetricRecord({"contrastive-loss": l_reg})
                metrics["contrastive-loss"] = l_reg
            metrics["ce-loss"] = float(torch.stack(ce_losses).mean())
        features, _ = features_and_logits(self.model, self.data.train_x)
        means, counts = class_means(features, self.data.train_y, self.data.num_classes)  # Eq. 3-4
        self.store_personal_model()
        fit_metrics = self.fit_metrics(loss, prototypes=means, **{"class-counts": counts})
        return self._shared_arrays(), self.data.num_train, fit_metrics | metrics

    def evaluate(self, parameters, config):
        """PM: the client's own model after its last local training (``after-fit``), or the model
        it would start the next round from (``after-aggregation``, PFLlib's point)."""
        if self.options.evaluate_at == "after-aggregation" or not self.restore_personal_model():
            self._local_aggregation(parameters, self.global_prototypes(config))
        return self.evaluate_head()


STRATEGY, CLIENT = FedCoSRStrategy, FedCoSRClient
