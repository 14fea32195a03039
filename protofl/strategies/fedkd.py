"""FedKD (Wu et al., Nature Communications 2022): a small shared mentee learns with each client's
own mentor by adaptive mutual distillation; its updates travel SVD-compressed.

Client (HtFLlib's form): the mentor (its own model, any architecture, kept on its node), the mentee
(one architecture on every client: the family's first, received each round) and W_h (a d x d linear
map without bias from the mentee's features to the mentor's, kept on the node) train together on
L = CE_t + CE_s + (KL(p_s || p_t) + KL(p_t || p_s) + 2 MSE(h_t, W_h h_s)) / (CE_t + CE_s) (Eq. 3-6;
KL over the batch and the classes, MSE over the batch and the features; HtFLlib counts the hidden
loss once for each model), at the run's learning rate, each module's gradient clipped to norm 10 on
its own. The mentee then goes up compressed: each weight matrix (a convolution: each kernel's
kh x kw matrix, one rank for the layer) keeps its largest singular values, the fewest whose energy
exceeds T of the total (Eq. 7-8), T rising linearly from ``energy-start`` in round 1 to
``energy-end`` over ``energy-rounds`` rounds (0.95, 0.98, 1000: FedSA's scripts, whose runs are that
long; a run's own length would make an extended run differ from a longer one); biases and buffers as
they are. A matrix whose
singular values but the smallest do not reach T keeps all of them (HtFLlib's would send zeros).

Server: an upload whose matrices hold more ranks than T keeps is dropped (:func:`within_rank`); the
mentees averaged, unweighted (HtFLlib's), compressed again with the round's T: that is the mentee
every client receives. The arrays travel as the low-rank matrices they are, uncompressed
on the wire (the same numbers as HtFLlib's factors give). GM: the mentee on the global test set. PM:
the client's mentor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate
from protofl.federation.wire import SHARED_LOSS, PayloadError
from protofl.strategies.families.averaging import AveragingStrategy
from protofl.strategies.families.second_model import SecondModel, SecondModelClient
from protofl.task.losses import mean_kl
from protofl.task.models import SeededDraws

HIDDEN_MAP = "hidden-map/"  # local_state names of W_h's entries


@dataclass(frozen=True)
class FedKDOptions(SecondModel):
    energy_start: float = 0.95
    energy_end: float = 0.98
    energy_rounds: int = 1000

    @property
    def keeps_client_state(self) -> bool:
        return True  # the mentor and W_h

    def check(self) -> None:
        for key in ("energy_start", "energy_end"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"fedkd.{key.replace('_', '-')} must be in (0, 1], got {getattr(self, key)}")
        if self.energy_rounds < 1:
            raise ValueError(f"fedkd.energy-rounds must be >= 1, got {self.energy_rounds}")

    def energy(self, round_number: int) -> float:
        """T of a round: linear from ``energy-start`` (round 1) towards ``energy-end`` over
        ``energy-rounds`` rounds (HtFLlib's schedule over its run's rounds), then ``energy-end``."""
        fraction = min((round_number - 1) / self.energy_rounds, 1.0)
        return self.energy_start + fraction * (self.energy_end - self.energy_start)


def low_rank(array: np.ndarray, energy: float) -> np.ndarray:
    """Eq. 7-8: a matrix (ndim >= 2, more than one row; batched over the last two axes: a convolution's
    kernels) rebuilt from its largest singular values, the fewest (one rank for every matrix of the
    array) whose squared sum exceeds ``energy`` of the total, all of them when only all do; other
    arrays unchanged."""
    if array.ndim < 2 or array.shape[0] <= 1:
        return array
    u, s, vt = np.linalg.svd(array, full_matrices=False)
    power = s.astype(np.float64) ** 2
    total = power.sum()
    if total == 0:
        return array
    cumulative = np.cumsum(power.reshape(-1, s.shape[-1]).sum(axis=0))  # the first n ranks' energy, n = 1, 2, ...
    above = np.flatnonzero(cumulative[:-1] > energy * total)
    rank = int(above[0]) + 1 if len(above) else s.shape[-1]
    return ((u[..., :rank] * s[..., None, :rank]) @ vt[..., :rank, :]).astype(array.dtype)


def within_rank(array: np.ndarray, energy: float, slack: float = 1e-4) -> bool:
    """Whether ``array`` can be what :func:`low_rank` makes of some matrix at ``energy``: with r its
    rank (one for every matrix of the array; a rank holding below 1e-10 of the energy is float32's
    rounding, about 1e-14), its first r - 1 ranks hold at most ``energy`` of what those r and
    min(m, n) - r more, none above the r-th, can hold (``slack``: the rounding of its singular
    values)."""
    if array.ndim < 2 or array.shape[0] <= 1:
        return True
    singular = np.linalg.svd(array.astype(np.float64), compute_uv=False)
    power = (singular**2).reshape(-1, singular.shape[-1]).sum(axis=0)  # each rank's energy, all matrices
    if power.sum() == 0:
        return True
    rank = int(np.flatnonzero(power > 1e-10 * power.sum())[-1]) + 1
    most = power[:rank].sum() + (len(power) - rank) * power[rank - 1]  # the original's energy, at most
    return bool(power[: rank - 1].sum() <= energy * most * (1 + slack))


def fedkd_loss(features: torch.Tensor, logits: torch.Tensor, shared_features: torch.Tensor, shared_logits: torch.Tensor,
               labels: torch.Tensor, hidden_map: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, the mentee's part of it): Eq. 3-6 as HtFLlib sums the mentor's and the mentee's losses."""
    ce, shared_ce = F.cross_entropy(logits, labels), F.cross_entropy(shared_logits, labels)
    scale = ce + shared_ce
    hidden = F.mse_loss(features, hidden_map(shared_features)) / scale
    mentor = ce + mean_kl(logits, shared_logits) / scale + hidden
    mentee = shared_ce + mean_kl(shared_logits, logits) / scale + hidden
    return mentor + mentee, mentee


