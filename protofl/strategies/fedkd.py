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
they are. A matrix whose singular values but the smallest do not reach T keeps all of them
(HtFLlib's would send zeros).

On the wire, up and down, a matrix of rank r travels as its factors U_r S_r and V_r^T, r (m + n)
numbers, where those are fewer than its m n entries (:func:`factor_form`; HtFLlib sends U_r, S_r
and V_r^T, r (m + n + 1), always); the receiver multiplies them out (:func:`from_factor_form`).

Server: an upload whose matrices hold more ranks than T keeps is dropped (:func:`held_rank`); the
mentees averaged, unweighted (HtFLlib's), compressed again with the round's T: that is the mentee
every client receives. GM: the mentee on the global test set. PM: the client's mentor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protofl.federation.admission import ClientUpdate
from protofl.federation.wire import SHARED_LOSS, ArraySpec, PayloadError
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


def compressible(array: np.ndarray) -> bool:
    """Whether Eq. 7-8 compress ``array``: a matrix of more than one row (a convolution's kernels:
    its last two axes, one rank for the layer; HtFLlib's test, on the first axis)."""
    return array.ndim >= 2 and array.shape[0] > 1


def truncated(array: np.ndarray, energy: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Eq. 7-8: (U_r S_r, V_r^T) of each matrix of a :func:`compressible` array (batched over the
    last two axes), r the fewest singular values (one rank for every matrix of the array) whose
    squared sum exceeds ``energy`` of the total, all of them when only all do; None for an array
    that is not compressed (not compressible, or zero)."""
    if not compressible(array):
        return None
    u, s, vt = np.linalg.svd(array, full_matrices=False)
    power = s.astype(np.float64) ** 2
    total = power.sum()
    if total == 0:
        return None
    cumulative = np.cumsum(power.reshape(-1, s.shape[-1]).sum(axis=0))  # the first n ranks' energy, n = 1, 2, ...
    above = np.flatnonzero(cumulative[:-1] > energy * total)
    rank = int(above[0]) + 1 if len(above) else s.shape[-1]
    return np.ascontiguousarray(u[..., :rank] * s[..., None, :rank]), np.ascontiguousarray(vt[..., :rank, :])


def low_rank(array: np.ndarray, energy: float) -> np.ndarray:
    """Eq. 7-8: ``array`` rebuilt from its :func:`truncated` factors (other arrays unchanged)."""
    factors = truncated(array, energy)
    return array if factors is None else (factors[0] @ factors[1]).astype(array.dtype)


def factor_form(array: np.ndarray, energy: float) -> np.ndarray:
    """``array`` as it travels after Eq. 7-8: each m x n matrix of rank r as r (m + n) numbers on
    the last axis, U_r S_r then V_r^T row by row (:func:`truncated`), when those are fewer than its
    m n entries; otherwise :func:`low_rank`'s array. :func:`from_factor_form` reads either."""
    return as_sent(array, truncated(array, energy))


def as_sent(array: np.ndarray, factors: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    """:func:`factor_form` of ``array`` from its :func:`truncated` ``factors``."""
    if factors is None:
        return array
    us, vt = factors
    (m, r), n = us.shape[-2:], vt.shape[-1]
    if r * (m + n) >= m * n:
        return (us @ vt).astype(array.dtype)
    batch = array.shape[:-2]
    return np.concatenate([us.reshape(*batch, m * r), vt.reshape(*batch, r * n)], axis=-1)


def factor_spec(reference: np.ndarray) -> ArraySpec:
    """What :func:`factor_form` may send for an entry like ``reference`` in place of the entry:
    its batch axes and one of any length (:func:`from_factor_form` checks that length)."""
    return ArraySpec((*reference.shape[:-2], None), (reference.dtype.name,))


def from_factor_form(sent: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``shape`` that :func:`factor_form` sent as ``sent``: the array itself, or the
    product of its factors (the numbers :func:`low_rank` gives). Raises :class:`PayloadError` when
    ``sent`` is neither (factors of a rank below 1 or above min(m, n)) or their product is not finite."""
    shape = tuple(shape)
    if sent.shape == shape or len(shape) < 2:
        return sent
    *batch, m, n = shape
    rank, extra = divmod(sent.shape[-1], m + n) if sent.shape[:-1] == tuple(batch) else (0, 1)
    if extra or not 1 <= rank <= min(m, n):
        raise PayloadError(f"shape {sent.shape} is neither {shape} nor its factors (r x {m + n} numbers on the "
                           f"last axis, 1 <= r <= {min(m, n)})")
    us = np.ascontiguousarray(sent[..., : m * rank]).reshape(*batch, m, rank)
    vt = np.ascontiguousarray(sent[..., m * rank:]).reshape(*batch, rank, n)
    with np.errstate(over="ignore", invalid="ignore"):
        array = (us @ vt).astype(sent.dtype)
    if not np.isfinite(array).all():
        raise PayloadError("the product of its factors is not finite")
    return array


def held_rank(array: np.ndarray, energy: float, slack: float = 1e-4) -> int | None:
    """The rank r of a :func:`compressible` ``array`` (one for every matrix of it; a rank holding
    below 1e-10 of the energy is float32's rounding, about 1e-14) when it can be what
    :func:`low_rank` makes of some matrix at ``energy``: its first r - 1 ranks hold at most
    ``energy`` of what those r and min(m, n) - r more, none above the r-th, can hold (``slack``:
    the rounding of its singular values). None when it cannot: it holds more ranks than that."""
    singular = np.linalg.svd(array.astype(np.float64), compute_uv=False)
    power = (singular**2).reshape(-1, singular.shape[-1]).sum(axis=0)  # each rank's energy, all matrices
    if power.sum() == 0:
        return 0
    rank = int(np.flatnonzero(power > 1e-10 * power.sum())[-1]) + 1
    most = power[:rank].sum() + (len(power) - rank) * power[rank - 1]  # the original's energy, at most
    return rank if power[: rank - 1].sum() <= energy * most * (1 + slack) else None


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
    """Each round records ``mentee_ranks``: the rank of each compressed entry of the mentee that goes
    down (``down``) and of each accepted upload's (``up``, in partition order)."""

    options_class = FedKDOptions
    loss_metrics = (SHARED_LOSS,)

    @functools.cached_property
    def upload_ranks(self) -> dict[int, list[int]]:
        """The ranks of this round's uploads' compressed entries, by partition (:meth:`check_update`)."""
        return {}

    def compressed(self, index: int) -> bool:
        """Whether shared entry ``index`` travels compressed: a compressible trainable parameter."""
        return self.trained_entries[index] and compressible(self.initial_weights[self.shared_indices[index]])

    def parameter_spec(self, index: int, reference: np.ndarray) -> ArraySpec | tuple[ArraySpec, ...]:
        full = ArraySpec.like(reference)
        return (full, factor_spec(reference)) if self.compressed(index) else full

    def parameter_from_wire(self, index: int, array: np.ndarray, reference: np.ndarray) -> np.ndarray:
        return from_factor_form(array, reference.shape)

    def check_update(self, update: ClientUpdate) -> None:
        """Each weight matrix of the mentee must be compressed with the round's energy (Eq. 7-8)."""
        energy = self.options.energy(self.admission.server_round)
        ranks = []
        for i, array in enumerate(update.parameters):
            if self.compressed(i):
                if (rank := held_rank(array, energy)) is None:
                    raise PayloadError(f"parameter array {i} has a rank above what the round's energy {energy:g} "
                                       "keeps (Eq. 7-8)")
                ranks.append(rank)
        self.upload_ranks[update.partition_id] = ranks

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        """The mentees' mean, compressed again with the round's energy: as it goes down, factors where
        they are smaller (:func:`factor_form`)."""
        mean = super().aggregate_updates(server_round, updates)
        energy = self.options.energy(server_round)
        factors = {i: truncated(a, energy) for i, a in enumerate(mean) if self.compressed(i)}
        sent = [as_sent(a, factors[i]) if i in factors else a for i, a in enumerate(mean)]
        down = [0 if f is None else f[0].shape[-1] for f in factors.values()]  # r: U_r S_r's columns
        up = [self.upload_ranks.get(u.partition_id) for u in updates]
        self.upload_ranks.clear()
        self.recorder.update(server_round, mentee_ranks={"down": down, "up": up})
        return sent


class FedKDClient(SecondModelClient):
    options_class = FedKDOptions

    def receive(self, parameters, this_round):
        state = self.exchanged.state_dict()
        if len(parameters) == len(self.shared_names):  # the mentee's matrices as they travel: factors
            parameters = [from_factor_form(a, state[name].shape) for name, a in zip(self.shared_names, parameters)]
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
        parameters = dict(self.exchanged.named_parameters())  # Eq. 7-8: the mentee goes up compressed
        self.upload_forms = {name: factor_form(parameters[name].detach().cpu().numpy(), self.upload_energy)
                             for name in self.shared_names if name in parameters}
        return {}

    def uploaded_parameters(self):
        return [self.upload_forms.get(name, array) for name, array in zip(self.shared_names, self.shared_arrays())]


STRATEGY, CLIENT = FedKDStrategy, FedKDClient
