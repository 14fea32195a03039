"""FedGen (Zhu et al., ICML 2021): data-free knowledge distillation through a generator of features
that the server trains on the clients' heads, and the clients learn from.

Generator G (HtFLlib's, after the authors' code): [noise epsilon ~ U(0, 1)^``noise-dim``, one-hot y]
-> Linear(``hidden-dim``) -> BatchNorm -> ReLU -> Linear(d), a feature of class y.

Client: trains its whole model (its own body, kept on its node, under the global head received) with
CE(f(x), y) + CE(head(G(y~)), y~) (Eq. 5 as HtFLlib writes it): y~ a batch of ``batch-size`` labels
drawn from the federation's label distribution, G in training mode (its BatchNorm on the batch), not
trained. It uploads its head (the shared entries) and its class counts (``label-counts``).

Server (Eq. 4): the heads averaged by training size; the generator, kept across rounds, takes
``server-epochs`` Adam steps at ``generator-lr`` (a fresh Adam each round) on
CE(sum_k w_k head_k(G(y~)), y~), w_k the uploaders' training-size weights, y~ drawn as the clients'
from the label distribution: the sum of the latest counts of every client that has uploaded. G goes
out with that distribution from round 2 on (round 1 trains with cross-entropy only: the server knows
no labels yet; HtFLlib's server reads every client's counts before it starts). Its draws come from the
server's seeded stream on its device. ``generator = "kept"``: G learns across rounds, as the paper's;
``"initial"``: the clients always draw from the initial G, as under HtFLlib's code (e959261), whose
server trains a copy of the initial G each round and discards it (it never saves it), the form FedSA's
table ran. Defaults: noise 32, hidden 512, 100 steps (FedSA's scripts); Adam at 0.005 (HtFLlib's
default: FedSA's scripts' 0.1, harmless to a generator that is discarded, makes a kept one's features
grow until the clients' generated-feature loss reaches 10^2-10^3 on the digits within 20 rounds).

PM: the client's own body with the global head. No GM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from protofl.federation.admission import ClientUpdate
from protofl.federation.client import PrototypeClient
from protofl.federation.wire import ArraySpec, PayloadError, indexed
from protofl.strategies.families.averaging import AveragingStrategy, ParameterAveraging
from protofl.strategies.families.model_parts import HEAD, HeadSharing

GENERATOR = "generator"  # broadcast: G's state_dict entries, in order
LABEL_DISTRIBUTION = "federation-label-counts"  # broadcast: the federation's class counts (C)
LABEL_COUNTS = "label-counts"  # uploaded: the client's class counts (C, int64)


@dataclass(frozen=True)
class FedGenOptions(HeadSharing, ParameterAveraging):
    noise_dim: int = 32
    hidden_dim: int = 512
    generator_lr: float = 0.005
    server_epochs: int = 100
    generator: Literal["kept", "initial"] = "kept"

    def check(self) -> None:
        for key in ("noise_dim", "hidden_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"fedgen.{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        if self.server_epochs < 0:
            raise ValueError(f"fedgen.server-epochs must be >= 0, got {self.server_epochs}")
        if not self.generator_lr > 0:
            raise ValueError(f"fedgen.generator-lr must be > 0, got {self.generator_lr}")


class Generator(nn.Module):
    """G: (labels, noise) -> features."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.hidden = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim),
                                    nn.ReLU())
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.out(self.hidden(torch.cat([noise, one_hot], dim=1)))


def generator_entries(generator: Generator) -> dict[str, torch.Tensor]:
    """What G's broadcast carries: its parameters and BatchNorm statistics (not its batch count)."""
    return {k: v for k, v in generator.state_dict().items() if v.is_floating_point()}