class FedKDStrategy(AveragingStrategy):
    options_class = FedKDOptions
    loss_metrics = (SHARED_LOSS,)

    def check_update(self, update: ClientUpdate) -> None:
        """Each weight matrix of the mentee must be compressed with the round's energy (Eq. 7-8)."""
        energy = self.options.energy(self.admission.server_round)
        for i, (array, trained) in enumerate(zip(update.parameters, self.trained_entries)):
            if trained and not within_rank(array, energy):
                raise PayloadError(f"parameter array {i} has a rank above what the round's energy {energy:g} keeps "
                                   "(Eq. 7-8)")

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        mean = super().aggregate_updates(server_round, updates)
        energy = self.options.energy(server_round)
        return [low_rank(a, energy) if trained else a for a, trained in zip(mean, self.trained_entries)]


class FedKDClient(SecondModelClient):
    options_class = FedKDOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        with SeededDraws(self.settings.seed):  # W_h's initial values, until the client has its own
            self.hidden_map = nn.Linear(self.exchanged.feature_dim, self.model.feature_dim, bias=False)
        self.hidden_map.to(self.device, next(self.model.parameters()).dtype)
        self.restore_personal_model(self.hidden_map, HIDDEN_MAP)

    def local_training(self, this_round):
        def loss(inputs, features, logits, labels):
            shared_features, shared_logits = self.exchanged(inputs)
            total, mentee = fedkd_loss(features, logits, shared_features, shared_logits, labels, self.hidden_map)
            self.record_loss(**{SHARED_LOSS: mentee})
            return total

        self.upload_energy = self.options.energy(this_round.number)
        return self.train_together(this_round, loss, self.hidden_map)

    def after_fit(self, statistics):
        self.store_personal_model(self.hidden_map, HIDDEN_MAP)
        with torch.no_grad():  # Eq. 7-8: the mentee goes up compressed
            for p in self.exchanged.parameters():
                p.copy_(torch.from_numpy(low_rank(p.detach().cpu().numpy(), self.upload_energy)))
        return {}


STRATEGY, CLIENT = FedKDStrategy, FedKDClient
