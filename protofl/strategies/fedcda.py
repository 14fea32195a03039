"""FedCDA (Wang et al., ICLR 2024): cross-round divergence-aware aggregation.

Clients train as FedAvg's. The server keeps each client's K most recent local models w_i^(k) with
the training loss F_i(w_i^(k)) the client reported for each, and aggregates, for every client, one
model of its cache: the selection that minimises the divergence among the selected models while
they keep fitting their own data (Eq. 8),

    sum_i a_i F_i(w_i) + (L / 2) sum_i a_i ||w_i - w_bar||^2,   w_bar = sum_i a_i w_i,

with a_i the clients' training sizes over their sum (``weighted = false``: 1 / n) and L the
smoothness constant (``smoothness``). The exact selection is combinatorial; the server approximates
it batch by batch (Algorithm 1): the round's clients, in a seeded random order, split into ``batches``
near-equal batches; for each batch it tries every combination of its clients' cached models against
the models already fixed (the clients absent this round keep their selection; earlier batches'
choices), keeps the best and moves on, ignoring the batches still to come. The new global model is
the mean of every client's selected model, absent clients' included, under the run's
``aggregation`` rule. For the first ``warmup-rounds`` rounds it is FedAvg's (the local models far
from their optima, whose losses say little); each client's latest model is its selection.

Choices the paper leaves to an implementation, and protofl's: the divergence is measured on the
trainable parameters (a BatchNorm's running statistics are averaged, not compared); F_i is the
client's reported ``train-loss`` (the mean over the round's local steps); a batch holds at most
``MAX_BATCH`` clients (more batches where the round has more clients than ``batches`` x
``MAX_BATCH``: K^MAX_BATCH combinations at most). Defaults: K = 3, 3 batches, 50 warm-up rounds,
L = 1. The paper's code is not public; the form here follows its text as two public readings of it
state it (docs/results/baselines.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.wire import TRAIN_LOSS
from protofl.strategies.families.averaging import AveragingStrategy, GlobalModelAveraging
from protofl.task.sampling import server_seed

MAX_BATCH = 6  # clients a batch tries together: K^6 = 729 combinations at K = 3


@dataclass(frozen=True)
class FedCDAOptions(GlobalModelAveraging):
    cache_size: int = 3  # K, each client's recent models the server keeps
    batches: int = 3  # B
    warmup_rounds: int = 50
    smoothness: float = 1.0  # L

    capturable: ClassVar[bool] = True  # FedAvg's training

    def check(self) -> None:
        if self.cache_size < 1 or self.batches < 1 or self.warmup_rounds < 0:
            raise ValueError("fedcda.cache-size and fedcda.batches must be >= 1 and fedcda.warmup-rounds >= 0, got "
                             f"{self.cache_size}, {self.batches} and {self.warmup_rounds}")
        if not 0 <= self.smoothness < math.inf:
            raise ValueError(f"fedcda.smoothness must be >= 0, got {self.smoothness}")


def best_combination(fixed_sum: np.ndarray, fixed_weight: float, fixed_constant: float,
                     candidates: Sequence[np.ndarray], weights: Sequence[float], losses: Sequence[float],
                     choices: Sequence[Sequence[int]], smoothness: float) -> tuple[tuple[int, ...], float]:
    """The combination of candidates (one index of ``choices[b]`` for each client b of a batch)
    that minimises Eq. 8's objective over the fixed models and the batch's choice, and its value.

    The fixed models enter as their weighted sum ``fixed_sum`` (sum a_j w_j), their weight
    ``fixed_weight`` (sum a_j) and ``fixed_constant`` (sum a_j (F_j + L/2 ||w_j||^2)); each
    candidate c is a flat float64 vector with its client's weight and loss. With A the total
    weight, the objective is (sum a_i (F_i + L/2 ||w_i||^2) - L/2 ||sum a_i w_i||^2 / A) / A:
    the weighted variance's form, from dot products only."""
    vectors = np.stack(candidates)
    gram = vectors @ vectors.T
    with_fixed = vectors @ fixed_sum
    a, loss = np.asarray(weights, np.float64), np.asarray(losses, np.float64)
    combos = np.array(list(itertools.product(*choices)), np.int64)  # (combinations, batch)
    w = a[combos]
    total = fixed_weight + w.sum(axis=1)
    with np.errstate(over="ignore"):  # a loss a client claims near the float limit: its combinations inf
        constant = fixed_constant + (w * (loss[combos] + smoothness / 2 * np.diag(gram)[combos])).sum(axis=1)
    mean_norm = (fixed_sum @ fixed_sum + 2 * (w * with_fixed[combos]).sum(axis=1)
                 + np.einsum("nb,nc,nbc->n", w, w, gram[combos[:, :, None], combos[:, None, :]]))
    objective = (constant - smoothness / 2 * mean_norm / total) / total
    best = int(np.argmin(objective))
    return tuple(int(i) for i in combos[best]), float(objective[best])


