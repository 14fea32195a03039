"""Two small methods that use the template hooks none of the shipped methods needs yet, registered
for a test by :func:`registered`: ``server-head`` trains a module on the server (FedGH's shape) and
keeps it and its optimizer in its state; ``own-broadcast`` sends each client an array of its own
(FedAMP's shape). docs/adding-a-method.md quotes them."""

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

import protofl.strategies
from protofl.federation.client import PrototypeClient
from protofl.federation.admission import ClientUpdate, stacked_statistics
from protofl.federation.server_rule import ServerRule
from protofl.federation.wire import ArraySpec, PayloadError
from protofl.settings import MethodOptions

HEAD = "server-head"  # the head the server trained, broadcast as one array per head entry
OWN = "own-array"  # own-broadcast: the array sent to one client only


@dataclass(frozen=True)
class ServerHeadOptions(MethodOptions):
    server_epochs: int = 2


class ServerHeadStrategy(ServerRule):
    """The clients share their bodies; the server trains the head on the uploaded class means."""

    options_class = ServerHeadOptions
    state_fields = ("head", "optimizer")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        with self.seeded():  # its initial values from the run seed: the same in a resumed run
            self.head = torch.nn.Linear(self.feature_dim, self.num_classes).to(self.device)
        self.optimizer = torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)

    def broadcast(self, server_round):
        return {f"{HEAD}/{name}": t.detach().cpu().numpy() for name, t in self.head.state_dict().items()}

    def aggregate_updates(self, server_round, updates: list[ClientUpdate]):
        means, counts = stacked_statistics(updates)
        held = counts > 0
        x = torch.from_numpy(means[held]).to(self.device, torch.float32)
        y = torch.from_numpy(np.nonzero(held)[1]).to(self.device)
        generator = self.server_generator(server_round)  # the server's own draws, from the run seed
        for _ in range(self.options.server_epochs):
            order = torch.randperm(len(y), generator=generator).to(self.device)
            self.optimizer.zero_grad()
            F.cross_entropy(self.head(x[order]), y[order]).backward()
            self.optimizer.step()
        return self.average_parameters(updates)


class ServerHeadClient(PrototypeClient):
    options_class = ServerHeadOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        head = self.model.head.state_dict()
        received = {name: self.received(this_round, f"{HEAD}/{name}", ArraySpec.like(t.numpy()))
                    for name, t in head.items()}
        if all(v is not None for v in received.values()):
            self.model.head.load_state_dict({name: torch.from_numpy(v) for name, v in received.items()})


@dataclass(frozen=True)
class OwnBroadcastOptions(MethodOptions):
    statistics: ClassVar[None] = None


class OwnBroadcastStrategy(ServerRule):
    options_class = OwnBroadcastOptions
    state_fields = ("own",)
    poisoned: ClassVar[set[int]] = set()  # partitions whose array the rule makes non-finite
    broken: ClassVar[bool] = False  # every client's array non-finite from round 2, whatever the rule

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.own: dict[str, np.ndarray] = {}  # partition -> its array

    def broadcast_to(self, server_round, partition_id):
        if self.broken and server_round > 1:
            return {OWN: np.full(3, np.nan, np.float32)}
        return {OWN: self.own.get(str(partition_id), np.full(3, partition_id, np.float32))}

    def aggregate_updates(self, server_round, updates):
        for u in updates:
            value = np.nan if u.partition_id in self.poisoned else float(u.partition_id)
            self.own[str(u.partition_id)] = np.full(3, value, np.float32)
        return self.average_parameters(updates)


class OwnBroadcastClient(PrototypeClient):
    options_class = OwnBroadcastOptions

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        own = self.received(this_round, OWN, ArraySpec((3,)))
        if own is None or not (own == self.data.partition_id).all():
            raise PayloadError(f"partition {self.data.partition_id} received {own}")


TOYS = {
    "server-head": SimpleNamespace(STRATEGY=ServerHeadStrategy, CLIENT=ServerHeadClient),
    "own-broadcast": SimpleNamespace(STRATEGY=OwnBroadcastStrategy, CLIENT=OwnBroadcastClient),
}


@contextlib.contextmanager
def registered():
    """Within: the toy methods run as any registered method does (their names in the run config)."""
    known = protofl.strategies._module
    with mock.patch.object(protofl.strategies, "_module", lambda name: TOYS.get(name) or known(name)):
        yield


class BalancedSoftmaxClient(PrototypeClient):
    """FedRoD's task loss: the cross-entropy of the logits shifted by the log of the client's class
    prior (its training counts), so that a skewed split does not bias the head."""

    def receive(self, parameters, this_round):
        self.load_shared(parameters)
        counts = torch.from_numpy(self.data.class_counts()).to(self.device)
        self.log_prior = torch.log(counts.clamp(min=1) / counts.sum()).to(self.model.head.weight.dtype)

    def classification_loss(self, logits, labels):
        return F.cross_entropy(logits + self.log_prior, labels)