def draw(generator: Generator, label_distribution: torch.Tensor, batch_size: int, noise_dim: int,
         draws: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(y~, G(y~)): ``batch_size`` labels drawn with replacement in proportion to
    ``label_distribution``, and their generated features (uniform noise), from ``draws``."""
    device = label_distribution.device
    labels = torch.multinomial(label_distribution.double(), batch_size, replacement=True, generator=draws)
    noise = torch.rand(batch_size, noise_dim, generator=draws, device=device, dtype=label_distribution.dtype)
    return labels, generator(labels, noise)


def ensemble_loss(head: nn.Module, heads: list[dict[str, torch.Tensor]], weights: torch.Tensor,
                  features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 4: CE of the heads' logits on ``features``, summed with ``weights``, against ``labels``."""
    logits = sum(w * functional_call(head, h, (features,)) for w, h in zip(weights, heads))
    return F.cross_entropy(logits, labels)


class FedGenStrategy(AveragingStrategy):
    options_class = FedGenOptions
    state_fields = ("generator", "label_counts")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        o = self.options
        dtype = next(self.model.head.parameters()).dtype
        with self.seeded(0):
            self.generator = Generator(o.noise_dim, self.num_classes, o.hidden_dim, self.feature_dim).to(
                self.device, dtype)
        self.label_counts: dict[str, np.ndarray] = {}  # each partition's latest, by partition id

    def upload_specs(self) -> dict[str, ArraySpec]:
        return {LABEL_COUNTS: ArraySpec((self.num_classes,), ("int64",), nonnegative=True, scale="checked")}

    def check_update(self, update: ClientUpdate) -> None:
        counts = update.uploads[LABEL_COUNTS]
        if (counts > update.num_examples).any():  # also: no int64 sum that wraps round to the claim
            raise PayloadError(f"{LABEL_COUNTS!r} hold a count above the {update.num_examples} examples "
                               "the client claims")
        if int(counts.sum()) != update.num_examples:
            raise PayloadError(f"{LABEL_COUNTS!r} sum to {int(counts.sum())}, not the {update.num_examples} "
                               "examples the client claims")
        known = self.discovery.known_sizes(update.partition_id)
        if known is not None and known[2] is not None and not np.array_equal(counts, known[2]):
            raise PayloadError(f"{LABEL_COUNTS!r} are not partition {update.partition_id}'s")

    def label_distribution(self) -> np.ndarray | None:
        counts = sum(self.label_counts.values()) if self.label_counts else None
        return None if counts is None or counts.sum() == 0 else counts

    def broadcast(self, server_round: int) -> dict[str, np.ndarray]:
        distribution = self.label_distribution()
        if distribution is None:
            return {}
        entries = [t.detach().cpu().numpy() for t in generator_entries(self.generator).values()]
        return indexed(GENERATOR, entries) | {LABEL_DISTRIBUTION: distribution}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate]) -> list[np.ndarray]:
        for u in updates:
            self.label_counts[str(u.partition_id)] = u.uploads[LABEL_COUNTS].astype(np.int64)
        heads = super().aggregate_updates(server_round, updates)  # the heads averaged by training size
        distribution = self.label_distribution()
        if distribution is not None and self.options.server_epochs > 0 and self.options.generator == "kept":
            self.train_generator(server_round, updates, distribution)
        return heads

    def train_generator(self, server_round: int, updates: list[ClientUpdate], distribution: np.ndarray) -> None:
        o, dtype = self.options, next(self.generator.parameters()).dtype
        names = [n.removeprefix(HEAD) for n in self.model.state_dict() if self.options.shares(n)]
        heads = [{n: torch.from_numpy(np.array(a)).to(self.device, dtype) for n, a in zip(names, u.parameters)}
                 for u in updates]
        sizes = torch.tensor([float(u.num_examples) for u in updates], dtype=dtype, device=self.device)
        head = self.model.head
        labels_from = torch.from_numpy(distribution).to(self.device, dtype)
        draws = torch.Generator(device=self.device).manual_seed(self.server_generator(server_round).initial_seed())
        optimizer = torch.optim.Adam(self.generator.parameters(), lr=o.generator_lr)
        self.generator.train()
        for _ in range(o.server_epochs):
            labels, features = draw(self.generator, labels_from, self.settings.batch_size, o.noise_dim, draws)
            loss = ensemble_loss(head, heads, sizes / sizes.sum(), features, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


class FedGenClient(PrototypeClient):
    options_class = FedGenOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        self.generated = None
        o = self.options
        like = Generator(o.noise_dim, self.data.num_classes, o.hidden_dim, self.model.feature_dim)
        like = like.to(self.device, next(self.model.parameters()).dtype)
        names = generator_entries(like)
        entries = self.received_like(this_round, GENERATOR, list(names.values()))
        distribution = self.received(this_round, LABEL_DISTRIBUTION,
                                     ArraySpec((self.data.num_classes,), ("int64",), True))
        if entries is None or distribution is None or distribution.sum() == 0:
            return
        like.load_state_dict(dict(zip(names, entries)), strict=False)
        like.requires_grad_(False)
        draws = torch.Generator(device=self.device).manual_seed(this_round.seed)
        self.generated = (like.train(), torch.from_numpy(distribution).to(self.device, torch.float64), draws)

    def batch_loss(self, features, logits, labels, inputs):
        if self.generated is None:
            return None
        generator, distribution, draws = self.generated
        with torch.no_grad():
            drawn, generated = draw(generator, distribution.to(features.dtype), self.settings.batch_size,
                                    self.options.noise_dim, draws)
        return F.cross_entropy(self.model.head(generated), drawn)  # Eq. 5's second term

    def uploads(self):
        return {LABEL_COUNTS: self.data.class_counts().astype(np.int64)}


STRATEGY, CLIENT = FedGenStrategy, FedGenClient