class FedCDAStrategy(AveragingStrategy):
    options_class = FedCDAOptions
    state_fields = ("cached_models", "cached_losses", "training_sizes", "selected")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cached_models: dict[int, list[list[np.ndarray]]] = {}  # each client's last K models, oldest first
        self.cached_losses: dict[int, list[float]] = {}  # F_i of each
        self.training_sizes: dict[int, int] = {}
        self.selected: dict[int, int] = {}  # each client's selection, an index into its cache

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        o = self.options
        for u in updates:
            p = u.partition_id
            self.cached_models[p] = (self.cached_models.get(p, []) + [u.parameters])[-o.cache_size:]
            self.cached_losses[p] = (self.cached_losses.get(p, []) + [float(u.metrics[TRAIN_LOSS])])[-o.cache_size:]
            self.training_sizes[p] = u.num_examples
        clients = [u.partition_id for u in updates]
        if server_round <= o.warmup_rounds:  # FedAvg's, each client's latest model selected
            self.selected |= {p: len(self.cached_models[p]) - 1 for p in clients}
            return super().aggregate_updates(server_round, updates)
        self.select(server_round, clients)
        chosen = sorted(self.selected)
        models = [self.cached_models[p][self.selected[p]] for p in chosen]
        return self.average_arrays(models, [self.weight(p) for p in chosen], self.admission.sent_parameters)

    def weight(self, partition_id: int) -> float:
        return float(self.training_sizes[partition_id]) if self.options.weighted else 1.0

    def flat(self, model: list[np.ndarray]) -> np.ndarray:
        """The model's trainable parameters as one float64 vector (what Eq. 8's norms measure)."""
        return np.concatenate([a.astype(np.float64).ravel() for a, t in zip(model, self.trained_entries) if t])

    def select(self, server_round: int, clients: list[int]) -> None:
        """Algorithm 1's batch approximation: each batch of this round's clients, in a seeded order,
        takes the combination of its cached models that minimises Eq. 8 against the models fixed so
        far (the absent clients' selections, then each earlier batch's)."""
        o = self.options
        order = np.random.default_rng(server_seed(self.settings.seed, server_round)).permutation(clients)
        batches = np.array_split(order, min(len(order), max(o.batches, math.ceil(len(order) / MAX_BATCH))))
        size = sum(a.size for a, trained in zip(self.shared_weights(), self.trained_entries) if trained)
        # the fixed models' sum a_j w_j, sum a_j and sum a_j (F_j + L/2 ||w_j||^2)
        fixed_sum, fixed_weight, fixed_constant = np.zeros(size), 0.0, 0.0

        def fix(partition_id: int, index: int, vector: np.ndarray) -> None:
            nonlocal fixed_sum, fixed_weight, fixed_constant
            a, loss = self.weight(partition_id), self.cached_losses[partition_id][index]
            self.selected[partition_id] = index
            fixed_sum = fixed_sum + a * vector
            fixed_weight += a
            fixed_constant += a * (loss + o.smoothness / 2 * float(vector @ vector))

        for p, s in list(self.selected.items()):
            if p not in clients:
                fix(p, s, self.flat(self.cached_models[p][s]))
        objective = math.nan
        for batch in batches:
            candidates, weights, losses, choices = [], [], [], []
            for p in batch:
                choices.append(range(len(candidates), len(candidates) + len(self.cached_models[p])))
                candidates += [self.flat(model) for model in self.cached_models[p]]
                weights += [self.weight(p)] * len(self.cached_models[p])
                losses += self.cached_losses[p]
            combination, objective = best_combination(fixed_sum, fixed_weight, fixed_constant, candidates, weights,
                                                      losses, choices, o.smoothness)
            for p, c, r in zip(batch, combination, choices):
                fix(int(p), c - r.start, candidates[c])
        older = sum(self.selected[p] != len(self.cached_models[p]) - 1 for p in clients)
        self.recorder.update(server_round, cda_objective=objective, cda_older_selected=older)


class FedCDAClient(PrototypeClient):
    options_class = FedCDAOptions


STRATEGY, CLIENT = FedCDAStrategy, FedCDAClient
